"""Faults seen from the client, against the real server: every one leaves state unchanged.

Covers a stream cut after the server applied a step and one cut before it got there
(reconnect: nothing lost, nothing applied twice), a reply that misses the deadline,
duplicated and out-of-order seqs, a second writer, another writer that stepped while the
client was away, a server restarted under the client, an executor failure, oversized
messages and malformed ids. The cuts are real: a unix-socket proxy that drops every
connection, and a client interceptor that cancels the stream before a step leaves.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdefrag.client import (
    DefragClient,
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    MirrorDiverged,
    OutOfOrder,
    ServiceUnavailable,
    SessionConflict,
    StepEvents,
    StepOutcomeUnknown,
    StepPending,
    _convert,
)
from kvdefrag.client import _session as session_module
from kvdefrag.server import ServerHandle
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.proxy import SocketProxy
from support.server import Serve

NUM_BLOCKS = 64
BLOCK_SIZE = 2


# --- resources and factories ------------------------------------------------------------
class DropStepInterceptor(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Cancels the step stream instead of sending the step with seq ``drop_seq``."""

    def __init__(self) -> None:
        self.drop_seq: int | None = None
        self.dropped: list[int] = []

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        calls: list[Any] = []

        def requests() -> Iterator[Any]:
            for message in request_iterator:
                if message.WhichOneof("kind") == "step" and message.step.seq == self.drop_seq:
                    self.drop_seq = None
                    self.dropped.append(message.step.seq)
                    calls[0].cancel()  # the step never leaves this process
                    return
                yield message

        call = continuation(details, requests())
        calls.append(call)
        return call


@dataclasses.dataclass
class Pool:
    """A served pool: the server handle, its signed KV tensors and executor."""

    handle: ServerHandle
    signed: SignedKv
    executor: ScriptedExecutor


@pytest.fixture
def socket_dir(tmp_path: Path) -> Path:
    return tmp_path


def serve_pool(serve: Serve, path: Path, **config: Any) -> Pool:
    """A server on ``path`` (the ``serve`` fixture stops it) with a faulty executor."""
    signed = SignedKv.create(config.pop("num_blocks", NUM_BLOCKS), block_size=BLOCK_SIZE)
    executor = ScriptedExecutor.for_kv(signed)
    config.setdefault("threshold", 0)
    handle = serve(f"unix:{path}", kv=signed, executor=executor, **config)
    return Pool(handle, signed, executor)


def step_and_write(client: DefragClient, signed: SignedKv, **fields: Any) -> Any:
    """One step; then the worker writes every fresh block (all new blocks are fresh here)."""
    events = StepEvents(**fields)
    reply = client.step(events)
    new_ids = sorted({i for ids in events.new_blocks.values() for i in ids})
    signed.write(new_ids, client.resolve(new_ids))
    return reply


def lost_blocks(client: DefragClient, signed: SignedKv) -> list[int]:
    """Live blocks whose data the client's mapping does not find."""
    live = sorted({i for ids in client.live_requests().values() for i in ids})
    return signed.mismatched(live, client.resolve(live))


def server_state(pool: Pool) -> tuple[Any, ...]:
    """What must not change when a step is refused (read in-process, no session needed)."""
    engine = pool.handle._engine
    stats = engine.stats()
    return (
        pool.handle.epoch,
        stats.totals.num_steps,
        engine.digest,
        engine.list_requests(),
        engine.resolve(range(engine.num_blocks)).tolist(),
    )


def client_state(client: DefragClient) -> tuple[Any, ...]:
    """The client's epoch, seq and mirror, read even where its reads refuse (stale)."""
    mirror = client._session.require_mirror()
    return (client.epoch, client.next_seq, mirror.digest, dict(mirror.requests))


def fragment(client: DefragClient, signed: SignedKv) -> None:
    """Two requests, the first finished: holes below the second one's blocks."""
    step_and_write(client, signed, new_blocks={"a": list(range(1, 11)), "b": [40, 41, 42]})
    client.step(StepEvents(finished=["a"]))


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- stream cuts and reconnects ---------------------------------------------------------
def test_cut_after_the_server_applied_a_step_replays_it_once(
    socket_dir: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    proxy = SocketProxy(f"unix:{socket_dir}/server.sock", listen=f"unix:{socket_dir}/proxy.sock")
    engine = pool.handle._engine
    real_apply_events = engine.apply_events  # what the servicer calls
    cut_after: list[int] = []

    def apply_then_cut(events: Any) -> Any:
        result = real_apply_events(events)
        if cut_after:
            cut_after.clear()
            proxy.cut()  # the reply of an applied step never reaches the client
        return result

    monkeypatch.setattr(engine, "apply_events", apply_then_cut)
    try:
        with DefragClient(proxy.address, timeout_s=10) as client:
            fragment(client, pool.signed)
            cut_after.append(3)

            reply = step_and_write(client, pool.signed, new_blocks={"c": [50, 51]})

            assert proxy.num_cuts == 1
            assert reply.seq == 3
            assert reply.replayed  # answered from the replay cache after the reconnect
            assert engine.stats().totals.num_steps == 3  # applied exactly once
            assert lost_blocks(client, pool.signed) == []
            assert client.audit().is_consistent

            # A cut while idle: the next step reconnects transparently.
            proxy.cut()
            reply = step_and_write(client, pool.signed, new_blocks={"d": [60]})
            assert (reply.seq, reply.replayed) == (4, False)
            assert engine.stats().totals.num_steps == 4
            assert client.audit(strict=True).is_consistent
    finally:
        proxy.close()


def test_cut_before_the_step_reached_the_server_sends_it_again(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    interceptor = DropStepInterceptor()
    with DefragClient(pool.handle.address, timeout_s=10, interceptors=[interceptor]) as client:
        fragment(client, pool.signed)
        interceptor.drop_seq = 3

        reply = step_and_write(client, pool.signed, new_blocks={"c": [50, 51]})

        assert interceptor.dropped == [3]
        assert (reply.seq, reply.replayed) == (3, False)  # applied now, for the first time
        assert pool.handle.stats().totals.num_steps == 3
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


def test_a_reply_past_the_deadline_leaves_the_step_pending_and_it_is_applied_once(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
        pool.executor.stall_next(1.5)
        client.timeout_s = 0.5

        with pytest.raises(StepOutcomeUnknown, match=r"step seq 2: no reply .* within 0.5 s"):
            client.step(StepEvents(finished=["a"]))  # compaction stalls in the executor

        client.timeout_s = 5
        assert client.has_pending_step and client.pending_seq == 2
        assert client.next_seq == 2
        wait_until(lambda: pool.handle.stats().totals.num_steps == 2)
        completed = client.complete_pending_step()
        assert completed is not None and (completed.seq, completed.replayed) == (2, True)
        reply = step_and_write(client, pool.signed, new_blocks={"c": [50]})

        assert reply.seq == 3
        assert not client.has_pending_step
        assert pool.handle.stats().totals.num_steps == 3
        assert client.live_requests() == {"b": [40], "c": [50]}
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


# --- sequence numbers -------------------------------------------------------------------
class RawStream:
    """A bare step stream on its own channel: one message in, one reply out."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call = pb_grpc.DefragServiceStub(self._channel).StepStream(self._requests())
        self._replies = iter(self._call)

    def _requests(self) -> Iterator[Any]:
        while (message := self._outbox.get()) is not None:
            yield message

    def exchange(self, message: Any) -> Any:
        self._outbox.put(message)
        return next(self._replies)

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()


def test_duplicated_seq_is_replayed_and_out_of_order_seq_refused(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    stream = RawStream(pool.handle.address)
    try:
        opened = stream.exchange(pb.StepStreamRequest(open=pb.OpenSession(client_name="raw")))
        epoch = opened.opened.epoch
        step = pb.StepRequest(
            seq=1, epoch=epoch, new_blocks=[pb.RequestBlocks(request_id="a", block_ids=[9])]
        )
        first = stream.exchange(pb.StepStreamRequest(step=step)).step
        state = server_state(pool)

        again = stream.exchange(pb.StepStreamRequest(step=step)).step

        assert again.replayed and not first.replayed
        assert list(again.logical_block_ids) == list(first.logical_block_ids)
        assert list(again.physical_block_ids) == list(first.physical_block_ids)
        assert server_state(pool) == state  # not applied twice

        with pytest.raises(grpc.RpcError) as caught:
            stream.exchange(pb.StepStreamRequest(step=pb.StepRequest(seq=3, epoch=epoch)))
        error = _convert.defrag_error(caught.value, "step")
        assert isinstance(error, OutOfOrder)
        assert "expected seq 2" in str(error)
        assert server_state(pool) == state
    finally:
        stream.close()


def test_client_refuses_a_server_another_writer_stepped_until_it_rebuilds(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    proxy = SocketProxy(f"unix:{socket_dir}/server.sock", listen=f"unix:{socket_dir}/proxy.sock")
    tool = grpc.insecure_channel(pool.handle.address)
    try:
        with DefragClient(proxy.address, timeout_s=5) as client:
            step_and_write(client, pool.signed, new_blocks={"a": [5, 6]})
            proxy.cut()
            wait_until(lambda: not client.stats().is_session_open)
            # A tool steps the server while the client is away (unary, epoch 0: current).
            pb_grpc.DefragServiceStub(tool).Step(
                pb.StepRequest(seq=2, new_blocks=[pb.RequestBlocks(request_id="t", block_ids=[7])]),
                timeout=5,
            )
            state = server_state(pool)
            before = client_state(client)

            with pytest.raises(MirrorDiverged, match="seq 2 was applied with other events"):
                client.step(StepEvents(new_blocks={"b": [8]}))
            with pytest.raises(MirrorDiverged):
                client.resolve([5])  # a stale mirror is not used

            assert server_state(pool) == state
            assert client_state(client) == before
            report = client.audit()
            assert report.only_on_server == {"t": [7]}
            with pytest.raises(MirrorDiverged, match="request 't' only on the server"):
                client.audit(strict=True)

            client.rebuild_mirror()

            assert client.live_requests() == {"a": [5, 6], "t": [7]}
            assert client.next_seq == 3
            pool.signed.write([7], client.resolve([7]))
            reply = step_and_write(client, pool.signed, new_blocks={"b": [8]})
            assert reply.seq == 3
            assert lost_blocks(client, pool.signed) == []
            assert client.audit().is_consistent
    finally:
        tool.close()
        proxy.close()


# --- sessions and epochs ----------------------------------------------------------------
def test_a_second_writer_is_refused_and_changes_nothing(socket_dir: Path, serve: Serve) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5, client_name="first") as client:
        step_and_write(client, pool.signed, new_blocks={"a": [3, 4]})
        state = server_state(pool)

        with pytest.raises(SessionConflict, match="client_name='first'"):
            DefragClient(pool.handle.address, timeout_s=5, client_name="second")
        with grpc.insecure_channel(pool.handle.address) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                pb_grpc.DefragServiceStub(channel).Step(pb.StepRequest(seq=2), timeout=5)
            assert isinstance(_convert.defrag_error(caught.value), SessionConflict)

        assert server_state(pool) == state
        assert (
            client.step(StepEvents(new_blocks={"b": [9]})).seq == 2
        )  # the first writer carries on
        assert client.audit().is_consistent


def test_a_new_client_adopts_the_state_a_previous_one_left(socket_dir: Path, serve: Serve) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as first:
        step_and_write(first, pool.signed, new_blocks={"a": [30, 31], "b": [40]})
        first.step(StepEvents(finished=["a"]))
        mapping = first.resolve(range(NUM_BLOCKS))

    with DefragClient(pool.handle.address, timeout_s=5) as second:
        assert second.live_requests() == {"b": [40]}
        assert (second.next_seq, second.epoch) == (3, pool.handle.epoch)
        assert second.resolve(range(NUM_BLOCKS)) == mapping
        assert step_and_write(second, pool.signed, new_blocks={"c": [50]}).seq == 3
        assert lost_blocks(second, pool.signed) == []


def test_a_prefix_caching_mode_change_is_refused_while_the_server_has_state(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [3]})
    state = server_state(pool)

    with pytest.raises(SessionConflict, match="Reset to change the mode"):
        DefragClient(pool.handle.address, prefix_caching=True, timeout_s=5)

    assert server_state(pool) == state
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        client.reset()  # a reset in the client's own mode; a new client may then switch
    with DefragClient(pool.handle.address, prefix_caching=True, timeout_s=5) as client:
        assert client.step(StepEvents(new_blocks={"b": [4]}, fresh=[4])).seq == 1
    assert pool.handle._engine.config.prefix_caching


def test_a_server_restarted_under_the_client_raises_epoch_mismatch_until_reset(
    socket_dir: Path, serve: Serve
) -> None:
    path = socket_dir / "server.sock"
    first = serve_pool(serve, path)
    with DefragClient(first.handle.address, timeout_s=5) as client:
        step_and_write(client, first.signed, new_blocks={"a": [3, 4]})
        old_epoch = client.epoch
        first.handle.stop(1.0)
        second = serve_pool(serve, path)
        state = server_state(second)

        with pytest.raises(EpochMismatch, match=f"open.epoch {old_epoch} is not the server"):
            client.step(StepEvents(new_blocks={"b": [5]}))
        with pytest.raises(EpochMismatch, match="call reset\\(\\)"):
            client.step(StepEvents(new_blocks={"b": [5]}))
        with pytest.raises(EpochMismatch):
            client.resolve([3])

        assert server_state(second) == state
        client.reset()

        assert client.epoch == second.handle.epoch != old_epoch
        assert client.live_requests() == {}
        reply = step_and_write(client, second.signed, new_blocks={"b": [5]})
        assert reply.seq == 1
        assert lost_blocks(client, second.signed) == []
        assert client.audit().is_consistent


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvdefrag.v1.DefragService"), timeout=5
        )
    return int(response.status)


def test_an_executor_failure_refuses_steps_until_reset(socket_dir: Path, serve: Serve) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock", threshold=4)
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        fragment(client, pool.signed)  # 10 holes below b, above the threshold of 4 ...
        assert pool.handle.stats().holes == 0  # ... so b was compacted down
        step_and_write(client, pool.signed, new_blocks={"c": [20, 21, 22], "d": [23]})
        client.step(StepEvents(finished=["c"]))
        assert pool.handle.stats().holes == 3  # at most the threshold: left alone
        client.defragment()  # so the next step runs a pass, which fails
        pool.executor.fail_next()
        before = client_state(client)
        live_before = pool.handle.resolve([40, 41, 42, 23]).tolist()

        with pytest.raises(EngineUnhealthy, match="injected KV copy failure"):
            client.step(StepEvents())

        assert health_status(pool.handle.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(EngineUnhealthy, match="reset\\(\\) is required"):
            client.step(StepEvents(new_blocks={"d": [33]}))
        stats = client.stats()
        assert not stats.stats.is_healthy
        assert "injected" in stats.unhealthy_reason
        assert client_state(client) == before
        assert pool.handle.resolve([40, 41, 42, 23]).tolist() == live_before
        # The failed pass committed nothing: every live block is where the server says.
        live = sorted({i for ids in before[3].values() for i in ids})
        assert pool.signed.mismatched(live, pool.handle.resolve(live).tolist()) == []
        with pytest.raises(EngineUnhealthy, match="refused"):
            client.resolve(live)  # the mirror is not trusted after a failure

        client.reset()

        assert health_status(pool.handle.address) == health_pb2.HealthCheckResponse.SERVING
        assert client.stats().stats.is_healthy
        reply = step_and_write(client, pool.signed, new_blocks={"e": [9, 50]})
        assert reply.seq == 1
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


def test_reads_refuse_after_an_engine_failure_until_the_mirror_is_rebuilt(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
        pool.executor.fail_next()  # the compaction of this step fails ...
        with pytest.raises(EngineUnhealthy, match="injected KV copy failure"):
            client.step(StepEvents(finished=["a"], new_blocks={"c": [50]}))
        # ... after the step was applied with c's block placed low: the server moved it,
        # the mirror never heard of it.
        assert pool.handle.resolve([50]).tolist() != [50]

        for read in (
            lambda: client.resolve([50]),
            lambda: client.resolve_tables([[50]]),
            client.live_requests,
            lambda: client.digest,
        ):
            with pytest.raises(EngineUnhealthy, match=r"refused: .*rebuild_mirror\(\)"):
                read()
        with pytest.raises(EngineUnhealthy):
            client.step(StepEvents(new_blocks={"d": [33]}))

        client.rebuild_mirror()  # adopts the server's state, the failed step included

        assert client.resolve([50]) == pool.handle.resolve([50]).tolist()
        assert client.live_requests() == {"b": [40], "c": [50]}
        assert client.digest == pool.handle._engine.digest
        pool.signed.write([50], client.resolve([50]))  # the forward pass writes where it is
        assert lost_blocks(client, pool.signed) == []


# --- sizes and malformed input ------------------------------------------------------------
def test_an_oversized_step_is_refused_by_the_client_before_sending(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock", num_blocks=4096)
    with DefragClient(pool.handle.address, timeout_s=5, max_message_bytes=4096) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [1, 2]})
        state, before = server_state(pool), client_state(client)

        with pytest.raises(MessageTooLarge, match="exceeds max_message_bytes \\(4096\\)"):
            client.step(StepEvents(new_blocks={"big": list(range(100, 3100))}))

        assert (server_state(pool), client_state(client)) == (state, before)
        assert client.step(StepEvents(new_blocks={"b": [3]})).seq == 2


@pytest.mark.parametrize(
    ("num_ids", "message"),
    [
        (3000, "larger than max"),  # gRPC refuses the request itself
        (800, "its reply could reach"),  # the server refuses a reply that could not fit
    ],
)
def test_an_oversized_step_is_refused_by_the_server_and_changes_nothing(
    socket_dir: Path, serve: Serve, num_ids: int, message: str
) -> None:
    pool = serve_pool(
        serve,
        socket_dir / "server.sock",
        num_blocks=4096,
        max_message_bytes=4096,
        max_moves_per_step=8,
    )
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [1, 2]})
        state, before = server_state(pool), client_state(client)

        with pytest.raises(MessageTooLarge, match=message):
            client.step(StepEvents(new_blocks={"big": list(range(100, 100 + num_ids))}))

        assert (server_state(pool), client_state(client)) == (state, before)
        assert client.step(StepEvents(new_blocks={"b": [3]})).seq == 2
        assert client.audit().is_consistent


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ({"new_blocks": {"x": [-1]}}, r"new_blocks\['x'\]: block id -1 is outside \[0, 64\)"),
        ({"new_blocks": {"x": [64]}}, r"new_blocks\['x'\]: block id 64 is outside"),
        ({"new_blocks": {"x": [7, 7]}}, r"new_blocks\['x'\]: block id 7 appears twice"),
        ({"resumed": {"": [7]}}, "resumed: request id must be a non-empty str"),
        ({"finished": ["r" * 300]}, "longer than 256 characters"),
        ({"new_blocks": {"x": [7]}, "fresh": [8]}, "fresh: block id 8 is not among"),
        ({"new_blocks": {"x": [3]}, "fresh": [3]}, "fresh: block id 3 still holds data"),
        ({"evicted": [99]}, r"evicted: block id 99 is outside"),
        ({"new_blocks": {"x": ["7"]}}, r"new_blocks\['x'\]: block id .* is not an integer"),
        ({"new_blocks": {"x": [2**70]}}, r"new_blocks\['x'\]\[0\]: block id .* not an int64"),
    ],
)
def test_malformed_steps_are_refused_and_change_nothing(
    socket_dir: Path, serve: Serve, events: dict[str, Any], message: str
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [3, 4]})
        state, before = server_state(pool), client_state(client)

        with pytest.raises(InvalidArgument, match=message):
            client.step(StepEvents(**events))

        assert (server_state(pool), client_state(client)) == (state, before)
        assert step_and_write(client, pool.signed, new_blocks={"b": [9]}).seq == 2
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


# --- the two forms of step() -------------------------------------------------------------
def test_a_client_without_a_mirror_steps_adopts_no_tables_and_refuses_reads(
    socket_dir: Path, serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as seed:
        fragment(seed, pool.signed)  # state the next client adopts
    monkeypatch.setattr(session_module, "fetch_mirror", _no_fetch)
    with DefragClient(pool.handle.address, timeout_s=5, keep_mirror=False) as client:
        engine = pool.handle._engine
        assert (client.next_seq, client.digest) == (3, engine.digest)  # adopted: no tables
        reply = client.step(StepEvents(new_blocks={"c": [50, 51]}))
        assert client.digest == reply.digest == engine.digest
        reads = {
            "resolve": lambda: client.resolve([50]),
            "resolve_tables": lambda: client.resolve_tables([[50]]),
            "live_requests": client.live_requests,
            "audit": client.audit,
        }
        for what, read in reads.items():
            with pytest.raises(InvalidArgument, match=f"{what}: this client keeps no mirror"):
                read()
        client.rebuild_mirror()  # adopts the server's state again: still no tables
        assert (client.next_seq, client.digest) == (4, engine.digest)


def _no_fetch(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a client without a mirror fetched the server's tables")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda client: client.step([("new_blocks", {"b": [3]})]),
            r"step: expected a StepEvents, got a list",
        ),
        (
            lambda client: client.step({"new_blocks": {"b": [3]}}),
            r"step: expected a StepEvents, got a dict",
        ),
        (
            lambda client: client.step(StepEvents(new_blocks={"b": [3.0]})),
            r"new_blocks\['b'\]: block id 3.0 is not an integer",
        ),
    ],
    ids=["a-list", "a-dict", "of-wrong-type"],
)
def test_events_of_another_type_are_refused_unsent(
    socket_dir: Path, serve: Serve, call: Any, message: str
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [3, 4]})
        state, before = server_state(pool), client_state(client)

        with pytest.raises(InvalidArgument, match=message):
            call(client)

        assert not client.has_pending_step
        assert (server_state(pool), client_state(client)) == (state, before)
        assert step_and_write(client, pool.signed, new_blocks={"b": [9]}).seq == 2


def test_resolve_refuses_ids_outside_the_pool(socket_dir: Path, serve: Serve) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with (
        DefragClient(pool.handle.address, timeout_s=5) as client,
        pytest.raises(InvalidArgument, match=r"logical_ids\[1\] = 64 is outside \[0, 64\)"),
    ):
        client.resolve([1, 64])


def test_a_closed_client_refuses_steps(socket_dir: Path, serve: Serve) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    client = DefragClient(pool.handle.address, timeout_s=5)
    client.close()
    client.close()  # idempotent

    with pytest.raises(DefragError, match="is closed"):
        client.step(StepEvents())
    assert not pool.handle._engine.list_requests()


def test_a_probe_names_a_server_that_stopped_and_closing_need_not_wait_for_a_step(
    socket_dir: Path, serve: Serve
) -> None:
    """What a shutdown needs when the server went first: to know it at once, and to close
    while another thread still waits to send it a step."""
    pool = serve_pool(serve, socket_dir / "server.sock")
    client = DefragClient(pool.handle.address, timeout_s=5)
    assert client.probe_connection(1.0) is None  # it serves
    step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
    pool.executor.hold()
    outcomes: queue.SimpleQueue[object] = queue.SimpleQueue()

    def step_in_another_thread() -> None:
        try:
            outcomes.put(client.step(StepEvents(finished=["a"])))
        except Exception as err:  # handed to the test through the queue
            outcomes.put(err)

    stepping = threading.Thread(target=step_in_another_thread)
    stepping.start()
    try:
        assert pool.executor.entered.wait(10)
        pool.handle.stop(grace_s=0)  # the step's call is cancelled; the client reconnects

        reason = client.probe_connection(1.0)
        assert reason is not None and reason.startswith("UNAVAILABLE: "), reason
        assert "No such file or directory" in reason
        started = time.monotonic()
        client.close(wait_s=0)
        assert time.monotonic() - started < 1.0  # the step's reconnect (5 s) not waited for
        stepping.join(10)
        assert isinstance(outcomes.get(timeout=1), Exception)  # failed there, no reply
        with pytest.raises(DefragError, match="is closed"):
            client.step(StepEvents())
    finally:
        pool.executor.release()


def test_no_server_is_service_unavailable_within_the_deadline(socket_dir: Path) -> None:
    with pytest.raises(ServiceUnavailable, match=r"no answer from unix:.* within 0.3 s"):
        DefragClient(f"unix:{socket_dir}/nobody.sock", timeout_s=0.3)


# --- the pending-step contract ----------------------------------------------------------
def test_a_step_behind_a_pending_one_is_refused_unsent_and_lands_after_completion(
    socket_dir: Path, serve: Serve
) -> None:
    """A timed-out step's successor is never dropped silently: it is refused, unsent."""
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
        pool.executor.stall_next(1.5)
        client.timeout_s = 0.5
        with pytest.raises(StepOutcomeUnknown) as unknown:
            client.step(StepEvents(finished=["a"]))  # compaction stalls: seq 2's outcome is unknown
        assert unknown.value.pending_seq == 2

        # The server is still busy with seq 2: the next step is refused, not sent.
        with pytest.raises(StepPending, match="not sent: step seq 2 is pending") as refused:
            client.step(StepEvents(new_blocks={"c": [13]}))
        assert refused.value.pending_seq == 2

        client.timeout_s = 5
        completed = client.complete_pending_step()
        assert completed is not None and completed.seq == 2
        assert client.complete_pending_step() is None  # nothing pending any more
        reply = step_and_write(client, pool.signed, new_blocks={"c": [13]})  # sent again

        assert reply.seq == 3
        assert pool.handle.stats().totals.num_steps == 3
        assert client.live_requests() == {"b": [40], "c": [13]}
        assert pool.handle._engine.request_blocks("c") == [13]
        # Later fresh blocks land around c's, never on them.
        step_and_write(client, pool.signed, new_blocks={"d": list(range(20, 30))})
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


def test_reads_refuse_while_a_step_is_pending_and_retrying_it_never_applies_it_twice(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
        pool.executor.stall_next(1.5)
        client.timeout_s = 0.5
        events = StepEvents(finished=["a"], new_blocks={"c": [50, 51]})
        with pytest.raises(StepOutcomeUnknown):
            client.step(events)  # the server applies it and moves b's block 40 down
        wait_until(lambda: pool.handle.stats().totals.num_steps == 2)

        # The mirror still has the mapping from before seq 2: every read refuses.
        for read in (
            lambda: client.resolve([40]),
            lambda: client.resolve_tables([[40]]),
            client.live_requests,
            client.audit,
        ):
            with pytest.raises(StepPending, match="outcome of step seq 2 is unknown"):
                read()
        # The natural retry, step() with the same events, is refused: not applied twice.
        with pytest.raises(StepPending, match="not sent"):
            client.step(events)
        assert pool.handle.stats().totals.num_steps == 2

        client.timeout_s = 5
        completed = client.complete_pending_step()
        assert completed is not None and completed.replayed
        assert client.resolve([40]) == pool.handle.resolve([40]).tolist()
        assert client.live_requests() == {"b": [40], "c": [50, 51]}
        assert pool.handle._engine.request_blocks("c") == [50, 51]
        pool.signed.write([50, 51], client.resolve([50, 51]))  # the forward pass fills c
        assert lost_blocks(client, pool.signed) == []
        assert client.audit().is_consistent


def test_a_pending_step_survives_a_reopen_refused_by_a_session_the_server_still_holds(
    socket_dir: Path, serve: Serve
) -> None:
    """The server still holds a writer session when the client reopens: the step stays
    pending (it is not dropped as a SessionConflict) and completes once the session ends."""
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [1, 2]})
        client._session.drop_stream(cancel=True)  # the client's stream broke
        squatter = hold_the_session(pool.handle.address)  # as the server sees it: held
        client.timeout_s = 0.5
        with pytest.raises(StepOutcomeUnknown, match="still held a writer session"):
            client.step(StepEvents(new_blocks={"b": [3]}))
        assert client.pending_seq == 2
        squatter.close()
        client.timeout_s = 5
        completed = client.complete_pending_step()
        assert completed is not None and completed.seq == 2
        assert pool.handle.stats().totals.num_steps == 2
        assert client.live_requests() == {"a": [1, 2], "b": [3]}


def test_retries_behind_a_held_step_leave_probes_and_stats_answered(
    socket_dir: Path, serve: Serve
) -> None:
    """Each retry of a step stuck in the executor must not keep a server thread: with the
    default 8 handler threads, a Kubernetes probe would otherwise time out."""
    pool = serve_pool(serve, socket_dir / "server.sock")
    address = pool.handle.address
    tool = grpc.insecure_channel(address)
    stats_stub = pb_grpc.DefragServiceStub(tool)
    health_stub = health_pb2_grpc.HealthStub(tool)
    with DefragClient(address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": list(range(1, 11)), "b": [40]})
        pool.executor.hold()  # a device copy that would take 20 s; released below
        client.timeout_s = 0.3
        try:
            with pytest.raises(StepOutcomeUnknown):
                client.step(StepEvents(finished=["a"]))
            assert pool.executor.entered.wait(10)
            for _ in range(20):
                with pytest.raises(StepOutcomeUnknown) as unknown:
                    client.complete_pending_step()
                assert unknown.value.pending_seq == 2
                check = health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                assert stats_stub.GetStats(pb.GetStatsRequest(), timeout=5).next_seq == 2
            client.timeout_s = 2  # longer than the server's wait: it answers StepInFlight
            with pytest.raises(
                StepOutcomeUnknown, match=r"still applying a step .*step seq 2 of epoch"
            ):
                client.complete_pending_step()
        finally:
            pool.executor.release()
            tool.close()
        client.timeout_s = 10
        completed = client.complete_pending_step()

        assert completed is not None and completed.seq == 2
        assert pool.handle.stats().totals.num_steps == 2  # applied once, however many retries
        assert len(pool.executor.calls) == 1
        assert client.live_requests() == {"b": [40]}
        assert lost_blocks(client, pool.signed) == []


def test_reset_is_refused_while_another_writer_holds_the_session_unless_forced(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as client:
        step_and_write(client, pool.signed, new_blocks={"a": [1, 2]})
        client._session.drop_stream(cancel=False)  # this client let go of its session ...
        squatter = hold_the_session(pool.handle.address)  # ... and another writer took it
        old_epoch = pool.handle.epoch
        client.timeout_s = 0.5
        try:
            with pytest.raises(SessionConflict, match=r"'holder'.* pass force .*restart vLLM"):
                client.reset()
            assert pool.handle.epoch == old_epoch
            assert pool.handle._engine.list_requests() == {"a": [1, 2]}

            client.reset(force=True)

            assert client.epoch == pool.handle.epoch != old_epoch
            assert client.live_requests() == {} and client.next_seq == 1
            with pytest.raises(grpc.RpcError):  # the other writer's session was ended
                squatter.exchange(pb.StepStreamRequest(step=pb.StepRequest(seq=1)))
            client.timeout_s = 5
            assert client.step(StepEvents(new_blocks={"b": [3]})).seq == 1
        finally:
            squatter.close()


def hold_the_session(address: str) -> RawStream:
    """Opens a raw writer session as soon as the server has let go of the last one."""
    deadline = time.monotonic() + 10
    while True:
        stream = RawStream(address)
        try:
            stream.exchange(pb.StepStreamRequest(open=pb.OpenSession(client_name="holder")))
            return stream
        except grpc.RpcError:
            stream.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e12, math.nan, 86_401, 0, -1])
def test_a_timeout_out_of_range_is_refused_by_name_before_connecting(
    socket_dir: Path, timeout_s: float
) -> None:
    # NOTE: no server listens: the check comes before any call.
    with pytest.raises(InvalidArgument, match=r"timeout_s must be a number of seconds > 0"):
        DefragClient(f"unix:{socket_dir}/nobody.sock", timeout_s=timeout_s)


def test_a_client_with_the_longest_timeout_adopts_state_and_refuses_a_bad_new_one(
    socket_dir: Path, serve: Serve
) -> None:
    pool = serve_pool(serve, socket_dir / "server.sock")
    with DefragClient(pool.handle.address, timeout_s=5) as first:
        step_and_write(first, pool.signed, new_blocks={"a": [30, 31]})

    with DefragClient(pool.handle.address, timeout_s=86_400) as second:  # a day
        assert second.live_requests() == {"a": [30, 31]}
        with pytest.raises(InvalidArgument, match=r"timeout_s must .* got inf"):
            second.timeout_s = math.inf
        assert second.timeout_s == 86_400
        assert second.step(StepEvents(new_blocks={"b": [50]})).seq == 2
