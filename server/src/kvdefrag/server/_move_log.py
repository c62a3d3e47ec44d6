"""The move log: committed compactions, by number, for readers that follow moved data.

A reader that keeps physical ids of its own between steps (a worker's persistent block
tables, for instance) asks for the moves committed since the version it last saw and
applies them to what it keeps: O(blocks moved), never O(pool).

What is logged is each compaction's moves of the blocks that were live *before* its step,
as one-way moves (``moves_of_blocks_live_before``). The contract that makes this enough,
for any reader: a reader learns a block from a step's own result (or from something
issued after it), and it drops what names a block once that block's request released it.
So a block that became live in the step that moved it is named by nothing older than the
move, and a free block is named only by records the reader drops; neither is logged.

A leaf of the engine: it imports only ``_moves``.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence

from kvdefrag.server._moves import MoveBatch

__all__ = ["MOVE_LOG_LENGTH", "MoveLog", "moves_of_blocks_live_before"]

MOVE_LOG_LENGTH = 4096
"""Logged compactions a reader can catch up on: a reader that follows the log once per
step falls at most one compaction behind per step, far inside this."""


class MoveLog:
    """Numbered batches of moves, the last ``length`` of them.

    Invariants: numbers never restart and grow by one per batch logged and per
    ``restart``; a ``restart`` leaves nothing to replay from before it.
    """

    def __init__(self, length: int = MOVE_LOG_LENGTH) -> None:
        self._num_logged = 0
        self._restarted_at = 0
        self._batches: collections.deque[tuple[int, MoveBatch]] = collections.deque(maxlen=length)

    @property
    def version(self) -> int:
        """The number of the last batch logged (or of the last restart)."""
        return self._num_logged

    def record(self, moves: MoveBatch) -> None:
        """Logs one compaction's moves; an empty batch is not logged."""
        if moves:
            self._num_logged += 1
            self._batches.append((self._num_logged, moves))

    def restart(self) -> None:
        """Forgets every batch (the mapping started over): a reader of an older version
        is told only what comes after."""
        self._num_logged += 1
        self._restarted_at = self._num_logged
        self._batches.clear()

    def since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None:
        """The batches logged after number ``version``, oldest first.

        Args:
            version: What this returned last time; None to learn the current number.

        Returns:
            ``(version now, the batches)``; None when the log no longer reaches back to
            ``version`` (more than its length was logged in between): the reader can no
            longer follow the moves.
        """
        now = self._num_logged
        if version is None or version >= now:
            return now, []
        version = max(version, self._restarted_at)
        if version == now:
            return now, []
        batches = self._batches
        if not batches or batches[0][0] > version + 1:
            return None
        return now, [batch for number, batch in batches if number > version]


def moves_of_blocks_live_before(
    fwd: Sequence[int], moves: MoveBatch, newly_live: Iterable[int], released: Iterable[int]
) -> MoveBatch:
    """The moves of ``moves`` whose source holds a block that was live before this step,
    each as a one-way move. Call it before the moves are committed (``fwd``, the
    logical-to-physical mapping, still names the sources).

    Left out: the slots of blocks that became live in this step (``newly_live``) unless
    they were also released in it (``released``: a block freed and taken again in one
    step was live before), and the free block a swap sends up (a one-way move does not
    carry it).
    """
    src_ids, dst_ids = moves.src_ids, moves.dst_ids
    new_slots = {fwd[logical_id] for logical_id in newly_live}
    if new_slots:
        new_slots.difference_update(fwd[logical_id] for logical_id in released)
        if not new_slots.isdisjoint(src_ids):
            is_followed = [src not in new_slots for src in src_ids]
            src_ids = list(itertools.compress(src_ids, is_followed))
            dst_ids = list(itertools.compress(dst_ids, is_followed))
    return MoveBatch(src_ids, dst_ids)
