"""A worker's pass: one runner step, from ``execute_model`` to the end of its ``sample_tokens``.

vLLM 0.33 runs a step in two calls to every worker (``vllm/v1/engine/core.py``):
``EngineCore.step`` calls ``execute_model(output)`` and, when that returns None,
``sample_tokens(grammar_output)``; ``step_with_batch_queue`` (async scheduling) sends
``execute_model(N)`` and then ``sample_tokens(N)`` (unless no token was scheduled), and
each worker runs the calls it is sent in order, so ``sample_tokens(N)`` always comes
between ``execute_model(N)`` and ``execute_model(N + 1)``; vLLM's GPU runner refuses
anything else (``GPUModelRunner.execute_model``: "sample_tokens() must be called after
execute_model() returns None"). What reads KV data by block id in each half differs by
runner:

* vLLM's V1 and V2 runners (``gpu_model_runner.py``; the CPU runner is built on them)
  run the forward pass in ``execute_model`` and sampling plus the speculative drafter in
  ``sample_tokens``;
* vllm-gaudi's HPU runner (``vllm_gaudi/v1/worker/hpu_model_runner.py``, L4151-4224 and
  L4303 at 091bbadd) only updates its states in ``execute_model`` and returns None; the
  inputs are built, every block id is resolved and the forward runs in ``sample_tokens``
  (its Eagle draft too).

So a pass spans both calls: ``RunnerPass.execute_model`` makes sure the step stamped on
the output is applied (applying it itself when the output carries its events and the
scheduler's call has not arrived: ``wait_for_planned_step``), takes ``kv_lock`` and
readies the runner (``PassTarget.begin``); when the runner returns None the lock stays
held until the step's ``sample_tokens`` has run.
Calls outside any scheduled step (a data-parallel rank's dummy batch, a warm-up) run
holding the lock too, with the mapping as it is (``RunnerPass.idle``).

Calls made from inside an idle call run inside it, holding the same lock: vLLM 0.33's GPU
worker warms its V2 runner's kernels with its own ``execute_model`` and ``sample_tokens``
from ``compile_or_warm_up_model`` (``v1/worker/gpu_worker.py``, ``warmup_kernels`` in
``v1/worker/gpu/warmup.py``), so those come back through this object.

Between its step check and ``kv_lock`` a pass holds nothing: a Reset (forced, or while
the scheduler's stream is between connections) can take the lock first and publish the
identity mapping while the KV data stays where the moves put it. So once the lock is held
the pass checks again that the service is still at the epoch its step names, with that
step applied (``StepService.applied``: the servicer publishes a Reset's new epoch before
the engine's identity mapping, and the mapping changes only under ``kv_lock``); otherwise
it fails with ``EpochMismatch`` before the runner reads or writes anything. A call outside
any step checks that the epoch is still the one the rank's last pass ran under (its
persistent rows follow that epoch's moves).

Invariants: between ``begin`` and ``end`` this rank's ``kv_lock`` is held, so no step's
moves and no Reset change the mapping the runner reads; the runner runs only on the
mapping of the epoch its step (or its rank's last pass) belongs to; at most one pass is
open; a pass left open by a ``sample_tokens`` that never came is closed (with a warning)
before the next one begins, so a lost call cannot stall the rank's service for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvdefrag.common import EpochMismatch, OutOfOrder, SessionConflict, StepEvents, StepInFlight
from kvdefrag.vllm.contract import read_step_stamp
from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag

__all__ = [
    "PassTarget",
    "RunnerPass",
    "StepService",
    "guard_runner",
    "wait_for_planned_step",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class StepService(Protocol):
    """What a pass needs of its rank's service (``ServerHandle``)."""

    @property
    def kv_lock(self) -> threading.Lock: ...

    @property
    def applied(self) -> tuple[int, int]:
        """``(epoch, next_seq)`` as published (lock-free); a Reset publishes its new epoch
        before it publishes the identity mapping."""
        ...

    def apply_planned_step(self, epoch: int, seq: int, events: StepEvents) -> bool: ...

    def wait_applied(self, epoch: int, seq: int, timeout_s: float) -> None: ...


# Refusals of an in-process step after which the step's own call still decides: the
# session is between streams, an earlier step is missing here, or a step holds the service.
_LEFT_TO_THE_CALL = (SessionConflict, OutOfOrder, StepInFlight)


def wait_for_planned_step(
    service: StepService, rank: int, output: Any, timeout_s: float
) -> tuple[int, int] | None:
    """Returns once this rank's service has applied the step planned with ``output``.

    The scheduler sends each step without waiting for its reply and stamps the output
    with it (``contract.attach_step_stamp``); a runner that read block ids before its step
    is applied would find the blocks' old places. The output that planned the step also
    carries its events: if the scheduler's call has not arrived yet, the step is applied
    here, in this thread, through the service's own checks
    (``ServerHandle.apply_planned_step``), and the call finds it applied. Otherwise (an
    output that repeats an earlier step, or one the service refuses to apply for now) it
    waits for the call. Call it before taking ``kv_lock`` (applying the step may need the
    lock to move KV data). An unstamped output waits for nothing, nor does one planned
    before the epoch's first step (seq 0, no events: a ``schedule()`` that changed no
    block, as a decode instance's with only loads pending may be).

    Returns:
        ``(epoch, seq)`` of the step waited for; None for an unstamped output.

    Raises:
        EpochMismatch, EngineUnhealthy, ServiceUnavailable: As
            ``ServerHandle.wait_applied`` (the step will not be applied here).
        InvalidArgument, MessageTooLarge: The service refused the step's events (so will
            the scheduler's call).
    """
    stamp = read_step_stamp(output)
    if stamp is None:
        return None
    epoch, seq = stamp.for_rank(rank)
    if seq == 0 and stamp.events is None:
        # Planned before the epoch's first step: nothing to wait for (the pass checks the
        # epoch holding kv_lock).
        return epoch, seq
    if stamp.events is not None:
        try:
            service.apply_planned_step(epoch, seq, stamp.events)
            return epoch, seq
        except _LEFT_TO_THE_CALL:
            pass
    service.wait_applied(epoch, seq, timeout_s)
    return epoch, seq


class PassTarget(Protocol):
    """What readies a runner for a pass: on vLLM's runners the rows and the output turn
    physical; on vllm-gaudi's the switch answers the runner's resolves."""

    def begin(self, output: Any) -> None:
        """Called holding ``kv_lock`` once the output's step is applied; ``output`` is
        None for a call outside any scheduled step (dummy batch, warm-up)."""

    def end(self) -> None:
        """Called before ``kv_lock`` is released."""


class RunnerPass:
    """Owns one rank's passes: the wait for the planned step, ``kv_lock`` and the target.

    Args:
        service: The rank's service.
        rank: The worker's global rank (which stamp of the output is its own).
        step_wait_s: How long a pass waits for its step to be applied.
        target: What readies the runner.

    Attributes:
        num_passes: Passes begun for scheduled steps.
        num_idle: Calls run outside any scheduled step (dummy batches, warm-ups).
        num_unclosed: Passes closed because their ``sample_tokens`` never came.
    """

    def __init__(self, service: StepService, rank: int, step_wait_s: float, target: PassTarget):
        self._service = service
        self._rank = rank
        self._step_wait_s = step_wait_s
        self._target = target
        self._lock = service.kv_lock
        self._is_open = False
        self._is_idle = False  # an idle call holds the lock; calls inside it run in it
        self._epoch = 0  # the epoch of the last pass run (0: none yet)
        self.num_passes = 0
        self.num_idle = 0
        self.num_unclosed = 0

    @property
    def is_open(self) -> bool:
        """Whether a pass holds ``kv_lock`` now (between the two halves of a step)."""
        return self._is_open

    def execute_model(self, output: Any, run: Callable[[], _T]) -> _T:
        """Waits for ``output``'s step, begins the pass and runs the runner's first half.

        The pass stays open (``kv_lock`` held) when ``run`` returns None: the step's
        ``sample_tokens`` closes it. Otherwise, or when ``run`` raises, it closes here.

        Raises:
            EpochMismatch, EngineUnhealthy, ServiceUnavailable: As
                ``ServerHandle.wait_applied`` (the step will not be applied here).
            EpochMismatch: The service was reset after the step was found applied; the
                runner did not run.
        """
        if self._is_idle:  # a warm-up stepping the runner through the worker
            self._target.begin(output)
            return run()
        if self._is_open:
            self.num_unclosed += 1
            logger.warning(
                "kvdefrag: rank %d's previous step never called sample_tokens; its pass "
                "is closed now",
                self._rank,
            )
            self._close()
        step = wait_for_planned_step(self._service, self._rank, output, self._step_wait_s)
        self._open(output, step)
        self.num_passes += 1
        try:
            result = run()
        except BaseException:
            self._close()
            raise
        if result is not None:
            self._close()
        return result

    def sample_tokens(self, run: Callable[[], _T]) -> _T:
        """Runs the runner's second half inside the open pass, then closes it.

        With no pass open (``execute_model`` returned its output, as a step without
        tokens does) it runs ``run`` as it is: the runner has nothing pending and reads
        no block. A pipeline stage but the last returns None from ``execute_model``
        once it sent its intermediate tensors (vLLM 0.33 ``v1/worker/gpu_worker.py``),
        so its pass stays open until this call, as the last stage's does.
        """
        if not self._is_open or self._is_idle:
            return run()
        try:
            return run()
        finally:
            self._close()

    def idle(self, run: Callable[[], _T]) -> _T:
        """Runs a call outside any scheduled step (a dummy batch, a warm-up) holding
        ``kv_lock``, the target begun with no output: the runner reads the mapping as it
        is, and nothing moves meanwhile. Inside another idle call it runs in that one.

        Raises:
            PassRefused: Called between a step's ``execute_model`` and its
                ``sample_tokens``.
            EpochMismatch: The service was reset since the rank's last pass; ``run`` did
                not run.
        """
        if self._is_idle:
            return run()
        if self._is_open:
            raise PassRefused(
                f"kvdefrag: rank {self._rank} was asked to run a dummy batch or a warm-up "
                "between a step's execute_model and its sample_tokens"
            )
        self._open(None, None)
        self._is_idle = True
        self.num_idle += 1
        try:
            return run()
        finally:
            self._is_idle = False
            self._close()

    def _open(self, output: Any, step: tuple[int, int] | None) -> None:
        self._lock.acquire()
        self._is_open = True
        try:
            self._check_mapping(step)
            self._target.begin(output)
        except BaseException:
            self._is_open = False
            self._lock.release()
            raise

    def _check_mapping(self, step: tuple[int, int] | None) -> None:
        """Refuses to run on a mapping other than the one ``step`` left (or, outside any
        step, other than the last pass's epoch); call it holding ``kv_lock``.

        Raises:
            EpochMismatch: The service is at another epoch, or ``step`` is not applied.
        """
        current_epoch, next_seq = self._service.applied
        if step is None:
            if self._epoch and current_epoch != self._epoch:
                raise EpochMismatch(
                    f"rank {self._rank}: a call outside any step (a dummy batch, a "
                    f"warm-up) finds the service at epoch {current_epoch}, not at epoch "
                    f"{self._epoch} its rows follow (it was reset); nothing ran; restart vLLM"
                )
            return
        epoch, seq = step
        if current_epoch != epoch or next_seq <= seq:
            raise EpochMismatch(
                f"rank {self._rank}: the pass for step seq {seq} of epoch {epoch} finds the "
                f"service at epoch {current_epoch} (next seq {next_seq}): it was reset after "
                "the step was applied, so the block ids no longer name where the KV data "
                "is; nothing ran; restart vLLM"
            )
        self._epoch = epoch

    def _close(self) -> None:
        try:
            self._target.end()
        finally:
            self._is_open = False
            self._lock.release()


def guard_runner(worker: Any, step: RunnerPass) -> None:
    """Makes the model runner refuse a step run outside the worker's pass.

    NOTE: an executor that calls the runner directly, not the worker (vLLM 0.32's legacy
    Ray executor does, ``v1/executor/ray_utils.py``), would run forward passes
    without the wait, ``kv_lock`` and the translation: it would read moved blocks at their
    old places and generate wrong tokens without an error. The executors kvdefrag knows of
    are served or refused from the configuration before the model loads
    (``check_engine_config``); this stops any other one at its first step instead.
    """
    runner = getattr(worker, "model_runner", None)
    run = getattr(runner, "execute_model", None)
    if runner is None or runner is worker or not callable(run):
        return
    rank = int(worker.rank)

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        if not step.is_open:
            raise UnsupportedByKvdefrag(
                f"kvdefrag: rank {rank}'s model runner was asked to run a step outside the "
                "worker's execute_model: this executor calls the runner directly, so the "
                "step would read KV blocks where they no longer are. Use vLLM's mp or ray "
                "(RayExecutorV2) executor, which call the worker, or drop kvdefrag."
            )
        return run(*args, **kwargs)

    runner.execute_model = execute_model
