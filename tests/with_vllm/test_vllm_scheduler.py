"""kvdefrag's DefragScheduler inside vLLM 0.33's real Scheduler, proven by signatures.

Real rank services on unix sockets, tiny int64 KV caches; the simulated worker keeps its
rows the way vLLM's V1 runner does from the rewritten outputs, and every read of a computed
token (and of every block vLLM keeps in its prefix cache) must find its own signature.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvdefrag.client.vllm import _bridge, _ledger
from kvdefrag.client.vllm.scheduler import DefragScheduler, UnsupportedByKvdefrag
from kvdefrag.client.vllm.topology import RUN_DIR_ENV, rank_address

from support.vllm_harness import SignedWorker, Workload, make_scheduler, run_loop, serve_rank

NUM_BLOCKS = 96  # small: preemption happens


@pytest.fixture
def run_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, os.fspath(folder))
    return os.fspath(folder)


class TwoRankScheduler(DefragScheduler):
    """Two ranks (as under TP=2) without a TP=2 config on a CPU-only machine."""

    def kvdefrag_addresses(self) -> list[str]:
        return [rank_address(os.environ[RUN_DIR_ENV], rank) for rank in range(2)]


@pytest.fixture
def ranks(run_dir: str) -> Iterator[list[Any]]:
    served = [serve_rank(f"{run_dir}/rank{rank}.sock", NUM_BLOCKS) for rank in range(2)]
    yield served
    for handle, _ in served:
        handle.stop(grace_s=0.5)


def _run(
    cls: type[Scheduler],
    model_dir: str,
    ranks: list[Any],
    *,
    prefix_caching: bool,
    seed: int = 1,
    num_requests: int = 80,
    **loop: Any,
) -> tuple[Scheduler, list[SignedWorker], int]:
    scheduler = make_scheduler(cls, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=prefix_caching)
    is_defrag = isinstance(scheduler, DefragScheduler)
    num_ranks = len(scheduler.kvdefrag.ranks.clients) if is_defrag else 1
    workers = [SignedWorker(kv) for _, kv in ranks[:num_ranks]]
    resolve = scheduler.kvdefrag.ranks.primary.resolve if is_defrag else (lambda ids: list(ids))
    steps = run_loop(
        scheduler,
        workers,
        Workload(seed=seed, num_requests=num_requests),
        resolve=resolve,
        **loop,
    )
    if is_defrag:
        scheduler.kvdefrag.ranks.close()
    return scheduler, workers, steps


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_read_finds_its_signature_with_two_ranks(
    model_dir: str, ranks: list[Any], prefix_caching: bool
) -> None:
    scheduler, workers, steps = _run(
        TwoRankScheduler, model_dir, ranks, prefix_caching=prefix_caching, abort_every=37
    )
    totals = scheduler.kvdefrag.totals
    assert not scheduler.has_requests(), f"unfinished after {steps} steps"
    assert scheduler.kvdefrag.ledger.held == {}
    stats = [handle.engine.stats() for handle, _ in ranks]
    assert stats[0].totals.num_moves > 0, "the workload never made kvdefrag move a block"
    assert stats[0] == stats[1]
    assert totals.num_rows_resent > 0
    for worker in workers:
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


def test_preemption_happens_in_the_small_pool(model_dir: str, ranks: list[Any]) -> None:
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
    )
    preempted: list[str] = []
    original = scheduler._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append(request.request_id)
        original(request, *args, **kwargs)

    scheduler._preempt_request = spy  # type: ignore[method-assign]
    workers = [SignedWorker(kv) for _, kv in ranks]
    run_loop(
        scheduler,
        workers,
        Workload(seed=3, num_requests=80),
        resolve=scheduler.kvdefrag.ranks.primary.resolve,
    )
    scheduler.kvdefrag.ranks.close()
    assert len(preempted) >= 3
    assert scheduler.kvdefrag.totals.num_preempted == len(preempted)
    assert all(worker.num_corrupted == 0 for worker in workers)


def test_reset_prefix_cache_and_aborts(model_dir: str, ranks: list[Any]) -> None:
    scheduler, workers, _ = _run(
        TwoRankScheduler,
        model_dir,
        ranks,
        prefix_caching=True,
        seed=5,
        abort_every=11,
        reset_prefix_cache_every=23,
    )
    assert all(worker.num_corrupted == 0 for worker in workers)
    # every cached free block the engines keep is one vLLM still hashes
    pool = scheduler.kv_cache_manager.block_pool.blocks
    for block_id in scheduler.kvdefrag.ledger.cached_free:
        assert pool[block_id].block_hash is not None


def test_without_kvdefrag_the_harness_sees_no_corruption(model_dir: str, ranks: list[Any]) -> None:
    _, workers, _ = _run(Scheduler, model_dir, ranks, prefix_caching=True)
    assert workers[0].num_checked > 10_000
    assert workers[0].num_corrupted == 0


def test_rows_not_resent_after_a_move_corrupt(
    model_dir: str, ranks: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ledger.WorkerRows, "mark_moved", lambda *args, **kwargs: None)
    _, workers, _ = _run(TwoRankScheduler, model_dir, ranks, prefix_caching=False)
    assert workers[0].num_corrupted > 0


def test_a_worker_given_logical_ids_corrupts(
    model_dir: str, ranks: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_bridge.SchedulerBridge, "_rewrite", lambda self, output: None)
    _, workers, _ = _run(TwoRankScheduler, model_dir, ranks, prefix_caching=True)
    assert workers[0].num_corrupted > 0


def test_async_scheduling_is_refused_by_name(model_dir: str, ranks: list[Any]) -> None:
    scheduler = make_scheduler(Scheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False)
    scheduler.vllm_config.scheduler_config.async_scheduling = True
    from kvdefrag.client.vllm.scheduler import check_supported

    with pytest.raises(UnsupportedByKvdefrag, match="async scheduling"):
        check_supported(scheduler.vllm_config, scheduler.kv_cache_config)
