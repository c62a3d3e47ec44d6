"""Compaction planner: which live blocks move to which holes.

Reads the tracker, never changes what it means (slots it takes from the tracker's heaps
are handed back before it returns). Deterministic: the same state gives the same plan.
"""

from __future__ import annotations

from typing import NamedTuple

from kvdefrag.server._tracker import BlockTracker


class Move(NamedTuple):
    """One block move in physical space.

    Attributes:
        src_physical_id: A live slot high in the pool.
        dst_physical_id: A free slot below it.
        is_two_way: The destination holds cached data, so the two slots swap contents;
            otherwise the source is copied one way and the destination's content dropped.
    """

    src_physical_id: int
    dst_physical_id: int
    is_two_way: bool


def plan_compaction(tracker: BlockTracker, max_moves: int) -> list[Move]:
    """Pairs the highest live slots with the lowest free slots, at most ``max_moves``.

    Pairs stop at the first free slot that is not below its live partner: a block only
    ever moves down, and slot 0 is never a candidate (the tracker never lists it).

    The slots of the returned moves are taken out of the tracker's heaps: the caller
    commits them (``BlockTracker.move_live_blocks``) or hands them back
    (``BlockTracker.restore_slots``).
    """
    src_ids, dst_ids = tracker.take_compaction_pairs(max_moves)
    return [
        Move(src, dst, tracker.holds_data(dst)) for src, dst in zip(src_ids, dst_ids, strict=True)
    ]
