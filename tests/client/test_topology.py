"""Who translates block ids, where the scheduler finds each rank (TCP addresses, the
published list) and its client TLS."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdefrag.client.vllm.topology import (
    CLIENT_TLS_ENV,
    RANKS_FILE,
    TCP_HOST_ENV,
    TCP_PORT_ENV,
    TRANSLATE_ENV,
    client_tls_from_env,
    publish_rank_addresses,
    published_rank_addresses,
    tcp_address,
    workers_translate,
)


def test_no_tcp_port_means_a_unix_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TCP_PORT_ENV, raising=False)
    assert tcp_address(3, lambda: "10.0.0.7") is None


def test_each_local_rank_takes_the_next_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TCP_PORT_ENV, "50100")
    monkeypatch.delenv(TCP_HOST_ENV, raising=False)
    assert tcp_address(0, lambda: "10.0.0.7") == "10.0.0.7:50100"
    assert tcp_address(3, lambda: "10.0.0.7") == "10.0.0.7:50103"
    monkeypatch.setenv(TCP_HOST_ENV, "fd00::5")
    assert tcp_address(1, lambda: "10.0.0.7") == "[fd00::5]:50101"


@pytest.mark.parametrize("port", ["http", "0", "65535"])
def test_a_bad_port_is_named(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    monkeypatch.setenv(TCP_PORT_ENV, port)
    with pytest.raises(
        RuntimeError, match=re.escape(f"{TCP_PORT_ENV} must be a TCP port, got {port!r}")
    ):
        tcp_address(1 if port == "65535" else 0, lambda: "10.0.0.7")


def test_published_addresses_round_trip_in_rank_order(tmp_path: Path) -> None:
    run_dir = os.fspath(tmp_path / "run")
    publish_rank_addresses(run_dir, ["10.0.0.7:50100", "10.0.0.8:50100"])
    assert published_rank_addresses(run_dir, 2) == ["10.0.0.7:50100", "10.0.0.8:50100"]
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    assert os.listdir(run_dir) == [RANKS_FILE]  # no partial file left behind


def test_missing_addresses_say_which_worker_class_publishes_them(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=re.escape("kvdefrag.server.vllm_worker.DefragWorker")):
        published_rank_addresses(os.fspath(tmp_path), 1)


def test_addresses_for_another_world_size_are_refused(tmp_path: Path) -> None:
    (tmp_path / RANKS_FILE).write_text(json.dumps({"addresses": ["unix:/a.sock"]}))
    with pytest.raises(RuntimeError, match="lists 1 rank addresses, the engine has 2 ranks"):
        published_rank_addresses(os.fspath(tmp_path), 2)


def test_client_tls_reads_the_named_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in CLIENT_TLS_ENV.values():
        monkeypatch.delenv(variable, raising=False)
    assert client_tls_from_env() == {}
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "client.pem").write_bytes(b"CERT")
    monkeypatch.setenv(CLIENT_TLS_ENV["root_certificates"], os.fspath(tmp_path / "ca.pem"))
    monkeypatch.setenv(CLIENT_TLS_ENV["certificate_chain"], os.fspath(tmp_path / "client.pem"))
    assert client_tls_from_env() == {"root_certificates": b"CA", "certificate_chain": b"CERT"}
    missing = os.fspath(tmp_path / "client.key")
    monkeypatch.setenv(CLIENT_TLS_ENV["private_key"], missing)
    with pytest.raises(RuntimeError, match=f"cannot read KVDEFRAG_VLLM_TLS_KEY_FILE='{missing}'"):
        client_tls_from_env()


def _config(*, async_scheduling: bool, use_v2_model_runner: bool) -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
        use_v2_model_runner=use_v2_model_runner,
    )


@pytest.mark.parametrize(
    ("async_scheduling", "use_v2_model_runner", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_the_workers_translate_under_async_scheduling_or_the_v2_runner(
    monkeypatch: pytest.MonkeyPatch,
    async_scheduling: bool,
    use_v2_model_runner: bool,
    expected: bool,
) -> None:
    monkeypatch.delenv(TRANSLATE_ENV, raising=False)
    config = _config(async_scheduling=async_scheduling, use_v2_model_runner=use_v2_model_runner)
    assert workers_translate(config) is expected


def test_the_environment_makes_the_workers_translate_under_sync_v1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TRANSLATE_ENV, "worker")
    assert workers_translate(_config(async_scheduling=False, use_v2_model_runner=False))
    assert workers_translate(None) is True
    monkeypatch.setenv(TRANSLATE_ENV, "")
    assert workers_translate(None) is False
