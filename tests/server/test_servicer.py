"""The gRPC service through raw generated stubs: sessions, exactly-once, errors, health.

Every test runs a real server (temporary unix socket or TCP port 0) and talks to it with
the generated ``kvdefrag.v1`` stubs, as any client in any language would.
"""

from __future__ import annotations

import base64
import logging
import queue
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from kvdefrag.server import ServerHandle
from kvdefrag.server._convert import max_step_response_bytes, step_events
from kvdefrag.server._executor_cpu import CpuSwapExecutor
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.server import Serve

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Harness:
    """Starts servers (through ``serve``) and opens stubs and streams; closes them at teardown."""

    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        self.channels: list[grpc.Channel] = []
        self.streams: list[Stream] = []

    def serve(
        self, num_blocks: int = 64, *, kv: SignedKv | None = None, **options: Any
    ) -> ServerHandle:
        return self._serve(kv=kv, num_blocks=num_blocks, **options)

    def channel(self, address: str) -> grpc.Channel:
        channel = grpc.insecure_channel(address)
        self.channels.append(channel)
        return channel

    def stub(self, handle: ServerHandle) -> pb_grpc.DefragServiceStub:
        return pb_grpc.DefragServiceStub(self.channel(handle.address))

    def stream(self, handle: ServerHandle) -> Stream:
        stream = Stream(self.stub(handle))
        self.streams.append(stream)
        return stream

    def health(self, handle: ServerHandle, service: str = "") -> Any:
        stub = health_pb2_grpc.HealthStub(self.channel(handle.address))
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    def close(self) -> None:
        """Cancels the streams and closes the channels (the ``serve`` fixture stops servers)."""
        for stream in self.streams:
            stream.call.cancel()
        for channel in self.channels:
            channel.close()


class Stream:
    """A StepStream driven one message at a time."""

    def __init__(self, stub: pb_grpc.DefragServiceStub) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self.call = stub.StepStream(iter(self._requests.get, None), timeout=30)

    def send(self, message: Any) -> Any:
        self._requests.put(message)
        return next(self.call)

    def open(self, client_name: str = "test", epoch: int = 0, prefix_caching: bool = False) -> Any:
        session = pb.OpenSession(
            epoch=epoch, prefix_caching=prefix_caching, client_name=client_name
        )
        return self.send(pb.StepStreamRequest(open=session)).opened

    def step(self, **fields: Any) -> Any:
        return self.send(pb.StepStreamRequest(step=pb.StepRequest(**fields))).step

    def close(self) -> None:
        """Half-closes and waits until the server ended the stream."""
        self._requests.put(None)
        assert list(self.call) == []


@pytest.fixture
def harness(serve: Serve) -> Iterator[Harness]:
    harness = Harness(serve)
    yield harness
    harness.close()


def blocks(request_id: str, block_ids: Sequence[int]) -> Any:
    return pb.RequestBlocks(request_id=request_id, block_ids=list(block_ids))


def expect_error(call: Callable[[], Any], code: grpc.StatusCode, error: str) -> str:
    """Runs a call that must fail with ``code`` and kvdefrag error class ``error``."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    rpc_error: Any = info.value
    assert rpc_error.code() == code, rpc_error.details()
    assert dict(rpc_error.trailing_metadata())["kvdefrag-error"] == error
    return str(rpc_error.details())


def snapshot(stub: pb_grpc.DefragServiceStub) -> tuple[Any, Any]:
    """Everything a refused call must leave unchanged: stats, digest, seq, requests."""
    return stub.GetStats(pb.GetStatsRequest()), stub.ListRequests(pb.ListRequestsRequest())


def snapshot_stats(stub: pb_grpc.DefragServiceStub) -> Any:
    return stub.GetStats(pb.GetStatsRequest())


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def session_is_open(stub: pb_grpc.DefragServiceStub) -> bool:
    return bool(stub.GetStats(pb.GetStatsRequest()).is_session_open)


# --- exactly-once and ordering --------------------------------------------------------
def test_stream_applies_in_order_and_replays_a_resent_seq(harness: Harness) -> None:
    handle = harness.serve(threshold=0)
    stub = harness.stub(handle)
    stream = harness.stream(handle)
    opened = stream.open()
    assert (opened.epoch, opened.next_seq, opened.num_blocks) == (handle.epoch, 1, 64)
    first = stream.step(seq=1, new_blocks=[blocks("a", [5, 9])])
    second = stream.step(seq=2, new_blocks=[blocks("b", [30])])
    assert (first.seq, first.epoch, first.replayed) == (1, handle.epoch, False)
    assert dict(zip(first.logical_block_ids, first.physical_block_ids, strict=True))[5] == 1
    before = snapshot(stub)

    replay = stream.step(seq=1, new_blocks=[blocks("a", [5, 9])])

    assert replay.replayed
    replay.replayed = False
    assert replay == first
    assert snapshot(stub) == before
    assert before[0].next_seq == 3 and before[0].digest == second.digest
    assert stream.step(seq=3).seq == 3


def test_a_resend_with_other_events_than_were_applied_is_refused(harness: Harness) -> None:
    handle = harness.serve(threshold=0)
    stub = harness.stub(handle)
    stream = harness.stream(handle)
    stream.open()
    stream.step(seq=1, new_blocks=[blocks("a", [5, 9])])
    before = snapshot(stub)

    details = expect_error(
        lambda: stream.step(seq=1, new_blocks=[blocks("a", [5, 40])]),
        FAILED_PRECONDITION,
        "OutOfOrder",
    )

    assert "seq 1 was applied with other events" in details and "expected seq 2" in details
    after = snapshot(stub)
    assert (after[0].next_seq, after[0].digest, after[0].stats) == (
        before[0].next_seq,
        before[0].digest,
        before[0].stats,
    )
    assert after[1] == before[1]


def test_seq_gap_is_refused_naming_the_expected_seq(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stream = harness.stream(handle)
    stream.open()
    stream.step(seq=1, new_blocks=[blocks("a", [3])])
    before = snapshot(stub)

    details = expect_error(lambda: stream.step(seq=3), FAILED_PRECONDITION, "OutOfOrder")

    assert "expected seq 2" in details
    assert snapshot(stub)[0].next_seq == 2
    assert snapshot(stub)[1] == before[1]


def test_seq_no_longer_cached_is_refused(harness: Harness) -> None:
    handle = harness.serve(replay_cache_size=2)
    stub = harness.stub(handle)
    for seq in range(1, 5):
        stub.Step(pb.StepRequest(seq=seq, new_blocks=[blocks(f"r{seq}", [seq])]))
    assert stub.Step(pb.StepRequest(seq=3, new_blocks=[blocks("r3", [3])])).replayed

    details = expect_error(
        lambda: stub.Step(pb.StepRequest(seq=1)), FAILED_PRECONDITION, "OutOfOrder"
    )

    assert "no longer cached" in details and "expected seq 5" in details
    details = expect_error(lambda: stub.Step(pb.StepRequest()), FAILED_PRECONDITION, "OutOfOrder")
    assert "expected seq 5" in details


def test_concurrent_senders_apply_each_step_exactly_once(harness: Harness) -> None:
    handle = harness.serve(threshold=0)
    stub = harness.stub(handle)
    steps = [
        pb.StepRequest(
            seq=seq,
            finished_request_ids=[f"r{seq - 3}"],
            new_blocks=[blocks(f"r{seq}", [seq, seq + 30])],
        )
        for seq in range(1, 25)
    ]
    replies: list[list[Any]] = [[] for _ in range(6)]

    def send_all(sent: list[Any]) -> None:
        sent.extend(stub.Step(step, timeout=30) for step in steps)

    senders = [threading.Thread(target=send_all, args=(sent,)) for sent in replies]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(60)

    assert sum(reply.replayed for sent in replies for reply in sent) == 5 * len(steps)
    for sent in replies:
        for reply in sent:
            reply.replayed = False
        assert sent == replies[0]
    stats = stub.GetStats(pb.GetStatsRequest())
    assert (stats.next_seq, stats.stats.num_steps) == (25, 24)


def test_unary_and_stream_steps_share_one_sequence(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stub.Step(pb.StepRequest(seq=1, new_blocks=[blocks("a", [2])]))
    stream = harness.stream(handle)
    assert stream.open(epoch=handle.epoch).next_seq == 2
    assert stream.step(seq=2, epoch=handle.epoch, finished_request_ids=["a"]).seq == 2


# --- epochs -----------------------------------------------------------------------------
def test_other_epoch_is_refused_on_open_step_and_reset(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stale = handle.epoch ^ 1

    details = expect_error(
        lambda: harness.stream(handle).open(epoch=stale), FAILED_PRECONDITION, "EpochMismatch"
    )
    assert str(stale) in details and str(handle.epoch) in details
    expect_error(
        lambda: stub.Step(pb.StepRequest(seq=1, epoch=stale)), FAILED_PRECONDITION, "EpochMismatch"
    )
    expect_error(
        lambda: stub.Reset(pb.ResetRequest(epoch=stale)), FAILED_PRECONDITION, "EpochMismatch"
    )
    assert stub.GetStats(pb.GetStatsRequest()).next_seq == 1


def test_reset_starts_a_new_epoch_and_forgets_everything(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stub.Step(pb.StepRequest(seq=1, new_blocks=[blocks("a", [9, 4])]))
    old_epoch = handle.epoch

    new_epoch = stub.Reset(pb.ResetRequest(epoch=old_epoch, prefix_caching=True)).epoch

    assert new_epoch == handle.epoch != old_epoch
    stats = stub.GetStats(pb.GetStatsRequest())
    assert (stats.epoch, stats.next_seq, stats.stats.num_live, stats.digest) == (new_epoch, 1, 0, 0)
    assert handle._engine.config.prefix_caching
    expect_error(
        lambda: stub.Step(pb.StepRequest(seq=1, epoch=old_epoch)),
        FAILED_PRECONDITION,
        "EpochMismatch",
    )
    assert stub.Step(pb.StepRequest(seq=1)).epoch == new_epoch


def test_reset_is_refused_while_a_writer_session_is_open_unless_forced(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    writer = harness.stream(handle)
    writer.open(client_name="vllm-rank0")
    writer.step(seq=1, new_blocks=[blocks("a", [9, 4])])
    before = snapshot(stub)

    details = expect_error(
        lambda: stub.Reset(pb.ResetRequest()), FAILED_PRECONDITION, "SessionConflict"
    )

    assert "vllm-rank0" in details and "force" in details and "restart vLLM" in details
    assert snapshot(stub) == before  # nothing changed: same epoch, seq, requests
    old_epoch = handle.epoch

    new_epoch = stub.Reset(pb.ResetRequest(force=True)).epoch

    assert new_epoch == handle.epoch != old_epoch
    stats = stub.GetStats(pb.GetStatsRequest())
    assert (stats.next_seq, stats.stats.num_live) == (1, 0)
    # The writer's session ended with the reset; its next step names the new epoch.
    with pytest.raises(grpc.RpcError):
        writer.step(seq=2, epoch=old_epoch, finished_request_ids=["a"])
    wait_until(lambda: not session_is_open(stub))
    stub.Reset(pb.ResetRequest())  # no session: no force needed


# --- one writer -------------------------------------------------------------------------
def test_second_writer_is_refused_until_the_first_closes(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    first = harness.stream(handle)
    first.open(client_name="scheduler-0")

    details = expect_error(
        lambda: harness.stream(handle).open(), FAILED_PRECONDITION, "SessionConflict"
    )
    assert "scheduler-0" in details
    expect_error(lambda: stub.Step(pb.StepRequest(seq=1)), FAILED_PRECONDITION, "SessionConflict")
    assert session_is_open(stub)  # read-only calls still work
    first.step(seq=1, new_blocks=[blocks("a", [7])])
    first.close()

    assert not session_is_open(stub)
    assert harness.stream(handle).open().next_seq == 2


def test_cancelled_stream_releases_its_session(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stream = harness.stream(handle)
    stream.open()
    stream.call.cancel()

    wait_until(lambda: not session_is_open(stub))
    assert harness.stream(handle).open().next_seq == 1


def test_stream_must_start_with_open_and_open_only_once(harness: Harness) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    expect_error(lambda: harness.stream(handle).step(seq=1), FAILED_PRECONDITION, "SessionConflict")
    stream = harness.stream(handle)
    stream.open()
    expect_error(stream.open, FAILED_PRECONDITION, "SessionConflict")
    wait_until(lambda: not session_is_open(stub))
    empty = harness.stream(handle)
    empty.open()
    expect_error(
        lambda: empty.send(pb.StepStreamRequest()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "InvalidArgument",
    )
    assert stub.GetStats(pb.GetStatsRequest()).next_seq == 1


def test_open_switches_prefix_caching_only_while_nothing_was_applied(harness: Harness) -> None:
    handle = harness.serve()
    stream = harness.stream(handle)
    opened = stream.open(prefix_caching=True)
    assert opened.prefix_caching and opened.epoch == handle.epoch
    stream.step(seq=1, new_blocks=[blocks("a", [3])])
    stream.close()

    details = expect_error(
        lambda: harness.stream(handle).open(prefix_caching=False),
        FAILED_PRECONDITION,
        "SessionConflict",
    )
    assert "prefix_caching" in details and handle._engine.config.prefix_caching


# --- bad input --------------------------------------------------------------------------
BAD_STEPS: dict[str, tuple[dict[str, Any], str]] = {
    "negative id": ({"new_blocks": [blocks("c", [-1])]}, "block id -1"),
    "id past the pool": ({"new_blocks": [blocks("c", [64])]}, "outside [0, 64)"),
    "empty request id": ({"new_blocks": [blocks("", [7])]}, "non-empty"),
    "empty finished id": ({"finished_request_ids": [""]}, "finished"),
    "long request id": ({"finished_request_ids": ["x" * 300]}, "longer than"),
    "block twice in one request": ({"new_blocks": [blocks("c", [7, 7])]}, "appears twice"),
    "request twice": ({"new_blocks": [blocks("c", [7]), blocks("c", [8])]}, "'c' appears twice"),
    "fresh block not new": (
        {"new_blocks": [blocks("c", [7])], "fresh": pb.BlockIds(block_ids=[1])},
        "fresh: block id 1",
    ),
    "evicted out of range": ({"evicted_block_ids": [99]}, "evicted"),
    "resumed negative": ({"resumed": [blocks("a", [-5])]}, "resumed"),
    "valid finish, bad new block": (
        {"finished_request_ids": ["a"], "new_blocks": [blocks("c", [1 << 40])]},
        str(1 << 40),
    ),
}


@pytest.mark.parametrize("case", BAD_STEPS, ids=list(BAD_STEPS))
def test_bad_step_is_refused_and_changes_nothing(harness: Harness, case: str) -> None:
    fields, expected_text = BAD_STEPS[case]
    handle = harness.serve(threshold=0)
    stub = harness.stub(handle)
    stub.Step(pb.StepRequest(seq=1, new_blocks=[blocks("a", [1, 2, 3]), blocks("b", [9, 12])]))
    before = snapshot(stub)

    details = expect_error(
        lambda: stub.Step(pb.StepRequest(seq=2, **fields)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "InvalidArgument",
    )
    assert expected_text in details
    assert snapshot(stub) == before
    stream = harness.stream(handle)
    stream.open()
    expect_error(
        lambda: stream.step(seq=2, **fields), grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument"
    )
    assert snapshot(stub)[1:] == before[1:]
    wait_until(lambda: not session_is_open(stub))
    assert stub.Step(pb.StepRequest(seq=2, finished_request_ids=["a"])).seq == 2


def test_bad_reads_are_refused(harness: Harness) -> None:
    stub = harness.stub(harness.serve())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    details = expect_error(
        lambda: stub.Resolve(pb.ResolveRequest(logical_block_ids=[3, -2])),
        invalid,
        "InvalidArgument",
    )
    assert "-2" in details
    table = pb.BlockTable(block_ids=[64])
    expect_error(
        lambda: stub.Resolve(pb.ResolveRequest(block_tables=[table])), invalid, "InvalidArgument"
    )
    expect_error(lambda: stub.GetRequest(pb.GetRequestRequest()), invalid, "InvalidArgument")
    details = expect_error(
        lambda: stub.GetRequest(pb.GetRequestRequest(request_id="nope")),
        grpc.StatusCode.NOT_FOUND,
        "NotFound",
    )
    assert "'nope'" in details


def test_a_forged_page_token_is_invalid_argument_and_logs_no_traceback(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    handle = harness.serve()
    stub = harness.stub(handle)
    stub.Step(pb.StepRequest(seq=1, new_blocks=[blocks("a", [3]), blocks("b", [4])]))
    token = stub.ListRequests(pb.ListRequestsRequest(page_size=1)).next_page_token
    epoch, generation, _ = struct.unpack("<QQQ", base64.urlsafe_b64decode(token))
    # The right epoch and generation, and a position no page ever had (past int64).
    forged = base64.urlsafe_b64encode(struct.pack("<QQQ", epoch, generation, 2**63)).decode()

    with caplog.at_level(logging.ERROR):
        details = expect_error(
            lambda: stub.ListRequests(pb.ListRequestsRequest(page_token=forged)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "InvalidArgument",
        )

    assert "page_token" in details and forged in details
    assert [record for record in caplog.records if record.levelno >= logging.ERROR] == []
    page = stub.ListRequests(pb.ListRequestsRequest(page_size=1, page_token=token))
    assert [entry.request_id for entry in page.requests] == ["b"]  # the real token still works


def test_oversized_messages_are_resource_exhausted(harness: Harness) -> None:
    handle = harness.serve(
        num_blocks=4096, max_message_bytes=4096, max_moves_per_step=1, threshold=4096
    )
    stub = harness.stub(handle)
    for index in range(6):  # replies of ~3.3 kB each: within the limit
        ids = range(1 + 400 * index, 401 + 400 * index)
        stub.Step(pb.StepRequest(seq=index + 1, new_blocks=[blocks(f"r{index}", ids)]))
    before = snapshot_stats(stub)
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED

    with pytest.raises(grpc.RpcError) as info:  # refused by gRPC itself: ~6 kB
        stub.Step(pb.StepRequest(seq=7, new_blocks=[blocks("big", range(2401, 4096))]))
    assert info.value.code() == exhausted
    big_reply = pb.StepRequest(seq=7, new_blocks=[blocks("big", range(2401, 3001))])
    details = expect_error(lambda: stub.Step(big_reply), exhausted, "MessageTooLarge")
    assert "max_message_bytes=4096" in details
    first = stub.ListRequests(pb.ListRequestsRequest())  # pages, each within the limit
    second = stub.ListRequests(pb.ListRequestsRequest(page_token=first.next_page_token))
    assert [len(first.requests), len(second.requests), second.next_page_token] == [4, 2, ""]
    assert max(first.ByteSize(), second.ByteSize()) <= 4096
    assert snapshot_stats(stub) == before
    assert len(stub.GetRequest(pb.GetRequestRequest(request_id="r5")).logical_block_ids) == 400
    assert stub.Step(pb.StepRequest(seq=7, finished_request_ids=["r0"])).seq == 7


# --- the data behind the mapping --------------------------------------------------------
def test_every_live_block_keeps_its_data_through_the_wire(harness: Harness) -> None:
    kv = SignedKv.create(128, block_size=2)
    handle = harness.serve(kv=kv, threshold=2, max_moves_per_step=8)
    stub = harness.stub(handle)
    rng = random.Random(3)
    mirror = list(range(128))  # logical -> physical, from the replies' deltas only
    free, running = list(range(1, 128)), dict[str, list[int]]()
    for seq in range(1, 80):
        finished = rng.sample(sorted(running), k=min(len(running), rng.randint(0, 2)))
        for request_id in finished:
            free += running.pop(request_id)
        rng.shuffle(free)
        new_blocks: dict[str, list[int]] = {}
        for request_id in [*rng.sample(sorted(running), k=min(2, len(running))), f"r{seq}"]:
            count = min(len(free) - 8, rng.randint(1, 5))
            if count > 0:
                new_blocks[request_id] = [free.pop() for _ in range(count)]
                running.setdefault(request_id, []).extend(new_blocks[request_id])
        request = pb.StepRequest(
            seq=seq,
            finished_request_ids=finished,
            new_blocks=[blocks(rid, ids) for rid, ids in new_blocks.items()],
        )
        reply = stub.Step(request)
        assert reply.ByteSize() <= max_step_response_bytes(step_events(request), 128, 8)
        pairs = zip(reply.logical_block_ids, reply.physical_block_ids, strict=True)
        for logical_id, physical_id in pairs:
            mirror[logical_id] = physical_id
        fresh = [logical_id for ids in new_blocks.values() for logical_id in ids]
        kv.write(fresh, [mirror[logical_id] for logical_id in fresh])  # the forward pass
        live = [logical_id for ids in running.values() for logical_id in ids]
        assert kv.mismatched(live, [mirror[logical_id] for logical_id in live]) == []
    assert mirror == handle.resolve(list(range(128))).tolist()
    assert stub.GetStats(pb.GetStatsRequest()).stats.num_moves > 0


# --- executor failure, health, shutdown -------------------------------------------------
def scripted_torch_executor(kv: SignedKv) -> ScriptedExecutor:
    """The real torch executor of ``kv``, with scripted faults."""
    return ScriptedExecutor.around(CpuSwapExecutor(kv.kv_caches, kv.block_size))


def fragment(stub: pb_grpc.DefragServiceStub) -> Any:
    """Step 1 packs two requests; step 2 finishes the first, so compaction must move."""
    stub.Step(
        pb.StepRequest(seq=1, new_blocks=[blocks("a", range(1, 9)), blocks("b", range(9, 17))])
    )
    return pb.StepRequest(seq=2, finished_request_ids=["a"])


def test_executor_failure_is_unavailable_until_reset(harness: Harness) -> None:
    kv = SignedKv.create(64)
    executor = scripted_torch_executor(kv)
    handle = harness.serve(kv=kv, executor=executor, threshold=0)
    stub = harness.stub(handle)
    step_2 = fragment(stub)
    executor.is_failing = True

    details = expect_error(
        lambda: stub.Step(step_2), grpc.StatusCode.UNAVAILABLE, "EngineUnhealthy"
    )

    assert "injected KV copy failure" in details
    assert harness.health(handle) == NOT_SERVING
    assert harness.health(handle, "kvdefrag.v1.DefragService") == NOT_SERVING
    expect_error(lambda: stub.Step(step_2), grpc.StatusCode.UNAVAILABLE, "EngineUnhealthy")
    stats = stub.GetStats(pb.GetStatsRequest())
    assert "reset() is required" in stats.unhealthy_reason and not stats.stats.is_healthy
    executor.is_failing = False

    epoch = stub.Reset(pb.ResetRequest()).epoch

    assert harness.health(handle) == SERVING
    reply = stub.Step(pb.StepRequest(seq=1, epoch=epoch, new_blocks=[blocks("c", [5])]))
    assert (reply.seq, reply.epoch, reply.stats.is_healthy) == (1, epoch, True)


def test_stop_flips_health_first_and_lets_the_step_in_flight_finish(harness: Harness) -> None:
    kv = SignedKv.create(64)
    executor = scripted_torch_executor(kv)
    handle = harness.serve(kv=kv, executor=executor, threshold=0)
    stub = harness.stub(handle)
    step_2 = fragment(stub)
    executor.hold()
    replies: list[Any] = []
    stepping = threading.Thread(target=lambda: replies.append(stub.Step(step_2, timeout=30)))
    stepping.start()
    assert executor.entered.wait(10)
    stopping = threading.Thread(target=handle.stop, args=(10,))
    stopping.start()

    wait_until(lambda: harness.health(handle) == NOT_SERVING)
    executor.release()
    stepping.join(30)
    stopping.join(30)

    assert replies and replies[0].seq == 2 and replies[0].num_moves > 0
    assert not stopping.is_alive() and handle.wait(0)
    with pytest.raises(grpc.RpcError) as info:
        harness.stub(handle).GetStats(pb.GetStatsRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_ends_an_idle_stream_instead_of_waiting_for_it(harness: Harness) -> None:
    handle = harness.serve()
    stream = harness.stream(handle)
    stream.open()
    stream.step(seq=1, new_blocks=[blocks("a", [4])])
    stopping = threading.Thread(target=handle.stop, args=(600,))  # a grace it must not need

    stopping.start()
    stopping.join(60)

    assert not stopping.is_alive()
    with pytest.raises(grpc.RpcError) as info:
        stream.step(seq=2)
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def test_metrics_count_errors_and_replays(harness: Harness, registry: CollectorRegistry) -> None:
    stub = harness.stub(harness.serve(registry=registry))
    stub.Step(pb.StepRequest(seq=1))
    stub.Step(pb.StepRequest(seq=1))
    with pytest.raises(grpc.RpcError):
        stub.Step(pb.StepRequest(seq=7))
    with pytest.raises(grpc.RpcError):
        stub.Resolve(pb.ResolveRequest(logical_block_ids=[-1]))
    errors = {
        (sample.labels["method"], sample.labels["code"]): sample.value
        for family in registry.collect()
        if family.name == "kvdefrag_errors"
        for sample in family.samples
        if sample.name == "kvdefrag_errors_total"
    }
    assert registry.get_sample_value("kvdefrag_replayed_steps_total") == 1
    assert errors == {("Step", "FAILED_PRECONDITION"): 1, ("Resolve", "INVALID_ARGUMENT"): 1}
