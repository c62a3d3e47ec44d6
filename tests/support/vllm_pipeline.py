"""Pipeline parallelism with vLLM 0.33's real scheduler: one signed stand-in runner per stage,
driven as ``EngineCore.step_with_batch_queue`` drives the workers.

Under PP vLLM keeps several batches in flight (``VllmConfig.max_concurrent_batches``,
``vllm/config/vllm.py:588-598``: ``pp_size`` batches, ``pp_size + 1`` with async
scheduling on the V2 runner). Every rank gets every ``execute_model`` and
``sample_tokens`` in order; stage ``s + 1`` runs batch ``N`` only once stage ``s`` sent
it its intermediate tensors (``v1/worker/gpu_worker.py:1346-1392``), and the engine core
sees a batch's output once the last stage returned it
(``v1/executor/multiproc_executor.py:649-663``, ``output_rank``). So earlier stages run
ahead of later ones by any number of batches up to the queue's depth. ``run_pipeline``
draws, at random, how far each stage has got within those rules.

``StageWorker`` is ``DefragWorkerMixin`` (the real pass, wait, lock and translation) in
front of ``StageRunner``, vLLM's V2 runner's rows (``V2SignedRunner``) on the stage's own
KV tensor, signing each token with a salt of its own (another stage's layers hold other
data). Like vLLM's GPU worker under PP, ``execute_model`` runs the stage's forward and
returns None for a step with tokens (a non-last stage sends its intermediate tensors;
the V2 runner's last stage samples later); ``sample_tokens`` returns the output, the
last stage's being the step's. A step without tokens returns its output from
``execute_model`` (``v1/worker/gpu/model_runner.py``: ``kv_connector.no_forward``) and
gets no ``sample_tokens`` (``v1/engine/core.py:737-755``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvdefrag.server import ServerHandle
from kvdefrag.vllm._discovery import PublishedRank, publish_ranks, rank_address
from kvdefrag.vllm.worker import DefragWorkerMixin

from support.vllm_harness import (
    BLOCK_SIZE,
    V2SignedRunner,
    Workload,
    harness_engine_id,
    runner_output,
    serve_rank,
)

_SALT = 0x2545F4914F6CDD1D  # odd; stage s writes signature ^ (s * _SALT masked)
_MASK = (1 << 62) - 1


def serve_stages(run_dir: str, num_blocks: int, num_stages: int) -> Iterator[list[Any]]:
    """One rank's service per stage in ``run_dir``, published as DefragWorker's rank 0
    publishes them (a fixture's body: stops them after). Each binds its own KV tensor."""
    secrets = [os.urandom(32) for _ in range(num_stages)]
    served = [
        serve_rank(f"{run_dir}/rank{rank}.sock", num_blocks, secrets[rank])
        for rank in range(num_stages)
    ]
    publish_ranks(
        run_dir,
        [PublishedRank(rank_address(run_dir, rank), secrets[rank]) for rank in range(num_stages)],
        engine_id=harness_engine_id(),
    )
    yield served
    for handle, _ in served:
        handle.stop(grace_s=0.5)


class StageRunner(V2SignedRunner):
    """One pipeline stage's runner: the V2 runner's rows, this stage's KV tensor and salt."""

    def __init__(self, kv: torch.Tensor, max_num_reqs: int, stage: int) -> None:
        super().__init__(kv, max_num_reqs=max_num_reqs)
        self.stage = stage
        self.salt = (stage * _SALT) & _MASK
        self._pending: ModelRunnerOutput | None = None
        self.num_forwards = 0

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The stage's forward: rows, then every scheduled token signed and its row read."""
        self._update_rows(output)
        if output.total_num_scheduled_tokens == 0:
            return runner_output(output, {})
        self._table_rows = self.model_runner.block_tables.block_tables[0].gpu.tolist()
        self._pending = self._forward(output)
        self.num_forwards += 1
        return None

    def sample_tokens(self, grammar_output: Any = None) -> ModelRunnerOutput:
        """The step's output (only the last stage's reaches the scheduler)."""
        pending, self._pending = self._pending, None
        assert pending is not None, "sample_tokens without a forward before it"
        return pending


class StageWorker(DefragWorkerMixin, StageRunner):
    """``DefragWorkerMixin`` in front of ``StageRunner``; without a handle it runs plain."""

    def __init__(
        self,
        kv: torch.Tensor,
        vllm_config: VllmConfig,
        stage: int,
        handle: ServerHandle | None = None,
        num_blocks: int = 0,
    ) -> None:
        super().__init__(kv, vllm_config.scheduler_config.max_num_seqs, stage)
        self.vllm_config = vllm_config
        self.rank = stage
        if handle is not None:
            self.kvdefrag_attach(handle, num_blocks)

    def rank_service(self) -> ServerHandle | None:
        return self.kvdefrag_handle


@dataclasses.dataclass
class _Batch:
    output: SchedulerOutput
    sent: list[SchedulerOutput]  # each stage's copy, taken when it was scheduled
    result: ModelRunnerOutput | None = None


@dataclasses.dataclass
class PipelineTotals:
    """What a run did: steps, batches, and how far the stages ran apart."""

    num_steps: int = 0
    num_batches: int = 0
    max_in_flight: int = 0
    max_stage_spread: int = 0  # the most batches stage 0 was ahead of the last stage
    num_aborted: int = 0
    num_empty_batches: int = 0  # batches without tokens (no forward, no sample_tokens)


def run_pipeline(
    scheduler: Scheduler,
    stages: list[StageWorker],
    workload: Workload,
    *,
    depth: int,
    seed: int,
    abort_every: int = 0,
    last_stage_lags: bool = False,
    max_steps: int = 4000,
) -> PipelineTotals:
    """Drives ``scheduler`` and one worker per stage until every request is done.

    Modelled on ``EngineCore.step_with_batch_queue`` (``vllm/v1/engine/core.py:708-822``)
    with a batch queue of ``depth``: while the queue has room and there is work it
    schedules a batch and sends it to every stage (each its own copy, as vLLM's
    executor pickles it then); once the queue is full, or nothing more can be
    scheduled, it waits for the oldest batch (the last stage's output) and calls
    ``update_from_output``. Meanwhile each stage runs its next batch at random moments,
    only after the stage before it ran that batch, and always in order; a stage runs
    ``execute_model`` and, for a batch with tokens, ``sample_tokens`` right after it
    (the engine core sends both before it schedules again). ``last_stage_lags``: the
    other stages run each batch as soon as it is scheduled and the last stage only when
    the engine core waits for it, so it runs batch ``N`` after every later step in
    flight was applied on it (the most a stage can lag).
    """
    pending = list(workload.requests(BLOCK_SIZE))
    rng = random.Random(seed)
    batches: list[_Batch] = []
    queue: deque[int] = deque()
    next_batch = [0] * len(stages)
    totals = PipelineTotals()
    last = len(stages) - 1

    def can_run(stage: int) -> bool:
        index = next_batch[stage]
        return index < len(batches) and (stage == 0 or next_batch[stage - 1] > index)

    def run(stage: int) -> None:
        index = next_batch[stage]
        batch = batches[index]
        sent = batch.sent[stage]
        worker = stages[stage]
        result = worker.execute_model(sent)
        if result is None:
            result = worker.sample_tokens(None)
        else:
            assert sent.total_num_scheduled_tokens == 0, "a forward's output came early"
        if stage == last:
            batch.result = result
        next_batch[stage] += 1
        spread = next_batch[0] - next_batch[last]
        totals.max_stage_spread = max(totals.max_stage_spread, spread)

    def wander() -> None:
        if last_stage_lags:
            for stage in range(last):
                while can_run(stage):
                    run(stage)
            return
        for _ in range(rng.randrange(0, 2 * len(stages) + 1)):
            ready = [stage for stage in range(len(stages)) if can_run(stage)]
            if not ready:
                return
            run(rng.choice(ready))

    while (pending or scheduler.has_requests() or queue) and totals.num_steps < max_steps:
        totals.num_steps += 1
        for _ in range(rng.randrange(0, 4)):
            if pending and not scheduler.has_request(pending[0].request_id):
                scheduler.add_request(pending.pop(0))
        if abort_every and totals.num_steps % abort_every == 0 and scheduler.requests:
            victim = sorted(scheduler.requests)[rng.randrange(len(scheduler.requests))]
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            totals.num_aborted += 1
        wander()
        assert len(queue) < depth
        if scheduler.has_requests():
            output = scheduler.schedule()
            batches.append(_Batch(output, [copy.deepcopy(output) for _ in stages]))
            queue.append(len(batches) - 1)
            totals.num_batches += 1
            totals.max_in_flight = max(totals.max_in_flight, len(queue))
            wander()
            has_tokens = output.total_num_scheduled_tokens > 0
            totals.num_empty_batches += not has_tokens
            if len(queue) < depth and (has_tokens or scheduler.has_requests()):
                continue
        elif not queue:
            continue
        index = queue.popleft()
        while next_batch[last] <= index:
            behind = [s for s in range(len(stages)) if next_batch[s] <= index and can_run(s)]
            run(rng.choice(behind))
        batch = batches[index]
        assert batch.result is not None
        scheduler.update_from_output(batch.output, batch.result)
        batch.sent = []  # only the stages' copies of batches in flight are kept
        wander()
    for stage in range(len(stages)):  # batches nobody waited for (none, normally)
        while can_run(stage):
            run(stage)
    return totals
