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
import dataclasses
import importlib
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._policy import Move, MoveBatch

KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]

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
# Index kernels cost per element: moving a block as a few wide integers instead of many
# half floats is cheaper, and integer copies are bit-exact whatever the KV dtype.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclasses.dataclass(frozen=True)
class MoveReport:
    """What one executed batch did.

    Attributes:
        num_moves: Real moves executed.
        num_padded: Pad pairs added to reach a static batch size (static-shape backends).
        num_bytes: Bytes written to the KV tensors by real moves.
    """

    num_moves: int
    num_padded: int
    num_bytes: int


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
    """Moves blocks of CPU tensors as row copies, split across threads.

    Each block of each tensor is one row of a ``uint8`` numpy view that shares the
    tensor's memory; a move is one row assignment (a ``memcpy`` that releases the GIL), so
    ``num_threads`` threads copy that many rows at once, each on its own share of the
    moves (moves never share a slot, so the shares never touch the same row).

    NOTE: measured on 2 cores against ``Tensor.copy_`` of the same bytes: torch's index
    kernels and a ``copy_`` per row reached 0.3-0.45x for scattered blocks (per-element or
    per-call overhead); numpy rows on two threads reached ~1x for 128-token blocks and
    ~0.6-0.7x for 16-token ones, where the per-row Python step is what remains.

    One-way moves never write their source, so a failure mid-batch leaves every live
    block intact at its old slot; a two-way swap writes the destination first and, on a
    failure, every swap already done (in any thread) is undone.
    """

    # Below this many bytes a batch is copied on the calling thread (no hand-over).
    _THREADED_MIN_BYTES = 1 << 20

    def __init__(self, kv_caches: KvCaches, block_size: int, num_threads: int = 0) -> None:
        tensors, self.num_blocks = bind_kv_caches(kv_caches, block_size)
        views = block_views(tensors, self.num_blocks)
        self._rows = [view.view(torch.uint8).numpy() for view in views]
        self.bytes_per_block = sum(rows.shape[1] for rows in self._rows)
        self._num_threads = num_threads or max(1, torch.get_num_threads())
        self._pool: ThreadPoolExecutor | None = None
        self._max_row_bytes = max(rows.shape[1] for rows in self._rows)
        self._buffers = threading.local()

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        one_way = [(m.src_physical_id, m.dst_physical_id) for m in moves if not m.is_two_way]
        two_way = [(m.src_physical_id, m.dst_physical_id) for m in moves if m.is_two_way]
        if one_way:
            self._run(self._copy_share, one_way)
        if two_way:
            self._run(self._swap_share, two_way)
        num_bytes = self.bytes_per_block * (len(one_way) + 2 * len(two_way))
        return MoveReport(num_moves=len(moves), num_padded=0, num_bytes=num_bytes)

    def _run(self, work: Any, pairs: list[tuple[int, int]]) -> None:
        """Runs ``work`` on shares of ``pairs``; on a failure undoes every swap done."""
        num_shares = min(self._num_threads, len(pairs))
        if num_shares < 2 or len(pairs) * self.bytes_per_block < self._THREADED_MIN_BYTES:
            done: list[tuple[Any, int, int]] = []
            try:
                work(pairs, done)
            except BaseException:
                self._undo(done)
                raise
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="kvdefrag-move")
        shares: list[list[tuple[Any, int, int]]] = [[] for _ in range(num_shares)]
        futures = [
            self._pool.submit(work, pairs[index::num_shares], shares[index])
            for index in range(num_shares)
        ]
        errors = [future.exception() for future in futures]
        failure = next((error for error in errors if error is not None), None)
        if failure is not None:
            self._undo([swap for share in shares for swap in share])
            raise failure

    def write_row(self, rows: Any, index: int, data: Any) -> None:
        """Writes one block of one tensor: the only place a move writes KV data."""
        rows[index] = data

    def _copy_share(self, pairs: list[tuple[int, int]], done: list[Any]) -> None:
        write_row = self.write_row
        for rows in self._rows:
            for src, dst in pairs:
                write_row(rows, dst, rows[src])

    def _swap_share(self, pairs: list[tuple[int, int]], done: list[Any]) -> None:
        buffer = getattr(self._buffers, "row", None)
        if buffer is None:
            buffer = self._buffers.row = np.empty(self._max_row_bytes, dtype=np.uint8)
        write_row = self.write_row
        for rows in self._rows:
            saved = buffer[: rows.shape[1]]
            for src, dst in pairs:
                saved[...] = rows[dst]
                # Destination first: until the source is overwritten, the live block is
                # readable at its old slot.
                write_row(rows, dst, rows[src])
                try:
                    write_row(rows, src, saved)
                except BaseException:
                    rows[dst] = saved  # undo the half swap
                    raise
                done.append((rows, src, dst))

    def _undo(self, swaps: list[tuple[Any, int, int]]) -> None:
        """Swaps back every completed swap (a swap is its own inverse), newest first."""
        for rows, src, dst in reversed(swaps):
            saved = rows[dst].copy()
            rows[dst] = rows[src]
            rows[src] = saved


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
