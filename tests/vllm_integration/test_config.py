"""The integration's settings: every ``KVDEFRAG_VLLM_*`` variable read and checked once."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from kvdefrag.vllm._scheduler.ranks import client_tls
from kvdefrag.vllm.config import (
    AUDIT_EVERY_ENV,
    CLIENT_TLS_ENV,
    RAY_ENV_PREFIXES_ENV,
    RUN_DIR_ENV,
    STEP_WAIT_ENV,
    TCP_HOST_ENV,
    TCP_PORT_ENV,
    IntegrationConfig,
    load_integration_config,
    tcp_address,
)
from kvdefrag.vllm.errors import BadSetting, StartupRefused, UnsupportedByKvdefrag

from support.public_api import assert_public_names

RUN_DIR = "/run/kvdefrag/engine"


def _load(**variables: str) -> IntegrationConfig:
    return load_integration_config({RUN_DIR_ENV: RUN_DIR, **variables})


def test_the_defaults_need_only_the_run_directory() -> None:
    assert _load() == IntegrationConfig(run_dir=RUN_DIR)
    config = _load()
    assert (config.tcp_port, config.step_wait_s, config.audit_every) == (None, 60.0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.run_dir = "/elsewhere"  # type: ignore[misc]


def test_the_settings_come_from_the_environment_when_none_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, RUN_DIR)
    monkeypatch.setenv(AUDIT_EVERY_ENV, "7")
    assert load_integration_config().audit_every == 7


def test_no_tcp_port_means_a_unix_socket() -> None:
    assert tcp_address(_load(), 3, lambda: "10.0.0.7") is None


def test_each_local_rank_takes_the_next_port() -> None:
    config = _load(**{TCP_PORT_ENV: "50100"})
    assert tcp_address(config, 0, lambda: "10.0.0.7") == "10.0.0.7:50100"
    assert tcp_address(config, 3, lambda: "10.0.0.7") == "10.0.0.7:50103"
    config = _load(**{TCP_PORT_ENV: "50100", TCP_HOST_ENV: "fd00::5"})
    assert tcp_address(config, 1, lambda: "10.0.0.7") == "[fd00::5]:50101"


@pytest.mark.parametrize("port", ["http", "0", "-5", "65536"])
def test_a_port_that_is_not_one_is_named(port: str) -> None:
    with pytest.raises(
        BadSetting, match=re.escape(f"{TCP_PORT_ENV} must be a TCP port (1..65535), got '{port}'")
    ):
        _load(**{TCP_PORT_ENV: port})


@pytest.mark.parametrize(("port", "offset"), [("65535", 1), ("65000", 1000)])
def test_a_ranks_port_past_the_range_names_the_setting_and_the_largest_base(
    port: str, offset: int
) -> None:
    config = _load(**{TCP_PORT_ENV: port})
    with pytest.raises(
        BadSetting,
        match=re.escape(f"= {int(port) + offset}, not a TCP port; choose {TCP_PORT_ENV} in 1..")
        + str(65535 - offset),
    ):
        tcp_address(config, offset, lambda: "10.0.0.7")


def test_client_tls_reads_the_named_files(tmp_path: Path) -> None:
    assert client_tls(_load()) == {}
    (tmp_path / "ca.pem").write_bytes(b"CA")
    (tmp_path / "client.pem").write_bytes(b"CERT")
    files = {
        CLIENT_TLS_ENV["root_certificates"]: os.fspath(tmp_path / "ca.pem"),
        CLIENT_TLS_ENV["certificate_chain"]: os.fspath(tmp_path / "client.pem"),
    }
    assert client_tls(_load(**files)) == {"root_certificates": b"CA", "certificate_chain": b"CERT"}
    missing = os.fspath(tmp_path / "client.key")
    config = _load(**files, **{CLIENT_TLS_ENV["private_key"]: missing})
    with pytest.raises(BadSetting, match=f"cannot read KVDEFRAG_VLLM_TLS_KEY_FILE='{missing}'"):
        client_tls(config)


def test_the_audit_is_off_unless_asked_and_a_bad_period_is_named() -> None:
    assert _load(**{AUDIT_EVERY_ENV: "25"}).audit_every == 25
    for bad in ("-1", "often", "2.5"):
        with pytest.raises(BadSetting, match=f"must be a whole number >= 0, got '{bad}'"):
            _load(**{AUDIT_EVERY_ENV: bad})


def test_the_step_wait_defaults_to_a_minute_and_refuses_a_bad_value() -> None:
    assert _load(**{STEP_WAIT_ENV: "2.5"}).step_wait_s == 2.5
    assert _load(**{STEP_WAIT_ENV: "86400"}).step_wait_s == 86400.0  # a day, the longest
    # NOTE: an infinite or huge wait would overflow in the first pass that had to wait.
    for bad in ("0", "-1", "soon", "nan", "inf", "1e12", "86400.5"):
        with pytest.raises(
            BadSetting,
            match=(
                f"{STEP_WAIT_ENV} must be a positive number of seconds, at most "
                rf"86400 \(a day\), got '{bad}'"
            ),
        ):
            _load(**{STEP_WAIT_ENV: bad})


def test_an_unset_or_relative_run_dir_is_refused_and_under_ray_says_how_ray_copies_variables() -> (
    None
):
    hint = f"export {RAY_ENV_PREFIXES_ENV}=KVDEFRAG_ where"
    with pytest.raises(BadSetting, match=hint):
        load_integration_config({}, executor_backend="ray")
    with pytest.raises(BadSetting, match=hint):
        load_integration_config({}, executor_backend=type("RayExecutorV2", (), {"uses_ray": True}))
    for environ in ({}, {RUN_DIR_ENV: "relative/dir"}):
        with pytest.raises(BadSetting, match=f"set {RUN_DIR_ENV} to an absolute") as refused:
            load_integration_config(environ, executor_backend="mp")
        assert RAY_ENV_PREFIXES_ENV not in str(refused.value)


def test_every_refusal_at_start_up_is_one_type() -> None:
    from kvdefrag.common import DefragError
    from kvdefrag.vllm._run_dir import UnsafeRunDir
    from kvdefrag.vllm._scheduler.gaudi import GaudiSchedulerMismatch
    from kvdefrag.vllm._scheduler.ranks import RankNotVerified

    for refusal in (
        BadSetting,
        UnsupportedByKvdefrag,
        UnsafeRunDir,
        RankNotVerified,
        GaudiSchedulerMismatch,
    ):
        assert issubclass(refusal, StartupRefused)
    assert issubclass(StartupRefused, DefragError)


def test_the_public_names_are_pinned() -> None:
    assert_public_names(
        "kvdefrag.vllm.config",
        {
            "AUDIT_EVERY_ENV",
            "CLIENT_TLS_ENV",
            "RAY_ENV_PREFIXES_ENV",
            "RUN_DIR_ENV",
            "STEP_WAIT_ENV",
            "TCP_HOST_ENV",
            "TCP_PORT_ENV",
            "IntegrationConfig",
            "load_integration_config",
            "tcp_address",
        },
    )
    assert_public_names(
        "kvdefrag.vllm.errors",
        {"BadSetting", "PassRefused", "StartupRefused", "UnsafeRunDir", "UnsupportedByKvdefrag"},
    )
