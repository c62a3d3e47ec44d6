"""Block tracker: reference counts, requests and the logical->physical permutation.

Pure Python + numpy; no torch, no grpc. The engine is its only owner.

Two id spaces meet here::

    logical id  (what the scheduler allocated)  --fwd-->  physical id (slot in the KV tensors)
    physical id                                 --bwd-->  logical id

Reference counts and the "cached" flag belong to *logical* ids (prefix caching shares and
caches the scheduler's blocks); the packing question -- which slots are live, which are
holes -- is asked in *physical* space. Three lazy heaps answer it in O(log n) per change,
so no step ever scans or sorts the pool.

NOTE: the per-block state is kept in Python lists, not numpy arrays: the hot path reads
and writes single elements, which lists do several times faster. ``fwd_array`` is a numpy
copy of ``fwd`` for vectorised resolve, brought up to date by ``flush`` in O(changes).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import numpy.typing as npt

from kvdefrag.common import NULL_BLOCK_ID, pair_digest
from kvdefrag.common.digest import DIGEST_INCREMENT, DIGEST_MULTIPLIER_1, DIGEST_MULTIPLIER_2


def pair_digests(logical_ids: list[int], physical_ids: list[int]) -> list[int]:
    """``pair_digest`` of many pairs; numpy for batches, the same values."""
    if len(logical_ids) < 32:
        return [
            pair_digest(l_id, p_id) for l_id, p_id in zip(logical_ids, physical_ids, strict=True)
        ]
    logical = np.asarray(logical_ids, dtype=np.uint64)
    physical = np.asarray(physical_ids, dtype=np.uint64)
    z = (logical << np.uint64(32)) ^ physical ^ np.uint64(DIGEST_INCREMENT)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(DIGEST_MULTIPLIER_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(DIGEST_MULTIPLIER_2)
    z ^= z >> np.uint64(31)
    digests: list[int] = z.tolist()
    return digests


class _SlotHeap:
    """A lazy heap of physical slots whose entries are re-checked when read.

    Invariant: every slot that satisfies the owner's predicate has an entry (its flag is
    set), and a flagged slot has exactly one entry. Entries whose slot no longer satisfies
    the predicate are dropped when they reach the top, so each change costs O(log n)
    amortised.
    """

    def __init__(self, num_blocks: int, slots: Iterable[int], descending: bool) -> None:
        self._sign = -1 if descending else 1
        self.flags = bytearray(num_blocks)
        self.heap: list[int] = []
        for slot in slots:
            self.flags[slot] = 1
            self.heap.append(self._sign * slot)
        heapq.heapify(self.heap)

    def push(self, slot: int) -> None:
        if not self.flags[slot]:
            self.flags[slot] = 1
            heapq.heappush(self.heap, self._sign * slot)

    def top(self, is_valid: Callable[[int], bool]) -> int | None:
        """Returns the best valid slot, dropping stale entries above it; None if empty."""
        heap = self.heap
        while heap:
            slot = self._sign * heap[0]
            if is_valid(slot):
                return slot
            heapq.heappop(heap)
            self.flags[slot] = 0
        return None


class BlockTracker:
    """Live blocks, requests and the logical->physical permutation of one KV pool.

    Invariants:
        * ``fwd`` is a permutation of ``[0, num_blocks)`` and ``bwd`` its inverse.
        * Block 0 (the null block) is never referenced, never moved: ``fwd[0] == 0``.
        * ``refs[l]`` is the number of references to logical ``l`` held by requests;
          ``num_live`` counts logical ids with ``refs > 0``.
        * ``digest`` is the XOR of ``pair_digest(l, fwd[l])`` over live ``l``.
        * ``cached[l]`` (meaningful while ``refs[l] == 0``) says the free block's content
          must be kept (prefix caching).
        * Every request in ``requests`` holds at least one block other than the null
          block (``append_blocks`` keeps no other).
    """

    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        assert num_blocks >= 2, f"a pool needs the null block and one more, got {num_blocks}"
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.fwd: list[int] = list(range(num_blocks))
        self.bwd: list[int] = list(range(num_blocks))
        self.refs: list[int] = [0] * num_blocks
        self.cached: list[bool] = [False] * num_blocks
        self.fwd_array: npt.NDArray[np.int64] = np.arange(num_blocks, dtype=np.int64)
        self._remapped: list[int] = []  # logical ids whose fwd changed since flush()
        self.requests: dict[str, list[int]] = {}
        self.num_live = 0
        self.digest = 0
        # pair_digest(l, fwd[l]) as of when l became live or last moved (stale while free),
        # so releases and moves XOR the stored value out instead of recomputing it.
        self._live_digests: list[int] = [0] * num_blocks
        slots = range(1, num_blocks)
        self._live = _SlotHeap(num_blocks, (), descending=True)
        self._free = _SlotHeap(num_blocks, slots, descending=False)
        self._expendable = _SlotHeap(num_blocks, slots, descending=False)

    # --- predicates on physical slots -------------------------------------------------
    def is_live_slot(self, physical_id: int) -> bool:
        return self.refs[self.bwd[physical_id]] > 0

    def is_expendable_slot(self, physical_id: int) -> bool:
        logical_id = self.bwd[physical_id]
        return (
            physical_id != NULL_BLOCK_ID
            and not self.refs[logical_id]
            and not self.cached[logical_id]
        )

    def holds_data(self, physical_id: int) -> bool:
        """True when the slot's content must survive a move (live, or cached while free)."""
        return not self.is_expendable_slot(physical_id)

    # --- queries ----------------------------------------------------------------------
    @property
    def max_live(self) -> int:
        """Highest live physical id, 0 when nothing is live."""
        return self._live.top(self.is_live_slot) or 0

    def lowest_expendable(self) -> int | None:
        return self._expendable.top(self.is_expendable_slot)

    def pop_live_slots(self) -> Iterator[int]:
        """Yields live slots, highest first; each yielded slot leaves the live index
        (commit it with ``move_live_blocks`` or hand it back with ``restore_slots``).

        NOTE: works on the heap directly: this and ``pop_free_slots`` are the hottest
        loop of a compaction step.
        """
        refs, bwd = self.refs, self.bwd
        heap, flags = self._live.heap, self._live.flags
        while heap:
            slot = -heapq.heappop(heap)
            flags[slot] = 0
            if refs[bwd[slot]]:  # else stale: no longer live
                yield slot

    def pop_free_slots(self) -> Iterator[int]:
        """Yields free slots, lowest first, taking each out of the free index (as above)."""
        refs, bwd = self.refs, self.bwd
        heap, flags = self._free.heap, self._free.flags
        while heap:
            slot = heapq.heappop(heap)
            flags[slot] = 0
            if not refs[bwd[slot]]:  # else stale: live again
                yield slot

    def restore_slots(self, physical_ids: Iterable[int]) -> None:
        """Re-indexes slots taken by ``pop_*_slots`` (their state has not changed)."""
        for physical_id in physical_ids:
            self._index_slot(physical_id)

    # --- mutations --------------------------------------------------------------------
    def acquire(self, logical_id: int) -> bool:
        """Adds one reference; returns True when the block became live."""
        refs = self.refs[logical_id]
        self.refs[logical_id] = refs + 1
        if refs:
            return False
        physical_id = self.fwd[logical_id]
        self.num_live += 1
        became_live = pair_digest(logical_id, physical_id)
        self._live_digests[logical_id] = became_live
        self.digest ^= became_live
        self._live.push(physical_id)
        return True

    def release(self, logical_id: int) -> None:
        """Drops one reference; a block that becomes free is cached under prefix caching."""
        refs = self.refs[logical_id]
        assert refs > 0, f"release of logical block {logical_id} with no references"
        self.refs[logical_id] = refs - 1
        if refs > 1:
            return
        physical_id = self.fwd[logical_id]
        self.num_live -= 1
        self.digest ^= self._live_digests[logical_id]
        self.cached[logical_id] = self.prefix_caching
        self._index_slot(physical_id)

    def evict(self, logical_id: int) -> None:
        """Marks a free block's content as no longer needed (a no-op for live blocks)."""
        if not self.refs[logical_id] and self.cached[logical_id]:
            self.cached[logical_id] = False
            self._index_slot(self.fwd[logical_id])

    def swap_slots(self, physical_a: int, physical_b: int) -> tuple[int, int]:
        """Exchanges the logical ids held by two physical slots (the mapping only).

        Returns:
            The logical ids now at ``physical_a`` and ``physical_b``.
        """
        assert NULL_BLOCK_ID not in (physical_a, physical_b), "the null block never moves"
        logical_a = self.bwd[physical_a]
        logical_b = self.bwd[physical_b]
        for logical_id, new in ((logical_a, physical_b), (logical_b, physical_a)):
            if self.refs[logical_id]:
                moved = pair_digest(logical_id, new)
                self.digest ^= self._live_digests[logical_id] ^ moved
                self._live_digests[logical_id] = moved
        self.fwd[logical_a], self.fwd[logical_b] = physical_b, physical_a
        self.bwd[physical_a], self.bwd[physical_b] = logical_b, logical_a
        self._remapped += (logical_a, logical_b)
        self._index_slot(physical_a)
        self._index_slot(physical_b)
        return logical_b, logical_a

    def move_live_blocks(self, src_ids: list[int], dst_ids: list[int]) -> list[int]:
        """Commits a compaction batch: live ``src_ids[i]`` and free ``dst_ids[i]`` trade
        logical ids. The slots must have been taken by ``pop_live_slots`` and
        ``pop_free_slots``.

        Returns:
            Every logical id whose slot changed.
        """
        fwd, bwd = self.fwd, self.bwd
        moved_ids = [bwd[src] for src in src_ids]
        freed_ids = [bwd[dst] for dst in dst_ids]
        assert all(self.refs[i] for i in moved_ids), "compaction moves live blocks only"
        assert not any(self.refs[i] for i in freed_ids), "compaction targets free slots only"
        for moved_id, freed_id, src, dst in zip(
            moved_ids, freed_ids, src_ids, dst_ids, strict=True
        ):
            fwd[moved_id], fwd[freed_id] = dst, src
            bwd[dst], bwd[src] = moved_id, freed_id
        live_digests = self._live_digests
        digest = self.digest
        for moved_id, moved in zip(moved_ids, pair_digests(moved_ids, dst_ids), strict=True):
            digest ^= live_digests[moved_id] ^ moved
            live_digests[moved_id] = moved
        self.digest = digest
        for physical_id in (*src_ids, *dst_ids):
            self._index_slot(physical_id)
        changed = moved_ids + freed_ids
        self._remapped += changed
        return changed

    def has_unflushed_changes(self) -> bool:
        """True when ``fwd`` changed since the last ``flush``."""
        return bool(self._remapped)

    def flush(self) -> None:
        """Brings ``fwd_array`` up to date with ``fwd`` (O(ids changed since last flush))."""
        if self._remapped:
            remapped = self._remapped
            self.fwd_array[remapped] = [self.fwd[i] for i in remapped]
            self._remapped = []

    def _index_slot(self, physical_id: int) -> None:
        """Puts a slot into every heap whose predicate it now satisfies."""
        logical_id = self.bwd[physical_id]
        if self.refs[logical_id]:
            self._live.push(physical_id)
        elif physical_id != NULL_BLOCK_ID:
            self._free.push(physical_id)
            if not self.cached[logical_id]:
                self._expendable.push(physical_id)

    # --- requests ---------------------------------------------------------------------
    def drop_request(self, request_id: str) -> bool:
        """Releases every reference a request holds; False if the request is unknown."""
        logical_ids = self.requests.pop(request_id, None)
        if logical_ids is None:
            return False
        for logical_id in logical_ids:
            if logical_id != NULL_BLOCK_ID:
                self.release(logical_id)
        return True

    def append_blocks(self, request_id: str, logical_ids: list[int]) -> list[int]:
        """Adds references for a request's new blocks; returns those that became live.

        A request that would hold no block but the null block is not kept (it holds
        nothing to track, and would stay forever if the scheduler never finishes it).
        """
        held = self.requests.get(request_id)
        if held is None:
            if all(logical_id == NULL_BLOCK_ID for logical_id in logical_ids):
                return []
            held = self.requests[request_id] = []
        held.extend(logical_ids)
        return [
            logical_id
            for logical_id in logical_ids
            if logical_id != NULL_BLOCK_ID and self.acquire(logical_id)
        ]
