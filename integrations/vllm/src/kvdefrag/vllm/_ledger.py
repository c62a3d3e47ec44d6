"""What every rank's engine believes about the pool, kept next to vLLM's scheduler.

Each step is planned from vLLM's ground truth (the KV cache manager's block list of every
request, and which free blocks still carry a prefix-cache hash), never from the
``SchedulerOutput`` alone: finished, aborted and preempted requests, deferred frees and
``reset_prefix_cache`` all show up as a difference between two truths.

The worker's view is kept too: the physical row each request's persistent block table
holds, so that a request whose held blocks moved can be re-sent whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from kvdefrag.common import NULL_BLOCK_ID, StepEvents
from kvdefrag.vllm.common import first_fresh_block_index


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step's events and what the rewrite needs to know about them.

    Attributes:
        events: The step, the same for every rank.
        full_rows: Request ids whose whole logical list this step carries (new to the
            engine, or replaced); the others only appended.
    """

    events: StepEvents
    full_rows: frozenset[str]


class BlockLedger:
    """The engines' view of the pool, as the scheduler side planned it.

    Invariants: ``held`` maps every request that holds blocks to its logical list, in
    vLLM's order; ``cached_free`` holds the free logical ids whose content the engines
    preserve (prefix caching only), never the null block 0 and never a held block.
    """

    def __init__(self, *, block_size: int, prefix_caching: bool) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.held: dict[str, list[int]] = {}
        self.cached_free: set[int] = set()

    def plan(
        self,
        truth: Mapping[str, Sequence[int]],
        num_computed_tokens: Mapping[str, int],
        is_cached: Callable[[int], bool],
        not_fresh: frozenset[int] = frozenset(),
    ) -> StepPlan:
        """Plans the step that takes the engines from ``held`` to ``truth``, and adopts it.

        Args:
            truth: Request id -> its logical block ids now (requests holding none left out).
            num_computed_tokens: Request id -> tokens computed before this step, for the
                requests scheduled in it; blocks of other requests are never fresh.
            is_cached: Whether a free logical id still carries a prefix-cache hash.
            not_fresh: Ids that must keep their data whatever (copy-on-write targets).

        Returns:
            The step; ordering never depends on set or hash order.
        """
        previous_live = {block_id for ids in self.held.values() for block_id in ids}
        finished = sorted(request_id for request_id in self.held if request_id not in truth)
        new_blocks: dict[str, list[int]] = {}
        resumed: dict[str, list[int]] = {}
        fresh: list[int] = []
        full_rows: set[str] = set()
        for request_id in sorted(truth):
            block_ids = [int(block_id) for block_id in truth[request_id]]
            old_ids = self.held.get(request_id)
            if old_ids is None:
                start = 0
                new_blocks[request_id] = block_ids
                full_rows.add(request_id)
            elif block_ids[: len(old_ids)] == old_ids:
                start = len(old_ids)
                if len(block_ids) > start:
                    new_blocks[request_id] = block_ids[start:]
            else:
                start = 0
                resumed[request_id] = block_ids
                full_rows.add(request_id)
            computed = num_computed_tokens.get(request_id)
            if computed is None:
                continue
            first_fresh = max(start, first_fresh_block_index(computed, self.block_size))
            fresh += [
                block_id
                for block_id in block_ids[first_fresh:]
                if block_id != NULL_BLOCK_ID and block_id not in not_fresh
            ]
        live = {block_id for ids in truth.values() for block_id in ids}
        evicted: list[int] = []
        if self.prefix_caching:
            candidates = (self.cached_free | previous_live) - live - {NULL_BLOCK_ID}
            evicted = sorted(block_id for block_id in candidates if not is_cached(block_id))
            self.cached_free = candidates - set(evicted)
        self.held = {request_id: [int(b) for b in truth[request_id]] for request_id in truth}
        events = StepEvents(
            finished=tuple(finished),
            new_blocks=new_blocks,
            resumed=resumed,
            fresh=list(dict.fromkeys(fresh)),
            evicted=evicted,
        )
        return StepPlan(events=events, full_rows=frozenset(full_rows))


class WorkerRows:
    """The physical rows the workers' persistent block tables hold, as last sent.

    A row goes stale when a block it names moves; a stale row is re-sent whole the next
    time its request is scheduled (vLLM only appends to rows of running requests).
    """

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.stale: set[str] = set()

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drops requests the workers dropped (finished or preempted)."""
        for request_id in request_ids:
            self.rows.pop(request_id, None)
            self.stale.discard(request_id)

    def set_row(self, request_id: str, physical_ids: Sequence[int]) -> None:
        """Records a row sent whole."""
        self.rows[request_id] = list(physical_ids)
        self.stale.discard(request_id)

    def append(self, request_id: str, physical_ids: Sequence[int]) -> None:
        """Records ids appended to a row."""
        self.rows.setdefault(request_id, []).extend(physical_ids)

    def mark_moved(
        self,
        moved_logical_ids: Sequence[int],
        held: Mapping[str, Sequence[int]],
        resolve: Callable[[Sequence[int]], list[int]],
    ) -> None:
        """Marks stale every row naming one of the moved ids at its old physical id."""
        if not moved_logical_ids:
            return
        moved = set(moved_logical_ids)
        for request_id in sorted(self.rows):
            if request_id in self.stale:
                continue
            logical_ids = list(held.get(request_id, ()))
            row = self.rows[request_id]
            prefix = logical_ids[: len(row)]
            if moved.isdisjoint(prefix):
                continue
            if resolve(prefix) != row:
                self.stale.add(request_id)
