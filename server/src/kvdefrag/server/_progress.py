"""Which steps the service has applied, for readers that must not wait behind a step.

The servicer changes its ``(epoch, next_seq)`` under its own lock, which a step holds for
as long as its device copy takes (forever, if the executor hangs). An in-process reader
that only needs to know whether a step was applied (a vLLM worker before its pass) reads
the pair published here instead: a leaf lock held only to publish or to check it, so
``wait_for`` keeps its bound whatever holds the servicer lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from kvdefrag.common import EngineUnhealthy, EpochMismatch, ServiceUnavailable


@dataclasses.dataclass(frozen=True)
class _StepInProgress:
    """The step the engine is applying (published without the servicer lock)."""

    epoch: int
    seq: int
    started_s: float


class StepProgress:
    """``(epoch, next_seq)`` as of the last change to either, and the step in progress.

    Invariant: ``applied`` is one tuple, replaced whole, so a reader never pairs one
    epoch's seq with another epoch.
    """

    def __init__(self, epoch: int, next_seq: int) -> None:
        self.applied = (epoch, next_seq)
        self._changed = threading.Condition(threading.Lock())
        self._in_progress: _StepInProgress | None = None

    def publish(self, epoch: int, next_seq: int) -> None:
        """Publishes a new ``(epoch, next_seq)`` and wakes every ``wait_for``."""
        with self._changed:
            self.applied = (epoch, next_seq)
            self._changed.notify_all()

    def wake_all(self) -> None:
        """Wakes every ``wait_for`` to check its conditions again (stopping, unhealthy)."""
        with self._changed:
            self._changed.notify_all()

    def begin_step(self, epoch: int, seq: int) -> None:
        """Names the step the engine starts applying (for ``describe_in_progress``)."""
        self._in_progress = _StepInProgress(epoch, seq, time.monotonic())

    def end_step(self) -> None:
        self._in_progress = None

    def describe_in_progress(self) -> str:
        """``; step seq N of epoch E has been running for T s`` when one is, else ``""``."""
        step = self._in_progress
        if step is None:
            return ""
        return (
            f"; step seq {step.seq} of epoch {step.epoch} has been running for "
            f"{time.monotonic() - step.started_s:.1f} s"
        )

    def wait_for(
        self,
        epoch: int,
        seq: int,
        timeout_s: float,
        *,
        unhealthy_reason: Callable[[], str | None],
        is_stopping: Callable[[], bool],
    ) -> None:
        """Returns once step ``seq`` of ``epoch`` is applied.

        Raises:
            EpochMismatch: The service is at another epoch (restarted or reset).
            EngineUnhealthy: ``unhealthy_reason()`` names a failed KV move: the step may
                never be applied.
            ServiceUnavailable: Not applied within ``timeout_s``, or ``is_stopping()``;
                the message names the step, the bound and the step in progress.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                current_epoch, next_seq = self.applied
                if current_epoch != epoch:
                    raise EpochMismatch(
                        f"waiting for step seq {seq} of epoch {epoch}: the server is at "
                        f"epoch {current_epoch} (it restarted or was reset)"
                    )
                if next_seq > seq:
                    return
                reason = unhealthy_reason()
                if reason is not None:
                    raise EngineUnhealthy(f"waiting for step seq {seq} of epoch {epoch}: {reason}")
                remaining_s = deadline - time.monotonic()
                stopping = is_stopping()
                if remaining_s <= 0 or stopping:
                    raise ServiceUnavailable(
                        f"step seq {seq} of epoch {epoch} was not applied within the "
                        f"{timeout_s} s bound (next seq {next_seq}"
                        + self.describe_in_progress()
                        + ")"
                        + ("; the server is stopping" if stopping else "")
                    )
                self._changed.wait(remaining_s)
