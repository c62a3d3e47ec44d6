"""What the server bounds, so that it keeps serving its writer and its probes.

Every test runs a real server on a temporary unix socket and talks to it over real
channels: the generated stubs, raw bytes, or a ``DefragClient``. Nothing here asserts a
duration: each test asserts what a call returns, a status code or a bound.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kv import SignedKv

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, SessionConflict
from kvdefrag.server import ServerHandle, serve_in_process
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
# Well under gRPC's 16 KiB metadata limit: what an error message may take at most.
MAX_DETAILS_CHARS = 2048


class Servers:
    """Starts servers and opens channels and clients; closes everything at teardown."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.handles: list[ServerHandle] = []
        self.channels: list[grpc.Channel] = []
        self.clients: list[DefragClient] = []
        self.calls: list[Any] = []

    def serve(self, num_blocks: int = 64, **options: Any) -> ServerHandle:
        kv = SignedKv.create(num_blocks)
        options.setdefault("address", f"unix:{self.directory}/kv{len(self.handles)}.sock")
        handle = serve_in_process(kv.kv_caches, kv.block_size, **options)
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

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for client in self.clients:
            client.close()
        for handle in self.handles:
            handle.stop(0)
        for channel in self.channels:
            channel.close()


@pytest.fixture
def servers(tmp_path: Any) -> Iterator[Servers]:
    servers = Servers(str(tmp_path))
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
    writer.step(new_blocks={"a": [1, 2]})
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
    assert client.step().seq == 1
    assert client.step(new_blocks={"a": [700]}).block_mapping == {700: 1, 1: 700}
    assert client.audit().is_consistent


# --- state that could grow without bound --------------------------------------------------
def test_requests_without_blocks_are_not_kept(servers: Servers) -> None:
    handle = servers.serve()
    client = servers.client(handle)
    client.step(new_blocks={"kept": [0, 5]})
    for batch in range(6):  # 3000 requests holding nothing but the null block, or nothing
        no_blocks = [0] if batch % 2 else []
        reply = client.step(new_blocks={f"r{batch}-{i}": no_blocks for i in range(500)})
        assert reply.stats.num_requests == 1
    reply = client.step(resumed={"kept": [0, 0]}, new_blocks={"grows": [0]})
    assert reply.stats.num_requests == 0
    stub = servers.stub(handle)
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=10).stats
    assert (stats.num_requests, stats.num_live) == (0, 0)
    assert not stub.ListRequests(pb.ListRequestsRequest(), timeout=10).requests
    assert client.list_requests() == {}
    assert client.audit().is_consistent
    assert client.step(finished=["r0-0"]).num_unknown_finished == 1
