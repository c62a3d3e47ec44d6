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
import gc
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from kv import SignedKv

from kvdefrag.client import DefragClient, EngineUnhealthy, ServiceUnavailable
from kvdefrag.common import InvalidArgument
from kvdefrag.server import Move, MoveReport, ServerHandle, make_executor, serve_in_process
from kvdefrag.server._server import grpc_options
from kvdefrag.server.config import ServiceConfig
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

OPENSSL = shutil.which("openssl")
BLOCK_SIZE = 2


# --- resources and factories ------------------------------------------------------------
@pytest.fixture
def servers() -> Iterator[list[ServerHandle]]:
    """Servers a test starts; all stopped at the end."""
    started: list[ServerHandle] = []
    yield started
    for handle in started:
        handle.stop(0)


def serve(
    servers: list[ServerHandle], address: str, *, kv: SignedKv | None = None, **options: Any
) -> ServerHandle:
    kv = kv or SignedKv.create(64, block_size=BLOCK_SIZE)
    handle = serve_in_process(kv.kv_caches, kv.block_size, address, **options)
    servers.append(handle)
    return handle


class GatedExecutor:
    """The real CPU executor behind a gate: a batch can be made to hang or to fail."""

    def __init__(self, kv: SignedKv) -> None:
        self._inner = make_executor(kv.kv_caches, kv.block_size)
        self.num_blocks = self._inner.num_blocks
        self.is_failing = False
        self.entered = threading.Event()
        self.go_ahead = threading.Event()
        self.go_ahead.set()

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        self.entered.set()
        # A hung device copy, for at most a minute (the test lets it go before then).
        self.go_ahead.wait(60)
        if self.is_failing:
            raise RuntimeError("injected KV copy failure")
        report: MoveReport = self._inner.execute(moves)
        return report


def get_stats(address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def step_and_write(client: DefragClient, kv: SignedKv, **events: Any) -> Any:
    """One step; then the worker writes every new block (all of them fresh here)."""
    reply = client.step(**events)
    new_ids = sorted({i for ids in events.get("new_blocks", {}).values() for i in ids})
    kv.write(new_ids, client.resolve(new_ids))
    return reply


def fragment(client: DefragClient, kv: SignedKv) -> None:
    """Two requests; with ``a`` finished, the next step has holes below ``b`` to fill."""
    step_and_write(client, kv, new_blocks={"a": list(range(1, 11)), "b": [40, 41, 42]})


# --- 1. stop() removes only its own socket file ---------------------------------------
def test_stop_leaves_the_socket_file_of_a_replacement_server_alone(
    servers: list[ServerHandle], tmp_path: Path
) -> None:
    path = tmp_path / "kv.sock"
    old = serve(servers, f"unix:{path}")
    # A replacement bound while the old server was stopping: the old one's file is gone
    # (a stale file is replaced) and the path now holds the new server's socket.
    path.unlink()
    new = serve(servers, f"unix:{path}")
    new_inode = path.stat().st_ino

    old.stop(0)

    assert path.exists() and path.stat().st_ino == new_inode
    assert get_stats(new.address).epoch == new.epoch
    new.stop(0)
    assert not path.exists()  # its own file it does remove


# --- 2. stop(grace_s) is bounded --------------------------------------------------------
def step_until_stopped(client: DefragClient) -> None:
    """The step that hangs; the server stops under it, so it ends unacknowledged."""
    with contextlib.suppress(ServiceUnavailable):
        client.step(finished=["a"])


def test_stop_returns_after_its_grace_while_a_step_hangs(
    servers: list[ServerHandle], tmp_path: Path
) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    executor = GatedExecutor(kv)
    handle = serve(servers, f"unix:{tmp_path}/kv.sock", kv=kv, executor=executor, threshold=0)
    client = DefragClient(handle.address, timeout_s=5)
    try:
        fragment(client, kv)
        executor.go_ahead.clear()
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
        executor.go_ahead.set()  # the step completes after stop() has returned ...
        stepping.join(60)
        client.close()
    engine = handle.engine
    wait_until(lambda: engine.stats().totals.num_steps == 2)
    # ... and leaves the engine whole: a permutation, compacted, and every live block
    # reads its own data where the mapping says it is.
    mapping = engine.resolve(range(engine.num_blocks)).tolist()
    assert sorted(mapping) == list(range(engine.num_blocks))
    stats = engine.stats()
    assert stats.is_healthy and stats.holes == 0 and stats.totals.num_moves > 0
    assert kv.lost_blocks(engine, [40, 41, 42]) == []


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
    servers: list[ServerHandle], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
        handle = serve(servers, f"unix:{path}")
    finally:
        os.umask(previous_umask)

    assert [observer.num_binds for observer in observers] == [1]
    assert observers[0].leaks == []
    assert _mode(path) == 0o600 and stat.S_ISSOCK(os.lstat(path).st_mode)
    assert os.listdir(shared) == ["kv.sock"]  # nothing left of the bind
    assert get_stats(handle.address).epoch == handle.epoch


