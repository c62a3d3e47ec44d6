"""Swap executors: the only code that reads or writes the worker's KV tensors.

The worker's caches are bound as flat pairs: one ``(key, value)`` pair per layer, each
tensor's first dimension ``num_blocks * block_size`` flat token slots, ``value`` None for
MLA models (the vLLM worker views vLLM's and vllm-gaudi's layouts as such pairs). A block
is ``block_size`` consecutive rows::

    key[l]:  | blk 0 (null) | blk 1 | blk 2 | ... | blk n-1 |
               ^ block_size rows each; a move copies whole blocks

This module holds what every backend shares and what they import: the ``SwapExecutor``
protocol, binding and viewing the caches, padding. One module per backend
(``_executor_cpu``: ``CpuSwapExecutor``, ``_executor_cuda``: ``CudaSwapExecutor``,
``_executor_hpu``: ``HpuSwapExecutor``, the only module that imports
``habana_frameworks``), chosen once from the tensors' device by ``_backends.make_executor``,
which imports only the one it chooses; nothing here imports a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server._moves import Move, MoveReport

KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]


class SwapExecutor(Protocol):
    """Moves whole blocks inside the bound KV tensors.

    An executor may also offer ``warmup() -> int``: it runs every static batch shape once
    with batches that move nothing (the HPU backend: each pad bucket, one-way and
    two-way) and returns how many batches it ran. The built-in backends all have it
    (CPU and CUDA run none: they compile no graphs); ``warm_up`` calls it where it exists.
    """

    num_blocks: int

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        """Copies (or swaps) every move's block; raises on failure."""
        ...


def warm_up(executor: SwapExecutor) -> int:
    """Runs ``executor``'s warm-up (see ``SwapExecutor``); returns the batches it ran, 0
    for an executor without one."""
    warmup = getattr(executor, "warmup", None)
    return 0 if warmup is None else int(warmup())


def bind_kv_caches(kv_caches: KvCaches, block_size: int) -> tuple[list[torch.Tensor], int]:
    """Checks the worker's caches and returns their tensors and the pool's num_blocks.

    Raises:
        InvalidArgument: The caches are empty, not (key, value) pairs, or disagree on
            device or on the number of token slots, or that is not a multiple of
            ``block_size``, or two tensors share memory (``check_disjoint``).
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
    check_disjoint(kv_caches)
    num_blocks = num_slots // block_size
    if num_blocks < 2:
        raise InvalidArgument(f"the pool needs at least 2 blocks, got {num_blocks}")
    return tensors, num_blocks


def check_disjoint(kv_caches: KvCaches) -> None:
    """Refuses KV tensors whose memory overlaps: the same tensor bound twice (as a
    layer's key and value, or in two layers), or two views of one storage that share
    bytes.

    A move is applied to every bound tensor in turn, so memory bound twice is moved
    twice: a two-way swap then undoes itself and a one-way move reads a block it has
    just overwritten, while the mapping says the blocks moved. Each tensor's span is
    its first to last byte (``data_ptr`` to the element at the largest offset its
    strides reach); spans are compared sorted by start, O(n log n) in the tensors and
    independent of the pool's size. Two views that interleave in one storage (not
    contiguous) have intersecting spans and are refused even where their elements
    differ: binding them is not worth proving safe. vLLM's layouts bind disjoint spans:
    ``[2, num_blocks, ...]``'s key and value halves, vllm-gaudi's caches and scales.

    Raises:
        InvalidArgument: Two tensors' spans intersect; the message names both, as
            ``kv_caches[LAYER].key`` or ``.value``.
    """
    spans: list[tuple[int, int, int, str]] = []
    for layer, pair in enumerate(kv_caches):
        for name, tensor in zip(("key", "value"), pair, strict=True):
            if tensor is None or tensor.numel() == 0 or tensor.device.type == "meta":
                continue  # no memory to share
            start = tensor.data_ptr()
            strides = tensor.stride()
            last = sum(
                (size - 1) * stride for size, stride in zip(tensor.shape, strides, strict=True)
            )
            end = start + (last + 1) * tensor.element_size()
            spans.append((start, len(spans), end, f"kv_caches[{layer}].{name}"))
    spans.sort()
    furthest_end, furthest_name = 0, ""
    for start, _, end, name in spans:
        if furthest_name and start < furthest_end:
            raise InvalidArgument(
                f"{name} overlaps {furthest_name}: the two share memory, so every move "
                "would be applied to it twice (a swap undoes itself); bind each KV "
                "tensor once (a tensor that two layers share is one pair), and key and "
                "value as disjoint tensors"
            )
        if end > furthest_end:
            furthest_end, furthest_name = end, name


TensorGeometry = tuple[tuple[int, ...], torch.dtype, str]
"""A KV tensor's shape, dtype and device kind (``cpu``, ``cuda``, ``hpu``)."""

KvGeometry = tuple[tuple[TensorGeometry, TensorGeometry | None], ...]
"""Per layer, its key's and its value's ``TensorGeometry`` (None for an MLA value)."""


def kv_geometry(kv_caches: KvCaches, block_size: int) -> KvGeometry:
    """What new KV tensors must keep to be bound in place of ``kv_caches``.

    Raises:
        InvalidArgument: As ``bind_kv_caches``.
    """
    bind_kv_caches(kv_caches, block_size)
    return tuple(
        (_tensor_geometry(key), None if value is None else _tensor_geometry(value))
        for key, value in kv_caches
    )


def check_same_geometry(bound: KvGeometry, kv_caches: KvCaches, block_size: int) -> None:
    """Refuses KV tensors that are not laid out as the bound ones.

    Raises:
        InvalidArgument: ``kv_caches`` is malformed (as ``bind_kv_caches``), or differs
            from ``bound`` in its number of layers, or in a tensor's shape, dtype or
            device kind, or has a value where the bound caches have none (or the other
            way round); the message names the first difference.
    """
    geometry = kv_geometry(kv_caches, block_size)
    if len(geometry) != len(bound):
        raise InvalidArgument(
            f"kv_caches has {len(geometry)} layers, the bound caches {len(bound)}: new KV "
            "caches must keep the bound caches' geometry (layers, shapes, dtypes, device kind)"
        )
    for layer, (was, now) in enumerate(zip(bound, geometry, strict=True)):
        for name, was_tensor, now_tensor in zip(("key", "value"), was, now, strict=True):
            if was_tensor != now_tensor:
                raise InvalidArgument(
                    f"kv_caches[{layer}].{name} is {_describe(now_tensor)}, the bound one "
                    f"{_describe(was_tensor)}: new KV caches must keep the bound caches' "
                    "geometry (layers, shapes, dtypes, device kind)"
                )


def _tensor_geometry(tensor: torch.Tensor) -> TensorGeometry:
    return tuple(tensor.shape), tensor.dtype, tensor.device.type


def _describe(geometry: TensorGeometry | None) -> str:
    if geometry is None:
        return "None"
    shape, dtype, device_type = geometry
    return f"a {str(dtype).removeprefix('torch.')} {device_type} tensor of shape {shape}"


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
