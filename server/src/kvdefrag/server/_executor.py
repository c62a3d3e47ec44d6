"""Swap executors: the only code that reads or writes the worker's KV tensors.

The worker's caches are bound exactly as vllm-gaudi lays them out: one ``(key, value)``
pair per layer, each tensor's first dimension ``num_blocks * block_size`` flat token
slots, ``value`` None for MLA models. A block is ``block_size`` consecutive rows::

    key[l]:  | blk 0 (null) | blk 1 | blk 2 | ... | blk n-1 |
               ^ block_size rows each; a move copies whole blocks

This module holds what every backend shares (the ``SwapExecutor`` protocol, binding and
viewing the caches, padding) and the backend table. One module per backend, chosen once
from the tensors' device through ``_BACKENDS`` and imported only when chosen:
``_executor_cpu`` (``CpuSwapExecutor``), ``_executor_cuda`` (``CudaSwapExecutor``) and
``_executor_hpu`` (``HpuSwapExecutor``, the only module that imports
``habana_frameworks``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._moves import Move, MoveReport

KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]


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


# NOTE: each backend's module is imported when a device of its kind is bound, not at the
# top: the CPU and CUDA modules import this one for the shared helpers, and the HPU one
# must not be imported where habana_frameworks is absent.
def _cpu_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    from kvdefrag.server._executor_cpu import CpuSwapExecutor

    return CpuSwapExecutor(kv_caches, block_size)


def _cuda_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    from kvdefrag.server._executor_cuda import CudaSwapExecutor

    return CudaSwapExecutor(kv_caches, block_size, stream=options.get("stream"))


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
