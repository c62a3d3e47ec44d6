"""Schedulers for engine_run.py that measure the run and write it down at shutdown.

Both write ``scheduler.json`` into their engine's run directory (``$KVDEFRAG_VLLM_RUN_DIR``,
or its ``dp<k>`` for data-parallel engine ``k > 0``) whenever the last request
has finished (in whichever process the engine core runs; not at shutdown: with tensor
parallel workers vLLM kills the engine core before its scheduler shuts down): preemptions,
and the fragmentation of the pool sampled after every ``schedule()`` that leaves a block
live. Fragmentation is
kvdefrag's ``PoolStats.fragmentation_ratio``: the highest live physical block id over the
number of live blocks (block 0 is vLLM's null block, so a packed pool reads 1.0).

* ``MeasuredScheduler``: plain vLLM; the physical ids are the KV cache manager's.
* ``MeasuredAsyncScheduler`` and ``MeasuredDefragAsyncScheduler``: the same on vLLM's
  ``AsyncScheduler`` and ``DefragAsyncScheduler`` (``engine_run.py --force-async``).
* ``MeasuredDefragScheduler``: ``DefragScheduler``; the ratio is the one the rank services
  report after each step (the last ``StepReply``'s stats, no extra round trip), with the
  bridge's counters (``BridgeTotals``) and every rank service's totals (``GetStats``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs

from kvdefrag.vllm.config import load_integration_config
from kvdefrag.vllm.contract import engine_run_dir
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

REPORT_NAME = "scheduler.json"


def write_report(report: dict[str, Any], parallel_config: Any) -> None:
    """Writes ``report`` as ``scheduler.json`` in the engine's run directory."""
    run_dir = engine_run_dir(parallel_config, load_integration_config().run_dir)
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, REPORT_NAME)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as file:
        json.dump(report, file)
    # NOTE: replaced whole: an engine core stopped while writing leaves the last report
    os.replace(partial, path)


class MeasuredScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, unchanged, sampling the truth of its KV cache manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._blocks = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        self.num_preempted = 0
        self.fragmentation: list[float] = []

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        self.num_preempted += len(output.preempted_req_ids or ())
        live_ids = {block.block_id for blocks in self._blocks.values() for block in blocks}
        if live_ids:
            self.fragmentation.append(max(live_ids) / len(live_ids))
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            write_report(
                {"num_preempted": self.num_preempted, "fragmentation": self.fragmentation},
                self.vllm_config.parallel_config,
            )
        return outputs


class MeasuredDefragScheduler(DefragScheduler):
    """``DefragScheduler``, sampling the pool stats the rank services reply with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fragmentation: list[float] = []

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        output = super().schedule(*args, **kwargs)
        reply = self.kvdefrag.totals.last_reply
        if reply is not None and reply.stats.num_live > 0:
            self.fragmentation.append(reply.stats.fragmentation_ratio)
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            self.kvdefrag.settle()  # the last step's reply, when the workers translate
            totals = self.kvdefrag.totals
            ranks = [client.stats().stats.totals for client in self.kvdefrag.ranks.clients]
            write_report(
                {
                    "num_preempted": totals.num_preempted,
                    "fragmentation": self.fragmentation,
                    "num_steps": totals.num_steps,
                    "num_audits": totals.num_audits,
                    "step_durations_s": totals.step_durations_s,
                    "num_moves": ranks[0].num_moves,
                    "num_placements": ranks[0].num_placements,
                    "ranks": [
                        {"num_moves": rank.num_moves, "num_placements": rank.num_placements}
                        for rank in ranks
                    ],
                },
                self.vllm_config.parallel_config,
            )
        return outputs


class MeasuredAsyncScheduler(MeasuredScheduler, AsyncScheduler):  # type: ignore[misc]
    """``MeasuredScheduler`` on vLLM's ``AsyncScheduler`` (async scheduling forced on)."""


class MeasuredDefragAsyncScheduler(MeasuredDefragScheduler, DefragAsyncScheduler):  # type: ignore[misc]
    """``MeasuredDefragScheduler`` on ``DefragAsyncScheduler``."""
