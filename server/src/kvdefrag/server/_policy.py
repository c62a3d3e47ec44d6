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

from kvdefrag.server._moves import MoveBatch
from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server.config import EngineConfig


def should_compact(tracker: BlockTracker, config: EngineConfig, *, is_forced: bool) -> bool:
    """The trigger: holes above the threshold, or a pass scheduled by the operator."""
    return is_forced or tracker.max_live - tracker.num_live > config.threshold


def place_fresh(
    tracker: BlockTracker, fresh_ids: Iterable[int], *, mix_digests: bool = True
) -> tuple[int, list[int]]:
    """Re-points each fresh block, in order, to the lowest expendable slot below it.

    ``mix_digests``: as ``BlockTracker.place_fresh_blocks``.

    Returns:
        How many blocks were re-pointed, and every logical id whose slot changed.
    """
    return tracker.place_fresh_blocks(dict.fromkeys(fresh_ids), mix_digests=mix_digests)


def plan_compaction(tracker: BlockTracker, config: EngineConfig) -> MoveBatch:
    """Pairs the highest live slots with the lowest free slots below them (nothing
    changes until the caller commits them with ``BlockTracker.move_live_blocks``)."""
    src_ids, dst_ids = tracker.compaction_pairs(config.max_moves_per_step)
    # A free destination holds data only when it is cached (prefix caching).
    if not tracker.prefix_caching:
        return MoveBatch(src_ids, dst_ids)
    cached, bwd = tracker.cached, tracker.bwd
    return MoveBatch(src_ids, dst_ids, [cached[bwd[dst]] for dst in dst_ids])
