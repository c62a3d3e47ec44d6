"""vllm-gaudi's KV caches on the CPU, laid out as its HPU runner allocates them.

Modelled on vllm-project/vllm-gaudi (main, 2026-08-21),
``vllm_gaudi/v1/worker/hpu_model_runner.py``, ``HPUModelRunner.initialize_kv_cache``: per
attention layer the 4-tuple ``(key_cache, value_cache, key_scales, value_scales)`` over
``num_blocks + 1`` blocks, the last one its pad block (``_PAD_BLOCK_ID = num_blocks``)::

    key_cache, value_cache     [(num_blocks + 1) * block_size, num_kv_heads, head_size]
    key_scales                 [(num_blocks + 1) * block_size, num_kv_heads, 1]   bfloat16
    value_scales               ([(num_blocks + 1) * block_size, num_kv_heads, 1],
                                [num_blocks + 1, num_kv_heads, head_size])        bfloat16

The scales are tensors only with dynamic fp8 KV, else None; MLA keeps one latent
``[(num_blocks + 1) * block_size, head_size]`` with ``value_cache`` and both scales None.

Signing them block by block in this raw layout (not through kvdefrag's views) is
``SignedKv`` over ``gaudi_tensors``: block ``b`` of a tensor is row ``b`` of its
``[num_blocks + 1, -1]`` view, whether it has a row per token slot or per block.
"""

from __future__ import annotations

from typing import Any

import torch

GaudiLayer = tuple[torch.Tensor, torch.Tensor | None, Any, Any]


def make_gaudi_kv_caches(
    num_blocks: int,
    *,
    block_size: int = 4,
    num_layers: int = 2,
    num_heads: int = 2,
    head_size: int = 4,
    dtype: torch.dtype = torch.float32,
    mla: bool = False,
    scales: bool = False,
    extra_blocks: int = 0,
) -> list[GaudiLayer]:
    """Builds vllm-gaudi's per-layer KV tuples, zero-filled (scales one-filled).

    Args:
        num_blocks: ``KVCacheConfig.num_blocks`` (what kvdefrag binds).
        block_size: Token slots per block.
        num_layers: Attention layers.
        num_heads: KV heads.
        head_size: Head size (the latent size with ``mla``).
        dtype: The KV caches' element type (the scales are bfloat16, as vllm-gaudi's).
        mla: One latent cache per layer, value and scales None.
        scales: Dynamic fp8 KV's scale tensors (ignored with ``mla``); else None.
        extra_blocks: Blocks this rank's tensors hold past ``num_blocks`` (vLLM keeps the
            smallest count of all ranks), before the pad block.

    Returns:
        One ``(key_cache, value_cache, key_scales, value_scales)`` per layer over
        ``num_blocks + extra_blocks + 1`` blocks.
    """
    blocks = num_blocks + extra_blocks + 1
    slots = blocks * block_size
    shape = (slots, head_size) if mla else (slots, num_heads, head_size)
    with_scales = scales and not mla
    layers: list[GaudiLayer] = []
    for _ in range(num_layers):
        key_scales = value_scales = None
        if with_scales:
            key_scales = torch.ones(slots, num_heads, 1, dtype=torch.bfloat16)
            value_scales = (
                torch.ones(slots, num_heads, 1, dtype=torch.bfloat16),
                torch.ones(blocks, num_heads, head_size, dtype=torch.bfloat16),
            )
        value = None if mla else torch.zeros(shape, dtype=dtype)
        layers.append((torch.zeros(shape, dtype=dtype), value, key_scales, value_scales))
    return layers


def gaudi_tensors(kv_caches: list[Any]) -> list[torch.Tensor]:
    """Every distinct tensor of the layer tuples (a shared layer's once), in order."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(item: Any) -> None:
        if isinstance(item, (tuple, list)):
            for inner in item:
                add(inner)
        elif item is not None and item.data_ptr() not in seen:
            seen.add(item.data_ptr())
            found.append(item)

    add(kv_caches)
    return found
