"""The step handed to the workers on the output too: whichever arrives first applies it, once.

The scheduler sends each step over gRPC and stamps the output with it, events included; a
worker whose service has not applied the step when its pass starts applies it itself
(``wait_for_planned_step``), and the scheduler's call, arriving later, is answered from
the replay cache. Real servers on signed KV caches, one rank behind a proxy that holds
the scheduler's calls back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvdefrag.client import DefragClient
from kvdefrag.common import EpochMismatch, InvalidArgument, ServiceUnavailable, StepEvents
from kvdefrag.server import ServerHandle
from kvdefrag.vllm._scheduler.bridge import SchedulerBridge, changes_from_output
from kvdefrag.vllm._scheduler.ranks import RankGroup
from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm.contract import StepStamp, attach_step_stamp, read_step_stamp

from support.kv import SignedKv
from support.proxy import SocketProxy
from support.server import Serve
from support.vllm_output import NewRequestData, output

NUM_BLOCKS = 64
# Long enough for any step on a loaded machine; a pass that waited for a held-up call
# instead of applying its step would run into it and raise ServiceUnavailable.
STEP_WAIT_S = 5.0

# A fragmenting workload: with threshold 0 its finishes make the engines compact (move KV).
STEPS = (
    StepEvents(new_blocks={"a": list(range(1, 11)), "b": [40, 41, 42]}),
    StepEvents(new_blocks={"c": [50, 51], "a": [12]}),
    StepEvents(finished=["a"]),
    StepEvents(new_blocks={"d": [5, 6, 7]}, finished=["c"]),
    StepEvents(new_blocks={"b": [43]}),
    StepEvents(finished=["b"], new_blocks={"e": [20, 21]}),
)


def _fresh_ids(events: StepEvents) -> list[int]:
    return [block_id for ids in events.new_blocks.values() for block_id in ids]


def _stamped(stamp: StepStamp) -> Any:
    output = SimpleNamespace()
    attach_step_stamp(output, stamp)
    return output


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _state(handle: ServerHandle) -> tuple[int, int, list[int]]:
    """What a refused step must leave as it was: steps applied, digest, mapping."""
    return (
        handle.stats().totals.num_steps,
        handle._engine.digest,
        handle.resolve().tolist(),
    )


class _Rank:
    def __init__(self, handle: ServerHandle, kv: SignedKv, registry: CollectorRegistry) -> None:
        self.handle = handle
        self.kv = kv
        self.registry = registry


@pytest.fixture
def ranks(serve: Serve) -> list[_Rank]:
    made = []
    for _ in range(2):
        kv = SignedKv.create(NUM_BLOCKS)
        registry = CollectorRegistry()
        handle = serve(kv=kv, num_blocks=NUM_BLOCKS, threshold=0, registry=registry)
        made.append(_Rank(handle, kv, registry))
    return made


@pytest.fixture
def held_up(ranks: list[_Rank], tmp_path: Path) -> Iterator[SocketProxy]:
    """A proxy in front of rank 0's service (the scheduler's calls to it go through it)."""
    proxy = SocketProxy(ranks[0].handle.address, listen=f"unix:{tmp_path}/proxy.sock")
    try:
        yield proxy
    finally:
        proxy.close()


def test_a_pass_finds_its_step_applied_while_the_schedulers_call_is_held_up(
    ranks: list[_Rank], held_up: SocketProxy
) -> None:
    clients = [
        DefragClient(held_up.address, client_name="rank0"),
        DefragClient(ranks[1].handle.address, client_name="rank1"),
    ]
    group = RankGroup(clients)
    try:
        for number, events in enumerate(STEPS, start=1):
            held_up.mode = "stall"  # rank 0's call leaves, and goes nowhere for now
            in_flight = group.submit(events)
            output = _stamped(in_flight.stamp)
            for rank_number, rank in enumerate(ranks):
                wait_for_planned_step(rank.handle, rank_number, output, STEP_WAIT_S)
                assert rank.handle.stats().totals.num_steps == number
                rank.kv.write_fresh(rank.handle, _fresh_ids(events))  # the forward pass
            held_up.mode = "pass"
            reply = in_flight.result()  # the digests agree across ranks (RankGroup)
            assert (reply.seq, reply.replayed) == (number, True)  # rank 0 answered from cache
            assert reply.digest == ranks[0].handle._engine.digest
        live = clients[1].live_requests()
        assert sorted(live) == ["d", "e"]
        for rank in ranks:
            totals = rank.handle.stats().totals
            assert totals.num_steps == len(STEPS)  # each applied once
            assert totals.num_moves > 0  # the worker's own applies moved KV data
            ids = [block_id for ids in live.values() for block_id in ids]
            assert rank.kv.lost_blocks(rank.handle, ids) == []
        metrics = ranks[0].registry
        assert _sample(metrics, "kvdefrag_applied_steps_total", path="in_process") == len(STEPS)
        assert _sample(metrics, "kvdefrag_applied_steps_total", path="rpc") == 0
        # The held-up calls were answered from the cache, but none was a resend.
        assert _sample(metrics, "kvdefrag_replayed_steps_total") == 0
        assert clients[0].audit(strict=True).is_consistent
    finally:
        group.close()


def test_a_pass_whose_step_came_by_rpc_first_applies_nothing_again(
    ranks: list[_Rank],
) -> None:
    rank = ranks[0]
    with DefragClient(rank.handle.address) as client:
        group = RankGroup([client])
        in_flight = group.submit(STEPS[0])
        reply = in_flight.result()  # applied by the call
        before = _state(rank.handle)
        wait_for_planned_step(rank.handle, 0, _stamped(in_flight.stamp), STEP_WAIT_S)
        assert _state(rank.handle) == before
        assert reply.replayed is False
        assert _sample(rank.registry, "kvdefrag_applied_steps_total", path="rpc") == 1
        assert _sample(rank.registry, "kvdefrag_applied_steps_total", path="in_process") == 0


def test_a_stale_or_forged_step_on_an_output_is_refused_and_changes_nothing(
    ranks: list[_Rank],
) -> None:
    handle = ranks[0].handle
    other = StepEvents(new_blocks={"x": [30, 31]})
    with DefragClient(handle.address) as client:
        client.step(STEPS[0])
        client.step(STEPS[1])
        epoch, next_seq = client.epoch, client.next_seq
        before = _state(handle)

        def pass_with(stamp: tuple[int, int], timeout_s: float = STEP_WAIT_S) -> None:
            output = _stamped(StepStamp((stamp,), other))
            wait_for_planned_step(handle, 0, output, timeout_s)

        with pytest.raises(EpochMismatch, match=f"is not the server epoch {epoch}"):
            pass_with((epoch ^ 1, next_seq))
        assert _state(handle) == before
        with pytest.raises(ServiceUnavailable, match=f"step seq {next_seq + 1} of epoch"):
            pass_with((epoch, next_seq + 1), timeout_s=0.2)  # skips a step: left to the call
        assert _state(handle) == before
        pass_with((epoch, next_seq - 1))  # applied already: found applied, never again
        assert _state(handle) == before
        with pytest.raises(InvalidArgument, match="epoch 0"):
            handle.apply_planned_step(0, next_seq, other)
        assert _state(handle) == before

        handle.reset(force=True)  # the scheduler's session ends: restart vLLM
        after_reset = _state(handle)
        with pytest.raises(EpochMismatch, match=f"of epoch {epoch}: the server is at"):
            pass_with((epoch, next_seq))
        with pytest.raises(ServiceUnavailable, match="step seq 1 of epoch"):
            pass_with((handle.epoch, 1), timeout_s=0.2)  # no writer in the new epoch
        assert _state(handle) == after_reset
        assert after_reset[2] == list(range(NUM_BLOCKS))
    assert _sample(ranks[0].registry, "kvdefrag_applied_steps_total", path="in_process") == 0


def _stream_noticed_the_cut(client: DefragClient) -> bool:
    stream = client._session._stream
    return stream is None or not stream.is_idle_and_open


@pytest.mark.parametrize("keep_mirror", [False, True], ids=["rank-client", "mirror"])
def test_a_step_a_worker_applied_before_the_stream_broke_is_completed_after_reconnecting(
    ranks: list[_Rank], held_up: SocketProxy, keep_mirror: bool
) -> None:
    rank = ranks[0]
    with DefragClient(held_up.address, timeout_s=10, keep_mirror=keep_mirror) as client:
        client.step(STEPS[0])
        stamp = StepStamp(((client.epoch, client.next_seq),), STEPS[1])
        wait_for_planned_step(rank.handle, 0, _stamped(stamp), STEP_WAIT_S)  # the worker first
        applied = _state(rank.handle)
        held_up.cut()  # the stream breaks before the scheduler's call for that step leaves
        deadline = time.monotonic() + 10
        while not _stream_noticed_the_cut(client):
            assert time.monotonic() < deadline, "the client never noticed the cut"
            time.sleep(0.01)

        reply = client.step(STEPS[1])  # reopens one seq behind the server: its own step

        assert (reply.seq, reply.replayed) == (2, True)
        assert reply.digest == rank.handle._engine.digest
        assert _state(rank.handle) == applied  # answered from the cache, not applied again
        last = client.step(STEPS[2])
        assert (last.seq, last.digest) == (3, rank.handle._engine.digest)
        if keep_mirror:
            assert client.audit(strict=True).is_consistent
    assert _sample(rank.registry, "kvdefrag_applied_steps_total", path="in_process") == 1
    assert _sample(rank.registry, "kvdefrag_replayed_steps_total") == 0


def test_without_a_writer_session_a_pass_waits_for_the_call(ranks: list[_Rank]) -> None:
    handle = ranks[0].handle
    with DefragClient(handle.address) as client:
        client.step(STEPS[0])
        epoch, next_seq = client.epoch, client.next_seq
    before = _state(handle)
    output = _stamped(StepStamp(((epoch, next_seq),), STEPS[1]))
    with pytest.raises(ServiceUnavailable, match=f"step seq {next_seq} of epoch {epoch}"):
        wait_for_planned_step(handle, 0, output, 0.2)
    assert _state(handle) == before
    assert np.array_equal(handle.resolve(), np.array(before[2]))


def test_the_scheduler_sends_the_next_step_before_the_last_ones_replies_are_in(
    ranks: list[_Rank], held_up: SocketProxy
) -> None:
    clients = [
        DefragClient(held_up.address, client_name="rank0", keep_mirror=False),
        DefragClient(ranks[1].handle.address, client_name="rank1", keep_mirror=False),
    ]
    bridge = SchedulerBridge(
        RankGroup(clients), num_blocks=NUM_BLOCKS, block_size=16, prefix_caching=False
    )
    outputs = [
        output(new=[NewRequestData("a", (list(range(40, 48)),), 0)]),
        output(new=[NewRequestData("b", ([50, 51],), 0)]),
        output(finished=["a"]),
    ]
    try:
        held_up.mode = "stall"  # rank 0's calls leave, and go nowhere for now
        for number, out in enumerate(outputs[:2], start=1):
            bridge.apply(out, changes_from_output(out, None), lambda block_id: False)
            stamp = read_step_stamp(out)
            assert stamp is not None and [seq for _, seq in stamp.by_rank] == [number, number]
            for rank_number, rank in enumerate(ranks):
                wait_for_planned_step(rank.handle, rank_number, out, STEP_WAIT_S)
        # Step 2 went out with step 1's reply from rank 0 still held up.
        assert [step.done() for step in bridge._in_flight] == [False, False]

        held_up.mode = "pass"
        bridge.apply(outputs[2], changes_from_output(outputs[2], None), lambda block_id: False)
        for rank_number, rank in enumerate(ranks):
            wait_for_planned_step(rank.handle, rank_number, outputs[2], STEP_WAIT_S)
        bridge.settle()

        assert bridge.totals.last_reply is not None and bridge.totals.last_reply.seq == 3
        assert len({rank.handle._engine.digest for rank in ranks}) == 1
        for rank in ranks:
            assert rank.handle.stats().totals.num_steps == 3
            assert rank.handle._engine.list_requests() == {"b": [50, 51]}
        assert _sample(ranks[0].registry, "kvdefrag_applied_steps_total", path="in_process") == 3
    finally:
        bridge.settle()
        bridge.ranks.close()


def test_two_steps_workers_applied_before_their_calls_came_are_not_counted_as_resends(
    ranks: list[_Rank],
) -> None:
    """Two steps unsettled: the worker applies both before the scheduler's calls for
    either arrive; each call is the step's first copy, not a resend."""
    rank = ranks[0]
    with DefragClient(rank.handle.address, timeout_s=10) as client:
        client.step(STEPS[0])
        epoch, seq = client.epoch, client.next_seq
        for offset, events in enumerate(STEPS[1:3]):
            wait_for_planned_step(
                rank.handle, 0, _stamped(StepStamp(((epoch, seq + offset),), events)), STEP_WAIT_S
            )
        applied = _state(rank.handle)
        replies = [client.step(events) for events in STEPS[1:3]]
        assert [(reply.seq, reply.replayed) for reply in replies] == [(seq, True), (seq + 1, True)]
        assert _state(rank.handle) == applied
        assert replies[-1].digest == rank.handle._engine.digest
    assert _sample(rank.registry, "kvdefrag_applied_steps_total", path="in_process") == 2
    assert _sample(rank.registry, "kvdefrag_replayed_steps_total") == 0


@pytest.mark.parametrize("seq", [0, -1])
def test_a_stamp_that_names_no_step_is_refused_not_taken_as_applied(
    ranks: list[_Rank], seq: int
) -> None:
    handle = ranks[0].handle
    with DefragClient(handle.address) as client:
        client.step(STEPS[0])
        before = _state(handle)
        for events in (None, STEPS[1]):
            output = _stamped(StepStamp(((client.epoch, seq),), events))
            if seq == 0 and events is None:
                # Planned before the epoch's first step: nothing to wait for.
                assert wait_for_planned_step(handle, 0, output, STEP_WAIT_S) == (client.epoch, 0)
                continue
            with pytest.raises(InvalidArgument, match=f"seq {seq} is not a step number"):
                wait_for_planned_step(handle, 0, output, STEP_WAIT_S)
        assert _state(handle) == before


def test_a_worker_whose_service_stops_gets_service_unavailable(ranks: list[_Rank]) -> None:
    """While the service stops, a pass that would apply its step in process is told so
    with the public error, as its wait is."""
    handle = ranks[0].handle
    with DefragClient(handle.address, timeout_s=2) as client:
        client.step(STEPS[0])
        stamp = StepStamp(((client.epoch, client.next_seq),), STEPS[1])
        before = _state(handle)
        # NOTE: the first thing a stop does; the writer's stream is ended only after it
        # (begin_shutdown), so a pass in between still finds the session open.
        handle._servicer._is_stopping.set()
        with pytest.raises(ServiceUnavailable, match="the server is shutting down"):
            wait_for_planned_step(handle, 0, _stamped(stamp), STEP_WAIT_S)
        assert _state(handle) == before
