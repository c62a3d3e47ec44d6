"""CUDA swap executor: moves blocks of CUDA tensors with torch gather and scatter, on
the worker's stream.

Imported by ``_backends.make_executor`` when the KV tensors live on a CUDA device; CPU
tensors get ``_executor_cpu.CpuSwapExecutor`` there, so nothing here runs on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._executor import KvCaches, bind_kv_caches, block_views
from kvdefrag.server._moves import Move, MoveBatch, MoveReport

# NOTE: gather/scatter goes through a staging buffer allocated once, so no buffer is
# allocated per call (the seed's index_select allocates one per call and reaches ~0.1x of
# memcpy bandwidth), and a long batch goes a chunk at a time.
_STAGING_BYTES = 16 << 20
# Index kernels cost per element: moving a block as a few wide integers instead of many
# half floats is cheaper, and integer copies are bit-exact whatever the KV dtype.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widest_view(view: torch.Tensor) -> torch.Tensor:
    """Reinterprets a ``[num_blocks, n]`` view as the widest integer type its rows tile.

    Same bytes, no copy; moving them as integers is bit-exact for every KV dtype.
    """
    row_bytes = view.shape[1] * view.element_size()
    for dtype in _WIDE_DTYPES:
        if row_bytes % dtype.itemsize == 0 and view.data_ptr() % dtype.itemsize == 0:
            return view.view(dtype)
    return view


class CudaSwapExecutor:
    """Moves blocks of CUDA tensors with torch gather/scatter through a reused staging
    buffer, on the worker's stream.

    Each block of each tensor is one row of a ``[num_blocks, n]`` view, moved as the widest
    integer type that tiles it (``widest_view``). Per tensor, a chunk of moves is gathered
    into the staging buffer (``index_select``) and scattered to the destinations
    (``index_copy_``). Every kernel is queued on ``stream`` (given: the worker's forward
    stream; else the device's current stream at bind time), so it runs after the forward
    pass that wrote the blocks and before the next one reads them.

    One-way moves never write their source slots, so a failure mid-batch leaves every live
    block intact at its old slot; two-way moves write the destination before the source,
    and on a failure every swap done is undone.
    """

    def __init__(self, kv_caches: KvCaches, block_size: int, stream: Any = None) -> None:
        """Binds the caches.

        Raises:
            InvalidArgument: As ``bind_kv_caches``, or the tensors are not on a CUDA
                device (``make_executor`` picks the mover for each device).
        """
        tensors, self.num_blocks = bind_kv_caches(kv_caches, block_size)
        self._device = tensors[0].device
        if self._device.type != "cuda":
            raise InvalidArgument(
                f"CudaSwapExecutor moves CUDA tensors, got tensors on {self._device}"
            )
        self._stream = stream if stream is not None else torch.cuda.current_stream(self._device)
        self._views = [widest_view(view) for view in block_views(tensors, self.num_blocks)]
        self._staging: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for view in self._views:
            key = (view.dtype, view.shape[1])
            if key not in self._staging:
                rows = max(1, _STAGING_BYTES // (view.shape[1] * view.element_size()))
                rows = min(rows, self.num_blocks)
                self._staging[key] = (
                    torch.empty((rows, view.shape[1]), dtype=view.dtype, device=self._device),
                    torch.empty((rows, view.shape[1]), dtype=view.dtype, device=self._device),
                )
        self.bytes_per_block = sum(v.shape[1] * v.element_size() for v in self._views)

    def warmup(self) -> int:
        """Nothing to warm: the index kernels compile no graph per batch size. Runs no
        batch (returns 0)."""
        return 0

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        batch = MoveBatch.of(moves)
        one_way = batch.pairs(two_way=False)
        two_way = batch.pairs(two_way=True)
        with torch.cuda.stream(self._stream):
            if one_way:
                self._run(one_way, two_way=False)
            if two_way:
                self._run(two_way, two_way=True)
        num_bytes = self.bytes_per_block * (len(one_way) + 2 * len(two_way))
        return MoveReport(num_moves=len(moves), num_padded=0, num_bytes=num_bytes)

    def _index(self, ids: list[int]) -> torch.Tensor:
        """The ids on the device, copied from pinned memory without blocking the host."""
        index = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        return index.pin_memory().to(self._device, non_blocking=True)

    def _run(self, moves: list[tuple[int, int]], two_way: bool) -> None:
        """Moves every (source, destination) pair of one kind."""
        src = self._index([src for src, _ in moves])
        dst = self._index([dst for _, dst in moves])
        swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        half_swapped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        try:
            for view in self._views:
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
