"""The scheduler's shutdown in vLLM's order: ``EngineCore.shutdown`` stops the executor
(the workers, and so their kvdefrag services) before it shuts the scheduler down."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from support.vllm_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TwoRankAsyncScheduler,
    TwoRankScheduler,
    Workload,
    make_scheduler,
)

# The rank clients' timeout_s in these tests. NOTE: no clock is read: a shutdown that
# waited for the gone rank would run to this deadline and log that it did not answer.
TIMEOUT_S = 60.0


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_shutdown_after_the_ranks_stopped_names_the_rank_gone_and_does_not_wait_for_it(
    model_dir: str,
    ranks: list[Any],
    is_async: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shut_down: list[Any] = []
    monkeypatch.setattr(Scheduler, "shutdown", lambda self: shut_down.append(self))
    scheduler = make_scheduler(
        TwoRankAsyncScheduler if is_async else TwoRankScheduler,
        model_dir,
        num_blocks=NUM_BLOCKS,
        prefix_caching=False,
        async_scheduling=is_async,
    )
    for client in scheduler.kvdefrag.ranks.clients:
        client.timeout_s = TIMEOUT_S
    requests = Workload(seed=3, num_requests=8, reuse_ids=False).requests(BLOCK_SIZE)
    for request in [next(requests) for _ in range(4)]:
        scheduler.add_request(request)
    scheduler.schedule()
    scheduler.kvdefrag.settle()
    # Rank 1's worker stops; the next step goes out and stays in flight there (rank 0
    # may answer it before it stops too); then the scheduler shuts down.
    ranks[1][0].stop(grace_s=0)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    assert len(scheduler.kvdefrag._in_flight) == 1
    ranks[0][0].stop(grace_s=0)

    with caplog.at_level(logging.WARNING, logger="kvdefrag.vllm._scheduler.ranks"):
        scheduler.shutdown()

    assert "did not answer" not in caplog.text
    address = scheduler.kvdefrag.ranks.clients[1].address
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith(f"rank 1 at {address} is gone: UNAVAILABLE") for m in messages)
    assert shut_down == [scheduler]  # vLLM's own shutdown ran
