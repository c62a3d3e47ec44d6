"""The vLLM scheduler's lockstep group of rank clients, on real servers."""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc
import pytest

from kvdefrag.client import DefragClient, StepEvents
from kvdefrag.client import _convert as client_convert
from kvdefrag.common import (
    DefragError,
    EpochMismatch,
    InvalidArgument,
    ServiceUnavailable,
    SessionConflict,
)
from kvdefrag.common import events as events_module
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc
from kvdefrag.v1 import identity_pb2, identity_pb2_grpc
from kvdefrag.vllm._discovery import PublishedRank
from kvdefrag.vllm._scheduler.ranks import (
    RankGroup,
    RankNotVerified,
    RanksDiverged,
    connect_ranks,
    verify_rank,
)

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.server import Serve

# --- which services the scheduler trusts ------------------------------------------------
SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))


def is_session_open(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        stats = pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    return bool(stats.is_session_open)


def test_ranks_that_prove_their_secret_are_connected(serve: Serve) -> None:
    handles = [serve(identity_secret=SECRET), serve(identity_secret=OTHER_SECRET)]
    ranks = [
        PublishedRank(handles[0].address, SECRET),
        PublishedRank(handles[1].address, OTHER_SECRET),
    ]
    clients = connect_ranks(ranks, prefix_caching=False, tls={})
    try:
        assert [client.address for client in clients] == [h.address for h in handles]
        assert all(is_session_open(handle.address) for handle in handles)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize(
    ("impostor_secret", "message"),
    [
        (None, r"cannot prove the secret rank 1 published \(UNIMPLEMENTED\)"),
        (OTHER_SECRET, "its proof does not match the secret rank 1 published"),
    ],
)
def test_a_published_address_served_by_another_process_is_refused(
    serve: Serve, impostor_secret: bytes | None, message: str
) -> None:
    # ranks.json names rank 1's address, but what serves it is not the rank that
    # published the secret: a server started without one, or with another one.
    rank0 = serve(identity_secret=SECRET)
    impostor = serve(identity_secret=impostor_secret)
    ranks = [PublishedRank(rank0.address, SECRET), PublishedRank(impostor.address, SECRET)]
    with pytest.raises(RankNotVerified, match=message) as info:
        connect_ranks(ranks, prefix_caching=False, tls={})
    assert "is not served by this engine's rank 1" in str(info.value)
    assert "another process serves that address" in str(info.value)
    # every rank is verified before any session opens: nobody was stepped
    assert not is_session_open(rank0.address) and not is_session_open(impostor.address)


def test_an_address_nobody_serves_is_unavailable_not_unverified(tmp_path: Any) -> None:
    published = PublishedRank(f"unix:{tmp_path}/gone.sock", SECRET)
    with pytest.raises(ServiceUnavailable, match=r"rank 0's service at .* did not answer"):
        verify_rank(0, published, {}, timeout_s=0.3)


def test_the_proof_reveals_nothing_for_a_bad_nonce(serve: Serve) -> None:
    handle = serve(identity_secret=SECRET)
    with grpc.insecure_channel(handle.address) as channel:
        stub = identity_pb2_grpc.IdentityServiceStub(channel)
        for nonce in (b"", b"n" * 15, b"n" * 65):
            with pytest.raises(grpc.RpcError) as info:
                stub.ProveIdentity(identity_pb2.ProveIdentityRequest(nonce=nonce), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgument, match="identity_secret must be at least 16"):
        serve(identity_secret=b"short")


# --- stepping every rank -----------------------------------------------------------------
def test_a_rank_that_answers_late_is_completed_not_stepped_twice(serve: Serve) -> None:
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    slow = ScriptedExecutor.for_kv(kvs[1])
    slow.stall_next(1.5)  # its first batch
    handles = [serve(kv=kvs[0], threshold=0), serve(kv=kvs[1], threshold=0, executor=slow)]
    clients = [DefragClient(handle.address, timeout_s=0.5) for handle in handles]
    group = RankGroup(clients)
    try:
        group.step(StepEvents(new_blocks={"a": [40, 41]}, fresh=[]))  # moves: slow
        reply = group.step(StepEvents(new_blocks={"b": [50]}))
        assert reply.seq == 2
        for handle in handles:
            assert handle.stats().totals.num_steps == 2
            assert handle._engine.list_requests() == {"a": [40, 41], "b": [50]}
        assert handles[0]._engine.digest == handles[1]._engine.digest == clients[1].digest
    finally:
        group.close()


def test_a_submitted_step_is_waited_for_on_each_rank_by_its_stamp(serve: Serve) -> None:
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    slow = ScriptedExecutor.for_kv(kvs[1])
    slow.stall_next(0.3)  # its first batch
    handles = [serve(kv=kvs[0], threshold=0), serve(kv=kvs[1], threshold=0, executor=slow)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        in_flight = group.submit(StepEvents(new_blocks={"a": [40, 41]}, fresh=[]))
        assert [seq for _, seq in in_flight.stamp.by_rank] == [1, 1]
        assert [epoch for epoch, _ in in_flight.stamp.by_rank] == group.epochs
        for handle, (epoch, seq) in zip(handles, in_flight.stamp.by_rank, strict=True):
            handle.wait_applied(epoch, seq, timeout_s=10.0)
            assert handle._engine.list_requests() == {"a": [40, 41]}  # applied, moves done
        assert in_flight.result().seq == 1
        assert group.submit(StepEvents(finished=["a"])).result().seq == 2
    finally:
        group.close()


def test_waiting_for_a_step_that_never_comes_names_it(serve: Serve) -> None:
    handle = serve(kv=SignedKv.create(64))
    with DefragClient(handle.address) as client:
        client.step(StepEvents(new_blocks={"a": [3]}))
        handle.wait_applied(client.epoch, 1, timeout_s=0.0)  # applied: no wait at all
        with pytest.raises(ServiceUnavailable, match=r"step seq 2 of epoch .* was not applied"):
            handle.wait_applied(client.epoch, 2, timeout_s=0.05)
        epoch = client.epoch
        client.reset()
        with pytest.raises(EpochMismatch, match=f"seq 1 of epoch {epoch}: the server is at"):
            handle.wait_applied(epoch, 1, timeout_s=5.0)


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_rank_reset_by_force_stops_the_group_and_its_workers(
    serve: Serve, num_ranks: int
) -> None:
    handles = [serve(kv=SignedKv.create(64), threshold=0) for _ in range(num_ranks)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        group.step(StepEvents(new_blocks={"a": [40, 41]}, fresh=[]))
        last = handles[-1]
        with pytest.raises(SessionConflict, match="restart vLLM"):
            last.reset()  # the scheduler's session holds the service
        last.reset(force=True)

        in_flight = group.submit(StepEvents(new_blocks={"b": [50]}))
        epoch, seq = in_flight.stamp.for_rank(num_ranks - 1)
        with pytest.raises(EpochMismatch):
            last.wait_applied(epoch, seq, timeout_s=10)  # the worker's pass must not run
        with pytest.raises(RanksDiverged, match=f"rank {num_ranks - 1}: .*another epoch"):
            in_flight.result()
        with pytest.raises(RanksDiverged):
            group.step(StepEvents(new_blocks={"c": [51]}))
    finally:
        group.close()


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_a_step_is_checked_once_when_made_and_every_rank_is_sent_it_as_it_is(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, num_ranks: int
) -> None:
    handles = [serve(kv=SignedKv.create(64), threshold=0) for _ in range(num_ranks)]
    group = RankGroup([DefragClient(h.address, keep_mirror=False) for h in handles])
    checked: list[int] = []  # id() of every block-list mapping checked
    block_lists = events_module._block_lists

    def spy(field: str, lists: Any) -> Any:
        checked.append(id(lists))
        return block_lists(field, lists)

    monkeypatch.setattr(events_module, "_block_lists", spy)
    sent: list[StepEvents] = []
    stream_step_request = client_convert.stream_step_request

    def sending(seq: int, epoch: int, events: StepEvents) -> Any:
        sent.append(events)
        return stream_step_request(seq, epoch, events)

    monkeypatch.setattr(client_convert, "stream_step_request", sending)
    try:
        # As the scheduler's ledger makes them: lists of ints, checked here, once.
        steps = [
            StepEvents(new_blocks={"a": [40, 41], "b": [50]}),
            StepEvents(finished=("a",), new_blocks={"c": [60]}, fresh=[]),
        ]
        ours = {id(events.new_blocks) for events in steps}
        assert ours <= set(checked)
        checked.clear()
        assert group.step(steps[0]).seq == 1
        assert group.submit(steps[1]).result().seq == 2
        assert not ours & set(checked)  # never checked again (the servers check their own)
        assert [id(events) for events in sent] == [id(steps[0])] * num_ranks + [
            id(steps[1])
        ] * num_ranks  # the one value, to every rank, not a copy
        for client, handle in zip(group.clients, handles, strict=True):
            assert client.digest == handle._engine.digest  # the last reply's, no mirror
            with pytest.raises(InvalidArgument, match="keeps no mirror"):
                client.live_requests()
    finally:
        group.close()


def test_ranks_whose_mappings_differ_stop_the_group_by_their_digests(serve: Serve) -> None:
    """The scheduler's clients keep no mirror: the digests compared across ranks are what
    catches a rank whose mapping went another way."""
    handles = [
        serve(kv=SignedKv.create(64), threshold=0),
        serve(kv=SignedKv.create(64), threshold=100),  # never compacts
    ]
    group = RankGroup([DefragClient(h.address, keep_mirror=False) for h in handles])
    try:
        with pytest.raises(RanksDiverged, match=r"rank 1: digest .* differs from rank 0's"):
            # rank 0 compacts the blocks down, rank 1 leaves them where they are
            group.step(StepEvents(new_blocks={"a": [40, 41], "b": [50]}, fresh=[]))
        assert handles[0].resolve([40, 41, 50]).tolist() != [40, 41, 50]
        assert handles[1].resolve([40, 41, 50]).tolist() == [40, 41, 50]
    finally:
        group.close()


def test_a_step_of_another_type_is_refused_before_any_rank_is_sent_it(serve: Serve) -> None:
    handles = [serve(kv=SignedKv.create(64)) for _ in range(2)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        with pytest.raises(InvalidArgument):
            StepEvents(new_blocks={"a": ["3"]})  # wrong types never make a StepEvents
        bad_steps: list[Any] = [{"new_blocks": {"a": [3]}}, None]
        for bad in bad_steps:
            with pytest.raises(InvalidArgument):
                group.step(bad)
            with pytest.raises(InvalidArgument):
                group.submit(bad)
        assert [client.next_seq for client in group.clients] == [1, 1]
        assert [handle.stats().totals.num_steps for handle in handles] == [0, 0]
    finally:
        group.close()


def test_a_step_queued_behind_one_a_rank_refused_is_not_sent_there(serve: Serve) -> None:
    handles = [serve(kv=SignedKv.create(64)) for _ in range(2)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        group.step(StepEvents(new_blocks={"a": [3]}))
        refused = group.submit(StepEvents(new_blocks={"b": [64]}))  # outside the pool
        queued = group.submit(StepEvents(new_blocks={"c": [5]}))
        assert [seq for _, seq in queued.stamp.by_rank] == [3, 3]

        with pytest.raises(InvalidArgument, match="64"):
            refused.result()
        with pytest.raises(DefragError, match=r"step seq 3 was not sent: .* at seq 2"):
            queued.result()

        for handle in handles:  # neither step was applied, nor the second under seq 2
            assert handle.stats().totals.num_steps == 1
            assert handle._engine.list_requests() == {"a": [3]}
        while not queued.done():  # result() raised with rank 0's error; rank 1's may lag
            time.sleep(0.01)
        # Once the queues drained, the next step takes the seq the clients are at.
        assert group.submit(StepEvents(new_blocks={"c": [5]})).result().seq == 2
    finally:
        group.close()


def test_a_step_stamped_after_a_refusal_nobody_took_yet_does_not_reuse_its_seq(
    serve: Serve,
) -> None:
    """The bridge checks the step before the last, then plans and submits the next: a step
    that fails in between must not lend its seq to the next one, whose output would
    carry the failed step's seq with other events."""
    handles = [serve(kv=SignedKv.create(64)) for _ in range(2)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        group.step(StepEvents(new_blocks={"a": [3]}))
        refused = group.submit(StepEvents(new_blocks={"b": [64]}))  # outside the pool
        while not refused.done():  # failed, but its result not taken yet
            time.sleep(0.01)
        following = group.submit(StepEvents(new_blocks={"c": [5]}))
        assert [seq for _, seq in refused.stamp.by_rank] == [2, 2]
        assert [seq for _, seq in following.stamp.by_rank] == [3, 3]

        with pytest.raises(InvalidArgument, match="64"):
            refused.result()
        with pytest.raises(DefragError, match=r"step seq 3 was not sent: .* at seq 2"):
            following.result()
        for handle in handles:  # "c" was not applied under the refused step's seq
            assert handle.stats().totals.num_steps == 1
            assert handle._engine.list_requests() == {"a": [3]}
    finally:
        group.close()


# --- closing, for the scheduler's shutdown -----------------------------------------------
TIMEOUT_S = 1.0


def test_closing_does_not_wait_for_a_rank_that_stopped_with_a_step_in_flight(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM shuts down: the workers' services stop before the scheduler, one while the
    rank applies a step; closing the group names that rank and does not wait for it (its
    pending step once took a call and three completions, each up to ``timeout_s``)."""
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    held = ScriptedExecutor.for_kv(kvs[1])
    handles = [serve(kv=kvs[0], threshold=0), serve(kv=kvs[1], threshold=0, executor=held)]
    # NOTE: no clock is read: waiting for the gone rank would run to this deadline and
    # log that it did not answer; found gone, it is named so and the wait ends.
    timeout_s = 60.0
    group = RankGroup([DefragClient(h.address, timeout_s=timeout_s) for h in handles])
    try:
        held.hold()
        in_flight = [  # as the scheduler keeps them: two unsettled, the second queued
            group.submit(StepEvents(new_blocks={"a": [40, 41]}, fresh=[])),  # moves
            group.submit(StepEvents(new_blocks={"b": [50]})),
        ]
        assert held.entered.wait(10)
        handles[1].stop(grace_s=0)  # the step's call is cancelled; no socket any more

        with caplog.at_level(logging.WARNING, logger="kvdefrag.vllm._scheduler.ranks"):
            reply = group.close(in_flight)

        assert "did not answer" not in caplog.text
        assert reply is not None and reply.seq == 2  # rank 0's, checked
        gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1, caplog.text
        assert gone[0].startswith(f"rank 1 at {handles[1].address} is gone: UNAVAILABLE")
        assert not is_session_open(handles[0].address)  # closed, not left open
    finally:
        held.release()
        group.close()


def test_closing_waits_for_a_rank_that_serves_and_checks_its_reply(serve: Serve) -> None:
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    slow = ScriptedExecutor.for_kv(kvs[1])
    slow.stall_next(0.6)  # longer than a few looks at whether it still serves
    handles = [
        serve(kv=kvs[0], threshold=0),
        serve(kv=kvs[1], threshold=100, executor=slow),  # never compacts: another digest
    ]
    group = RankGroup([DefragClient(h.address, timeout_s=5.0) for h in handles])
    in_flight = group.submit(StepEvents(new_blocks={"a": [40, 41]}, fresh=[]))
    with pytest.raises(RanksDiverged, match=r"rank 1: digest .* differs from rank 0's"):
        group.close([in_flight])
    assert in_flight.done()
    assert not any(is_session_open(h.address) for h in handles)


def test_closing_gives_up_on_a_rank_that_serves_but_never_answers(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    held = ScriptedExecutor.for_kv(kv := SignedKv.create(64))
    handle = serve(kv=kv, threshold=0, executor=held)
    group = RankGroup([DefragClient(handle.address, timeout_s=TIMEOUT_S)])
    try:
        held.hold()
        in_flight = group.submit(StepEvents(new_blocks={"a": [40, 41]}, fresh=[]))
        assert held.entered.wait(10)
        with caplog.at_level(logging.WARNING, logger="kvdefrag.vllm._scheduler.ranks"):
            assert group.close([in_flight]) is None
        assert f"rank 0 at {handle.address} did not answer" in caplog.text
        assert "is gone" not in caplog.text
    finally:
        held.release()
        group.close()
