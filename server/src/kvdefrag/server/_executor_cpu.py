"""CPU swap executor: moves blocks of CPU tensors through numpy views, on threads.

Imported by ``_backends.make_executor`` when the KV tensors live on the CPU (the
``kvdefrag-server`` command's embedded cache, vLLM's CPU backend, the tests).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._executor import KvCaches, bind_kv_caches, block_views
from kvdefrag.server._moves import Move, MoveBatch, MoveReport

Rows = npt.NDArray[np.uint8]
Ids = npt.NDArray[np.int64]
Swapped = tuple[Rows, Ids, Ids]  # one tensor's rows and a chunk of swaps done on them
ShareWork = Callable[[Ids, Ids, list[Swapped]], None]  # moves one share: (src, dst, done)

# NOTE: the staging buffer, one per thread. Measured on 2 cores, 512 moves of 16 KiB rows
# over 8 tensors: 256 KiB chunks 4.9 GB/s, 512 KiB 8.0, 1 MiB 8.5-8.9, 2 MiB 8.7-9.0,
# 4 MiB 4.5-5.6 (smaller chunks pay numpy's ~3 µs a call, larger ones leave the cache).
_STAGING_BYTES_PER_THREAD = 2 << 20


class CpuSwapExecutor:
    """Moves blocks of CPU tensors a chunk at a time through a staging buffer, on threads.

    Each block of each tensor is one row of a ``uint8`` numpy view that shares the
    tensor's memory. The moves are sorted by source slot and split into ``num_threads``
    contiguous shares, one per thread. Per tensor, a thread gathers a chunk of its moves'
    source rows with one ``np.take`` into its own staging buffer, small enough to stay in
    cache, then writes the chunk to the destination rows with one fancy-index assignment;
    both are C loops of ``memcpy`` that release the GIL, so the threads copy at once and
    the Python cost is a few calls per chunk, not one per row::

        rows:     | 0 | .. | dst a | .. | dst b | .. | src a | src b | .. |
                               ^            ^           |       |
                               |            |    np.take (one call)
                               |            |           v       v
        staging:               |            |         | a     | b     |
                               +------------+---------+-------+-------+
                                 write_rows (one call)

    Rows of ``_ROW_LOOP_MIN_BYTES`` or more skip the staging pass: one row assignment per
    block. A batch's moves never share a slot (the pad pair ``0 -> 0`` excepted, which
    copies the null block onto itself), so the shares never touch the same row, and
    gathering a chunk before writing it moves the same bytes as copying row by row.

    ``write_rows`` is the only place a move writes KV data. One-way moves never write
    their source, so a failure mid-batch leaves every live block intact at its old slot;
    a two-way swap writes the destination first and, on a failure, every swap already
    done (in any thread) is undone, so the tensors hold what they held before the batch.
    """

    # Below this many bytes a batch is copied on the calling thread (no hand-over).
    _THREADED_MIN_BYTES = 1 << 20
    # NOTE: rows this large are copied one by one (one ``memcpy`` each, no staging pass):
    # at this size the Python step per row costs less than the second pass through the
    # staging buffer. Against ``copy_``, 512 moves on 2 cores: 128 KiB rows 0.88x one by one,
    # 0.71-0.73x staged; through ``Engine.step``, fp8 (64 KiB rows) 0.69-0.84x one by one,
    # 0.66x staged; 32 layers (32 KiB rows) 0.71x one by one, 0.75-0.80x staged.
    _ROW_LOOP_MIN_BYTES = 64 << 10

    def __init__(self, kv_caches: KvCaches, block_size: int, num_threads: int = 0) -> None:
        tensors, self.num_blocks = bind_kv_caches(kv_caches, block_size)
        views = block_views(tensors, self.num_blocks)
        self._rows = [view.view(torch.uint8).numpy() for view in views]
        self.bytes_per_block = sum(rows.shape[1] for rows in self._rows)
        self._num_threads = num_threads or max(1, torch.get_num_threads())
        self._pool: ThreadPoolExecutor | None = None
        # A swap stages both sides, so half the buffer must hold at least one row.
        max_row_bytes = max(rows.shape[1] for rows in self._rows)
        self._staging_bytes = max(_STAGING_BYTES_PER_THREAD, 2 * max_row_bytes)
        self._buffers = threading.local()

    def warmup(self) -> int:
        """Nothing to warm: no graph is compiled on the CPU. Runs no batch (returns 0)."""
        return 0

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        batch = MoveBatch.of(moves)
        num_moves = len(batch)
        src_ids = np.fromiter(batch.src_ids, np.int64, num_moves)
        dst_ids = np.fromiter(batch.dst_ids, np.int64, num_moves)
        self._check_in_pool(src_ids, dst_ids)
        if not batch.num_two_way:
            one_way, two_way = (
                self._sorted(src_ids, dst_ids),
                self._sorted(src_ids[:0], dst_ids[:0]),
            )
        else:
            is_two_way = np.fromiter(batch.is_two_way, np.bool_, num_moves)
            one_way = self._sorted(src_ids[~is_two_way], dst_ids[~is_two_way])
            two_way = self._sorted(src_ids[is_two_way], dst_ids[is_two_way])
        if len(one_way[0]):
            self._run(self._copy_share, *one_way)
        if len(two_way[0]):
            self._run(self._swap_share, *two_way)
        num_bytes = self.bytes_per_block * (len(one_way[0]) + 2 * len(two_way[0]))
        return MoveReport(num_moves=num_moves, num_padded=0, num_bytes=num_bytes)

    def write_rows(self, rows: Rows, indices: Ids | int, data: Rows) -> None:
        """Writes ``data`` to the blocks at ``indices`` (an array of ids, or one id) of
        one tensor: ``rows[indices] = data``.

        The only place a move writes KV data (tests override it to inject failures).
        """
        rows[indices] = data

    def _check_in_pool(self, src_ids: Ids, dst_ids: Ids) -> None:
        """Refuses a batch with a slot outside the pool, before anything is written.

        Raises:
            InvalidArgument: A slot is outside the pool.
        """
        for name, ids in (("src_physical_id", src_ids), ("dst_physical_id", dst_ids)):
            if len(ids) and not 0 <= ids.min() <= ids.max() < self.num_blocks:
                bad = ids[(ids < 0) | (ids >= self.num_blocks)][0]
                raise InvalidArgument(f"{name} {bad} is outside the pool [0, {self.num_blocks})")

    @staticmethod
    def _sorted(src_ids: Ids, dst_ids: Ids) -> tuple[Ids, Ids]:
        """The moves' source and destination slots, in ascending source order.

        NOTE: a gather that reads rows in address order runs about twice as fast as one
        that reads them backwards (one thread, 16 KiB rows: 19-21 GB/s against 10-12):
        compaction pairs the highest live slots with the lowest free ones, so the planner
        lists sources downwards. The destinations are scattered holes whichever the order
        (writing them up or down: 11 GB/s). A batch's moves never share a slot, so their
        order does not change what they copy.
        """
        order = np.argsort(src_ids, kind="stable")
        return src_ids[order], dst_ids[order]

    def _run(self, work: ShareWork, src_ids: Ids, dst_ids: Ids) -> None:
        """Runs ``work`` on contiguous shares of the moves, the first on this thread.

        On a failure in any share, waits for the others, undoes every swap done, and
        raises the first failure.
        """
        num_moves = len(src_ids)
        num_shares = min(self._num_threads, num_moves)
        if num_moves * self.bytes_per_block < self._THREADED_MIN_BYTES:
            num_shares = 1
        bounds = [num_moves * share // num_shares for share in range(num_shares + 1)]
        shares = [
            (src_ids[start:stop], dst_ids[start:stop]) for start, stop in itertools.pairwise(bounds)
        ]
        done: list[list[Swapped]] = [[] for _ in shares]
        futures = []
        if num_shares > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self._num_threads, thread_name_prefix="kvdefrag-move"
                )
            futures = [
                self._pool.submit(work, share_src_ids, share_dst_ids, share_done)
                for (share_src_ids, share_dst_ids), share_done in zip(
                    shares[1:], done[1:], strict=True
                )
            ]
        failures: list[BaseException | None] = []
        try:
            work(*shares[0], done[0])
        except BaseException as err:
            failures.append(err)
        failures += [future.exception() for future in futures]  # waits for every share
        failure = next((error for error in failures if error is not None), None)
        if failure is not None:
            self._undo([swap for share_done in done for swap in share_done])
            raise failure

    def _staging(self) -> Rows:
        """This thread's staging buffer (one per thread, allocated once)."""
        buffer: Rows | None = getattr(self._buffers, "staging", None)
        if buffer is None:
            buffer = self._buffers.staging = np.empty(self._staging_bytes, dtype=np.uint8)
        return buffer

    def _copy_share(self, src_ids: Ids, dst_ids: Ids, done: list[Swapped]) -> None:
        """One-way moves of one share, tensor by tensor (they never write a source)."""
        staging = self._staging()
        write_rows = self.write_rows
        for rows in self._rows:
            row_bytes = rows.shape[1]
            if row_bytes >= self._ROW_LOOP_MIN_BYTES:
                for src_id, dst_id in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
                    write_rows(rows, dst_id, rows[src_id])
                continue
            step = staging.size // row_bytes
            chunk_rows = staging[: step * row_bytes].reshape(step, row_bytes)
            for start in range(0, len(src_ids), step):
                src_chunk, dst_chunk = src_ids[start : start + step], dst_ids[start : start + step]
                from_src = chunk_rows[: len(src_chunk)]
                # NOTE: mode="clip" only because the default ("raise") stages ``out`` in a
                # second buffer (16 KiB rows, in cache: 13 GB/s against 35); the ids were
                # checked against the pool in _check_in_pool.
                np.take(rows, src_chunk, axis=0, out=from_src, mode="clip")
                write_rows(rows, dst_chunk, from_src)

    def _swap_share(self, src_ids: Ids, dst_ids: Ids, done: list[Swapped]) -> None:
        """Two-way moves of one share, tensor by tensor; ``done`` lists what was swapped.

        Each swap writes its destination first: until the source is overwritten, the live
        block is readable at its old slot. A failed write is undone before it is raised,
        however far it went, so ``done`` is exactly what the caller must swap back.
        """
        staging = self._staging()
        half = staging.size // 2
        write_rows = self.write_rows
        for rows in self._rows:
            row_bytes = rows.shape[1]
            if row_bytes >= self._ROW_LOOP_MIN_BYTES:
                from_dst = staging[:row_bytes]
                for index, (src_id, dst_id) in enumerate(
                    zip(src_ids.tolist(), dst_ids.tolist(), strict=True)
                ):
                    from_dst[...] = rows[dst_id]
                    try:
                        write_rows(rows, dst_id, rows[src_id])
                    except BaseException:
                        rows[dst_id] = from_dst
                        raise
                    try:
                        write_rows(rows, src_id, from_dst)
                    except BaseException:
                        rows[src_id] = rows[dst_id]
                        rows[dst_id] = from_dst
                        raise
                    done.append((rows, src_ids[index : index + 1], dst_ids[index : index + 1]))
                continue
            # Half the buffer stages the sources, the other half the destinations.
            step = half // row_bytes
            src_chunk_rows = staging[: step * row_bytes].reshape(step, row_bytes)
            dst_chunk_rows = staging[half : half + step * row_bytes].reshape(step, row_bytes)
            for start in range(0, len(src_ids), step):
                src_chunk, dst_chunk = src_ids[start : start + step], dst_ids[start : start + step]
                from_src = src_chunk_rows[: len(src_chunk)]
                from_dst = dst_chunk_rows[: len(dst_chunk)]
                np.take(rows, src_chunk, axis=0, out=from_src, mode="clip")
                np.take(rows, dst_chunk, axis=0, out=from_dst, mode="clip")
                try:
                    write_rows(rows, dst_chunk, from_src)
                    write_rows(rows, src_chunk, from_dst)
                except BaseException:
                    rows[dst_chunk] = from_dst
                    rows[src_chunk] = from_src
                    raise
                done.append((rows, src_chunk, dst_chunk))

    def _undo(self, swaps: list[Swapped]) -> None:
        """Swaps back every completed chunk of swaps (a swap is its own inverse).

        Newest first; each chunk fits this thread's staging buffer, as it fitted the one
        that swapped it.
        """
        staging = self._staging()
        half = staging.size // 2
        for rows, src_chunk, dst_chunk in reversed(swaps):
            num_bytes = len(src_chunk) * rows.shape[1]
            from_src = staging[:num_bytes].reshape(len(src_chunk), -1)
            from_dst = staging[half : half + num_bytes].reshape(len(dst_chunk), -1)
            np.take(rows, src_chunk, axis=0, out=from_src, mode="clip")
            np.take(rows, dst_chunk, axis=0, out=from_dst, mode="clip")
            rows[dst_chunk] = from_src
            rows[src_chunk] = from_dst
