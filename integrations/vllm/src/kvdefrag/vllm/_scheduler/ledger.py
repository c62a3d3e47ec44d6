"""What every rank's engine believes about the pool, kept next to vLLM's scheduler.

Each step is planned from what this ``schedule()`` changed, never from a scan of every
request's blocks: the ledger applies the changes (``StepChanges``) to its own copy of the
pool and turns them into the step's events in time proportional to the blocks and
requests that changed. Where the changes come from is ``_bridge.changes_from_output``.

A full comparison with vLLM's own truth (``audit``) runs every N steps when asked; it is
the check that the changes were read right.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from kvdefrag.common import NULL_BLOCK_ID, DefragError, StepEvents
from kvdefrag.vllm.output_blocks import first_fresh_block_index

DEFERRED_PREFIX = "kvdefrag-deferred-free/"
"""Request ids the ledger gives the blocks vLLM holds back after their request ended
(``defer_block_free``): live until they return to the pool, like a request's."""


class LedgerDiverged(DefragError):
    """The ledger no longer matches vLLM's KV cache manager: kvdefrag read a change wrong.

    The message lists the differences. Recovery: restart vLLM (the engines' mapping may
    already be planned from a wrong view); report it, with the message, as a bug.
    """


@dataclasses.dataclass
class StepChanges:
    """What one ``schedule()`` changed in the pool, in logical ids.

    Attributes:
        released: Requests that let go of their blocks (finished, aborted, preempted).
        full_rows: Request id -> its whole block list, for requests that got one this
            step (new, resumed, or re-admitted under a reused id).
        appended: Request id -> the ids appended to its list this step.
        num_computed_tokens: Request id -> tokens computed before this step, for (at
            least) the requests in ``full_rows`` and ``appended`` that were scheduled in
            it; blocks of other requests are never fresh.
        not_fresh: Ids that must keep their data whatever (copy-on-write targets).
        parked: Blocks vLLM held back after their request ended (deferred frees), each
            list under its own ``DEFERRED_PREFIX`` id.
        unparked: Ids of ``parked`` lists that returned to the pool.
        is_cache_reset: The prefix cache was reset: no free block keeps its content.
        kept: Request id -> pin key, for finished requests whose blocks vLLM keeps while
            a KV connector sends them (``_scheduler.transfers``): they stay held, and
            their lists are pinned under the key.
        pins: Pin key -> logical ids that must keep their slot (a KV transfer in flight).
        unpinned: Pin keys whose transfer ended.
    """

    released: Sequence[str] = ()
    full_rows: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    appended: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    num_computed_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)
    not_fresh: frozenset[int] = frozenset()
    parked: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    unparked: Sequence[str] = ()
    is_cache_reset: bool = False
    kept: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pins: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    unpinned: Sequence[str] = ()


class BlockLedger:
    """The engines' view of the pool, as the scheduler side planned it.

    Invariants: ``held`` maps every request (and parked list) that holds blocks to its
    logical list, in vLLM's order; ``refs[l]`` counts the entries of ``held`` naming
    ``l`` (block 0 never counted); ``cached_free`` holds the free logical ids whose content
    the engines preserve (prefix caching only), never the null block and never a held one.
    """

    def __init__(self, *, num_blocks: int, block_size: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.held: dict[str, list[int]] = {}
        self.refs: list[int] = [0] * num_blocks
        self.cached_free: set[int] = set()

    def plan(self, changes: StepChanges, is_cached: Callable[[int], bool]) -> StepEvents:
        """Adopts one step's changes and returns its events, the same for every rank.

        Args:
            changes: What ``schedule()`` changed.
            is_cached: Whether a free logical id still carries a prefix-cache hash (asked
                only for ids this step freed).

        Returns:
            The step; ordering never depends on set or hash order.
        """
        held, refs = self.held, self.refs
        finished: list[str] = []
        dropped: list[int] = []  # ids whose references went down: maybe free now
        for request_id in sorted({*changes.released, *changes.unparked}):
            logical_ids = held.pop(request_id, None)
            if logical_ids is not None:
                finished.append(request_id)
                dropped += logical_ids
        resumed: dict[str, list[int]] = {}
        new_blocks: dict[str, list[int]] = {}
        fresh: list[int] = []
        added: list[int] = []  # ids that got a reference
        for request_id in sorted(changes.full_rows):
            logical_ids = [int(block_id) for block_id in changes.full_rows[request_id]]
            old_ids = held.get(request_id)
            if old_ids is None:
                new_blocks[request_id] = logical_ids
            else:
                resumed[request_id] = logical_ids
                dropped += old_ids
            # NOTE: a copy: held lists grow with later steps, and the step's events must
            # not (they are shared with the ranks' clients and the workers, unchecked again).
            held[request_id] = list(logical_ids)
            added += logical_ids
            fresh += self._fresh(changes, request_id, logical_ids, 0)
        for request_id in sorted(changes.appended):
            logical_ids = [int(block_id) for block_id in changes.appended[request_id]]
            if not logical_ids:
                continue
            row = held.setdefault(request_id, [])
            start = len(row)
            row += logical_ids
            new_blocks.setdefault(request_id, []).extend(logical_ids)
            added += logical_ids
            fresh += self._fresh(changes, request_id, logical_ids, start)
        for request_id in sorted(changes.parked):
            logical_ids = [int(block_id) for block_id in changes.parked[request_id]]
            held[request_id] = logical_ids
            new_blocks[request_id] = list(logical_ids)
            added += logical_ids
        for logical_id in dropped:
            refs[logical_id] -= 1
        for logical_id in added:
            refs[logical_id] += 1
        refs[NULL_BLOCK_ID] = 0
        evicted = self._evictions(changes, dropped, added, is_cached)
        pins = {key: [int(block_id) for block_id in ids] for key, ids in changes.pins.items()}
        for request_id, key in sorted(changes.kept.items()):
            if request_id in held:
                pins[key] = list(held[request_id])
        return StepEvents(
            finished=tuple(finished),
            new_blocks=new_blocks,
            resumed=resumed,
            fresh=list(dict.fromkeys(fresh)),
            evicted=evicted,
            unpinned=tuple(changes.unpinned),
            pins=pins,
        )

    def _fresh(
        self, changes: StepChanges, request_id: str, logical_ids: list[int], start: int
    ) -> list[int]:
        """The ids of ``logical_ids`` (at ``start`` in the request's list) that hold no data."""
        num_computed = changes.num_computed_tokens.get(request_id)
        if num_computed is None:
            return []
        first = max(start, first_fresh_block_index(num_computed, self.block_size)) - start
        return [
            block_id
            for block_id in logical_ids[first:]
            if block_id != NULL_BLOCK_ID and block_id not in changes.not_fresh
        ]

    def _evictions(
        self,
        changes: StepChanges,
        dropped: list[int],
        added: list[int],
        is_cached: Callable[[int], bool],
    ) -> list[int]:
        """Free ids whose content is gone this step; keeps ``cached_free`` up to date."""
        if not self.prefix_caching:
            return []
        refs, cached_free = self.refs, self.cached_free
        cached_free.difference_update(added)
        evicted: list[int] = []
        for logical_id in sorted(set(dropped)):
            if logical_id == NULL_BLOCK_ID or refs[logical_id] > 0:
                continue
            if is_cached(logical_id):
                cached_free.add(logical_id)
            else:
                cached_free.discard(logical_id)
                evicted.append(logical_id)
        if changes.is_cache_reset:
            evicted = sorted({*evicted, *cached_free})
            cached_free.clear()
        return evicted

    def audit(
        self,
        truth: Mapping[str, Sequence[int]],
        parked: Sequence[Sequence[int]],
        is_cached: Callable[[int], bool],
    ) -> None:
        """Compares the ledger with vLLM's own view of the whole pool (O(pool)).

        Args:
            truth: Request id -> its logical block ids, from the KV cache manager
                (requests holding none left out).
            parked: The block lists vLLM holds back (its deferred frees).
            is_cached: Whether a free logical id still carries a prefix-cache hash.

        Raises:
            LedgerDiverged: Naming every difference (the first few of each kind).
        """
        problems: list[str] = []
        requests = {rid: ids for rid, ids in self.held.items() if not is_parked(rid)}
        wanted = {rid: [int(b) for b in ids] for rid, ids in truth.items() if ids}
        missing = sorted(set(wanted) - set(requests))
        extra = sorted(set(requests) - set(wanted))
        differ = sorted(rid for rid in set(wanted) & set(requests) if wanted[rid] != requests[rid])
        if missing:
            problems.append(f"requests vLLM holds but the ledger does not: {_few(missing)}")
        if extra:
            problems.append(f"requests the ledger holds but vLLM does not: {_few(extra)}")
        for rid in differ[:3]:
            problems.append(f"request {rid!r}: vLLM {wanted[rid]}, ledger {requests[rid]}")
        if len(differ) > 3:
            problems.append(f"... and {len(differ) - 3} more requests whose lists differ")
        held_parked = sorted(ids for rid, ids in self.held.items() if is_parked(rid))
        vllm_parked = sorted([int(b) for b in ids] for ids in parked if ids)
        if held_parked != vllm_parked:
            problems.append(f"deferred frees: vLLM {vllm_parked}, ledger {held_parked}")
        if self.prefix_caching:
            live = {b for ids in wanted.values() for b in ids} | {
                b for ids in vllm_parked for b in ids
            }
            cached = {b for b in range(1, self.num_blocks) if b not in live and is_cached(b)}
            if cached != self.cached_free:
                problems.append(
                    "cached free blocks: vLLM has "
                    f"{_few(sorted(cached - self.cached_free))} that the ledger lacks, the "
                    f"ledger {_few(sorted(self.cached_free - cached))} that vLLM lacks"
                )
        if problems:
            raise LedgerDiverged(
                "kvdefrag's ledger differs from vLLM's KV cache manager: "
                + "; ".join(problems)
                + ". Restart vLLM and report this as a kvdefrag bug."
            )


def is_parked(request_id: str) -> bool:
    """Whether ``request_id`` names a parked (deferred-free) list, not a request."""
    return request_id.startswith(DEFERRED_PREFIX)


def _few(items: Sequence[object], limit: int = 5) -> str:
    shown = ", ".join(repr(item) for item in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)})"
