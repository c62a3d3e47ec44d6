"""``python -m kvdefrag.server``: flag parsing, and the real process started and stopped."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvdefrag.server.__main__ import CacheShape, make_kv_caches, parse_args
from kvdefrag.server.config import EngineConfig, ServiceConfig
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc


def test_defaults_come_from_config() -> None:
    options = parse_args([], environ={})
    assert (options.engine_config, options.service_config) == (EngineConfig(), ServiceConfig())
    assert options.cache == CacheShape(2, 1024, 16, 4, 64, torch.float16)


def test_flags_override_env_which_overrides_defaults() -> None:
    environ = {"KVDEFRAG_THRESHOLD": "7", "KVDEFRAG_MAX_MOVES_PER_STEP": "64"}
    config = parse_args(["--threshold", "3"], environ=environ).engine_config
    assert (config.threshold, config.max_moves_per_step) == (3, 64)
    config = parse_args([], environ={"KVDEFRAG_ENABLE_PLACEMENT": "0"}).engine_config
    assert not config.enable_placement


def test_every_flag_reaches_its_field() -> None:
    argv = [
        "--num-layers", "3", "--num-blocks", "128", "--block-size", "8", "--num-kv-heads", "2",
        "--head-size", "32", "--dtype", "bfloat16", "--threshold", "5",
        "--max-moves-per-step", "16", "--pad-buckets", "8,16", "--decode-buckets", "64,128",
        "--no-placement",
        "--prefix-caching", "--address", "10.0.0.1:7000", "--metrics-port", "9464",
        "--metrics-max-connections", "8", "--metrics-idle-timeout-s", "2.5",
        "--insecure", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem",
        "--max-message-bytes", "65536", "--replay-cache-size", "8", "--grace-s", "1.5",
    ]  # fmt: skip
    options = parse_args(argv, environ={})
    assert options.cache == CacheShape(3, 128, 8, 2, 32, torch.bfloat16)
    assert options.engine_config == EngineConfig(
        threshold=5,
        max_moves_per_step=16,
        pad_buckets=(8, 16),
        enable_placement=False,
        prefix_caching=True,
        decode_buckets=(64, 128),
    )
    assert options.service_config == ServiceConfig(
        address="10.0.0.1:7000",
        metrics_port=9464,
        metrics_max_connections=8,
        metrics_idle_timeout_s=2.5,
        insecure=True,
        tls_cert_file="c.pem",
        tls_key_file="k.pem",
        tls_client_ca_file="ca.pem",
        max_message_bytes=65536,
        replay_cache_size=8,
    )
    assert options.grace_s == 1.5


@pytest.mark.parametrize(
    "argv",
    [
        ["--threshold", "-1"],
        ["--num-blocks", "0"],
        ["--pad-buckets", "16,8"],
        ["--dtype", "x"],
        ["--decode-buckets", "128,64"],
    ],
)
def test_bad_flags_exit_with_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ={})
    assert info.value.code == 2
    assert "kvdefrag-server" in capsys.readouterr().err


def test_bad_environment_value_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse_args([], environ={"KVDEFRAG_THRESHOLD": "many"})


def test_embedded_cache_has_the_vllm_layout() -> None:
    caches = make_kv_caches(CacheShape(2, 16, 4, 2, 8, torch.float32))
    assert len(caches) == 2
    assert all(tensor.shape == (64, 2, 8) for pair in caches for tensor in pair)


def server_environment() -> dict[str, str]:
    """This environment without KVDEFRAG_* variables (the flags decide)."""
    return {name: value for name, value in os.environ.items() if not name.startswith("KVDEFRAG_")}


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    address = f"unix:{tmp_path}/kv.sock"
    command = [sys.executable, "-m", "kvdefrag.server", "--address", address,
               "--num-blocks", "64", "--block-size", "4", "--threshold", "0"]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_environment()
    )
    yield process, address
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=30)


@pytest.mark.timeout(120)
def test_server_process_answers_and_stops_on_sigterm(
    server_process: tuple[subprocess.Popen[str], str], tmp_path: Path
) -> None:
    process, address = server_process
    assert process.stdout is not None
    banner = process.stdout.readline()
    assert f"listening on {address}" in banner and "64 blocks x 4 tokens" in banner
    with grpc.insecure_channel(address) as channel:
        stats = pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.stats.num_blocks == 64 and str(stats.epoch) in banner

    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)

    assert process.returncode == 0
    assert "stopped" in stdout
    assert not (tmp_path / "kv.sock").exists()


@pytest.mark.timeout(120)
def test_server_process_refuses_plain_text_on_a_public_address() -> None:
    command = [sys.executable, "-m", "kvdefrag.server", "--address", "0.0.0.0:0"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env=server_environment()
    )
    assert result.returncode == 1
    assert "not a loopback address" in result.stderr and "--insecure" in result.stderr


def send_signal_to_thread(pid: int, tid: int, signum: int) -> None:
    """tgkill(2): hands the signal to one thread, as the kernel may do with a plain kill."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_TGKILL, pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}) failed")


# The tgkill syscall number on the architectures CI runs on.
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]


@pytest.mark.timeout(120)
def test_sigterm_delivered_to_another_thread_still_stops_the_server(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, address = server_process
    assert process.stdout is not None
    assert f"listening on {address}" in process.stdout.readline()
    with grpc.insecure_channel(address) as channel:
        pb_grpc.DefragServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
    others = sorted(int(tid) for tid in os.listdir(f"/proc/{process.pid}/task"))
    others.remove(process.pid)
    assert others, "the server runs gRPC threads besides its main thread"

    send_signal_to_thread(process.pid, others[-1], signal.SIGTERM)
    stdout, _ = process.communicate(timeout=60)

    assert process.returncode == 0
    assert "stopped" in stdout
