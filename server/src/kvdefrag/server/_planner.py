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
    """
    moves: list[Move] = []
    taken_live: list[int] = []
    taken_free: list[int] = []
    while len(moves) < max_moves:
        src = tracker.take_highest_live(1)
        dst = tracker.take_lowest_free(1)
        taken_live += src
        taken_free += dst
        if not src or not dst or dst[0] > src[0]:
            break
        moves.append(Move(src[0], dst[0], tracker.holds_data(dst[0])))
    tracker.restore_slots(taken_live + taken_free)
    return moves
