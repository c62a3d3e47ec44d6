"""A server's and a client's life: listening, stopping, dead peers, exit, failures, TLS.

Real servers on real sockets, the real ``DefragClient``, and subprocesses where the
point is how a process exits. Covers: ``stop()`` removes only its own socket file and
returns after its grace period even while a step hangs; the socket is never reachable
by others while it binds, whatever the umask; a client behind a half-open TCP path
notices within seconds and reconnects; a process holding a server and a client exits
after an uncaught exception; a failed KV move leaves a step applied without its
compaction, and every number says so; bad TLS material is reported by file.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvdefrag.client import DefragClient, EngineUnhealthy, ServiceUnavailable
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import ServerHandle, serve_in_process
from kvdefrag.server._server import grpc_options
from kvdefrag.server.config import ServiceConfig
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.doubles import INJECTED_FAILURE, ScriptedExecutor
from support.kv import SignedKv
from support.proxy import SocketProxy
from support.server import Serve

OPENSSL = shutil.which("openssl")
BLOCK_SIZE = 2


# --- resources and factories ------------------------------------------------------------
# Servers start through the shared ``serve`` fixture (tests/conftest.py), on signed caches
# of 64 blocks of BLOCK_SIZE tokens.


def get_stats(address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def step_and_write(client: DefragClient, kv: SignedKv, **fields: Any) -> Any:
    """One step; then the worker writes every new block (all of them fresh here)."""
    events = StepEvents(**fields)
    reply = client.step(events)
    new_ids = sorted({i for ids in events.new_blocks.values() for i in ids})
    kv.write(new_ids, client.resolve(new_ids))
    return reply


def fragment(client: DefragClient, kv: SignedKv) -> None:
    """Two requests; with ``a`` finished, the next step has holes below ``b`` to fill."""
    step_and_write(client, kv, new_blocks={"a": list(range(1, 11)), "b": [40, 41, 42]})


# --- 1. stop() removes only its own socket file ---------------------------------------
def start_when_free(address: str, kv: SignedKv) -> ServerHandle:
    """Starts a server on ``address``, retrying while a live server still listens there."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            return serve_in_process(
                kv.kv_caches, kv.block_size, service_config=ServiceConfig(address=address)
            )
        except OSError as err:
            if err.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def test_a_replacement_started_while_the_old_server_stops_keeps_its_socket(
    tmp_path: Path,
) -> None:
    # The old server stops while its replacement starts on the same path, as when a
    # worker restarts. The file system hands the replacement's socket the inode number
    # of the stale file it unlinked, so an owner test by inode alone removes it.
    path = tmp_path / "kv.sock"
    address = f"unix:{path}"
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    for trial in range(50):
        old = start_when_free(address, kv)
        stopper = threading.Thread(target=old.stop, args=(0,))
        stopper.start()
        new = start_when_free(address, kv)
        stopper.join()
        try:
            assert path.exists(), f"trial {trial}: the old server removed its replacement's socket"
            assert get_stats(new.address).epoch == new.epoch
        finally:
            new.stop(0)
        assert not path.exists()  # its own file a server does remove


# --- 2. stop(grace_s) is bounded --------------------------------------------------------
def step_until_stopped(client: DefragClient) -> None:
    """The step that hangs; the server stops under it, so it ends unacknowledged."""
    with contextlib.suppress(ServiceUnavailable):
        client.step(StepEvents(finished=["a"]))


def test_stop_returns_after_its_grace_while_a_step_hangs(serve: Serve, tmp_path: Path) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    executor = ScriptedExecutor.for_kv(kv)
    handle = serve(
        f"unix:{tmp_path}/kv.sock", block_size=BLOCK_SIZE, kv=kv, executor=executor, threshold=0
    )
    client = DefragClient(handle.address, timeout_s=5)
    try:
        fragment(client, kv)
        executor.hold()  # a hung device copy, until the test releases it
        stepping = threading.Thread(target=step_until_stopped, args=(client,))
        stepping.start()
        assert executor.entered.wait(30)
        stopped: list[bool] = []
        stopping = threading.Thread(target=lambda: stopped.append(handle.stop(0.5)))

        started = time.monotonic()
        stopping.start()
        # NOTE: the bound is the point here (stop must not wait for a step that hangs
        # for a minute), so it is generous: the grace plus 5 s for a loaded machine.
        stopping.join(0.5 + 5.0)
        elapsed_s = time.monotonic() - started

        assert not stopping.is_alive(), f"stop(0.5) still waiting after {elapsed_s:.1f} s"
        assert stopped == [False]  # a step was still running when it returned
        assert handle.wait(0)
    finally:
        executor.release()  # the step completes after stop() has returned ...
        stepping.join(60)
        client.close()
    wait_until(lambda: handle.stats().totals.num_steps == 2)
    # ... and leaves the engine whole: a permutation, compacted, and every live block
    # reads its own data where the mapping says it is.
    mapping = handle.resolve().tolist()
    stats = handle.stats()
    assert sorted(mapping) == list(range(stats.num_blocks))
    assert stats.is_healthy and stats.holes == 0 and stats.totals.num_moves > 0
    assert kv.lost_blocks(handle, [40, 41, 42]) == []


# --- 3. the socket is never reachable by others while it binds --------------------------
class BindObserver:
    """A real gRPC server that looks at the file system right after each bind."""

    def __init__(self, server: grpc.Server, public_path: Path) -> None:
        self._server = server
        self._public_path = public_path
        self.leaks: list[str] = []
        self.num_binds = 0

    def add_insecure_port(self, target: str) -> int:
        port = self._server.add_insecure_port(target)
        self.num_binds += 1
        bound = Path(target.removeprefix("unix:"))
        # Others may connect to a socket file they can write, in a directory they
        # can enter.
        if _is_writable_by_others(bound) and _is_enterable_by_others(bound.parent):
            self.leaks.append(f"{bound} is {_mode(bound):o} in a {_mode(bound.parent):o} dir")
        if self._public_path.exists() and _is_writable_by_others(self._public_path):
            self.leaks.append(f"{self._public_path} is {_mode(self._public_path):o}")
        return port

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _is_writable_by_others(path: Path) -> bool:
    return bool(_mode(path) & 0o022)


def _is_enterable_by_others(path: Path) -> bool:
    return bool(_mode(path) & 0o011)


def test_socket_is_never_reachable_by_others_while_binding_with_umask_0(
    serve: Serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)  # a directory everyone may enter, as /tmp or /run are
    path = shared / "kv.sock"
    observers: list[BindObserver] = []
    real_server = grpc.server

    def observed_server(*args: Any, **kwargs: Any) -> Any:
        observers.append(BindObserver(real_server(*args, **kwargs), path))
        return observers[-1]

    monkeypatch.setattr(grpc, "server", observed_server)
    previous_umask = os.umask(0)
    try:
        handle = serve(f"unix:{path}", block_size=BLOCK_SIZE)
    finally:
        os.umask(previous_umask)

    assert [observer.num_binds for observer in observers] == [1]
    assert observers[0].leaks == []
    assert _mode(path) == 0o600 and stat.S_ISSOCK(os.lstat(path).st_mode)
    # Nothing left of the bind; the lock that says who owns the path is owner-only too.
    assert sorted(os.listdir(shared)) == ["kv.sock", "kv.sock.lock"]
    assert _mode(shared / "kv.sock.lock") == 0o600
    assert get_stats(handle.address).epoch == handle.epoch


# --- 4. client keepalive: a half-open TCP path is noticed -------------------------------
def test_client_keepalive_agrees_with_the_server_ping_policy() -> None:
    from kvdefrag.client._channel import channel_options

    client = dict(channel_options(max_message_bytes=1 << 20))
    server = dict(grpc_options(ServiceConfig()))
    # The client pings an idle stream, and the server accepts pings that often (a ping
    # sooner than the server's minimum is a strike; a few strikes and it says GOAWAY).
    assert client["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert client["grpc.keepalive_time_ms"] > server["grpc.http2.min_ping_interval_without_data_ms"]
    # A dead peer is noticed within seconds (an unanswered ping ends the connection
    # after the ping timeout, 60 s unless set), sooner than a step's default deadline.
    for options in (client, server):
        assert options["grpc.http2.ping_timeout_ms"] == options["grpc.keepalive_timeout_ms"]
    assert client["grpc.keepalive_time_ms"] + client["grpc.keepalive_timeout_ms"] <= 10_000


@pytest.mark.slow
def test_client_reconnects_when_its_tcp_path_goes_half_open(
    serve: Serve,
) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    handle = serve("127.0.0.1:0", block_size=BLOCK_SIZE, kv=kv)
    proxy = SocketProxy(handle.address)
    try:
        with DefragClient(proxy.address, timeout_s=30) as client:
            step_and_write(client, kv, new_blocks={"a": [3, 4]})
            # An idle session sees four client pings; pings the server's policy did
            # not allow would get the connection closed (GOAWAY too_many_pings).
            time.sleep(22)
            client.step(StepEvents())
            assert proxy.num_accepted == 1
            proxy.blackhole()

            # NOTE: keepalive notices the dead path on each side within 10-15 s (the
            # client's pings, and the server's, which end the old session), so the step
            # sent into it is resent on a new connection within its 30 s deadline. The
            # bound on trying is generous for a loaded machine; without keepalive no
            # step ever gets through again.
            deadline = time.monotonic() + 90.0
            while True:
                try:
                    client.step(StepEvents(new_blocks={"b": [7]}))
                    break
                except ServiceUnavailable:
                    assert time.monotonic() < deadline, "no step got through in 90 s"

            assert proxy.num_accepted == 2  # the client came back on a new connection
            kv.write([7], client.resolve([7]))
            assert client.audit().is_consistent
            assert kv.mismatched([3, 4, 7], client.resolve([3, 4, 7])) == []
    finally:
        proxy.close()


# --- 5. a process with a server and a client exits after an uncaught exception ----------
EXITING_SCRIPT = """
    import tempfile
    import torch
    from kvdefrag.client import DefragClient, StepEvents
    from kvdefrag.server import ServiceConfig, serve_in_process

    kv_caches = [(torch.zeros(64 * 2, 4), torch.zeros(64 * 2, 4))]
    address = f"unix:{tempfile.mkdtemp()}/kv.sock"
    handle = serve_in_process(kv_caches, 2, service_config=ServiceConfig(address=address))
    client = DefragClient(address)
    client.step(StepEvents(new_blocks={"a": [3, 4]}))
    print("stepped", flush=True)
    raise RuntimeError("uncaught")
"""


def test_process_with_a_server_and_an_open_client_stream_exits_after_an_uncaught_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "uncaught.py"
    script.write_text(textwrap.dedent(EXITING_SCRIPT))
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        # NOTE: generous: importing torch on a loaded machine takes seconds; a process
        # that hangs at exit never ends at all.
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"the process did not exit; it printed {stdout!r}, {stderr[-2000:]!r}")
    assert "stepped" in stdout
    assert process.returncode == 1 and "RuntimeError: uncaught" in stderr


def test_exit_hooks_keep_no_server_or_client_alive(tmp_path: Path) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE)
    # NOTE: not the ``serve`` fixture: it keeps its servers alive until teardown.
    handle = serve_in_process(
        kv.kv_caches,
        kv.block_size,
        service_config=ServiceConfig(address=f"unix:{tmp_path}/kv.sock"),
    )
    client = DefragClient(handle.address)
    client.close()
    handle.stop(0)
    handle_ref, client_ref = weakref.ref(handle), weakref.ref(client)

    del handle, client
    gc.collect()

    assert handle_ref() is None and client_ref() is None


# --- 6. a failed KV move: the step is applied without its compaction --------------------
def test_a_failed_move_applies_the_step_without_its_compaction_and_says_so(
    serve: Serve, tmp_path: Path
) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    executor = ScriptedExecutor.for_kv(kv)
    handle = serve(
        f"unix:{tmp_path}/kv.sock", block_size=BLOCK_SIZE, kv=kv, executor=executor, threshold=0
    )
    with DefragClient(handle.address, timeout_s=5) as client:
        fragment(client, kv)  # seq 1
        executor.is_failing = True

        with pytest.raises(EngineUnhealthy, match=INJECTED_FAILURE):
            client.step(StepEvents(finished=["a"], new_blocks={"c": [20, 21]}))  # seq 2

        stats = client.stats()
        # Step 2's events stand (a finished, c running), so the numbers count it ...
        assert handle._engine.list_requests() == {"b": [40, 41, 42], "c": [20, 21]}
        assert stats.next_seq == 3
        assert stats.stats.totals.num_steps == 2 and stats.stats.totals.num_moves == 0
        # ... and the reason says what the state is.
        assert not stats.stats.is_healthy
        assert "step 2" in stats.unhealthy_reason
        assert "applied without its compaction" in stats.unhealthy_reason
        assert "reset() is required" in stats.unhealthy_reason
        with pytest.raises(EngineUnhealthy, match="reset\\(\\) is required"):
            client.step(StepEvents(new_blocks={"d": [30]}))  # the client's mirror lacks step 2

        client.rebuild_mirror()  # adopts exactly what the server holds

        assert client.next_seq == 3
        assert client.live_requests() == {"b": [40, 41, 42], "c": [20, 21]}
        assert client.audit().is_consistent
        live = [40, 41, 42]  # c's blocks are fresh: they hold no data yet
        assert kv.mismatched(live, client.resolve(live)) == []  # nothing moved, nothing lost
        with pytest.raises(EngineUnhealthy, match="step 2"):
            client.step(StepEvents(new_blocks={"d": [30]}))
        executor.is_failing = False
        client.reset()
        assert client.step(StepEvents(new_blocks={"d": [30]})).seq == 1


# --- 7. bad TLS material is reported by file, before binding ----------------------------
def _openssl(*args: str | Path) -> None:
    assert OPENSSL is not None, (
        "the TLS tests make certificates with openssl: run `make system-deps`"
    )
    subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True, timeout=60)


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", cert, "-days", "1",
             "-subj", "/CN=localhost")  # fmt: skip
    return cert, key


@pytest.mark.parametrize(
    ("case", "option", "problem"),
    [
        ("garbage certificate", "tls_cert_file", "no certificate"),
        ("key of another certificate", "tls_key_file", "does not match"),
        ("garbage key", "tls_key_file", "not an unencrypted PEM private key"),
        ("missing key", "tls_key_file", "cannot be read"),
        ("garbage client CA", "tls_client_ca_file", "no certificate"),
    ],
)
def test_bad_tls_material_is_named_by_file(
    serve: Serve, tmp_path: Path, case: str, option: str, problem: str
) -> None:
    cert, key = _self_signed(tmp_path, "server")
    _, other_key = _self_signed(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not PEM\n")
    files = {"tls_cert_file": cert, "tls_key_file": key}
    if case == "garbage certificate":
        files["tls_cert_file"] = garbage
    elif case == "key of another certificate":
        files["tls_key_file"] = other_key
    elif case == "garbage key":
        files["tls_key_file"] = garbage
    elif case == "missing key":
        files["tls_key_file"] = tmp_path / "missing.key"
    else:
        files["tls_client_ca_file"] = garbage
    options = {name: str(path) for name, path in files.items()}

    with pytest.raises(InvalidArgument) as info:
        serve("127.0.0.1:0", block_size=BLOCK_SIZE, **options)

    message = str(info.value)
    assert option in message and str(files[option]) in message and problem in message
    handle = serve(
        "127.0.0.1:0", block_size=BLOCK_SIZE, tls_cert_file=str(cert), tls_key_file=str(key)
    )
    assert handle.address  # the good pair serves
