"""Durations and limits are checked where they enter, named in the error, and a refused
call changes nothing: ``ServerHandle.stop``/``wait``/``wait_applied``, the command line's
``--grace-s``, and the service options gRPC or the metrics server would choke on later
(``max_message_bytes``, ``metrics_port``, ``handshake_timeout_s``); the socket's lock
on a file system without ``flock``, and in a child forked from a killed server.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import ServiceConfig, load_config, serve_in_process
from kvdefrag.server.__main__ import parse_args
from kvdefrag.server._socket_file import PathLock

from support.kv import make_kv_caches
from support.server import Serve

TOO_LONG = [math.inf, 1e12, math.nan, 86_401]


@pytest.mark.parametrize("grace_s", [*TOO_LONG, -1])
def test_stop_with_a_bad_grace_is_refused_and_the_server_keeps_serving(
    serve: Serve, grace_s: float
) -> None:
    handle = serve()
    with pytest.raises(InvalidArgument, match=r"stop: grace_s must be a number of seconds >= 0"):
        handle.stop(grace_s)
    with DefragClient(handle.address, timeout_s=10) as client:  # still listening, healthy
        assert client.step(StepEvents(new_blocks={"a": [1, 2]})).seq == 1
    assert handle.stop(1.0)
    assert handle.wait(0)


@pytest.mark.parametrize("timeout_s", [*TOO_LONG, -1])
def test_wait_applied_with_a_bad_timeout_is_refused_by_name(serve: Serve, timeout_s: float) -> None:
    handle = serve()
    with pytest.raises(InvalidArgument, match=r"wait_applied: timeout_s must be .* >= 0"):
        handle.wait_applied(handle.epoch, 1, timeout_s)


@pytest.mark.parametrize("timeout_s", [*TOO_LONG, -1])
def test_wait_with_a_bad_timeout_is_refused_by_name(serve: Serve, timeout_s: float) -> None:
    handle = serve()
    with pytest.raises(InvalidArgument, match=r"wait: timeout_s must be .* >= 0"):
        handle.wait(timeout_s)


@pytest.mark.parametrize("text", ["inf", "1e12", "nan", "-1"])
def test_the_command_line_refuses_a_bad_grace_by_name(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--grace-s", text], {})
    assert "--grace-s must be a number of seconds >= 0 and <= 86400" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"KVDEFRAG_MAX_MESSAGE_BYTES": str(2**31)},
            r"max_message_bytes \(KVDEFRAG_MAX_MESSAGE_BYTES, --max-message-bytes\) must be "
            r"<= 2147483647",
        ),
        (
            {"KVDEFRAG_METRICS_PORT": "65536"},
            r"metrics_port \(KVDEFRAG_METRICS_PORT, --metrics-port\) must be a TCP port 0-65535",
        ),
        ({"KVDEFRAG_METRICS_PORT": "-1"}, r"KVDEFRAG_METRICS_PORT.* got -1"),
        (
            {"KVDEFRAG_HANDSHAKE_TIMEOUT_S": "inf"},
            r"handshake_timeout_s \(KVDEFRAG_HANDSHAKE_TIMEOUT_S, --handshake-timeout-s\) must "
            r"be a number of seconds > 0 and <= 3600, got inf",
        ),
    ],
)
def test_service_options_out_of_range_are_refused_at_load_naming_the_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_config({}, environ)


def test_the_largest_message_limit_and_port_still_load() -> None:
    _, config = load_config(
        {}, {"KVDEFRAG_MAX_MESSAGE_BYTES": str(2**31 - 1), "KVDEFRAG_METRICS_PORT": "0"}
    )
    assert (config.max_message_bytes, config.metrics_port) == (2**31 - 1, 0)
    assert ServiceConfig(metrics_port=65535).metrics_port == 65535


# --- the socket's lock ------------------------------------------------------------------
def test_a_file_system_without_flock_is_named_and_leaves_no_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    engine_config, service_config = load_config({"address": f"unix:{tmp_path}/s.sock"}, {})
    with pytest.raises(InvalidArgument) as caught:
        serve_in_process(
            make_kv_caches(8),
            4,
            engine_config=engine_config,
            service_config=service_config,
        )
    message = str(caught.value)
    assert f"{tmp_path}/s.sock.lock" in message and "does not support flock" in message
    assert "KVDEFRAG_ADDRESS" in message
    assert list(tmp_path.iterdir()) == []


_KILLED_SERVER = """
import os, signal, sys
from kvdefrag.server._socket_file import PathLock

lock = PathLock.acquire(sys.argv[1])
if os.fork() == 0:  # a helper forked without exec: it outlives the server
    sys.stdin.read()
    os._exit(0)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_child_forked_from_a_killed_server_does_not_keep_its_socket_lock(
    tmp_path: Path,
) -> None:
    socket_path = f"{tmp_path}/s.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SERVER, socket_path],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert server.stdin is not None
    try:
        assert server.wait(timeout=60) == -signal.SIGKILL
        # The forked child still runs (it waits on stdin), and the lock is free.
        lock = PathLock.acquire(socket_path, wait_s=1.0)
        lock.release()
    finally:
        server.stdin.close()
