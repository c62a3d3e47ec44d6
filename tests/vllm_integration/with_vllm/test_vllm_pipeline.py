"""Pipeline parallelism: vLLM 0.33's real Scheduler/AsyncScheduler with 2 to 5 batches in
flight, one rank service and one signed stand-in runner per stage.

Each stage's worker is ``DefragWorkerMixin`` (its real pass: the wait for the stamped
step, ``kv_lock`` from ``execute_model`` to ``sample_tokens``, the translation, the V2
table following moves) in front of a runner that keeps its own KV tensor and signs every
token it writes with a salt of its own stage. Stages run each batch in order, stage
``s + 1`` only after stage ``s``, at random distances behind each other
(``support.vllm_pipeline.run_pipeline``, modelled on ``EngineCore.step_with_batch_queue``),
while every rank's service applies each step as soon as it arrives: a stage regularly runs
batch ``N`` after the steps planned with ``N + 1`` and later were applied on it.

The reference is plain vLLM: every token a stage reads must carry the signature its
request's tokens give it at that stage, as it does without kvdefrag
(``test_plain_vllm_pipelines_read_every_signature``). The sabotages show the block-free
fence is what keeps it so: without it, or released one batch early, reads corrupt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.config import ParallelConfig
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvdefrag.vllm._scheduler.ledger import DEFERRED_PREFIX
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

from support.vllm_harness import Workload, make_scheduler, spy_preemptions
from support.vllm_pipeline import PipelineTotals, StageWorker, run_pipeline, serve_stages

NUM_REQUESTS = 60
NUM_BLOCKS = 64  # small: every run preempts


def _run(
    cls: type[Scheduler],
    model_dir: str,
    served: list[Any],
    *,
    prefix_caching: bool,
    seed: int = 1,
    abort_every: int = 23,
    last_stage_lags: bool = False,
    sabotage: Any = None,
) -> tuple[Scheduler, list[StageWorker], list[str], PipelineTotals]:
    """Runs ``cls`` on ``len(served)`` stages with the V2 runner selected (vLLM 0.33
    runs async scheduling under PP only on it); ``sabotage(scheduler)`` runs before the
    first step."""
    num_stages = len(served)
    is_async = issubclass(cls, AsyncScheduler)
    scheduler = make_scheduler(
        cls,
        model_dir,
        num_blocks=NUM_BLOCKS,
        prefix_caching=prefix_caching,
        async_scheduling=is_async,
        v2=True,
        parallel_config=ParallelConfig(pipeline_parallel_size=num_stages),
    )
    if sabotage is not None:
        sabotage(scheduler)
    preempted = spy_preemptions(scheduler)
    is_defrag = isinstance(scheduler, DefragScheduler)
    workers = [
        StageWorker(
            kv,
            scheduler.vllm_config,
            stage,
            handle if is_defrag else None,
            NUM_BLOCKS,
        )
        for stage, (handle, kv) in enumerate(served)
    ]
    depth = int(scheduler.vllm_config.max_concurrent_batches)
    totals = run_pipeline(
        scheduler,
        workers,
        Workload(seed=seed, num_requests=NUM_REQUESTS),
        depth=depth,
        seed=seed,
        abort_every=abort_every,
        last_stage_lags=last_stage_lags,
    )
    if is_defrag:
        scheduler.kvdefrag.settle()
        scheduler.kvdefrag.ranks.close()
    return scheduler, workers, preempted, totals


def _assert_reads_every_signature(
    scheduler: Scheduler, workers: list[StageWorker], preempted: list[str], totals: PipelineTotals
) -> None:
    assert not scheduler.has_requests(), f"unfinished after {totals.num_steps} steps"
    depth = int(scheduler.vllm_config.max_concurrent_batches)
    assert totals.max_in_flight == depth
    assert totals.max_stage_spread >= 2, "the stages never ran two batches apart"
    assert preempted, "the workload never preempted"
    assert totals.num_aborted > 0
    for worker in workers:
        assert worker.num_checked > 5_000
        assert worker.num_corrupted == 0, (
            f"stage {worker.stage}: {worker.num_corrupted} of {worker.num_checked} reads corrupted"
        )


SCHEDULES = {"random": False, "last-stage-lags": True}
"""How far the stages run apart: at random within vLLM's rules, or the last stage as far
behind as the batch queue allows (the others run each batch as soon as it is sent)."""

PIPELINES = [
    pytest.param(
        num_stages, mode, prefix_caching, schedule, id=f"pp{num_stages}-{mode}-{prefix}-{schedule}"
    )
    for num_stages in (2, 3, 4)
    for mode in ("sync", "async")
    for prefix_caching, prefix in ((False, "noprefix"), (True, "prefix"))
    for schedule in SCHEDULES
]


@contextlib.contextmanager
def _stages(run_dir: str, num_stages: int) -> Iterator[list[Any]]:
    """Fresh services for ``num_stages`` stages, stopped after."""
    served = serve_stages(run_dir, NUM_BLOCKS, num_stages)
    try:
        yield next(served)
    finally:
        next(served, None)


@pytest.mark.parametrize(("num_stages", "mode", "prefix_caching", "schedule"), PIPELINES)
def test_every_stage_reads_every_signature(
    model_dir: str,
    run_dir: str,
    num_stages: int,
    mode: str,
    prefix_caching: bool,
    schedule: str,
) -> None:
    cls = DefragAsyncScheduler if mode == "async" else DefragScheduler
    with _stages(run_dir, num_stages) as served:
        scheduler, workers, preempted, totals = _run(
            cls,
            model_dir,
            served,
            prefix_caching=prefix_caching,
            seed=num_stages,
            last_stage_lags=SCHEDULES[schedule],
        )
        _assert_reads_every_signature(scheduler, workers, preempted, totals)
        assert scheduler.defer_block_free  # the fence, under sync scheduling too
        if mode == "sync":  # decodes wait for their output: batches without tokens come
            assert totals.num_empty_batches > 0
        # NOTE: no request holds a block; a list parked by the fence may still be held
        # (returned after the last schedule, the ledger learns it at the next one).
        assert all(name.startswith(DEFERRED_PREFIX) for name in scheduler.kvdefrag.ledger.held)
        assert scheduler.kvdefrag.totals.num_audits == scheduler._kvdefrag_num_schedules
        stats = [handle.stats() for handle, _ in served]
        assert stats[0].totals.num_moves > 0, "the workload never made kvdefrag move a block"
        assert all(stat == stats[0] for stat in stats), "the stages applied different steps"
        for worker in workers:
            step = worker.kvdefrag_pass
            assert step is not None
            assert not step.is_open and step.num_unclosed == 0
            assert step.num_passes == totals.num_batches
            assert worker.num_forwards == totals.num_batches - totals.num_empty_batches
            assert not worker.kvdefrag_handle.kv_lock.locked()  # type: ignore[union-attr]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize(
    ("num_stages", "mode"), [(2, "sync"), (4, "sync"), (2, "async"), (4, "async")]
)
def test_plain_vllm_pipelines_read_every_signature(
    model_dir: str, run_dir: str, num_stages: int, mode: str, schedule: str
) -> None:
    """The reference: vLLM's own scheduler, the stages given logical ids, no kvdefrag."""
    cls = AsyncScheduler if mode == "async" else Scheduler
    with _stages(run_dir, num_stages) as served:
        scheduler, workers, preempted, totals = _run(
            cls,
            model_dir,
            served,
            prefix_caching=True,
            seed=num_stages,
            last_stage_lags=SCHEDULES[schedule],
        )
        _assert_reads_every_signature(scheduler, workers, preempted, totals)


def _without_the_fence(scheduler: Scheduler) -> None:
    scheduler.defer_block_free = False


def _fence_for_one_batch_in_flight(scheduler: Scheduler) -> None:
    """vLLM's fence, but a parked list returns as if one batch only were in flight: once
    the batch ``depth - 1`` before its fence was processed."""
    original = scheduler._drain_deferred_frees
    shortfall = int(scheduler.vllm_config.max_concurrent_batches) - 1

    def drain() -> None:
        scheduler.processed_step_seq += shortfall
        try:
            original()
        finally:
            scheduler.processed_step_seq -= shortfall

    scheduler._drain_deferred_frees = drain  # type: ignore[method-assign]


SABOTAGES = [
    pytest.param(DefragScheduler, 3, _without_the_fence, id="pp3-sync-no-fence"),
    pytest.param(DefragScheduler, 3, _fence_for_one_batch_in_flight, id="pp3-sync-short-fence"),
    pytest.param(
        DefragAsyncScheduler, 2, _fence_for_one_batch_in_flight, id="pp2-async-short-fence"
    ),
]


@pytest.mark.parametrize(("cls", "num_stages", "sabotage"), SABOTAGES)
def test_sabotage_a_missing_or_short_fence_corrupts_the_lagging_stage(
    model_dir: str, run_dir: str, cls: type[Scheduler], num_stages: int, sabotage: Any
) -> None:
    with _stages(run_dir, num_stages) as served:
        _, workers, _, _ = _run(
            cls,
            model_dir,
            served,
            prefix_caching=False,
            seed=1,
            abort_every=7,
            last_stage_lags=True,
            sabotage=sabotage,
        )
    last = workers[-1]
    assert last.num_corrupted > 0, "the sabotaged fence never corrupted a read"
    assert all(worker.num_checked > 5_000 for worker in workers)
