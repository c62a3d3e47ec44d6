"""``StepProgress``: the published ``(epoch, next_seq)`` a worker waits on without the
servicer's lock."""

from __future__ import annotations

import threading

import pytest

from kvdefrag.common import EngineUnhealthy, EpochMismatch, ServiceUnavailable
from kvdefrag.server._progress import StepProgress


def _wait(
    progress: StepProgress, epoch: int, seq: int, timeout_s: float = 5.0, **kw: object
) -> None:
    progress.wait_for(
        epoch,
        seq,
        timeout_s,
        unhealthy_reason=kw.get("unhealthy", lambda: None),  # type: ignore[arg-type]
        is_stopping=kw.get("stopping", lambda: False),  # type: ignore[arg-type]
    )


def test_a_step_applied_already_is_found_at_once() -> None:
    progress = StepProgress(7, 4)
    _wait(progress, 7, 3, timeout_s=0)


def test_a_waiter_wakes_when_its_step_is_published() -> None:
    progress = StepProgress(7, 4)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (_wait(progress, 7, 4), done.set()))
    waiter.start()
    assert not done.wait(0.05)
    progress.publish(7, 5)
    waiter.join(timeout=5)
    assert done.is_set()


def test_another_epoch_is_refused_naming_both() -> None:
    progress = StepProgress(7, 4)
    with pytest.raises(EpochMismatch, match="step seq 2 of epoch 8: the server is at epoch 7"):
        _wait(progress, 8, 2)


def test_an_unhealthy_engine_and_a_stop_end_the_wait() -> None:
    progress = StepProgress(7, 4)
    with pytest.raises(EngineUnhealthy, match="a move failed"):
        _wait(progress, 7, 4, unhealthy=lambda: "a move failed")
    with pytest.raises(ServiceUnavailable, match="the server is stopping"):
        _wait(progress, 7, 4, stopping=lambda: True)


def test_the_bound_names_the_step_and_the_step_in_progress() -> None:
    progress = StepProgress(7, 4)
    progress.begin_step(7, 4)
    with pytest.raises(ServiceUnavailable, match=r"step seq 4 of epoch 7 has been running"):
        _wait(progress, 7, 4, timeout_s=0.01)
    progress.end_step()
    assert progress.describe_in_progress() == ""
