"""kvdefrag with vLLM 0.33's V2 model runner: the workers translate, the table follows moves.

The real ``Scheduler``/``AsyncScheduler`` with the V2 runner selected (``make_scheduler(...,
v2=True)``: resumed requests come as new ones, with every token), real rank services, and
``V2SignedWorker``: ``DefragWorkerMixin`` in front of a simulated V2 runner whose block
table is a torch int32 tensor where vLLM's ``BlockTables`` keeps it. Every read of a
computed token, and of every block vLLM keeps in its prefix cache, must find its own
signature. Runs preempt (a 96-block pool) except async ones with prefix caching on, which,
as the V1 ones, use a pool where nothing is preempted (``ASYNC_NUM_BLOCKS``). Simulated on
CPU: never run on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvdefrag.vllm import worker as vllm_worker
from kvdefrag.vllm.scheduler import DefragScheduler

from support.vllm_harness import (
    ASYNC_NUM_BLOCKS,
    NUM_BLOCKS,
    TwoRankAsyncScheduler,
    TwoRankScheduler,
    V2SignedWorker,
    Workload,
    make_scheduler,
    run_loop,
    spy_preemptions,
)


def _run_v2(
    cls: type[Scheduler],
    model_dir: str,
    ranks: list[Any],
    *,
    prefix_caching: bool,
    num_blocks: int = NUM_BLOCKS,
    seed: int = 1,
    num_requests: int = 80,
    **loop: Any,
) -> tuple[Scheduler, list[V2SignedWorker], list[str], int]:
    """Runs ``cls`` with the V2 runner selected; returns the preempted request ids too."""
    is_async = issubclass(cls, AsyncScheduler)
    scheduler = make_scheduler(
        cls,
        model_dir,
        num_blocks=num_blocks,
        prefix_caching=prefix_caching,
        async_scheduling=is_async,
        v2=True,
    )
    assert scheduler.use_v2_model_runner
    preempted = spy_preemptions(scheduler)
    is_defrag = isinstance(scheduler, DefragScheduler)
    num_ranks = len(scheduler.kvdefrag.ranks.clients) if is_defrag else 1
    workers = [
        V2SignedWorker(
            kv, scheduler.vllm_config, handle if is_defrag else None, num_blocks, rank=rank
        )
        for rank, (handle, kv) in enumerate(ranks[:num_ranks])
    ]
    resolve = ranks[0][0].resolve if is_defrag else (lambda ids: list(ids))
    steps = run_loop(
        scheduler,
        workers,  # type: ignore[arg-type]
        Workload(seed=seed, num_requests=num_requests),
        resolve=resolve,
        in_flight=2 if is_async else 1,
        snapshot_outputs=True,
        **loop,
    )
    if is_defrag:
        scheduler.kvdefrag.ranks.close()
    return scheduler, workers, preempted, steps


def _served(
    request: pytest.FixtureRequest, cls: type[Scheduler], prefix_caching: bool
) -> tuple[list[Any], int]:
    """The ranks for ``cls``: async classes with prefix caching run on the pool where
    nothing is preempted (see ``ASYNC_NUM_BLOCKS``)."""
    if issubclass(cls, AsyncScheduler) and prefix_caching:
        return request.getfixturevalue("async_ranks"), ASYNC_NUM_BLOCKS
    return request.getfixturevalue("ranks"), NUM_BLOCKS


@pytest.mark.parametrize("cls", [Scheduler, AsyncScheduler])
def test_without_kvdefrag_the_v2_harness_sees_no_corruption(
    model_dir: str, request: pytest.FixtureRequest, cls: type[Scheduler]
) -> None:
    ranks, num_blocks = _served(request, cls, prefix_caching=True)
    _, workers, preempted, _ = _run_v2(
        cls, model_dir, ranks, prefix_caching=True, num_blocks=num_blocks
    )
    if cls is Scheduler:
        assert len(preempted) >= 3  # resumed requests came back as new ones
    assert workers[0].num_checked > 10_000
    assert workers[0].num_corrupted == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("cls", [TwoRankScheduler, TwoRankAsyncScheduler])
def test_v2_runner_workers_read_every_signature(
    model_dir: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[Scheduler],
    prefix_caching: bool,
) -> None:
    ranks, num_blocks = _served(request, cls, prefix_caching)
    is_async = cls is TwoRankAsyncScheduler
    num_remaps = [0]
    original = vllm_worker.remap_v2_runner_rows

    def counting_remap(model_runner: Any, remap: Any) -> None:
        num_remaps[0] += 1
        original(model_runner, remap)

    monkeypatch.setattr(vllm_worker, "remap_v2_runner_rows", counting_remap)
    scheduler, workers, preempted, steps = _run_v2(
        cls,
        model_dir,
        ranks,
        prefix_caching=prefix_caching,
        num_blocks=num_blocks,
        abort_every=37,
        reset_prefix_cache_every=53 if prefix_caching and is_async else 0,
    )
    assert not scheduler.has_requests(), f"unfinished after {steps} steps"
    stats = [handle.stats() for handle, _ in ranks]
    assert stats[0].totals.num_moves > 0, "the workload never made kvdefrag move a block"
    assert stats[0] == stats[1]
    assert num_remaps[0] > 0, "no table ever followed a move"
    assert scheduler.kvdefrag.totals.num_audits == scheduler._kvdefrag_num_schedules > 100
    if num_blocks == NUM_BLOCKS:
        assert len(preempted) >= 3  # resumed requests came back as new ones, with their rows
        assert scheduler.kvdefrag.totals.num_preempted == len(preempted)
    for worker in workers:
        assert worker.kvdefrag_is_v2_runner
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


@pytest.mark.parametrize("cls", [TwoRankScheduler, TwoRankAsyncScheduler])
def test_v2_tables_that_do_not_follow_moves_corrupt(
    model_dir: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[Scheduler],
) -> None:
    ranks, num_blocks = _served(request, cls, prefix_caching=False)
    monkeypatch.setattr(vllm_worker, "remap_v2_runner_rows", lambda model_runner, remap: None)
    _, workers, _, _ = _run_v2(cls, model_dir, ranks, prefix_caching=False, num_blocks=num_blocks)
    assert workers[0].num_corrupted > 0


def test_a_v2_worker_given_logical_ids_corrupts(
    model_dir: str, ranks: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output stays logical under the V2 runner: a worker that does not translate it
    (and so never follows moves) reads blocks at their old places."""
    # NOTE: the pass still waits for the step and holds kv_lock; only the runner's
    # readying (rows and output turned physical) is left out.
    monkeypatch.setattr(vllm_worker._RowsTarget, "begin", lambda target, output: None)
    _, workers, _, _ = _run_v2(TwoRankScheduler, model_dir, ranks, prefix_caching=True)
    assert workers[0].kvdefrag_handle is not None  # kv_lock still held, ids never translated
    assert workers[0].num_corrupted > 0
