"""Decode buckets: the sizes a static-shape backend's decode runs in, and vllm-gaudi's list.

Gaudi's contiguous paged attention reads the first ``decode_bucket(max_live + 1)`` blocks
of the pool in every decode, so the policy compacts only when its moves lower that bucket
(``EngineConfig.decode_buckets``, ``_policy``). ``exponential_decode_buckets`` restates the
list vllm-gaudi builds by default, for a pool and a model; on Gaudi the vLLM worker reads
the runner's own list instead (``kvdefrag.vllm._worker.gaudi_buckets``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from kvdefrag.common import InvalidArgument

__all__ = ["decode_bucket", "exponential_decode_buckets"]


def decode_bucket(buckets: Sequence[int], num_needed: int, num_blocks: int) -> int:
    """The decode bucket that ``num_needed`` blocks run in: the smallest of ``buckets``
    that holds them, or the whole pool (``num_blocks``) above the largest one.

    NOTE: vllm-gaudi's top decode bucket under contiguous paged attention is the pool
    itself, so a list that stops below the pool is read as if the pool followed it.

    Args:
        buckets: Strictly increasing bucket sizes, in blocks (``EngineConfig``'s
            ``decode_buckets``).
        num_needed: Blocks the decode must read: the highest live id + 1.
        num_blocks: Blocks in the pool.
    """
    index = bisect.bisect_left(buckets, num_needed)
    return buckets[index] if index < len(buckets) else max(num_blocks, num_needed)


def exponential_decode_buckets(
    num_blocks: int, *, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[int, ...]:
    """vllm-gaudi's default decode block buckets under contiguous paged attention, restated.

    The rules, each with where vllm-gaudi states it (commit 091bbadd):

    1. The exponential strategy is the default (``vllm_gaudi/extension/features.py``
       L99-100), and contiguous paged attention is on whenever prefix caching is off
       (L97).
    2. The block range tops out at the worst case, every sequence at ``max_model_len``:
       ``top = ceil(max_model_len / block_size) * max_num_seqs``
       (``vllm_gaudi/extension/bucketing/exponential.py`` L102), capped by the pool
       under contiguous paged attention, whose decode reads blocks by id: ``top =
       min(num_blocks, top)`` (L103-106). ``num_blocks`` is ``num_hpu_blocks``, the
       KV tensor's own block count (``py`` L211; ``v1/worker/hpu_model_runner.py``
       L6943-6944).
    3. The range is ``min=1, step=max_num_seqs, max=top, limit=ceil(log2(top)) + 1``
       (``exponential.py`` L124, L130).
    4. ``warmup_range_with_limit`` (``exponential.py`` L144-203) spaces ``limit`` points
       geometrically from ``step`` to ``top`` (the min of 1 is swapped for ``step`` and
       kept as a bucket of its own, L176-179 and L198-199), rounds each up to a multiple
       of ``step`` (L190-196) except the last, which is ``top`` itself under contiguous
       paged attention (L192-193), drops duplicates (a set), and lowers a largest value
       above ``top`` to ``top`` (L201-202): so nothing above ``top`` is kept. A
       ``limit`` of 1 (``top`` = 1) gives just ``top`` (L185-186).
    5. The pool is appended when the range stops below it (``py`` L218-219).
    6. With contiguous paged attention no decode bucket is filtered or corrected
       (``py`` L474-476, L487-489), and every batch size is paired with every
       block count (L511-515), so the block counts are exactly this list.

    NOTE: the "3x physical" clamp (``exponential.py`` L107-123) and the runner's
    ``skip_decode_block_clamp`` (``hpu_model_runner.py`` L6161-6163), which turns it off,
    only apply without contiguous paged attention (an ``elif`` of rule 2), so neither
    enters here. For hybrid models whose attention block size differs from the KV cache's,
    the runner builds decode buckets with the attention block size (L6164-6169): pass that
    as ``block_size``. Decode buckets read from a file, another bucketing strategy, or
    speculative decoding (which adds block counts, ``py`` L230-234) are not
    restated: take the runner's own list then (``kvdefrag.vllm._worker.gaudi_buckets``).

    The rounding makes the low end a linear ramp (``step, 2*step, ...``) and the high end
    exponential (about 30% apart for a few thousand blocks).

    Example:
        >>> exponential_decode_buckets(
        ...     8192, max_num_seqs=128, max_model_len=4096, block_size=128
        ... )  # top = min(8192, 32 * 128) = 4096
        (1, 128, 256, 384, 512, 640, 768, 1024, 1408, 1792, 2304, 3072, 4096, 8192)

    Args:
        num_blocks: Blocks in the pool (the top bucket), >= 1.
        max_num_seqs: The scheduler's ``max_num_seqs``: the rounding step, and the
            sequences of the worst case. >= 1.
        max_model_len: The model's ``max_model_len``, in tokens, >= 1.
        block_size: Tokens per block (the attention block size, see the note), >= 1.

    Raises:
        InvalidArgument: An argument that is not an int >= 1 (named, with its value).
    """
    arguments = {
        "num_blocks": num_blocks,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len,
        "block_size": block_size,
    }
    for name, value in arguments.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
    step = max_num_seqs
    worst_case = -(-max_model_len // block_size) * max_num_seqs
    top = min(num_blocks, worst_case)
    num_points = math.ceil(math.log2(top)) + 1
    buckets = {1, top, num_blocks}
    # NOTE: the exponent is formed as vllm-gaudi forms it, (1 / (limit - 1)) * i, not
    # i / (limit - 1): the two can differ in the last bit, and a point that lands on a
    # multiple of the step would round to a different bucket.
    exponent_step = 1.0 / (num_points - 1) if num_points > 1 else 0.0
    for index in range(num_points - 1):  # the last point is top itself
        point = step * (top / step) ** (exponent_step * index)
        rounded = math.ceil(point / step) * step
        if rounded < top:
            buckets.add(rounded)
    return tuple(sorted(buckets))
