"""HPU (Intel Gaudi) swap executor: the only module that imports ``habana_frameworks``.

Imported by ``_backends.make_executor`` only when the KV tensors live on an HPU. Gaudi
graphs want static shapes, so every batch is padded to a bucket with the null pair
(0 -> 0) and the swap is pre-warmed for every bucket at bind time, so no graph is
compiled inside a worker step (``HpuSwapExecutor.warmup``, which the service runs again
when the worker asks: ``ServerHandle.warmup``).

NOTE: this backend cannot run on the CPU/CUDA machines kvdefrag is developed on; its
logic mirrors the CUDA backend (``_executor_cuda``), and it is tested on CPU tensors with
a stand-in ``habana_frameworks``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from kvdefrag.server._executor import KvCaches, bind_kv_caches, pad_to_bucket
from kvdefrag.server._moves import Move, MoveBatch, MoveReport
from kvdefrag.server.config import DEFAULT_PAD_BUCKETS


class _BlockSwap(torch.nn.Module):
    """Copies or swaps whole blocks in flat token-slot caches (graph-capturable)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        super().__init__()
        self.block_size = block_size
        self.block_slots = torch.arange(block_size, dtype=torch.long, device=device)

    def forward(
        self, src: torch.Tensor, dst: torch.Tensor, caches: list[torch.Tensor], two_way: bool
    ) -> None:
        src_slots = ((src * self.block_size).unsqueeze(-1) + self.block_slots).flatten()
        dst_slots = ((dst * self.block_size).unsqueeze(-1) + self.block_slots).flatten()
        for cache in caches:
            from_src = cache.index_select(0, src_slots)
            if two_way:
                from_dst = cache.index_select(0, dst_slots)
                cache.index_copy_(0, dst_slots, from_src)
                cache.index_copy_(0, src_slots, from_dst)
            else:
                cache.index_copy_(0, dst_slots, from_src)


class HpuSwapExecutor:
    """Swap executor for KV tensors on a Gaudi HPU (lazy or eager bridge mode)."""

    def __init__(
        self,
        kv_caches: KvCaches,
        block_size: int,
        pad_buckets: Sequence[int] = DEFAULT_PAD_BUCKETS,
        use_graphs: bool = True,
        **_: Any,
    ) -> None:
        self._htorch: Any = importlib.import_module("habana_frameworks.torch")
        self._caches, self.num_blocks = bind_kv_caches(kv_caches, block_size)
        self._device = self._caches[0].device
        self._buckets = tuple(pad_buckets)
        self._bytes_per_block = sum(
            block_size * (cache[0].numel() * cache.element_size()) for cache in self._caches
        )
        swap: Any = _BlockSwap(block_size, self._device)
        if use_graphs:
            if self._htorch.utils.internal.is_lazy():
                swap = self._htorch.hpu.wrap_in_hpu_graph(swap, disable_tensor_cache=True)
            else:
                swap.forward = torch.compile(
                    swap.forward, backend="hpu_backend", fullgraph=True, dynamic=False
                )
        self._swap = swap
        self.warmup()

    def warmup(self) -> int:
        """Runs every pad bucket once, one-way and two-way, with pad-only batches.

        A pad-only batch copies the null block onto itself: it moves nothing, and
        compiles (or captures) the bucket's graph, so none is compiled inside a step.
        The constructor runs it; run it again when the graphs may have been dropped (the
        worker woke up).

        Returns:
            The batches run: two per bucket.
        """
        for bucket in self._buckets:
            for two_way in (False, True):
                self._run([0] * bucket, [0] * bucket, two_way)
        return 2 * len(self._buckets)

    def _run(self, src_ids: list[int], dst_ids: list[int], two_way: bool) -> None:
        src = torch.tensor(src_ids, dtype=torch.long).to(self._device, non_blocking=True)
        dst = torch.tensor(dst_ids, dtype=torch.long).to(self._device, non_blocking=True)
        self._htorch.core.mark_step()
        self._swap(src, dst, self._caches, two_way)
        self._htorch.core.mark_step()

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        batch = MoveBatch.of(moves)
        num_padded = 0
        largest = self._buckets[-1]
        for start in range(0, len(batch), largest):
            end = start + largest
            src, dst, padded = pad_to_bucket(
                batch.src_ids[start:end], batch.dst_ids[start:end], self._buckets
            )
            num_padded += padded
            # NOTE: a swap is also a correct one-way move; one graph per bucket and mode.
            self._run(src, dst, two_way=any(batch.is_two_way[start:end]))
        num_bytes = self._bytes_per_block * (len(batch) + batch.num_two_way)
        return MoveReport(num_moves=len(batch), num_padded=num_padded, num_bytes=num_bytes)
