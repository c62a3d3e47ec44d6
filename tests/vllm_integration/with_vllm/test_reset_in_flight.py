"""``reset_prefix_cache(reset_running_requests=True)`` with a step in flight, under vLLM
0.33's real ``AsyncScheduler``: what vLLM's sleep path and an operator's reset call.

vLLM preempts every running request, then resets its block pool, which needs every block
but the null one free. ``DefragAsyncScheduler`` turns on the block-free fence, so the
blocks of requests whose last step is in flight are still held (parked) at that moment;
the reset must succeed all the same, as it does for vLLM's own ``AsyncScheduler``, with
every read of a row clean and the ledger equal to vLLM's after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvdefrag.vllm.scheduler import DefragScheduler

from support.vllm_harness import (
    ASYNC_NUM_BLOCKS,
    BLOCK_SIZE,
    SignedWorker,
    TwoRankAsyncScheduler,
    Workload,
    make_scheduler,
    run_loop,
    translator_for,
)

RESET_EVERY = 17
"""Steps between resets (each with a step in flight: the loop keeps a batch queue of 2)."""


def _run(
    cls: type[Scheduler], model_dir: str, ranks: list[Any] | None
) -> tuple[Any, list[Any], list[SignedWorker]]:
    """The workload under ``cls``, resetting with running requests every ``RESET_EVERY``
    steps; returns the scheduler and what each reset returned (or raised)."""
    scheduler = make_scheduler(
        cls,
        model_dir,
        num_blocks=ASYNC_NUM_BLOCKS,
        prefix_caching=True,
        async_scheduling=True,
    )
    results: list[Any] = []
    reset = scheduler.reset_prefix_cache
    in_flight: list[int] = []

    def reset_with_running_requests() -> bool:
        in_flight.append(len(scheduler.running))
        try:
            results.append(reset(reset_running_requests=True))
        except RuntimeError as err:
            results.append(f"raised: {err}")
        return True

    scheduler.reset_prefix_cache = reset_with_running_requests  # type: ignore[method-assign]
    is_defrag = isinstance(scheduler, DefragScheduler)
    if is_defrag:
        assert ranks is not None
        workers = [
            SignedWorker(kv, translator_for(handle, ASYNC_NUM_BLOCKS), service=(handle, rank))
            for rank, (handle, kv) in enumerate(ranks)
        ]
        resolve = ranks[0][0].resolve
    else:
        workers = [SignedWorker(torch.zeros(ASYNC_NUM_BLOCKS * BLOCK_SIZE, 1, dtype=torch.int64))]
        resolve = list
    run_loop(
        scheduler,
        workers,
        Workload(seed=11, num_requests=80),
        resolve=resolve,
        in_flight=2,
        reset_prefix_cache_every=RESET_EVERY,
    )
    if is_defrag:
        scheduler.kvdefrag.settle()
        scheduler.kvdefrag.ranks.close()
    assert sum(in_flight) > 0, "no reset met a running request"
    return scheduler, results, workers


def test_a_reset_with_running_requests_and_a_step_in_flight_succeeds_as_in_vllm(
    model_dir: str, async_ranks: list[Any]
) -> None:
    _, plain, _ = _run(AsyncScheduler, model_dir, None)
    scheduler, results, workers = _run(TwoRankAsyncScheduler, model_dir, async_ranks)
    assert plain and all(result is True for result in plain), plain
    assert results == [True] * len(results) and len(results) >= len(plain) - 2, results
    assert scheduler.kvdefrag.totals.num_audits > 100  # the ledger equalled vLLM's each step
    assert not scheduler.has_requests()
    assert scheduler.kvdefrag.ledger.held == {}
    assert len(scheduler.deferred_frees) == 0  # nothing left parked
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == ASYNC_NUM_BLOCKS - 1  # no block lost
    for worker in workers:
        assert worker.num_checked > 1_000
        # NOTE: every read of a row is clean. The harness's check of vLLM's cached free
        # blocks also fails for plain vLLM once a request is preempted with a step in
        # flight and prefix caching on (docs/design/vllm-integration.md), so it is not
        # asserted here.
        assert worker.num_corrupted - worker.num_cached_corrupted == 0


@pytest.mark.parametrize("reset_running_requests", [False, True])
def test_the_parked_blocks_lent_for_a_reset_are_held_again(
    model_dir: str, async_ranks: list[Any], reset_running_requests: bool
) -> None:
    """With a request still running (no preemption asked) vLLM refuses the reset, and the
    parked blocks are held as they were; with preemption it resets, and every parked
    block is held again, its hash gone."""
    scheduler = make_scheduler(
        TwoRankAsyncScheduler,
        model_dir,
        num_blocks=ASYNC_NUM_BLOCKS,
        prefix_caching=True,
        async_scheduling=True,
    )
    requests = list(Workload(seed=2, num_requests=3, reuse_ids=False).requests(BLOCK_SIZE))
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()  # step 1 in flight: every request holds blocks
    scheduler.finish_requests(requests[0].request_id, RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.deferred_frees) == 1, "the fence parked nothing"
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    counts = [block.ref_cnt for _, blocks in scheduler.deferred_frees for block in blocks]
    is_reset = scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests)
    assert is_reset is reset_running_requests  # running requests hold blocks otherwise
    parked = [block for _, blocks in scheduler.deferred_frees for block in blocks]
    if reset_running_requests:
        assert len(scheduler.deferred_frees) == len(requests)  # the preempted ones too
        assert all(block.ref_cnt >= 1 and block.block_hash is None for block in parked)
        assert pool.get_num_free_blocks() == ASYNC_NUM_BLOCKS - 1 - len(
            {block.block_id for block in parked}
        )
    else:
        assert [block.ref_cnt for block in parked] == counts
        assert pool.get_num_free_blocks() == free_before
    scheduler.kvdefrag.ranks.close()
