"""How a worker binds vLLM's KV caches: each layer's tensors viewed as kvdefrag's flat pairs.

``bind_vllm_kv_caches`` turns the runner's ``kv_caches`` into the per-layer ``(key,
value)`` views ``serve_in_process`` moves blocks in, refusing a layout it cannot move a
block of as one run of memory.

vllm-gaudi's HPU runner, as read in vllm-project/vllm-gaudi (main, 2026-08-21):

* ``vllm_gaudi/v1/worker/hpu_model_runner.py``, ``HPUModelRunner.initialize_kv_cache``
  allocates every attention layer with ``attn_backend.get_kv_cache_shape(num_blocks + 1,
  ...)``, ``num_blocks`` the layer tensor's own count (at least
  ``KVCacheConfig.num_blocks``: vLLM keeps the smallest count of all ranks and leaves the
  tensors as they are), and stores the layer as the 4-tuple ``(key_cache, value_cache,
  key_scales, value_scales)``. The extra block is its pad block, the last one:
  ``_PAD_BLOCK_ID = num_blocks`` and ``_PAD_SLOT_ID = num_blocks * block_size`` (padded
  slots write there).
* ``vllm_gaudi/attention/ops/hpu_paged_attn.py``, ``HPUPagedAttention.get_kv_cache_shape``:
  ``(num_blocks * block_size, num_kv_heads, head_size)``; the MLA backends
  (``HPUMLAAttentionBackend``, ``HPUUnifiedMLABackend`` in
  ``vllm_gaudi/attention/backends/hpu_attn.py``): ``(num_blocks * block_size,
  head_size)``, with ``value_cache`` None.
* The scales are tensors only with dynamic fp8 KV (an ``fp8_e4m3`` cache with
  ``QUANT_CONFIG`` and ``VLLM_DYNAMIC_KV_QUANT`` set, not MLA), else None:
  ``key_scales`` is ``[(num_blocks + 1) * block_size, num_kv_heads, 1]`` (one per token
  slot and head) and ``value_scales`` the pair ``(value_scales_on_T`` shaped as
  ``key_scales``, ``value_scales_on_hidden [num_blocks + 1, num_kv_heads, head_size])``
  (one row per block), all bfloat16. Its ``HPUPagedAttention.swap_blocks`` and
  ``copy_blocks`` (``vllm_gaudi/extension/cache_ops.py``) move them with their blocks;
  its own defragmenter's ``CacheSwapUtils.swap`` (``vllm_gaudi/extension/defragmentation.py``)
  swaps ``kv_cache[0]`` and ``kv_cache[1]`` only.
* ``bind_kv_cache`` (vLLM) puts the per-layer tuples into ``model_runner.kv_caches``; a
  layer that shares another's KV (``shared_kv_cache_layers``) gets the same tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvdefrag.vllm.errors import UnsupportedByKvdefrag

KvPair = tuple[torch.Tensor, torch.Tensor | None]


def bind_vllm_kv_caches(kv_caches: Sequence[Any], num_blocks: int, block_size: int) -> list[KvPair]:
    """Views vLLM's per-layer KV tensors as kvdefrag's flat ``(key, value)`` pairs.

    A block moves as a whole, so a layout binds when each block is one contiguous run of
    memory; the order inside a block (tokens, heads) does not matter::

        [2, num_blocks, ...]  (key/value first: FlashAttention, CPU)  -> (kv[0], kv[1])
        [num_blocks, ...]     (block first: FlashInfer, MLA)           -> (kv, None)
        each viewed as [num_blocks * block_size, -1]

    vllm-gaudi's layers are tuples (see the module docstring)::

        (key_cache, value_cache, key_scales, value_scales)   or (key_cache, value_cache)

        key_cache    | blk 0 | blk 1 | ... | blk n-1 | pad blk |  [(n + 1) * block_size, ...]
                       ^ bound: [:n * block_size]      ^ never bound, never moved
        value_cache  the same (None for MLA)                   -> (key, value)
        key_scales, value_scales[0]  one row per token slot    -> (scales, None) each
        value_scales[1]              one row per block          -> (scales, None), each
                                                                   block's row viewed as
                                                                   block_size slots

    Only the first ``num_blocks`` blocks are bound, so vllm-gaudi's pad block (and any
    block a rank has beyond ``num_blocks``) never moves. A scale that is None is skipped,
    and so is a single-element (per-tensor) scale: it is the same for every block, so a
    move leaves it right. A tensor two layers share is bound once (a swap applied twice
    would undo itself).

    Args:
        kv_caches: ``model_runner.kv_caches``, one entry per attention layer.
        num_blocks: ``KVCacheConfig.num_blocks``.
        block_size: Token slots per block.

    Returns:
        One ``(key, value)`` pair per distinct tensor pair; ``value`` is None when a block
        holds both (MLA's single latent) and for a bound scale tensor.

    Raises:
        UnsupportedByKvdefrag: A tensor with another layout (its layer, its name and shape in the
            message), or one that is not contiguous (a block is then not one run of
            memory, so it cannot be bound as a view). Nothing is bound.
    """
    pairs: list[KvPair] = []
    seen: set[int] = set()
    for index, kv in enumerate(kv_caches):
        if isinstance(kv, (tuple, list)):
            for pair in _bind_hpu_layer(index, kv, num_blocks, block_size):
                if pair[0].data_ptr() not in seen:
                    seen.add(pair[0].data_ptr())
                    pairs.append(pair)
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        shape = tuple(kv.shape)
        _check_contiguous(index, "KV cache", kv)
        per_block = kv.numel() // max(num_blocks, 1)
        if kv.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            pairs.append(
                (_flat(kv[0], num_blocks, block_size), _flat(kv[1], num_blocks, block_size))
            )
        elif kv.dim() >= 2 and shape[0] == num_blocks and per_block % block_size == 0:
            pairs.append((_flat(kv, num_blocks, block_size), None))
        else:
            raise UnsupportedByKvdefrag(
                f"kvdefrag: KV cache of layer {index} has shape {shape}; expected "
                f"[2, {num_blocks}, ...] or [{num_blocks}, ...] with {block_size}-token blocks"
            )
    return pairs


def _bind_hpu_layer(
    index: int, layer: Sequence[Any], num_blocks: int, block_size: int
) -> list[KvPair]:
    """vllm-gaudi's layer tuple as pairs: ``(key, value)`` first, then one per scale."""
    if len(layer) not in (2, 4) or not isinstance(layer[0], torch.Tensor):
        raise UnsupportedByKvdefrag(
            f"kvdefrag: KV cache of layer {index} is a sequence of {len(layer)} items "
            f"starting with {type(layer[0]).__name__ if layer else 'nothing'}; expected "
            "vllm-gaudi's (key_cache, value_cache, key_scales, value_scales) or (key_cache, "
            "value_cache), key_cache a tensor"
        )
    key, value = layer[0], layer[1]
    _check_contiguous(index, "key_cache", key)
    num_slots = key.shape[0] if key.dim() else 0
    pool_slots = num_blocks * block_size
    if num_slots % block_size or num_slots < pool_slots:
        raise UnsupportedByKvdefrag(
            f"kvdefrag: key_cache of layer {index} has shape {tuple(key.shape)}; expected "
            f"[k * {block_size}, ...] token slots with k >= {num_blocks} blocks (vllm-gaudi "
            "allocates num_blocks + 1, its pad block last)"
        )
    if value is not None:
        if not isinstance(value, torch.Tensor) or value.shape[:1] != key.shape[:1]:
            found = (
                f"of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else f"a {type(value).__name__}"
            )
            raise UnsupportedByKvdefrag(
                f"kvdefrag: value_cache of layer {index} is {found}; expected a tensor of "
                f"{num_slots} token slots as its key_cache, or None (MLA)"
            )
        _check_contiguous(index, "value_cache", value)
    pairs: list[KvPair] = [
        (_pool_view(key, pool_slots), None if value is None else _pool_view(value, pool_slots))
    ]
    for name, scales in zip(("key_scales", "value_scales"), layer[2:], strict=False):
        for scale_name, tensor in _scale_tensors(index, name, scales):
            view = _bind_scales(index, scale_name, tensor, num_slots, num_blocks, block_size)
            if view is not None:
                pairs.append((view, None))
    return pairs


def _scale_tensors(index: int, name: str, scales: Any) -> list[tuple[str, torch.Tensor]]:
    """A scales entry's tensors, named: None, a tensor, or a sequence of either."""
    if scales is None:
        return []
    if isinstance(scales, torch.Tensor):
        return [(name, scales)]
    if isinstance(scales, (tuple, list)):
        found = []
        for position, item in enumerate(scales):
            if item is None:
                continue
            if not isinstance(item, torch.Tensor):
                raise UnsupportedByKvdefrag(
                    f"kvdefrag: {name}[{position}] of layer {index} is a "
                    f"{type(item).__name__}; expected a tensor or None"
                )
            found.append((f"{name}[{position}]", item))
        return found
    raise UnsupportedByKvdefrag(
        f"kvdefrag: {name} of layer {index} is a {type(scales).__name__}; expected a tensor, "
        "a tuple of tensors, or None"
    )


def _bind_scales(
    index: int,
    name: str,
    tensor: torch.Tensor,
    num_slots: int,
    num_blocks: int,
    block_size: int,
) -> torch.Tensor | None:
    """The pool's part of one scale tensor, viewed as token slots; None for a per-tensor
    scale (one element: the same for every block, nothing to move)."""
    if tensor.numel() == 1:
        return None
    _check_contiguous(index, name, tensor)
    shape = tuple(tensor.shape)
    pool_slots = num_blocks * block_size
    if shape[0] == num_slots:  # one row per token slot
        return _pool_view(tensor, pool_slots)
    if shape[0] == num_slots // block_size:  # one row per block
        per_block = tensor[0].numel()
        if per_block % block_size:
            raise UnsupportedByKvdefrag(
                f"kvdefrag: {name} of layer {index} has shape {shape}: a row of {per_block} "
                f"elements per block, which does not split into {block_size} token slots, "
                "so it cannot be bound next to its blocks"
            )
        return tensor[:num_blocks].view(pool_slots, per_block // block_size)
    raise UnsupportedByKvdefrag(
        f"kvdefrag: {name} of layer {index} has shape {shape}; expected one row per token "
        f"slot [{num_slots}, ...] or per block [{num_slots // block_size}, ...], as its "
        "key_cache, or a single (per-tensor) scale"
    )


def _check_contiguous(index: int, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise UnsupportedByKvdefrag(
            f"kvdefrag: {name} of layer {index} (shape {tuple(tensor.shape)}, stride "
            f"{tensor.stride()}) is not contiguous, so a block is not one run of memory; "
            "this attention backend's layout cannot be bound"
        )


def _pool_view(tensor: torch.Tensor, pool_slots: int) -> torch.Tensor:
    """The first ``pool_slots`` token slots of a contiguous slot-first tensor, flat."""
    return tensor[:pool_slots].view(pool_slots, -1)


def _flat(tensor: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    per_block = tensor.numel() // num_blocks
    if per_block % block_size != 0:
        raise UnsupportedByKvdefrag(
            f"kvdefrag: a block of shape {tuple(tensor.shape[1:])} does not split into "
            f"{block_size} token slots"
        )
    return tensor.view(num_blocks * block_size, per_block // block_size)
