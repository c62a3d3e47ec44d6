"""A model of vLLM 0.33's data-parallel engine core loop, its workers each on a thread.

Modelled on vLLM 0.33's ``vllm/v1/engine/core.py`` (``core.py:N`` below):

* ``DPEngineCoreProc.run_busy_loop`` (core.py:2465-2509): each turn takes in new requests
  and aborts, steps the engine core, and when the step executed nothing
  (``_process_engine_step`` returns False) while this engine or another DP engine still
  has requests, runs ``execute_dummy_batch`` on every worker (core.py:2498-2507), so
  that its collectives meet the other engines' forward pass. Here another DP engine is
  taken to be running throughout: every step that executes nothing gets a dummy batch.
* ``step_with_batch_queue`` (core.py:708-822; async scheduling, a queue of two): the
  next output is scheduled and sent (``execute_model``, then ``sample_tokens`` when
  tokens were scheduled, both ``non_block``) before the oldest one's result is waited
  for; the step counts as executed only when it scheduled tokens (core.py:740-741). An
  output that schedules nothing still goes to the workers' ``execute_model``.
* ``step`` (core.py:667-698; sync scheduling): schedule, ``execute_model``,
  ``sample_tokens`` when that returned None, ``update_from_output``.

The executor sends each call to every worker, in order, and each worker runs its calls
on its own thread (vLLM's workers run in their own processes, reading one call queue):
so step ``N`` runs on the workers while the loop schedules ``N + 1``, and kvdefrag's
step for ``N + 1`` is applied by the rank services meanwhile. Each worker gets its own
copy of every output, taken when it is sent (the executor pickles it then).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from support.vllm_harness import BLOCK_SIZE, Workload


@dataclasses.dataclass
class LoopCounts:
    """What one run of the loop did.

    Attributes:
        num_steps: Loop turns.
        num_empty_steps: Outputs that scheduled nothing while the engine had requests
            running (``Scheduler.running`` not empty).
        num_dummy_batches: ``execute_dummy_batch`` calls (on every worker each).
    """

    num_steps: int = 0
    num_empty_steps: int = 0
    num_dummy_batches: int = 0


class _Executor:
    """vLLM's executor over the workers: one thread per worker, calls in order."""

    def __init__(self, workers: Sequence[Any]) -> None:
        self.workers = list(workers)
        self._threads = [ThreadPoolExecutor(max_workers=1) for _ in self.workers]

    def send(self, call: Callable[[int, Any], Any]) -> list[Future[Any]]:
        """``call(rank, worker)`` queued on every worker's thread; a future per worker."""
        return [
            thread.submit(call, rank, worker)
            for rank, (thread, worker) in enumerate(zip(self._threads, self.workers, strict=True))
        ]

    def close(self) -> None:
        for thread in self._threads:
            thread.shutdown(wait=True)


def _first_result(futures: list[Future[Any]]) -> Any:
    """Every worker's result waited for (an error raised); the first one returned."""
    results = [future.result(timeout=60) for future in futures]
    return results[0]


def run_dp_engine_loop(
    scheduler: Scheduler,
    workers: Sequence[Any],
    workload: Workload,
    *,
    is_async: bool,
    abort_every: int = 0,
    max_steps: int = 2000,
) -> LoopCounts:
    """Runs ``workload`` through ``scheduler`` and ``workers`` as a DP engine core does
    (module docstring) until every request is done; returns what the loop counted.

    Workers are called as vLLM's executor calls vllm-gaudi's ``HPUWorker``:
    ``execute_model(output)``, ``sample_tokens(grammar_output)``,
    ``execute_dummy_batch()``."""
    executor = _Executor(workers)
    counts = LoopCounts()
    pending = list(workload.requests(BLOCK_SIZE))
    rng = random.Random(workload.seed + 1)
    queue: collections.deque[tuple[list[Future[Any]], SchedulerOutput]] = collections.deque()
    queue_size = 2 if is_async else 1

    def send_step(output: SchedulerOutput) -> tuple[list[Future[Any]], bool]:
        executed = output.total_num_scheduled_tokens > 0
        if not executed and scheduler.running:
            counts.num_empty_steps += 1
        sent = [copy.deepcopy(output) for _ in workers]
        executions = executor.send(lambda rank, worker: worker.execute_model(sent[rank]))
        if not executed:
            return executions, executed
        if is_async:
            return executor.send(lambda _, worker: worker.sample_tokens(None)), executed
        result = _first_result(executions)
        if result is None:
            result_futures = executor.send(lambda _, worker: worker.sample_tokens(None))
            return result_futures, executed
        return executions, executed

    def step_with_batch_queue() -> bool:
        """core.py:708-822 (and, with a queue of one, ``step``, core.py:667-698)."""
        executed = False
        if scheduler.has_requests():
            output = scheduler.schedule()
            futures, executed = send_step(output)
            queue.appendleft((futures, output))
            if len(queue) < queue_size and (executed or scheduler.has_requests()):
                return executed
        elif not queue:
            return False
        futures, output = queue.pop()
        model_output = _first_result(futures)
        assert model_output is not None, "sample_tokens returned None for a scheduled step"
        scheduler.update_from_output(output, model_output)
        return executed

    try:
        while (pending or scheduler.has_requests() or queue) and counts.num_steps < max_steps:
            counts.num_steps += 1
            for _ in range(rng.randrange(0, 4)):  # _process_input_queue: new requests
                if pending and not scheduler.has_request(pending[0].request_id):
                    scheduler.add_request(pending.pop(0))
            if abort_every and counts.num_steps % abort_every == 0 and scheduler.requests:
                victim = sorted(scheduler.requests)[rng.randrange(len(scheduler.requests))]
                scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            if not step_with_batch_queue():
                # core.py:2498-2507: another DP engine runs, so this one runs a dummy.
                counts.num_dummy_batches += 1
                _first_result(executor.send(lambda _, worker: worker.execute_dummy_batch()))
    finally:
        executor.close()
    return counts
