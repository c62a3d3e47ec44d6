"""The compaction policy: when to compact, where fresh blocks go, which blocks move.

Everything kvdefrag decides about packing is decided in this module, from the tracker's
queries (``highest_live_slots``, ``lowest_free_slots``, ``lowest_expendable_slots``,
``are_cached_slots``, ``fwd``); the tracker keeps the state and applies the decisions
(``place_blocks``, ``move_live_blocks``), and the engine carries them out in between.

* **Trigger.** A step compacts when the holes below the highest live slot
  (``max_live - num_live``) exceed ``threshold``, or when a pass was scheduled.
  With ``decode_buckets`` set (a backend whose decode reads the first
  ``decode_bucket(max_live + 1)`` blocks: Gaudi's contiguous paged attention), the
  threshold is not used: a step compacts only when moves within ``max_moves_per_step``
  bring ``max_live + 1`` into a lower bucket (*bucket-aware* compaction); holes inside
  the bucket cost nothing and stay.
* **Placement.** A fresh block (allocated this step, holding no data yet) is re-pointed
  for free (only the mapping changes; nothing is copied) so that each request's blocks
  run on in consecutive slots: a segment of fresh blocks extends the request's run,
  else takes the fewest runs among the free slots and its own; a single new block (a
  decode step's) takes the lowest *expendable* slot below it (free, not holding cached
  data). No block goes up past the bucket the live blocks run in.
* **Pairing.** A step's pass moves whole runs (a request's blocks in consecutive slots),
  highest first, each into the lowest range of free slots below it that holds it, at
  most ``max_moves_per_step`` blocks, and stops at a run no range holds; with prefix
  caching, or when no run fits, it packs as a scheduled pass does. A scheduled
  pass pairs the highest live slots with the lowest free slots, again and again, while
  the free slot is below the live one; when the cap stops it early, a cached destination
  gives way to an empty slot that still lies below the highest live slot that stays (a
  copy instead of a swap, the pool as packed). Either way a block only ever moves down;
  slot 0 (the null block) is never a candidate, and the blocks of a pass keep their
  order (runs stay runs where the destinations allow).
* **Bucket-aware pairing.** With buckets, the pass aims at the lowest bucket that can
  hold every live block and every live block the cap leaves in place, and moves only the
  live blocks at or above that bucket's size, into the lowest free slots (all below it).
  A scheduled pass packs as without buckets.
* **Move kind.** A destination that holds cached data (prefix caching) swaps contents
  with the source (two-way); otherwise the source is copied one way. A source that holds
  no data yet (a fresh block of this step, which placement found no empty slot for) has
  nothing to copy down: only the cached data is copied up, one way, into the source's
  slot (``plan_copies``; the mapping changes as for a swap).

* **Pins.** A pinned block (a KV transfer reads or writes it outside the worker's passes)
  is never a source, a destination or a placement target, live or free: the queries
  above leave pinned slots out (``highest_movable_slots``, ``lowest_free_slots`` and
  the expendable slots), and passes pack around them.

Deterministic: the same tracker state and config give the same decisions (no hashing,
no set iteration), so every rank of a tensor-parallel worker plans identically. Planning
changes nothing: a plan is committed by the tracker, or dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvdefrag.common import NULL_BLOCK_ID
from kvdefrag.server._moves import MoveBatch
from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server.buckets import decode_bucket
from kvdefrag.server.config import EngineConfig


def should_compact(tracker: BlockTracker, config: EngineConfig, *, is_forced: bool) -> bool:
    """The trigger: a pass scheduled by the operator; otherwise holes above the threshold
    or, with ``decode_buckets``, live blocks that packed would fit a lower bucket.

    With buckets this is necessary, not sufficient: ``plan_compaction`` plans nothing when
    the move cap cannot reach a lower bucket.
    """
    if is_forced:
        return True
    buckets = config.decode_buckets
    if not buckets:
        return tracker.max_live - tracker.num_live > config.threshold
    # Packed, the live blocks and the null block fill slots 0..num_live.
    num_blocks = tracker.num_blocks
    return decode_bucket(buckets, tracker.num_live + 1, num_blocks) < decode_bucket(
        buckets, tracker.max_live + 1, num_blocks
    )


def plan_placement(
    tracker: BlockTracker,
    fresh_ids: Iterable[int],
    lists: Sequence[Mapping[str, Sequence[int]]] = (),
    *,
    decode_buckets: Sequence[int] = (),
    max_holes: int | None = None,
) -> tuple[list[int], list[int]]:
    """Picks a slot for each fresh block (repeats ignored); commit with
    ``BlockTracker.place_blocks``.

    A fresh block holds no data, so it may go to any expendable slot, or to a slot
    another fresh block of the batch leaves, for free. ``lists`` are the step's resumed
    and appended lists (request id -> logical ids, as the step names them, after the
    tracker appended them). In each, a *segment* is a maximal sequence of consecutive
    fresh blocks; segments are placed in the order the lists name them:

    1. **Extend**: for a segment of two or more blocks, block by block, the slot after
       the one before it in the request's list, while that slot is free (or the block's
       own): the request's run grows.
    2. **A run**: the rest of a segment of two or more blocks goes to the slots that
       hold it in the fewest runs, among the free slots and the segment's own (the
       lowest range that holds it whole, else the longest ranges, ascending), unless
       that leaves more than ``max_holes`` of those slots free below it (the holes
       compaction would then copy blocks into: ``threshold`` without decode buckets):
       then to the lowest of them, in order.
    3. **Lowest**: a segment of one block goes to the lowest free slot below its own, as
       do the fresh blocks outside ``lists``.

    No block goes above its own slot unless the target lies below the *ceiling*: the
    pool without decode buckets; with them, the decode bucket that the blocks already
    in place run in (decode reads it whatever the layout). So a run never raises the
    bucket. The trade-offs are explained in docs/design/step.md (Runs).

    Returns:
        The logical ids to re-point, and the slot each goes to, position by position:
        the targets are distinct, each free or the own slot of a block of the batch.

    NOTE: the planner keeps its own view of the slots (``_FreeSlots``): what the tracker
    says is expendable, the slots taken so far, and the own slots of the blocks placed
    elsewhere (free from then on).
    """
    fwd = tracker.fwd
    fresh_order = list(dict.fromkeys(fresh_ids))
    placed_ids: list[int] = []
    targets: list[int] = []
    if not fresh_order:
        return placed_ids, targets
    free = _FreeSlots(tracker, len(fresh_order), max(fwd[logical_id] for logical_id in fresh_order))
    fresh_set = set(fresh_order)
    planned: dict[int, int] = {}  # logical id -> its slot after the plan

    def commit(logical_id: int, target: int) -> None:
        planned[logical_id] = target
        own = fwd[logical_id]
        if target != own:
            free.take(target, vacated=own)
            placed_ids.append(logical_id)
            targets.append(target)

    ceiling = _placement_ceiling(tracker, fresh_order, decode_buckets)
    for request_lists in lists:
        for request_id, appended in request_lists.items():
            held = tracker.requests.get(request_id)
            if held is None:
                continue
            offset = len(held) - len(appended)
            for start, stop in _fresh_segments(appended, fresh_set, planned):
                index = offset + start
                prev_id = held[index - 1] if index else NULL_BLOCK_ID
                prev_slot = planned.get(prev_id, fwd[prev_id])  # 0 for the null block
                segment = list(appended[start:stop])
                # 1. extend the run that ends just before the segment
                while len(segment) >= 2 and prev_slot:
                    own = fwd[segment[0]]
                    target = prev_slot + 1
                    if target != own and (
                        target >= max(ceiling, own + 1) or not free.is_free(target)
                    ):
                        break
                    commit(segment.pop(0), target)
                    prev_slot = target
                # 2. the fewest runs for the rest
                if len(segment) >= 2:
                    own_slots = [fwd[logical_id] for logical_id in segment]
                    limit = max(ceiling, max(own_slots) + 1)
                    slots = free.fewest_runs(own_slots, limit, max_holes)
                    for logical_id, target in zip(segment, slots, strict=True):
                        commit(logical_id, target)
                    segment = []
                # 3. the lowest slot
                for logical_id in segment:
                    _place_lowest(free, logical_id, fwd[logical_id], commit)
    for logical_id in fresh_order:
        if logical_id not in planned:
            _place_lowest(free, logical_id, fwd[logical_id], commit)
    return placed_ids, targets


def _placement_ceiling(
    tracker: BlockTracker, fresh_order: list[int], decode_buckets: Sequence[int]
) -> int:
    """The slots below which a fresh block may go above its own: the pool, or with
    decode buckets the bucket that the blocks already in place (not this step's fresh
    ones) run in."""
    num_blocks = tracker.num_blocks
    if not decode_buckets:
        return num_blocks
    fwd = tracker.fwd
    fresh_slots = {fwd[logical_id] for logical_id in fresh_order}
    settled = tracker.highest_live_slots(len(fresh_slots) + 1).tolist()
    max_settled = next((slot for slot in settled if slot not in fresh_slots), 0)
    return decode_bucket(decode_buckets, max_settled + 1, num_blocks)


def _fresh_segments(
    logical_ids: Sequence[int], fresh_set: set[int], done: Mapping[int, int]
) -> list[tuple[int, int]]:
    """``(start, stop)`` of each maximal sequence of fresh blocks not yet placed."""
    segments = []
    start = None
    for index, logical_id in enumerate(logical_ids):
        is_fresh = logical_id in fresh_set and logical_id not in done
        if is_fresh and start is None:
            start = index
        elif not is_fresh and start is not None:
            segments.append((start, index))
            start = None
    if start is not None:
        segments.append((start, len(logical_ids)))
    return segments


def _place_lowest(
    free: _FreeSlots, logical_id: int, own: int, commit: Callable[[int, int], None]
) -> None:
    target = free.lowest(below=own)
    commit(logical_id, own if target is None else target)


class _FreeSlots:
    """The slots a placement batch may still give: the tracker's expendable ones and
    the own slots of blocks placed elsewhere, minus those taken.

    NOTE: two reads of the tracker, each only when needed: the lowest expendable slots
    below the highest fresh one (the chunk index, cheap: a decode step needs no more),
    and the expendable mask below a ceiling (a pass over the pool: only for a segment of
    two or more blocks that cannot extend its run).
    """

    def __init__(self, tracker: BlockTracker, num_fresh: int, highest_fresh: int) -> None:
        self._tracker = tracker
        self._num_fresh = num_fresh
        self._highest_fresh = highest_fresh
        self._taken: set[int] = set()
        self._vacated: list[int] = []  # a min-heap; entries taken again are skipped
        self._vacated_set: set[int] = set()
        self._lowest: list[int] | None = None
        self._next_lowest = 0

    def is_free(self, physical_id: int) -> bool:
        if physical_id >= self._tracker.num_blocks or physical_id in self._taken:
            return False
        return physical_id in self._vacated_set or self._tracker.is_expendable_slot(physical_id)

    def take(self, physical_id: int, *, vacated: int) -> None:
        """Gives ``physical_id`` to a block that leaves ``vacated`` (free from now on,
        unless a block of the batch already took it)."""
        self._taken.add(physical_id)
        self._vacated_set.discard(physical_id)
        if vacated not in self._taken:
            heapq.heappush(self._vacated, vacated)
            self._vacated_set.add(vacated)

    def lowest(self, below: int) -> int | None:
        """The lowest free slot below ``below``, or None."""
        if self._lowest is None:
            # At most one slot taken per fresh block, at most one wanted per fresh block.
            self._lowest = self._tracker.lowest_expendable_slots(
                2 * self._num_fresh, self._highest_fresh
            ).tolist()
        lowest, taken = self._lowest, self._taken
        while self._next_lowest < len(lowest) and lowest[self._next_lowest] in taken:
            self._next_lowest += 1
        best = lowest[self._next_lowest] if self._next_lowest < len(lowest) else None
        vacated = self._vacated
        while vacated and vacated[0] not in self._vacated_set:
            heapq.heappop(vacated)
        if vacated and (best is None or vacated[0] < best):
            best = vacated[0]
        return best if best is not None and best < below else None

    def fewest_runs(self, own_slots: list[int], below: int, max_holes: int | None) -> list[int]:
        """``len(own_slots)`` slots, ascending, among the free ones below ``below`` and
        ``own_slots`` (those of the blocks to place), in the fewest runs: the lowest run
        that holds them all, else the longest runs (the lower of equals first). When
        those would leave more than ``max_holes`` slots below their highest that no live
        block holds (None: no bound), the lowest ones instead (as packed as it gets)."""
        size = len(own_slots)
        mask = self._tracker.expendable_mask(below)
        for slot in self._taken:
            if slot < below:
                mask[slot] = False
        for slot in self._vacated_set:
            if slot < below:
                mask[slot] = True
        mask[own_slots] = True
        edges = np.diff(mask.view(np.int8), prepend=np.int8(0), append=np.int8(0))
        starts, stops = (edges == 1).nonzero()[0], (edges == -1).nonzero()[0]
        lengths = stops - starts
        whole = (lengths >= size).nonzero()[0]
        if len(whole):
            first = int(starts[whole[0]])
            slots = list(range(first, first + size))
        else:
            order = np.lexsort((starts, -lengths))
            chosen: list[tuple[int, int]] = []
            num_slots = 0
            for index in order.tolist():
                length = min(int(lengths[index]), size - num_slots)
                chosen.append((int(starts[index]), length))
                num_slots += length
                if num_slots == size:
                    break
            slots = [slot for start, run in sorted(chosen) for slot in range(start, start + run)]
        if max_holes is not None and self._holes_below(own_slots, slots) > max_holes:
            lowest: list[int] = mask.nonzero()[0][:size].tolist()
            return lowest
        return slots

    def _holes_below(self, own_slots: list[int], slots: list[int]) -> int:
        """The slots below the highest of ``slots`` that no live block holds once the
        blocks on ``own_slots`` move to ``slots`` (cached free slots count: compaction
        counts them as holes too)."""
        top = slots[-1]
        live = self._tracker.live_mask(top + 1)
        live[[slot for slot in own_slots if slot <= top]] = False
        live[slots] = True
        return top - int(live[1:].sum())


def plan_compaction(
    tracker: BlockTracker,
    config: EngineConfig,
    *,
    is_forced: bool = False,
    placed_ids: Iterable[int] = (),
) -> MoveBatch:
    """Plans a pass: the live slots that move down and where (nothing changes until the
    caller commits them with ``BlockTracker.move_live_blocks``).

    A step's pass moves whole runs (``_plan_run_compaction``); with ``decode_buckets``,
    only the blocks whose moves lower the decode bucket (``_plan_bucket_compaction``). A
    scheduled pass (``is_forced``), a step's under prefix caching (a whole run would swap
    with cached blocks, two copies each), or a step's when no run can move whole (then
    not the fresh blocks ``placed_ids`` that placement laid out this step), packs: the
    highest live slots leave for the lowest free slots (never the null slot) while the
    free one is below, at most ``max_moves_per_step``; with prefix caching, cached
    destinations then give way to empty ones (``_prefer_empty``). The blocks keep their
    order (``_pair_runs``).
    """
    if config.decode_buckets and not is_forced:
        return _plan_bucket_compaction(tracker, config)
    max_pairs = config.max_moves_per_step  # >= 1 (EngineConfig checks it)
    if is_forced or tracker.prefix_caching:
        src = tracker.highest_movable_slots(max_pairs + 1)  # one more: the highest that stays
    else:
        runs = _plan_run_compaction(tracker, config)
        if runs:
            return runs
        # The runs placement just laid out stay where they are (the next step may move
        # them): the step's fresh blocks are not sources.
        fwd = tracker.fwd
        placed = np.fromiter({fwd[logical_id] for logical_id in placed_ids}, np.intp)
        src = tracker.highest_movable_slots(max_pairs + 1 + len(placed))
        src = src[~np.isin(src, placed)][: max_pairs + 1]
    if not len(src):
        return MoveBatch([], [])
    dst = tracker.lowest_free_slots(min(len(src), max_pairs), below=int(src[0]))
    num_pairs = int(np.count_nonzero(dst < src[: len(dst)]))  # a prefix: src falls, dst rises
    dst = dst[:num_pairs]
    src_slots = src[:num_pairs]
    # A free destination holds data only when it is cached (prefix caching).
    if tracker.prefix_caching and num_pairs and num_pairs < len(src):
        dst = _prefer_empty(tracker, dst, stays=int(src[num_pairs]))
    return _pair_runs(tracker, src_slots, dst)


def plan_copies(tracker: BlockTracker, moves: MoveBatch, fresh_ids: Iterable[int]) -> MoveBatch:
    """The KV copies that carry out ``moves`` (planned by ``plan_compaction``, not yet
    committed): each move as planned, except a swap whose source is a fresh block
    (``fresh_ids``: logical ids that hold no data yet), which becomes the one-way copy of
    the destination's cached data into the source's slot (``Move(dst, src, False)``, the
    only move that goes up): half the transfers, the same mapping once committed.
    """
    if not moves.num_two_way:
        return moves
    fwd = tracker.fwd
    fresh_slots = {fwd[logical_id] for logical_id in fresh_ids}
    if fresh_slots.isdisjoint(moves.src_ids):
        return moves
    src_ids: list[int] = []
    dst_ids: list[int] = []
    is_two_way: list[bool] = []
    for src, dst, is_swap in zip(moves.src_ids, moves.dst_ids, moves.is_two_way, strict=True):
        if is_swap and src in fresh_slots:
            src, dst, is_swap = dst, src, False
        src_ids.append(src)
        dst_ids.append(dst)
        is_two_way.append(is_swap)
    return MoveBatch(src_ids, dst_ids, is_two_way)


def _plan_bucket_compaction(tracker: BlockTracker, config: EngineConfig) -> MoveBatch:
    """The fewest moves that bring ``max_live + 1`` into the lowest decode bucket within
    reach, or none when no lower bucket is within reach.

    The target is the smallest bucket that holds ``num_live + 1`` slots (every live block
    and the null block) and, when the cap binds, the highest live slot that cannot move
    (the ``max_moves_per_step + 1``-th highest). Every live slot at or above the target's
    size moves, highest first, to the lowest free slots, which all lie below it: the
    target holds ``num_live + 1`` slots, so it has a free slot for each block it lacks.

    Invariant: planned moves always lower the bucket of ``max_live + 1``; holes that do
    not change the bucket never cause a move.
    """
    max_pairs = config.max_moves_per_step
    src = tracker.highest_movable_slots(max_pairs + 1)  # one more: the highest that stays
    if not len(src):
        return MoveBatch([], [])
    buckets, num_blocks = config.decode_buckets, tracker.num_blocks
    # A pinned live block stays where it is, so the bucket holds it whatever moves.
    floor = max(tracker.num_live, tracker.max_pinned_live()) + 1
    if len(src) > max_pairs:
        floor = max(floor, int(src[max_pairs]) + 1)
    target = decode_bucket(buckets, floor, num_blocks)
    if target >= decode_bucket(buckets, int(src[0]) + 1, num_blocks):
        return MoveBatch([], [])
    num_pairs = int(np.count_nonzero(src >= target))  # a prefix: src falls
    dst = tracker.lowest_free_slots(num_pairs, below=target)
    if len(dst) < num_pairs:
        # Only pinned free slots can fill the target's room (packed, the target holds
        # every live block and the null block): the pass waits for their transfers.
        assert tracker.num_pinned, f"{num_pairs} moves, {len(dst)} free slots below {target}"
        return MoveBatch([], [])
    if tracker.prefix_caching:
        dst = _prefer_empty(tracker, dst, stays=target)
    return _pair_runs(tracker, src[:num_pairs], dst)


def _plan_run_compaction(tracker: BlockTracker, config: EngineConfig) -> MoveBatch:
    """Moves the highest runs down whole: each run of consecutive live slots that a
    request holds in order (``BlockTracker.successor``), highest first, goes to the
    lowest range of free slots below it that holds it whole, while the cap allows; the
    pass stops at the first run no range holds (moving the runs below it would not
    lower the highest live slot).

    A run that extends below the highest ``max_moves_per_step + 1`` live slots is not
    moved (its length is not known, and a part of it would split it).
    """
    max_pairs = config.max_moves_per_step
    src = tracker.highest_movable_slots(max_pairs + 1)
    if not len(src):
        return MoveBatch([], [])
    free = tracker.lowest_free_slots(max_pairs, below=int(src[0]))
    if not len(free):
        return MoveBatch([], [])
    holes = [list(hole) for hole in _ranges(free.tolist())]  # [start, stop), ascending
    bwd, successor = tracker.bwd, tracker.successor
    src_ids: list[int] = []
    dst_ids: list[int] = []
    slots: list[int] = src.tolist()  # descending
    is_all = len(slots) <= max_pairs  # every live slot read: the lowest run ends there
    top = 0
    while top < len(slots):
        bottom = top
        while (
            bottom + 1 < len(slots)
            and slots[bottom + 1] + 1 == slots[bottom]
            and successor[bwd[slots[bottom + 1]]] == bwd[slots[bottom]]
        ):
            bottom += 1
        if bottom == len(slots) - 1 and not is_all:
            break  # the run may go on below the slots read
        first, length = slots[bottom], bottom - top + 1
        if len(src_ids) + length > max_pairs:
            break
        hole = next((hole for hole in holes if hole[1] - hole[0] >= length), None)
        if hole is None or hole[0] + length > first:
            break
        src_ids += range(first, first + length)
        dst_ids += range(hole[0], hole[0] + length)
        hole[0] += length
        top = bottom + 1
    if not tracker.prefix_caching:
        return MoveBatch(src_ids, dst_ids)
    cached = tracker.are_cached_slots(np.asarray(dst_ids, dtype=np.intp)).tolist()
    return MoveBatch(src_ids, dst_ids, cached)


def _pair_runs(
    tracker: BlockTracker, src: npt.NDArray[np.intp], dst: npt.NDArray[np.intp]
) -> MoveBatch:
    """Pairs the slots that leave (``src``) with the slots they go to (``dst``, as many,
    ascending, all below every source) so that runs stay runs.

    Which source goes where changes neither the moves nor the slots live afterwards,
    only the order of the blocks: each run of consecutive sources, longest first, goes
    whole to the lowest range of consecutive destinations that holds it; the sources
    left over fill the destinations left over in ascending order (a run cut where the
    ranges end).
    """
    src_slots = sorted(src.tolist())
    dst_slots: list[int] = dst.tolist()
    runs = _ranges(src_slots)
    holes = _ranges(dst_slots)  # [start, stop) of consecutive destinations, ascending
    pairs: dict[int, int] = {}
    for start, stop in sorted(runs, key=lambda run: (run[0] - run[1], -run[0])):
        length = stop - start
        for index, (hole_start, hole_stop) in enumerate(holes):
            if hole_stop - hole_start >= length:
                for offset in range(length):
                    pairs[start + offset] = hole_start + offset
                holes[index] = (hole_start + length, hole_stop)
                break
    left_dst = [slot for hole_start, hole_stop in holes for slot in range(hole_start, hole_stop)]
    left_src = [slot for slot in src_slots if slot not in pairs]
    pairs.update(zip(left_src, left_dst, strict=True))
    src_ids = sorted(pairs)
    dst_ids = [pairs[slot] for slot in src_ids]
    if not tracker.prefix_caching:
        return MoveBatch(src_ids, dst_ids)
    cached = tracker.are_cached_slots(np.asarray(dst_ids, dtype=np.intp)).tolist()
    return MoveBatch(src_ids, dst_ids, cached)


def _ranges(ascending_slots: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of consecutive slots, ascending."""
    ranges: list[tuple[int, int]] = []
    for slot in ascending_slots:
        if ranges and ranges[-1][1] == slot:
            ranges[-1] = (ranges[-1][0], slot + 1)
        else:
            ranges.append((slot, slot + 1))
    return ranges


def _prefer_empty(
    tracker: BlockTracker, dst: npt.NDArray[np.intp], stays: int
) -> npt.NDArray[np.intp]:
    """Swaps cached destinations, highest first, for empty slots in ``(dst[-1], stays)``.

    A cached destination costs a swap (twice the transfers of a one-way copy). Every
    destination stays below ``stays`` (a live slot that does not move, or the target
    bucket's size) and so below every source: the same sources leave the top, and the
    highest live slot after the moves stays below ``stays``.

    Returns:
        The destinations, ascending.
    """
    is_cached = tracker.are_cached_slots(dst)
    num_cached = int(np.count_nonzero(is_cached))
    if not num_cached or stays <= int(dst[-1]) + 1:
        return dst
    empty = tracker.lowest_expendable_slots(num_cached + len(dst), stays)
    empty = empty[empty > dst[-1]][:num_cached]
    if not len(empty):
        return dst
    keep = np.ones(len(dst), dtype=np.bool_)
    keep[np.flatnonzero(is_cached)[::-1][: len(empty)]] = False
    return np.sort(np.concatenate([dst[keep], empty]))
