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
  to the lowest *expendable* slot below it: free and not holding cached data. Only the
  mapping changes; nothing is copied.
* **Pairing.** Compaction pairs the highest live slot with the lowest free slot, again
  and again, while the free slot is below the live one, at most ``max_moves_per_step``
  times. A block only ever moves down; slot 0 (the null block) is never a candidate.
  When the cap stops the pass early, a cached destination gives way to an empty slot
  that still lies below the highest live slot that stays (a copy instead of a swap, the
  pool as packed).
* **Bucket-aware pairing.** With buckets, the pass aims at the lowest bucket that can
  hold every live block and every live block the cap leaves in place, and moves only the
  live blocks at or above that bucket's size, into the lowest free slots (all below it).
  A scheduled pass packs as the threshold policy does.
* **Move kind.** A destination that holds cached data (prefix caching) swaps contents
  with the source (two-way); otherwise the source is copied one way. A source that holds
  no data yet (a fresh block of this step, which placement found no empty slot for) has
  nothing to copy down: only the cached data is copied up, one way, into the source's
  slot (``plan_copies``; the mapping changes as for a swap).

Deterministic: the same tracker state and config give the same decisions (no hashing,
no set iteration), so every rank of a tensor-parallel worker plans identically. Planning
changes nothing: a plan is committed by the tracker, or dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

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


def plan_placement(tracker: BlockTracker, fresh_ids: Iterable[int]) -> tuple[list[int], list[int]]:
    """Picks, for each fresh block in order (repeats ignored), the lowest expendable slot
    if it lies below the block's own; commit with ``BlockTracker.place_blocks``.

    A slot a block vacates is expendable from then on, so a later block of the batch may
    take it when it is the lowest.

    Returns:
        The logical ids to re-point, and the slot each goes to, position by position.

    NOTE: one pass: the candidates are read once (as many as there are fresh blocks, below
    the highest of their slots), a sentinel past the last one stands for "none left", and
    the vacated slots are a min-heap that ``heapreplace`` pops and pushes in one call.
    No placement changes the slot of a later block: targets are expendable, and fresh
    blocks are live.
    """
    fwd = tracker.fwd
    logical_ids = list(dict.fromkeys(fresh_ids))
    if not logical_ids:
        return [], []
    physical_ids = [fwd[logical_id] for logical_id in logical_ids]
    candidates: list[int] = tracker.lowest_expendable_slots(
        len(logical_ids), max(physical_ids)
    ).tolist()
    candidates.append(tracker.num_blocks)  # past the last: above every slot, never taken
    next_candidate = 0
    vacated: list[int] = []  # a min-heap of the slots vacated so far (expendable too)
    placed_ids: list[int] = []
    targets: list[int] = []
    for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True):
        target = candidates[next_candidate]
        if vacated and vacated[0] < target:  # a slot vacated earlier in this batch
            target = vacated[0]
            if target > physical_id:
                continue
            heapq.heapreplace(vacated, physical_id)
        else:
            if target > physical_id:
                continue
            next_candidate += 1
            heapq.heappush(vacated, physical_id)
        placed_ids.append(logical_id)
        targets.append(target)
    return placed_ids, targets


def plan_compaction(
    tracker: BlockTracker, config: EngineConfig, *, is_forced: bool = False
) -> MoveBatch:
    """Pairs the highest live slots with the lowest free slots below them (nothing
    changes until the caller commits them with ``BlockTracker.move_live_blocks``).

    The i-th highest live slot goes to the i-th lowest free slot (never the null slot),
    while the free one is below, at most ``max_moves_per_step`` pairs; with prefix
    caching, cached destinations then give way to empty ones (``_prefer_empty``). With
    ``decode_buckets`` and no scheduled pass (``is_forced``), only the pairs that lower
    the decode bucket (``_plan_bucket_compaction``).
    """
    if config.decode_buckets and not is_forced:
        return _plan_bucket_compaction(tracker, config)
    max_pairs = config.max_moves_per_step  # >= 1 (EngineConfig checks it)
    src = tracker.highest_live_slots(max_pairs + 1)  # one more: the highest that stays
    if not len(src):
        return MoveBatch([], [])
    dst = tracker.lowest_free_slots(min(len(src), max_pairs), below=int(src[0]))
    num_pairs = int(np.count_nonzero(dst < src[: len(dst)]))  # a prefix: src falls, dst rises
    dst = dst[:num_pairs]
    src_ids: list[int] = src[:num_pairs].tolist()
    # A free destination holds data only when it is cached (prefix caching).
    if not tracker.prefix_caching:
        return MoveBatch(src_ids, dst.tolist())
    if num_pairs and num_pairs < len(src):
        dst = _prefer_empty(tracker, dst, stays=int(src[num_pairs]))
    return MoveBatch(src_ids, dst.tolist(), tracker.are_cached_slots(dst).tolist())


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
    src = tracker.highest_live_slots(max_pairs + 1)  # one more: the highest that stays
    if not len(src):
        return MoveBatch([], [])
    buckets, num_blocks = config.decode_buckets, tracker.num_blocks
    floor = tracker.num_live + 1
    if len(src) > max_pairs:
        floor = max(floor, int(src[max_pairs]) + 1)
    target = decode_bucket(buckets, floor, num_blocks)
    if target >= decode_bucket(buckets, int(src[0]) + 1, num_blocks):
        return MoveBatch([], [])
    num_pairs = int(np.count_nonzero(src >= target))  # a prefix: src falls
    dst = tracker.lowest_free_slots(num_pairs, below=target)
    assert len(dst) == num_pairs, f"{num_pairs} moves, {len(dst)} free slots below {target}"
    src_ids: list[int] = src[:num_pairs].tolist()
    if not tracker.prefix_caching:
        return MoveBatch(src_ids, dst.tolist())
    dst = _prefer_empty(tracker, dst, stays=target)
    return MoveBatch(src_ids, dst.tolist(), tracker.are_cached_slots(dst).tolist())


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
