"""Swap executor: the only code that reads or writes the worker's KV tensors.

The worker's caches are bound exactly as vllm-gaudi lays them out: one ``(key, value)``
pair per layer, each tensor's first dimension ``num_blocks * block_size`` flat token
slots, ``value`` None for MLA models. A block is ``block_size`` consecutive rows::

    key[l]:  | blk 0 (null) | blk 1 | blk 2 | ... | blk n-1 |
               ^ block_size rows each; a move copies whole blocks

Backends are chosen once, from the tensors' device, through ``_BACKENDS``; only the HPU
backend (``_executor_hpu``) imports ``habana_frameworks``, and only when it is chosen.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._moves import Move, MoveBatch, MoveReport

KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]
Rows = npt.NDArray[np.uint8]
Ids = npt.NDArray[np.int64]
Swapped = tuple[Rows, Ids, Ids]  # one tensor's rows and a chunk of swaps done on them
ShareWork = Callable[[Ids, Ids, list[Swapped]], None]  # moves one share: (src, dst, done)

# NOTE: gather/scatter goes through a small staging buffer that stays in cache, so the
# extra pass costs little and no buffer is allocated per call (the seed's index_select
# allocates one per call and reaches ~0.1x of memcpy bandwidth). On CPU, 4 MiB chunks
# measured best (smaller ones pay per-call overhead, larger ones leave the cache).
_STAGING_BYTES_CPU = 4 << 20
_STAGING_BYTES_DEVICE = 16 << 20
# NOTE: on CPU a one-way move of a block this large per tensor is one copy_ per block:
# copy_ splits such a row across threads and writes it in one pass, which beats the two
# passes of gather + scatter (128-token blocks: ~0.8x of memcpy against ~0.6x). Smaller
# rows are copied by one thread each, so they go through the staging buffer instead.
_ROW_COPY_MIN_BYTES = 128 << 10
# NOTE: CpuSwapExecutor's staging buffer, one per thread. Measured on 2 cores, 512 moves of
# 16 KiB rows over 8 tensors: 256 KiB chunks 4.9 GB/s, 512 KiB 8.0, 1 MiB 8.5-8.9, 2 MiB
# 8.7-9.0, 4 MiB 4.5-5.6 (smaller chunks pay numpy's ~3 µs a call, larger ones leave the
# cache).
_STAGING_BYTES_PER_THREAD = 2 << 20
# Index kernels cost per element: moving a block as a few wide integers instead of many
# half floats is cheaper, and integer copies are bit-exact whatever the KV dtype.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


class SwapExecutor(Protocol):
    """Moves whole blocks inside the bound KV tensors."""

    num_blocks: int

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        """Copies (or swaps) every move's block; raises on failure."""
        ...


def bind_kv_caches(kv_caches: KvCaches, block_size: int) -> tuple[list[torch.Tensor], int]:
    """Checks the worker's caches and returns their tensors and the pool's num_blocks.

    Raises:
        InvalidArgument: The caches are empty, not (key, value) pairs, or disagree on
            device or on the number of token slots, or that is not a multiple of
            ``block_size``.
    """
    if block_size < 1:
        raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
    tensors: list[torch.Tensor] = []
    for layer, pair in enumerate(kv_caches):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgument(f"kv_caches[{layer}] must be a (key, value) pair")
        for name, tensor in zip(("key", "value"), pair, strict=True):
            if tensor is None and name == "value":
                continue
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
                raise InvalidArgument(f"kv_caches[{layer}].{name} must be a tensor")
            tensors.append(tensor)
    if not tensors:
        raise InvalidArgument("kv_caches is empty: bind at least one layer")
    num_slots = tensors[0].shape[0]
    device = tensors[0].device
    for tensor in tensors:
        if tensor.shape[0] != num_slots:
            raise InvalidArgument(
                f"every KV tensor must have {num_slots} token slots, got {tensor.shape[0]}"
            )
        if tensor.device != device:
            raise InvalidArgument(f"KV tensors on {device} and {tensor.device}: use one device")
    if num_slots % block_size:
        raise InvalidArgument(
            f"token slots ({num_slots}) are not a multiple of block_size ({block_size})"
        )
    num_blocks = num_slots // block_size
    if num_blocks < 2:
        raise InvalidArgument(f"the pool needs at least 2 blocks, got {num_blocks}")
    return tensors, num_blocks


def block_views(tensors: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Views each tensor as ``[num_blocks, elements_per_block]`` (no copy).

    Raises:
        InvalidArgument: A tensor is not contiguous, so a block is not one row.
    """
    views = []
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise InvalidArgument("KV tensors must be contiguous to move whole blocks")
        view = tensor.view(num_blocks, -1)
        if tensor.dtype.is_floating_point and tensor.element_size() == 1:
            # NOTE: index_copy_ has no float8 kernels; a move only copies bytes anyway.
            view = view.view(torch.uint8)
        views.append(view)
    return views


def pad_to_bucket(
    src_ids: list[int], dst_ids: list[int], buckets: Sequence[int]
) -> tuple[list[int], list[int], int]:
    """Pads a batch to the smallest bucket that holds it with the null pair (0 -> 0).

    Copying the null block onto itself is harmless: it never holds data anyone reads.
    Never negative indices (only HPU tolerates those).
    """
    size = next((bucket for bucket in buckets if bucket >= len(src_ids)), len(src_ids))
    num_padded = size - len(src_ids)
    pad = [0] * num_padded
    return src_ids + pad, dst_ids + pad, num_padded


def widest_view(view: torch.Tensor) -> torch.Tensor:
    """Reinterprets a ``[num_blocks, n]`` view as the widest integer type its rows tile.

    Same bytes, no copy; moving them as integers is bit-exact for every KV dtype.
    """
    row_bytes = view.shape[1] * view.element_size()
    for dtype in _WIDE_DTYPES:
        if row_bytes % dtype.itemsize == 0 and view.data_ptr() % dtype.itemsize == 0:
            return view.view(dtype)
    return view


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


class TorchSwapExecutor:
    """Moves blocks with torch gather/scatter through a reused staging buffer.

    Works on CPU tensors and, given the worker's stream, on CUDA tensors. Blocks move as
    wide integers (``widest_view``); on CPU, one-way moves of large blocks are one
    ``copy_`` per block instead (see ``_ROW_COPY_MIN_BYTES``). One-way moves never write
    their source slots, so a failure mid-batch leaves every live block intact at its old
    slot; two-way moves write the destination before the source.
    """

    def __init__(self, kv_caches: KvCaches, block_size: int, stream: Any = None) -> None:
        tensors, self.num_blocks = bind_kv_caches(kv_caches, block_size)
        self._views = [widest_view(view) for view in block_views(tensors, self.num_blocks)]
        self._device = tensors[0].device
        self._stream = stream
        on_cpu = self._device.type == "cpu"

        def copies_rows(view: torch.Tensor) -> bool:
            return on_cpu and view.shape[1] * view.element_size() >= _ROW_COPY_MIN_BYTES

        # One-way moves: large CPU rows one by one (as bytes: copy_ parallelises by
        # element count), every other tensor through the staging buffer.
        self._row_views = [v.view(torch.uint8) for v in self._views if copies_rows(v)]
        self._staged_views = [v for v in self._views if not copies_rows(v)]
        staging_bytes = _STAGING_BYTES_CPU if on_cpu else _STAGING_BYTES_DEVICE
        self._staging: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for view in self._views:
            key = (view.dtype, view.shape[1])
            if key not in self._staging:
                rows = max(1, staging_bytes // (view.shape[1] * view.element_size()))
                rows = min(rows, self.num_blocks)
                self._staging[key] = (
                    torch.empty((rows, view.shape[1]), dtype=view.dtype, device=self._device),
                    torch.empty((rows, view.shape[1]), dtype=view.dtype, device=self._device),
                )
        self.bytes_per_block = sum(v.shape[1] * v.element_size() for v in self._views)

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        batch = MoveBatch.of(moves)
        one_way = batch.pairs(two_way=False)
        two_way = batch.pairs(two_way=True)
        with self._on_stream():
            if one_way:
                self._run(one_way, two_way=False)
            if two_way:
                self._run(two_way, two_way=True)
        num_bytes = self.bytes_per_block * (len(one_way) + 2 * len(two_way))
        return MoveReport(num_moves=len(moves), num_padded=0, num_bytes=num_bytes)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
        else:
            with torch.cuda.stream(self._stream):
                yield

    def _index(self, ids: list[int]) -> torch.Tensor:
        index = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        if self._device.type == "cpu":
            return index
        return index.pin_memory().to(self._device, non_blocking=True)

    def _copy_rows(self, moves: list[tuple[int, int]]) -> None:
        """One-way moves on the large-row tensors: one ``copy_`` per block and tensor."""
        dst_rows: list[torch.Tensor] = []
        src_rows: list[torch.Tensor] = []
        for view in self._row_views:
            dst_rows += [view[dst] for _, dst in moves]
            src_rows += [view[src] for src, _ in moves]
        torch._foreach_copy_(dst_rows, src_rows)

    def _run(self, moves: list[tuple[int, int]], two_way: bool) -> None:
        """Moves every (source, destination) pair of one kind."""
        if not two_way and self._row_views:
            self._copy_rows(moves)
        views = self._views if two_way else self._staged_views
        if not views:
            return
        src = self._index([src for src, _ in moves])
        dst = self._index([dst for _, dst in moves])
        swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        half_swapped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        try:
            for view in views:
                staged_src, staged_dst = self._staging[(view.dtype, view.shape[1])]
                step = staged_src.shape[0]
                for start in range(0, len(moves), step):
                    src_ids, dst_ids = src[start : start + step], dst[start : start + step]
                    from_src = staged_src[: len(src_ids)]
                    torch.index_select(view, 0, src_ids, out=from_src)
                    if two_way:
                        from_dst = staged_dst[: len(dst_ids)]
                        torch.index_select(view, 0, dst_ids, out=from_dst)
                        # Destination first: until the source is overwritten, the live
                        # block is readable at its old slot.
                        half_swapped = (view, dst_ids, from_dst)
                        view.index_copy_(0, dst_ids, from_src)
                        view.index_copy_(0, src_ids, from_dst)
                        half_swapped = None
                        swapped.append((view, src_ids, dst_ids))
                    else:
                        view.index_copy_(0, dst_ids, from_src)
        except Exception:
            # NOTE: the engine keeps the old mapping when a batch fails, so the swaps
            # already done (on earlier tensors) are undone: a swap is its own inverse.
            # One-way moves need no undo: they never write a slot that holds data.
            if half_swapped is not None:
                view, dst_ids, from_dst = half_swapped
                view.index_copy_(0, dst_ids, from_dst)
            for view, src_ids, dst_ids in reversed(swapped):
                self._swap(view, src_ids, dst_ids)
            raise

    def _swap(self, view: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        staged_src, staged_dst = self._staging[(view.dtype, view.shape[1])]
        from_src, from_dst = staged_src[: len(src_ids)], staged_dst[: len(dst_ids)]
        torch.index_select(view, 0, src_ids, out=from_src)
        torch.index_select(view, 0, dst_ids, out=from_dst)
        view.index_copy_(0, dst_ids, from_src)
        view.index_copy_(0, src_ids, from_dst)


def _cuda_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    stream = options.get("stream") or torch.cuda.current_stream(kv_caches[0][0].device)
    return TorchSwapExecutor(kv_caches, block_size, stream=stream)


def _cpu_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    return CpuSwapExecutor(kv_caches, block_size)


def _hpu_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    module = importlib.import_module("kvdefrag.server._executor_hpu")
    executor: SwapExecutor = module.HpuSwapExecutor(kv_caches, block_size, **options)
    return executor


_BACKENDS = {"cpu": _cpu_executor, "cuda": _cuda_executor, "hpu": _hpu_executor}


def make_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    """Builds the executor for the caches' device (cpu, cuda or hpu).

    Args:
        kv_caches: The worker's per-layer ``(key, value)`` tensors.
        block_size: Token slots per block.
        **options: Backend options: ``stream`` (CUDA/HPU: the forward pass's stream),
            ``pad_buckets`` (HPU: static batch sizes).
    """
    tensors, _ = bind_kv_caches(kv_caches, block_size)
    device_type = tensors[0].device.type
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise InvalidArgument(
            f"no swap executor for device {device_type!r}; supported: {sorted(_BACKENDS)}"
        )
    return backend(kv_caches, block_size, **options)
