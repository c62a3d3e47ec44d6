"""The published mapping: what lock-free readers resolve through, double-buffered.

The engine publishes after every step that changed the mapping; readers (``resolve`` on
the worker, while it holds ``kv_lock``) take no lock. Copying the whole mapping per step
would cost O(num_blocks); instead two buffers take turns::

    publish N:    write buffer B (the ids changed since B was current)  -> readers go to B
    publish N+1:  write buffer A (the ids changed over publishes N, N+1) -> readers go to A

A reader that still reads a buffer when the writer starts on it (it has been on it for
a whole publish) notices: the buffer's write count is odd or changed (a seqlock), and it
reads again, from the buffer readers are sent to now. Publishing costs O(ids changed over
the last two publishes).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class MappingSnapshots:
    """Two copies of the logical->physical mapping; readers read the current one.

    Invariants: ``_buffers[_current]`` equals the mapping as of the last publish; the
    other buffer equals it except at the ids of ``_unsynced`` (those changed since that
    buffer was current); a buffer's write count is odd exactly while it is written.
    One writer at a time (the engine lock); any number of readers, without a lock.
    """

    def __init__(self, num_blocks: int) -> None:
        self._buffers = (
            np.arange(num_blocks, dtype=np.int64),
            np.arange(num_blocks, dtype=np.int64),
        )
        self._write_counts = [0, 0]
        self._current = 0
        # What the buffer readers are not sent to lacks: (ids, their values), in order.
        self._unsynced: list[tuple[npt.NDArray[np.intp], npt.NDArray[np.int64]]] = []

    def publish(self, fwd: list[int], changed_ids: list[int]) -> None:
        """Makes readers see ``fwd`` (the writer's mapping), whose entries at
        ``changed_ids`` (and nowhere else) changed since the last publish."""
        if not changed_ids:
            return
        # NOTE: converted to arrays once: assigning lists made numpy convert them at this
        # publish and again at the next (~3x the cost for 1,000 ids).
        num_changed = len(changed_ids)
        ids = np.fromiter(changed_ids, np.intp, num_changed)
        values = np.fromiter([fwd[logical_id] for logical_id in changed_ids], np.int64, num_changed)
        target = 1 - self._current
        buffer = self._buffers[target]
        self._write_counts[target] += 1  # odd: readers of this buffer read again
        # NOTE: one assignment per publish, in order: an id changed twice ends with its
        # later value (numpy does not promise an order among repeated ids of one call).
        for earlier_ids, earlier_values in self._unsynced:
            buffer[earlier_ids] = earlier_values
        buffer[ids] = values
        self._write_counts[target] += 1
        self._current = target
        self._unsynced = [(ids, values)]  # what the buffer just left lacks

    def read(self, logical_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Physical ids of ``logical_ids`` (in range, checked by the caller) as of the
        last publish; never waits."""
        while True:
            current = self._current
            count = self._write_counts[current]
            physical_ids: npt.NDArray[np.int64] = self._buffers[current][logical_ids]
            if count % 2 == 0 and self._write_counts[current] == count:
                return physical_ids

    def read_all(self) -> npt.NDArray[np.int64]:
        """The whole mapping as of the last publish (a copy: index ``i`` holds the
        physical id of logical id ``i``); never waits."""
        while True:
            current = self._current
            count = self._write_counts[current]
            mapping = self._buffers[current].copy()
            if count % 2 == 0 and self._write_counts[current] == count:
                return mapping
