"""The compaction policy: when to compact, where fresh blocks go, which blocks move.

Everything kvdefrag decides about packing reads in this module; the tracker keeps the
state it asks about, and the engine carries the decisions out.

* **Trigger.** A step compacts when the holes below the highest live slot
  (``max_live - num_live``) exceed ``threshold``, or when a pass was scheduled.
* **Placement.** A fresh block (allocated this step, holding no data yet) is re-pointed
  to the lowest *expendable* slot below it: free and not holding cached data. Only the
  mapping changes; nothing is copied.
* **Pairing.** Compaction pairs the highest live slot with the lowest free slot, again
  and again, while the free slot is below the live one, at most ``max_moves_per_step``
  times. A block only ever moves down; slot 0 (the null block) is never a candidate.
  When the cap stops the pass early, a cached destination gives way to an empty slot
  that still lies below the highest live slot that stays (a copy instead of a swap, the
  pool as packed).
* **Move kind.** A destination that holds cached data (prefix caching) swaps contents
  with the source (two-way); otherwise the source is copied one way.

Deterministic: the same tracker state and config give the same decisions (no hashing,
no set iteration), so every rank of a tensor-parallel worker plans identically.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple

from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server.config import EngineConfig


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


def should_compact(tracker: BlockTracker, config: EngineConfig, *, is_forced: bool) -> bool:
    """The trigger: holes above the threshold, or a pass scheduled by the operator."""
    return is_forced or tracker.max_live - tracker.num_live > config.threshold


def place_fresh(tracker: BlockTracker, fresh_ids: Iterable[int]) -> tuple[int, list[int]]:
    """Re-points each fresh block, in order, to the lowest expendable slot below it.

    Returns:
        How many blocks were re-pointed, and every logical id whose slot changed.
    """
    return tracker.place_fresh_blocks(dict.fromkeys(fresh_ids))


def plan_compaction(tracker: BlockTracker, config: EngineConfig) -> list[Move]:
    """Pairs the highest live slots with the lowest free slots below them (nothing
    changes until the caller commits them with ``BlockTracker.move_live_blocks``)."""
    src_ids, dst_ids = tracker.compaction_pairs(config.max_moves_per_step)
    # A free destination holds data only when it is cached (prefix caching).
    if tracker.prefix_caching:
        cached, bwd = tracker.cached, tracker.bwd
        is_two_way: Iterable[bool] = [cached[bwd[dst]] for dst in dst_ids]
    else:
        is_two_way = repeat(False, len(dst_ids))
    # NOTE: tuple.__new__ builds each Move in C (Move(...) runs a Python __new__ per move).
    return list(map(tuple.__new__, repeat(Move), zip(src_ids, dst_ids, is_two_way, strict=True)))
