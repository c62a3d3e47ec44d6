"""Who translates block ids: both sides call ``workers_translate`` with the same config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvdefrag.client.vllm.topology import TRANSLATE_ENV, workers_translate


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
