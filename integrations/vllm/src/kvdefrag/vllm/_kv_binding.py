"""How a worker binds vLLM's KV caches: each layer's tensor viewed as kvdefrag's flat pairs.

``bind_vllm_kv_caches`` turns the runner's ``kv_caches`` into the per-layer ``(key,
value)`` views ``serve_in_process`` moves blocks in, refusing a layout it cannot move a
block of as one run of memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def bind_vllm_kv_caches(
    kv_caches: Sequence[Any], num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Views vLLM's per-layer KV tensors as kvdefrag's flat ``(key, value)`` pairs.

    A block moves as a whole, so a layout binds when each block is one contiguous run of
    memory; the order inside a block (tokens, heads) does not matter::

        [2, num_blocks, ...]  (key/value first: FlashAttention, CPU)  -> (kv[0], kv[1])
        [num_blocks, ...]     (block first: FlashInfer, MLA)           -> (kv, None)
        each viewed as [num_blocks * block_size, -1]
        (key, value) pairs    (vllm-gaudi: [num_blocks * block_size, heads, head_size]
                               each, value None for MLA)               -> viewed the same

    A tensor two layers share (KV sharing) is bound once.

    Args:
        kv_caches: ``model_runner.kv_caches``, one tensor per attention layer.
        num_blocks: ``KVCacheConfig.num_blocks``.
        block_size: Token slots per block.

    Returns:
        One ``(key, value)`` pair per distinct tensor; ``value`` is None when a block holds
        both (or MLA's single latent).

    Raises:
        ValueError: A tensor with another layout, or one that is not contiguous (a block is
            then not one run of memory, so it cannot be bound as a view).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    seen: set[int] = set()
    for index, kv in enumerate(kv_caches):
        if isinstance(kv, (tuple, list)):
            pair = _bind_pair(index, kv, num_blocks, block_size)
            if pair[0].data_ptr() not in seen:
                seen.add(pair[0].data_ptr())
                pairs.append(pair)
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        shape = tuple(kv.shape)
        if not kv.is_contiguous():
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} (shape {shape}, stride {kv.stride()}) "
                "is not contiguous, so a block is not one run of memory; this attention "
                "backend's layout cannot be bound"
            )
        per_block = kv.numel() // max(num_blocks, 1)
        if kv.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            pairs.append(
                (_flat(kv[0], num_blocks, block_size), _flat(kv[1], num_blocks, block_size))
            )
        elif kv.dim() >= 2 and shape[0] == num_blocks and per_block % block_size == 0:
            pairs.append((_flat(kv, num_blocks, block_size), None))
        else:
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} has shape {shape}; expected "
                f"[2, {num_blocks}, ...] or [{num_blocks}, ...] with {block_size}-token blocks"
            )
    return pairs


def _bind_pair(
    index: int, pair: Sequence[torch.Tensor | None], num_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer given as a ``(key, value)`` pair whose first dimension counts token slots."""
    if len(pair) != 2 or pair[0] is None:
        raise ValueError(
            f"kvdefrag: KV cache of layer {index} is a sequence of {len(pair)} items; "
            "expected (key, value) with value None only for MLA"
        )
    flat: list[torch.Tensor | None] = []
    for tensor in pair:
        if tensor is None:
            flat.append(None)
            continue
        if not tensor.is_contiguous() or tensor.shape[0] != num_blocks * block_size:
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} holds a tensor of shape "
                f"{tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()}); expected a "
                f"contiguous [{num_blocks * block_size}, ...] (num_blocks * block_size)"
            )
        flat.append(tensor.view(num_blocks * block_size, -1))
    key = flat[0]
    assert key is not None
    return key, flat[1]


def _flat(tensor: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    per_block = tensor.numel() // num_blocks
    if per_block % block_size != 0:
        raise ValueError(
            f"kvdefrag: a block of shape {tuple(tensor.shape[1:])} does not split into "
            f"{block_size} token slots"
        )
    return tensor.view(num_blocks * block_size, per_block // block_size)
