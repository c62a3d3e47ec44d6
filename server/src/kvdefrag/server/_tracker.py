"""Block tracker: reference counts, requests and the logical->physical permutation.

Pure Python + numpy; no torch, no grpc. The engine is its only owner.

The tracker keeps state and decides nothing: it answers the policy's queries (the
highest live slots, the lowest free or expendable slots, which free slots are cached)
and applies what the policy decided (``place_blocks``, ``move_live_blocks``), keeping
every invariant below.

Two id spaces meet here::

    logical id  (what the scheduler allocated)  --fwd-->  physical id (slot in the KV tensors)
    physical id                                 --bwd-->  logical id

Reference counts and the "cached" flag belong to *logical* ids (prefix caching shares and
caches the scheduler's blocks); the packing question -- which slots are live, which are
holes, which may be overwritten -- is asked in *physical* space. Two slot sets answer it
(live, expendable), each a bitmap with a count per 1,024-slot chunk: numpy reads the
counts, then only the chunks that hold the slots asked for, so no step ever scans or
sorts the pool::

    counts  [1024, 1024, 997, 0, ..., 12, 0]   slots in the set per chunk (1/1024 of the pool)
    mask    [0 1 1 1 ... ]                       one bool per physical slot

NOTE: the per-block state is kept in Python lists, not numpy arrays: the hot path reads
and writes single elements, which lists do several times faster; batches of changes go
through one loop each, and the live bitmap is updated one batch at a time. The ids whose
``fwd`` changed are handed to the engine (``take_remapped``), which publishes them for
vectorised, lock-free resolve (``_snapshot``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import numpy.typing as npt

from kvdefrag.common import NULL_BLOCK_ID, pair_digest
from kvdefrag.common.digest import MIN_VECTOR_PAIRS, pair_digest_array

# Slots per chunk of the live summary (a power of two: chunk = slot >> _CHUNK_SHIFT).
_CHUNK_SHIFT = 10
_CHUNK_SLOTS = 1 << _CHUNK_SHIFT
# Up to this many slots, a slot set is updated element by element.
_MAX_SCALAR_UPDATES = 8


class _SlotSet:
    """A set of physical slots: a bitmap, and how many slots of each chunk are in it.

    Invariants: ``counts[c]`` is the number of slots of chunk ``c`` in the set; slot 0
    (the null block's) never is. The owner adds only slots not in the set and removes
    only slots in it (``add`` and ``remove`` do not check).
    """

    # NOTE: the masks and counts are 1-D, so ``x.nonzero()[0]`` is ``np.flatnonzero(x)``
    # without its Python wrappers (a few µs a call, several calls a step).

    def __init__(self, num_blocks: int) -> None:
        self.mask = np.zeros(num_blocks, dtype=np.bool_)
        num_chunks = ((num_blocks - 1) >> _CHUNK_SHIFT) + 1
        self.counts = np.zeros(num_chunks, dtype=np.int64)
        capacity = np.full(num_chunks, _CHUNK_SLOTS, dtype=np.int64)
        capacity[-1] = num_blocks - ((num_chunks - 1) << _CHUNK_SHIFT)
        capacity[0] -= 1  # the null slot
        self._capacity = capacity

    def add(self, physical_ids: list[int]) -> None:
        """Adds slots that are not in the set (each listed once)."""
        self._update(physical_ids, True)

    def remove(self, physical_ids: list[int]) -> None:
        """Removes slots that are in the set (each listed once)."""
        self._update(physical_ids, False)

    def _update(self, physical_ids: list[int], is_in: bool) -> None:
        mask, counts = self.mask, self.counts
        if len(physical_ids) <= _MAX_SCALAR_UPDATES:  # numpy's per-call cost would dominate
            delta = 1 if is_in else -1
            for physical_id in physical_ids:
                mask[physical_id] = is_in
                counts[physical_id >> _CHUNK_SHIFT] += delta
            return
        slots = np.asarray(physical_ids, dtype=np.intp)
        mask[slots] = is_in
        chunk_counts = np.bincount(slots >> _CHUNK_SHIFT, minlength=len(counts))
        if is_in:
            counts += chunk_counts
        else:
            counts -= chunk_counts

    def exchange(
        self, leaving: npt.NDArray[np.intp], joining: npt.NDArray[np.intp]
    ) -> npt.NDArray[np.int64]:
        """Removes ``leaving`` (slots in the set), then adds ``joining`` (slots not in it,
        or leaving too: those stay in); returns the change of each chunk's count (for a set
        that changes the other way, ``exchange_back``)."""
        mask = self.mask
        mask[leaving] = False
        mask[joining] = True
        num_chunks = len(self.counts)
        delta = np.bincount(joining >> _CHUNK_SHIFT, minlength=num_chunks)
        delta -= np.bincount(leaving >> _CHUNK_SHIFT, minlength=num_chunks)
        self.counts += delta
        return delta

    def exchange_back(
        self,
        left: npt.NDArray[np.intp],
        joined: npt.NDArray[np.intp],
        delta: npt.NDArray[np.int64],
    ) -> None:
        """The other side of ``exchange(left, joined)`` (which returned ``delta``): the
        slots that left the other set join this one (not in it), then those that joined the
        other set leave this one (in it, or joining: those end out), so the chunk changes
        are ``-delta``, computed once."""
        mask = self.mask
        mask[left] = True
        mask[joined] = False
        self.counts -= delta

    def highest(
        self, max_slots: int, excluded: npt.NDArray[np.bool_] | None = None
    ) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` slots of the set, highest first; none of ``excluded`` (a
        mask over the pool) when given."""
        found: list[npt.NDArray[np.intp]] = []
        num_found = 0
        for chunk in self.counts.nonzero()[0][::-1].tolist():
            if num_found >= max_slots:
                break
            start = chunk << _CHUNK_SHIFT
            window = self.mask[start : start + _CHUNK_SLOTS]
            if excluded is not None:
                window = window & ~excluded[start : start + _CHUNK_SLOTS]
            found.append(window.nonzero()[0][::-1] + start)
            num_found += len(found[-1])
        return np.concatenate(found)[:max_slots] if found else np.empty(0, dtype=np.intp)

    def lowest(self, max_slots: int, below: int, *, is_in: bool) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` slots below ``below``, lowest first: slots of the set, or
        (``is_in=False``) slots not in it, the null slot excepted."""
        if max_slots <= 0 or below <= 1:
            return np.empty(0, dtype=np.intp)
        # NOTE: the chunks to read are found from the counts in one pass, then read in one
        # call: a chunk at a time cost ~4 µs each, and free slots may sit in every chunk.
        num_chunks = ((below - 1) >> _CHUNK_SHIFT) + 1
        counts = self.counts[:num_chunks]
        per_chunk = counts if is_in else self._capacity[:num_chunks] - counts
        filled = per_chunk.cumsum()  # the last chunk may count slots at or above `below`
        first = int(np.count_nonzero(filled == 0))
        if first == num_chunks:
            return np.empty(0, dtype=np.intp)
        last = min(int(np.searchsorted(filled, max_slots)), num_chunks - 1)
        start = first << _CHUNK_SHIFT
        window = self.mask[start : min((last + 1) << _CHUNK_SHIFT, below)]
        slots = (window if is_in else ~window).nonzero()[0]
        if start == NULL_BLOCK_ID and not is_in:
            slots = slots[1:]  # the null slot is never in a set, so it is listed first
        slots = slots[:max_slots]
        return slots + start if start else slots

    def max(self) -> int:
        """The highest slot of the set, 0 when it is empty."""
        chunks = self.counts.nonzero()[0]
        if not len(chunks):
            return 0
        start = int(chunks[-1]) << _CHUNK_SHIFT
        return start + int(self.mask[start : start + _CHUNK_SLOTS].nonzero()[0][-1])


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
        * ``pin_counts[l]`` is the number of pins on logical ``l`` (a KV transfer in
          flight); a pinned block keeps its slot: the policy never moves it, places it
          or hands its slot out, live or free.
        * Slot ``p`` is in ``_live`` exactly when ``refs[bwd[p]] > 0``; in ``_pinned``
          exactly when ``pin_counts[bwd[p]] > 0``; in ``_held`` when it is in either
          (the slots no block may move to); and in ``_expendable`` exactly when
          ``p != 0``, ``refs[bwd[p]] == 0``, not ``cached[bwd[p]]`` and not pinned (free,
          holding nothing to keep).
    """

    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        assert num_blocks >= 2, f"a pool needs the null block and one more, got {num_blocks}"
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.fwd: list[int] = list(range(num_blocks))
        self.bwd: list[int] = list(range(num_blocks))
        self.refs: list[int] = [0] * num_blocks
        self.cached: list[bool] = [False] * num_blocks
        # The block after each one in the list of the request that appended it last (a
        # hint: compaction keeps a block and its successor together where it can).
        self.successor: list[int] = [NULL_BLOCK_ID] * num_blocks
        self._remapped: list[int] = []  # logical ids whose fwd changed since take_remapped()
        self.requests: dict[str, list[int]] = {}
        self.num_live = 0
        self.digest = 0
        # pair_digest(l, fwd[l]) as of when l became live or last moved (stale while free),
        # so releases and moves XOR the stored values out (numpy, a batch at a time).
        self._live_digests = np.zeros(num_blocks, dtype=np.uint64)
        self._live = _SlotSet(num_blocks)
        self._expendable = _SlotSet(num_blocks)
        self._expendable.add(list(range(1, num_blocks)))
        self.pin_counts: list[int] = [0] * num_blocks
        self.num_pinned = 0  # logical ids (so slots) with a pin
        self._pinned = _SlotSet(num_blocks)
        self._held = _SlotSet(num_blocks)

    # --- predicates on physical slots -------------------------------------------------
    def is_expendable_slot(self, physical_id: int) -> bool:
        logical_id = self.bwd[physical_id]
        return (
            physical_id != NULL_BLOCK_ID
            and not self.refs[logical_id]
            and not self.cached[logical_id]
            and not self.pin_counts[logical_id]
        )

    def holds_data(self, physical_id: int) -> bool:
        """True when the slot's content must survive a move (live, or cached while free)."""
        return not self.is_expendable_slot(physical_id)

    # --- queries ----------------------------------------------------------------------
    @property
    def max_live(self) -> int:
        """Highest live physical id, 0 when nothing is live."""
        return self._live.max()

    def highest_live_slots(self, max_slots: int) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` live slots, highest first."""
        return self._live.highest(max_slots)

    def highest_movable_slots(self, max_slots: int) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` live slots that are not pinned, highest first."""
        if not self.num_pinned:
            return self._live.highest(max_slots)
        return self._live.highest(max_slots, excluded=self._pinned.mask)

    def max_pinned_live(self) -> int:
        """The highest live slot that is pinned, 0 when none is (O(pinned slots))."""
        if not self.num_pinned:
            return 0
        pinned = self._pinned.highest(self.num_pinned)
        live = pinned[self._live.mask[pinned]]
        return int(live[0]) if len(live) else 0

    def lowest_free_slots(self, max_slots: int, below: int) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` free slots (cached or not) that are not pinned, below
        ``below``, lowest first; never the null slot."""
        return self._held.lowest(max_slots, below, is_in=False)

    def are_pinned_slots(self, physical_ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """Whether each of ``physical_ids`` is pinned."""
        return self._pinned.mask[physical_ids]

    def lowest_expendable_slots(self, max_slots: int, below: int) -> npt.NDArray[np.intp]:
        """Up to ``max_slots`` expendable slots (free, holding nothing to keep) below
        ``below``, lowest first."""
        return self._expendable.lowest(max_slots, below, is_in=True)

    def live_mask(self, below: int) -> npt.NDArray[np.bool_]:
        """Whether each slot below ``below`` is live (a copy, index: slot)."""
        return self._live.mask[: max(below, 0)].copy()

    def expendable_mask(self, below: int) -> npt.NDArray[np.bool_]:
        """Whether each slot below ``below`` is expendable (a copy, index: slot)."""
        return self._expendable.mask[: max(below, 0)].copy()

    def are_cached_slots(self, physical_ids: npt.NDArray[np.intp]) -> npt.NDArray[np.bool_]:
        """Whether each of ``physical_ids`` (free slots, never the null slot) holds cached
        data (prefix caching).

        NOTE: read from the expendable set (one numpy call): a free slot other than the
        null one is expendable exactly when it is not cached.
        """
        return ~self._expendable.mask[physical_ids]

    # --- mutations --------------------------------------------------------------------
    def acquire(self, logical_id: int) -> bool:
        """Adds one reference; returns True when the block became live."""
        refs = self.refs[logical_id]
        self.refs[logical_id] = refs + 1
        if refs:
            return False
        self._make_live([logical_id])
        return True

    def evict(self, logical_id: int) -> None:
        """Marks a free block's content as no longer needed (a no-op for live blocks)."""
        if not self.refs[logical_id] and self.cached[logical_id]:
            self.cached[logical_id] = False
            if not self.pin_counts[logical_id]:
                self._expendable.add([self.fwd[logical_id]])

    def pin(self, logical_ids: list[int]) -> None:
        """Adds a pin to each of ``logical_ids`` (the null block is skipped): from now on
        the block keeps its slot, live or free, until as many ``unpin``."""
        pin_counts, fwd = self.pin_counts, self.fwd
        slots: list[int] = []
        for logical_id in logical_ids:
            if logical_id != NULL_BLOCK_ID:
                count = pin_counts[logical_id]
                pin_counts[logical_id] = count + 1
                if not count:
                    slots.append(fwd[logical_id])
        if not slots:
            return
        self.num_pinned += len(slots)
        self._pinned.add(slots)
        bwd, refs = self.bwd, self.refs
        self._held.add([slot for slot in slots if not refs[bwd[slot]]])
        self._expendable.remove([slot for slot in slots if self._expendable.mask[slot]])

    def unpin(self, logical_ids: list[int]) -> None:
        """Takes one pin off each of ``logical_ids`` (pinned by ``pin``); a block whose
        last pin goes may move again."""
        fwd = self.fwd
        released: list[int] = []
        _take_one(self.pin_counts, logical_ids, released, "pins")
        if not released:
            return
        self.num_pinned -= len(released)
        self._pinned.remove([fwd[logical_id] for logical_id in released])
        refs, cached = self.refs, self.cached
        free = [logical_id for logical_id in released if not refs[logical_id]]
        self._held.remove([fwd[logical_id] for logical_id in free])
        self._expendable.add([fwd[logical_id] for logical_id in free if not cached[logical_id]])

    def place_blocks(
        self, logical_ids: list[int], physical_ids: list[int], *, mix_digests: bool = True
    ) -> list[int]:
        """Commits a placement: each live block ``logical_ids[i]`` (each listed once) is
        re-pointed to ``physical_ids[i]`` (the mapping only, no copy). The targets are
        distinct; each is expendable, or the slot of another block of the batch. The
        expendable blocks on the targets the batch enters take the slots it leaves, in
        order.

        ``mix_digests=False``: the blocks became live with their digests unmixed
        (``append_requests(..., mix_digests=False)``); ``mix_live_digests`` mixes them in
        where placement leaves them.

        Returns:
            Every logical id whose slot changed.
        """
        if not logical_ids:
            return []
        fwd, bwd, refs, cached = self.fwd, self.bwd, self.refs, self.cached
        old_slots = [fwd[logical_id] for logical_id in logical_ids]
        old_set, target_set = set(old_slots), set(physical_ids)
        entering = [target for target in physical_ids if target not in old_set]
        leaving = [slot for slot in old_slots if slot not in target_set]
        displaced_ids = [bwd[target] for target in entering]
        assert len(target_set) == len(physical_ids) and len(entering) == len(leaving), (
            f"placement of logical blocks {logical_ids} onto slots {physical_ids}: the "
            "targets must be distinct"
        )
        assert all(refs[logical_id] for logical_id in logical_ids) and not any(
            refs[displaced_id] or cached[displaced_id] or not bwd_slot
            for displaced_id, bwd_slot in zip(displaced_ids, entering, strict=True)
        ), (
            f"placement of logical blocks {logical_ids} onto slots {physical_ids}: the "
            "blocks must be live and each target expendable or one of theirs"
        )
        for logical_id, target in zip(logical_ids, physical_ids, strict=True):
            fwd[logical_id] = target
            bwd[target] = logical_id
        for displaced_id, slot in zip(displaced_ids, leaving, strict=True):
            fwd[displaced_id] = slot
            bwd[slot] = displaced_id
        # NOTE: beyond a few slots, each list is converted to an array once and the chunk
        # counts computed once for both sets (64 placements in an 8k pool: ~42 -> ~37 µs).
        assert not self.num_pinned or not any(
            self._pinned.mask[slot] for slot in (*entering, *leaving)
        ), f"placement of logical blocks {logical_ids} onto slots {physical_ids}: a slot is pinned"
        # NOTE: no pinned slot takes part, so the held set changes as the live one does.
        if len(entering) <= _MAX_SCALAR_UPDATES:
            for slot_set in (self._live, self._held):
                slot_set.remove(leaving)
                slot_set.add(entering)
            self._expendable.add(leaving)
            self._expendable.remove(entering)
        elif entering:
            left = np.fromiter(leaving, np.intp, len(leaving))
            joined = np.fromiter(entering, np.intp, len(entering))
            delta = self._live.exchange(left, joined)
            self._held.exchange(left, joined)
            self._expendable.exchange_back(left, joined, delta)
        if mix_digests:
            self._update_live_digests(logical_ids, physical_ids)
        changed = logical_ids + displaced_ids
        self._remapped += changed
        return changed

    def move_live_blocks(self, src_ids: list[int], dst_ids: list[int]) -> list[int]:
        """Commits a compaction batch: live ``src_ids[i]`` and free ``dst_ids[i]`` trade
        logical ids (the pairs of ``_policy.plan_compaction``).

        Returns:
            Every logical id whose slot changed.
        """
        fwd, bwd, refs, cached = self.fwd, self.bwd, self.refs, self.cached
        moved_ids = [bwd[src] for src in src_ids]
        freed_ids = [bwd[dst] for dst in dst_ids]
        assert all(map(refs.__getitem__, moved_ids)), "compaction moves live blocks only"
        assert not any(map(refs.__getitem__, freed_ids)), "compaction targets free slots only"
        for moved_id, freed_id, src, dst in zip(
            moved_ids, freed_ids, src_ids, dst_ids, strict=True
        ):
            fwd[moved_id], fwd[freed_id] = dst, src
            bwd[dst], bwd[src] = moved_id, freed_id
        # NOTE: each batch of slots is converted to an array once, and the chunk counts
        # computed once for both sets (with 512 moves, four list conversions and bincounts
        # cost as much as the rest of the commit).
        src_slots = np.fromiter(src_ids, np.intp, len(src_ids))
        dst_slots = np.fromiter(dst_ids, np.intp, len(dst_ids))
        assert not self.num_pinned or not (
            self._pinned.mask[src_slots].any() or self._pinned.mask[dst_slots].any()
        ), "compaction moves no pinned block and takes no pinned slot"
        delta = self._live.exchange(src_slots, dst_slots)
        self._held.exchange(src_slots, dst_slots)
        # A free block that is not cached leaves an expendable slot (dst) for another (src).
        if not self.prefix_caching:  # no free block is cached
            self._expendable.exchange_back(src_slots, dst_slots, delta)
        else:
            uncached = [index for index, freed_id in enumerate(freed_ids) if not cached[freed_id]]
            if uncached:
                self._expendable.remove([dst_ids[index] for index in uncached])
                self._expendable.add([src_ids[index] for index in uncached])
        self._update_live_digests(moved_ids, dst_ids)
        changed = moved_ids + freed_ids
        self._remapped += changed
        return changed

    def _update_live_digests(self, logical_ids: list[int], physical_ids: list[int]) -> None:
        """Live blocks ``logical_ids`` (each listed once) now sit at ``physical_ids``:
        re-mixes their digests."""
        if not logical_ids:
            return
        live_digests = self._live_digests
        if len(logical_ids) < MIN_VECTOR_PAIRS:  # numpy's per-call cost would dominate
            digest = self.digest
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True):
                moved_digest = pair_digest(logical_id, physical_id)
                digest ^= int(live_digests[logical_id]) ^ moved_digest
                live_digests[logical_id] = moved_digest
            self.digest = digest
            return
        ids = np.asarray(logical_ids, dtype=np.intp)
        moved = pair_digest_array(ids, physical_ids)
        self.digest ^= int(np.bitwise_xor.reduce(live_digests[ids] ^ moved))
        live_digests[ids] = moved

    def take_remapped(self) -> list[int]:
        """Returns the logical ids whose ``fwd`` changed since the last call (repeats
        possible), and forgets them."""
        remapped, self._remapped = self._remapped, []
        return remapped

    # --- requests ---------------------------------------------------------------------
    def drop_request(self, request_id: str) -> bool:
        """Releases every reference a request holds; False if the request is unknown."""
        return self.drop_requests((request_id,)) == 1

    def drop_requests(self, request_ids: Iterable[str], freed_ids: list[int] | None = None) -> int:
        """``drop_request`` for each request, in order; returns how many were known.

        ``freed_ids``: when given, the blocks that became free are appended to it.
        """
        requests, refs = self.requests, self.refs
        if freed_ids is None:
            freed_ids = []
        num_freed_before = len(freed_ids)
        num_known = 0
        for request_id in request_ids:
            logical_ids = requests.pop(request_id, None)
            if logical_ids is None:
                continue
            num_known += 1
            _take_one(refs, logical_ids, freed_ids, "references")
        if len(freed_ids) > num_freed_before:
            self._free_blocks(freed_ids[num_freed_before:])
        return num_known

    def _free_blocks(self, logical_ids: list[int]) -> None:
        """Bookkeeping of blocks whose last reference just went (refs already 0); a block
        that becomes free is cached under prefix caching."""
        fwd, cached, caching = self.fwd, self.cached, self.prefix_caching
        physical_ids = [fwd[logical_id] for logical_id in logical_ids]  # never the null slot
        for logical_id in logical_ids:
            cached[logical_id] = caching
        self.digest ^= int(
            np.bitwise_xor.reduce(self._live_digests[np.asarray(logical_ids, dtype=np.intp)])
        )
        self.num_live -= len(logical_ids)
        self._live.remove(physical_ids)
        if not self.num_pinned:
            self._held.remove(physical_ids)
            if not caching:
                self._expendable.add(physical_ids)
            return
        pin_counts = self.pin_counts
        unpinned = [
            physical_id
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True)
            if not pin_counts[logical_id]
        ]
        self._held.remove(unpinned)
        if not caching:
            self._expendable.add(unpinned)

    def append_blocks(self, request_id: str, logical_ids: list[int]) -> list[int]:
        """Adds references for a request's new blocks; returns those that became live.

        A request that would hold no block but the null block is not kept (it holds
        nothing to track, and would stay forever if the scheduler never finishes it).
        """
        return self.append_requests({request_id: logical_ids})

    def append_requests(
        self, lists: Mapping[str, list[int]], *, mix_digests: bool = True
    ) -> list[int]:
        """``append_blocks`` for every request of ``lists``, in order; returns the blocks
        that became live.

        ``mix_digests=False`` leaves the blocks that became live out of ``digest`` until
        the caller passes them to ``mix_live_digests``: a step mixes them in once, after
        placement has re-pointed most of them, not at their first slot and again at their
        new one. Until then, nothing may read ``digest``, and only
        ``place_blocks(..., mix_digests=False)`` may move those blocks.
        """
        requests, refs, successor = self.requests, self.refs, self.successor
        became_live: list[int] = []
        for request_id, logical_ids in lists.items():
            held = requests.get(request_id)
            if held is None:
                if all(logical_id == NULL_BLOCK_ID for logical_id in logical_ids):
                    continue
                held = requests[request_id] = []
            previous_id = held[-1] if held else NULL_BLOCK_ID
            held.extend(logical_ids)
            for logical_id in logical_ids:
                successor[previous_id] = logical_id
                previous_id = logical_id
                if logical_id != NULL_BLOCK_ID:
                    count = refs[logical_id]
                    refs[logical_id] = count + 1
                    if not count:
                        became_live.append(logical_id)
        if became_live:
            self._make_live(became_live, mix_digests)
        return became_live

    def _make_live(self, logical_ids: list[int], mix_digests: bool = True) -> None:
        """Bookkeeping of blocks that just got their first reference (refs already 1)."""
        fwd = self.fwd
        physical_ids = [fwd[logical_id] for logical_id in logical_ids]
        if mix_digests:
            self._mix_digests(logical_ids, physical_ids)
        self.num_live += len(logical_ids)
        self._live.add(physical_ids)
        # A slot that held a free block was expendable unless the block was cached or
        # pinned (and held already when pinned).
        cached, pin_counts = self.cached, self.pin_counts
        if not self.num_pinned:
            self._held.add(physical_ids)
            self._expendable.remove(
                [
                    physical_id
                    for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True)
                    if not cached[logical_id]
                ]
            )
            return
        unpinned = [
            (logical_id, physical_id)
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True)
            if not pin_counts[logical_id]
        ]
        self._held.add([physical_id for _, physical_id in unpinned])
        self._expendable.remove(
            [physical_id for logical_id, physical_id in unpinned if not cached[logical_id]]
        )

    def mix_live_digests(self, logical_ids: list[int]) -> None:
        """Mixes blocks that became live unmixed (``append_requests(..., mix_digests=False)``,
        each listed once) into ``digest`` at their slots now."""
        if logical_ids:
            fwd = self.fwd
            self._mix_digests(logical_ids, [fwd[logical_id] for logical_id in logical_ids])

    def _mix_digests(self, logical_ids: list[int], physical_ids: list[int]) -> None:
        """Live blocks ``logical_ids`` not in ``digest`` now sit at ``physical_ids``: mixes
        them in."""
        live_digests = self._live_digests
        if len(logical_ids) < MIN_VECTOR_PAIRS:  # numpy's per-call cost would dominate
            digest = self.digest
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True):
                became_live = pair_digest(logical_id, physical_id)
                live_digests[logical_id] = became_live
                digest ^= became_live
            self.digest = digest
        else:
            mixed = pair_digest_array(logical_ids, physical_ids)
            live_digests[np.asarray(logical_ids, dtype=np.intp)] = mixed
            self.digest ^= int(np.bitwise_xor.reduce(mixed))


def _take_one(counts: list[int], logical_ids: list[int], zeroed: list[int], what: str) -> None:
    """Takes one off ``counts`` of each of ``logical_ids`` (the null block skipped) and
    appends to ``zeroed`` the ids whose count reaches 0 (``what`` the counts count)."""
    for logical_id in logical_ids:
        if logical_id != NULL_BLOCK_ID:
            count = counts[logical_id]
            assert count > 0, f"logical block {logical_id} has no {what} to release"
            counts[logical_id] = count - 1
            if count == 1:
                zeroed.append(logical_id)
