"""The scheduler side of one step: plan it from vLLM's truth, step every rank, rewrite.

Duck-typed against vLLM 0.33's ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``) so
that it imports no vLLM; ``kvdefrag.vllm.scheduler`` feeds it the truth. The output's
fields are read and rewritten through ``kvdefrag.vllm.common``.

What the workers receive afterwards is in physical ids::

    scheduled_new_reqs[i].block_ids          whole row, resolved
    scheduled_cached_reqs.new_block_ids[i]   appended ids resolved; a whole row, and the
                                             request put in resumed_req_ids, when vLLM
                                             resumed it or when a block its worker row
                                             names moved (the V1 runner replaces the
                                             row of a resumed request and only appends
                                             to the others: gpu_model_runner.py
                                             _update_states, vLLM 0.33)
    new_block_ids_to_zero                    resolved
    kv_cache_block_copies                    (src, dst) resolved

A request whose row went stale while it was not scheduled is re-sent when it next is: its
stale row is not read before then.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvdefrag.client import StepReply
from kvdefrag.vllm._ledger import BlockLedger, WorkerRows
from kvdefrag.vllm._ranks import InFlightStep, RankGroup
from kvdefrag.vllm.common import (
    attach_step_stamp,
    copy_destinations,
    map_block_ids,
    scheduled_num_computed_tokens,
)


def _single_group(block_ids: Sequence[Sequence[int]], what: str) -> list[int]:
    assert len(block_ids) == 1, f"{what}: {len(block_ids)} KV-cache groups, kvdefrag serves one"
    return [int(block_id) for block_id in block_ids[0]]


@dataclasses.dataclass
class BridgeTotals:
    """Counters since start: steps sent, rows re-sent, preemptions, time per step.

    ``step_durations_s`` holds the scheduler-side time of each ``apply`` (plan, every
    rank's round trip, rewrite), the first ``SchedulerBridge.keep_durations`` of them.
    """

    num_steps: int = 0
    num_rows_resent: int = 0
    num_preempted: int = 0
    step_durations_s: list[float] = dataclasses.field(default_factory=list)
    last_reply: StepReply | None = None


class SchedulerBridge:
    """Turns each ``schedule()`` result into one step for every rank and rewrites it.

    Invariant: after ``apply`` returns, every block id in the output is physical and every
    rank's engine mirrors ``ledger.held`` and ``ledger.cached_free`` (when the workers
    translate: once the step in flight is applied, which ``settle`` waits for).
    """

    def __init__(self, ranks: RankGroup, *, block_size: int, prefix_caching: bool) -> None:
        self.ranks = ranks
        self.ledger = BlockLedger(block_size=block_size, prefix_caching=prefix_caching)
        self.rows = WorkerRows()
        self.totals = BridgeTotals()
        self.keep_durations = 100_000
        self._in_flight: InFlightStep | None = None

    def apply(
        self,
        output: Any,
        truth: Mapping[str, Sequence[int]],
        is_cached: Callable[[int], bool],
        *,
        rewrite: bool = True,
    ) -> None:
        """Plans, sends and applies one step, then rewrites ``output`` in place.

        Args:
            output: The ``SchedulerOutput`` ``schedule()`` just returned (logical ids).
            truth: Request id -> its logical block ids now, from the KV cache manager.
            is_cached: Whether a free logical id still carries a prefix-cache hash.
            rewrite: False when the workers translate ids themselves (async scheduling,
                the V2 model runner; see ``common.workers_translate``): ``output`` is
                then left logical, the step is only sent (its replies are checked at the
                next ``apply`` or ``settle``), and ``output`` carries its ``StepStamp``,
                which a worker waits for before it translates.
        """
        started = time.perf_counter()
        preempted_ids = sorted(output.preempted_req_ids or ())
        self.totals.num_preempted += len(preempted_ids)
        num_computed = scheduled_num_computed_tokens(output)
        plan = self.ledger.plan(truth, num_computed, is_cached, copy_destinations(output))
        if not rewrite:
            # Nothing in the output depends on the reply: the step flies while vLLM goes
            # on, and the workers wait for it (its stamp) before they translate.
            self.settle()
            if not plan.events.is_empty:
                self._in_flight = self.ranks.submit(plan.events)
                self.totals.num_steps += 1
                attach_step_stamp(output, self._in_flight.stamp)
        elif not plan.events.is_empty:
            reply = self.ranks.step(plan.events)
            self.totals.num_steps += 1
            self.totals.last_reply = reply
            resolve = self.ranks.primary.resolve
            self.rows.forget(sorted({*output.finished_req_ids, *preempted_ids}))
            self.rows.forget([rid for rid in self.rows.rows if rid not in truth])
            self.rows.mark_moved(sorted(reply.block_mapping), self.ledger.held, resolve)
        else:
            self.rows.forget(sorted({*output.finished_req_ids, *preempted_ids}))
        if rewrite:
            self._rewrite(output)
        if len(self.totals.step_durations_s) < self.keep_durations:
            self.totals.step_durations_s.append(time.perf_counter() - started)

    def settle(self) -> None:
        """Waits for the step in flight, if any, and checks every rank's reply.

        Raises:
            RanksDiverged, StepOutcomeUnknown, DefragError: As ``RankGroup.step``.
        """
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self.totals.last_reply = in_flight.result()

    def _rewrite(self, output: Any) -> None:
        cached = output.scheduled_cached_reqs
        # A running request whose worker row names a moved block is re-sent whole, as
        # resumed: the V1 runner replaces the row of a resumed request.
        new_block_ids = list(cached.new_block_ids)
        for position, request_id in enumerate(cached.req_ids):
            if request_id in self.rows.stale and request_id not in cached.resumed_req_ids:
                new_block_ids[position] = (list(self.ledger.held.get(request_id, ())),)
                cached.resumed_req_ids.add(request_id)
                self.totals.num_rows_resent += 1
        cached.new_block_ids = new_block_ids
        map_block_ids(output, self.ranks.primary.resolve)
        for request in output.scheduled_new_reqs:
            self.rows.set_row(request.req_id, _single_group(request.block_ids, request.req_id))
        for request_id, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if request_id in cached.resumed_req_ids:
                self.rows.set_row(request_id, _single_group(groups, request_id))
            elif groups is not None:
                self.rows.append(request_id, _single_group(groups, request_id))
