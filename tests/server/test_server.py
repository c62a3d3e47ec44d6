"""``serve_in_process`` and its handle: typed configs in, where the server listens (unix
sockets: 0600, stale, taken; TCP, TLS and mTLS), and the narrow ``ServerHandle``."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvdefrag.client import (
    DefragClient,
    DefragError,
    EpochMismatch,
    ServiceUnavailable,
    SessionConflict,
)
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import (
    EngineConfig,
    ServerHandle,
    ServiceConfig,
    load_config,
    serve_in_process,
)
from kvdefrag.server._server import parse_address
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.server import Serve
from support.tls import make_certificates


def get_stats(address: str, credentials: grpc.ChannelCredentials | None = None) -> Any:
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        return pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


# --- typed configs in -------------------------------------------------------------------
def test_typed_configs_are_used_as_given_and_no_environment_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The edge (command line, vLLM worker) reads these; serve_in_process must not.
    monkeypatch.setenv("KVDEFRAG_ADDRESS", f"unix:{tmp_path}/elsewhere.sock")
    monkeypatch.setenv("KVDEFRAG_THRESHOLD", "1000")
    monkeypatch.setenv("KVDEFRAG_REPLAY_CACHE_SIZE", "64")
    kv = SignedKv.create(64, block_size=4)
    address = f"unix:{tmp_path}/kv.sock"
    with (
        serve_in_process(
            kv.kv_caches,
            kv.block_size,
            engine_config=EngineConfig(threshold=0),
            service_config=ServiceConfig(address=address, replay_cache_size=1),
        ) as handle,
        grpc.insecure_channel(address) as channel,
    ):
        assert handle.address == address and not (tmp_path / "elsewhere.sock").exists()
        stub = pb_grpc.DefragServiceStub(channel)
        first = pb.StepRequest(seq=1, fresh=pb.BlockIds())  # b's blocks hold data
        first.new_blocks.add(request_id="b", block_ids=[40, 41])
        stub.Step(first, timeout=10)
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10).stats
        assert stats.num_moves == 2  # threshold 0: compacted at once
        stub.Step(pb.StepRequest(seq=2), timeout=10)
        with pytest.raises(grpc.RpcError, match="no longer cached"):
            stub.Step(first, timeout=10)  # one reply kept: seq 1's is gone


def test_configs_of_another_type_are_refused_naming_the_argument(tmp_path: Path) -> None:
    kv = SignedKv.create(16, block_size=4)
    with pytest.raises(InvalidArgument, match="engine_config must be an EngineConfig, got dict"):
        serve_in_process(kv.kv_caches, 4, engine_config={"threshold": 0})  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgument, match="service_config must be a ServiceConfig, got EngineConfig"
    ):
        serve_in_process(kv.kv_caches, 4, service_config=EngineConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "environ", "message"),
    [
        ({"threshold": -1}, {}, "threshold must be >= 0, got -1"),
        ({}, {"KVDEFRAG_MAX_MOVES_PER_STEP": "lots"}, "KVDEFRAG_MAX_MOVES_PER_STEP must be int"),
        ({}, {"KVDEFRAG_REPLAY_CACHE_SIZE": "0"}, "replay_cache_size must be >= 1, got 0"),
        ({"adress": "unix:/tmp/x.sock"}, {}, "unknown configuration option 'adress'"),
    ],
)
def test_a_bad_option_is_named_where_the_configs_are_built(
    options: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_config(options, environ)


def test_a_server_refused_by_its_configs_leaves_nothing_behind(
    serve: Serve, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgument, match="max_message_bytes=1024 is too small"):
        serve(f"unix:{tmp_path}/kv.sock", max_message_bytes=1024)
    assert not os.listdir(tmp_path)


# --- the handle ---------------------------------------------------------------------------
def test_the_handle_has_no_engine_and_its_reset_starts_a_new_epoch(serve: Serve) -> None:
    handle = serve()
    assert not hasattr(handle, "engine")
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [3, 4]}))
        old_epoch = handle.epoch
        assert client.epoch == old_epoch and handle.stats().num_live == 2
        with pytest.raises(SessionConflict, match=r"writer session .* restart vLLM"):
            handle.reset()  # the client's session holds the service
        assert handle.epoch == old_epoch and handle.stats().num_live == 2

        new_epoch = handle.reset(force=True)

        assert new_epoch == handle.epoch != old_epoch
        stats = handle.stats()
        assert (stats.num_live, stats.num_requests, stats.totals.num_steps) == (0, 0, 0)
        with pytest.raises(EpochMismatch):
            client.step(StepEvents(new_blocks={"b": [5]}))  # its state belongs to the old epoch
    with DefragClient(handle.address, timeout_s=10) as client:
        assert client.epoch == new_epoch  # a new session starts over at the new epoch
        client.step(StepEvents(new_blocks={"b": [5]}))


def held_step(serve: Serve) -> tuple[ServerHandle, ScriptedExecutor, DefragClient, int, int]:
    """A server whose second step (it moves blocks) hangs in the executor until released.

    Returns the handle, the executor (held: ``release()`` it), a client whose session
    sent that step from another thread, and the step's epoch and seq.
    """
    kv = SignedKv.create(64, block_size=4)
    executor = ScriptedExecutor.for_kv(kv)
    handle = serve(kv=kv, executor=executor, threshold=0)
    client = DefragClient(handle.address, timeout_s=30)
    client.step(StepEvents(new_blocks={"a": list(range(1, 9)), "b": list(range(9, 17))}))
    epoch = client.epoch
    executor.hold()

    def step() -> None:
        with contextlib.suppress(DefragError):  # a server stopped under it: no reply
            client.step(StepEvents(finished=["a"]))

    threading.Thread(target=step, daemon=True).start()
    assert executor.entered.wait(10), "the step never reached the executor"
    return handle, executor, client, epoch, 2


def wait_in_thread(handle: ServerHandle, epoch: int, seq: int, timeout_s: float) -> Any:
    """Runs ``handle.wait_applied`` in a thread; returns the thread and its outcome list."""
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            handle.wait_applied(epoch, seq, timeout_s)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, outcome


def test_wait_applied_keeps_its_bound_while_a_step_holds_the_service(serve: Serve) -> None:
    handle, executor, client, epoch, seq = held_step(serve)
    try:
        thread, outcome = wait_in_thread(handle, epoch, seq, timeout_s=0.5)
        thread.join(20)  # generous, and still long before the held step is released

        assert not thread.is_alive(), "wait_applied outlived its 0.5 s bound"
        assert isinstance(outcome[0], ServiceUnavailable), outcome
        message = str(outcome[0])
        assert f"step seq {seq} of epoch {epoch}" in message and "0.5 s" in message
        assert handle.stats().totals.num_steps == 1  # the step was still held all along
    finally:
        executor.release()
        client.close()
    handle.wait_applied(epoch, seq, timeout_s=10)  # released: applied now


def test_stop_ends_a_wait_applied_promptly_while_a_step_hangs(serve: Serve) -> None:
    handle, executor, client, epoch, seq = held_step(serve)
    try:
        thread, outcome = wait_in_thread(handle, epoch, seq, timeout_s=600)
        time.sleep(0.2)
        stopping = threading.Thread(target=handle.stop, args=(0.5,), daemon=True)
        stopping.start()
        thread.join(20)  # far less than its 600 s bound, and the step is still held

        assert not thread.is_alive(), "stop() did not end the wait"
        assert isinstance(outcome[0], ServiceUnavailable)
        assert f"step seq {seq} of epoch {epoch}" in str(outcome[0])
        assert "stopping" in str(outcome[0])
    finally:
        executor.release()
        client.close()
    stopping.join(20)


def test_wait_applied_raises_epoch_mismatch_after_a_forced_reset(serve: Serve) -> None:
    handle = serve()
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [3, 4]}))
        epoch, seq = client.epoch, client.next_seq - 1
        handle.wait_applied(epoch, seq, timeout_s=0)  # applied in this epoch

        with pytest.raises(SessionConflict):
            handle.reset()
        handle.wait_applied(epoch, seq, timeout_s=0)  # refused: nothing changed
        handle.reset(force=True)

        # A worker's next pass names the step of the old epoch: it must not run.
        for planned_seq in (seq, seq + 1):
            with pytest.raises(EpochMismatch, match=f"seq {planned_seq} of epoch {epoch}"):
                handle.wait_applied(epoch, planned_seq, timeout_s=5)
        with pytest.raises(EpochMismatch):
            client.step(StepEvents(new_blocks={"b": [5]}))


def test_the_handle_resolves_the_mapping_the_kv_lock_guards(serve: Serve) -> None:
    kv_lock = threading.Lock()
    handle = serve(kv_lock=kv_lock, threshold=0)
    assert handle.kv_lock is kv_lock
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [30, 31, 32]}))
        with handle.kv_lock:  # the forward pass: no block moves meanwhile
            mapping = handle.resolve()
            assert mapping.tolist() == handle.resolve(np.arange(64)).tolist()
            assert handle.resolve([30, 31, 32]).tolist() == client.resolve([30, 31, 32])
            assert sorted(mapping.tolist()) == list(range(64)) and mapping[30] != 30
    with pytest.raises(InvalidArgument, match="block id 64 is outside"):
        handle.resolve([64])


def test_unix_socket_is_private_and_removed_on_stop(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    handle = serve(f"unix:{path}")
    assert handle.address == f"unix:{path}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert get_stats(handle.address).epoch == handle.epoch
    handle.stop(0)
    assert not path.exists()


def test_stale_socket_file_is_replaced(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # a socket file nobody listens on, as after a crash
    handle = serve(f"unix:{path}")
    assert get_stats(handle.address).epoch == handle.epoch


def test_socket_of_a_live_server_is_refused(serve: Serve, tmp_path: Path) -> None:
    address = f"unix:{tmp_path}/kv.sock"
    first = serve(address)
    with pytest.raises(OSError) as info:
        serve(address)
    assert info.value.errno == errno.EADDRINUSE and "taken" in str(info.value)
    assert get_stats(address).epoch == first.epoch


def test_a_server_that_fails_after_binding_leaves_nothing_behind(
    serve: Serve, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port} .*in use"):
            serve(f"unix:{tmp_path}/kv.sock", metrics_port=port)
    assert not os.listdir(tmp_path)  # neither its socket nor the path's lock
    serve(f"unix:{tmp_path}/kv.sock")  # and the path is free


def test_a_symlink_at_the_lock_path_is_refused(serve: Serve, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("precious")
    (tmp_path / "kv.sock.lock").symlink_to(target)
    with pytest.raises(InvalidArgument, match=r"lock file .*kv\.sock\.lock"):
        serve(f"unix:{tmp_path}/kv.sock")
    assert target.read_text() == "precious" and not (tmp_path / "kv.sock").exists()


def test_a_file_that_is_not_a_socket_is_left_alone(serve: Serve, tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    path.write_text("precious")
    with pytest.raises(InvalidArgument, match="not a socket"):
        serve(f"unix:{path}")
    assert path.read_text() == "precious"


def test_tcp_port_zero_reports_the_real_port(serve: Serve) -> None:
    handle = serve("127.0.0.1:0")
    host, port = handle.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert get_stats(handle.address).epoch == handle.epoch


def test_taken_tcp_port_is_refused(serve: Serve) -> None:
    first = serve("127.0.0.1:0")
    with pytest.raises(OSError) as info:
        serve(first.address)
    assert info.value.errno == errno.EADDRINUSE
    assert get_stats(first.address).epoch == first.epoch


def test_non_loopback_tcp_needs_tls_or_insecure(serve: Serve) -> None:
    with pytest.raises(InvalidArgument, match="--insecure"):
        serve("0.0.0.0:0")
    handle = serve("0.0.0.0:0", insecure=True)
    port = handle.address.rsplit(":", 1)[1]
    assert get_stats(f"127.0.0.1:{port}").epoch == handle.epoch


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("unix:///tmp/a.sock", ("/tmp/a.sock", True)),
        ("unix:/tmp/b.sock", ("/tmp/b.sock", True)),
        ("localhost:5", (None, True)),
        ("[::1]:5", (None, True)),
        ("127.0.0.9:5", (None, True)),
        ("10.1.2.3:5", (None, False)),
        ("example.com:5", (None, False)),
    ],
)
def test_parse_address(address: str, expected: tuple[str | None, bool]) -> None:
    parsed = parse_address(address)
    assert (parsed.socket_path, parsed.is_loopback) == expected


@pytest.mark.parametrize("address", ["unix:", "nohost", ":50051", "host:port", "host:70000"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(InvalidArgument, match="address"):
        parse_address(address)


# --- TLS --------------------------------------------------------------------------------
def test_tls_serves_a_non_loopback_address(serve: Serve, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    handle = serve(
        "0.0.0.0:0", tls_cert_file=str(certs["server"]), tls_key_file=str(certs["server_key"])
    )
    port = handle.address.rsplit(":", 1)[1]
    trusted = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
    assert get_stats(f"localhost:{port}", trusted).epoch == handle.epoch
    with pytest.raises(grpc.RpcError):
        get_stats(f"localhost:{port}")  # plain text is not served


def test_mtls_requires_a_client_certificate(serve: Serve, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    handle = serve(
        "127.0.0.1:0",
        tls_cert_file=str(certs["server"]),
        tls_key_file=str(certs["server_key"]),
        tls_client_ca_file=str(certs["ca"]),
    )
    target = f"localhost:{handle.address.rsplit(':', 1)[1]}"
    ca = certs["ca"].read_bytes()
    with pytest.raises(grpc.RpcError) as info:
        get_stats(target, grpc.ssl_channel_credentials(root_certificates=ca))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=certs["client_key"].read_bytes(),
        certificate_chain=certs["client"].read_bytes(),
    )
    assert get_stats(target, client).epoch == handle.epoch


def test_incomplete_tls_options_are_refused(serve: Serve, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="tls_key_file"):
        serve("127.0.0.1:0", tls_cert_file=str(tmp_path / "cert.pem"))
    with pytest.raises(InvalidArgument, match="tls_client_ca_file"):
        serve("127.0.0.1:0", tls_client_ca_file=str(tmp_path / "ca.pem"))
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(InvalidArgument, match="cannot be read"):
        serve("127.0.0.1:0", tls_cert_file=missing, tls_key_file=missing)
    assert not os.listdir(tmp_path)
