"""vllm-gaudi's decode buckets under contiguous paged attention, modelled for the HPU
runner model (vllm-project/vllm-gaudi at 091bbadd: ``vllm_gaudi/extension/bucketing/
exponential.py`` and ``py``; lines cited per function).

A restatement of its own, apart from ``kvdefrag.server.buckets.exponential_decode_buckets``
(the product's): ``tests/vllm_integration/test_gaudi_buckets.py`` checks that the two
agree on the block counts.
"""

from __future__ import annotations

import itertools
import math

Bucket = tuple[int, int, int]
"""A decode bucket: (batch size, query length, number of blocks)."""


def _exponential_range(bmin: int, bstep: int, bmax: int, limit: int) -> list[int]:
    """``warmup_range_with_limit`` (exponential.py:147-203) under contiguous PA: ``limit``
    exponentially spaced values from ``bmin`` to ``bmax`` rounded up to ``bstep`` (the
    last one ``bmax`` itself), with 0 or 1 kept when it is ``bmin``."""
    low = bstep if bmin in (0, 1) else bmin
    if limit <= 1:
        return [bmax]
    values = set()
    for i in range(limit):
        value = low * math.pow(bmax / low, i / (limit - 1))
        values.add(bmax if i == limit - 1 else math.ceil(value / bstep) * bstep)
    if bmin in (0, 1):
        values.add(bmin)
    ordered = sorted(values)
    ordered[-1] = min(ordered[-1], bmax)
    return ordered


def decode_buckets(
    *,
    max_num_seqs: int,
    num_blocks: int,
    max_model_len: int,
    block_size: int,
    num_speculative_tokens: int = 0,
) -> list[Bucket]:
    """vllm-gaudi's decode buckets under contiguous PA, sorted.

    The batch sizes ``[1, 2, max_num_seqs]`` over ``log2(max_num_seqs) + 1`` values; the
    block counts ``[1, max_num_seqs, min(num_blocks, blocks of max_model_len * max_num_seqs)]``
    over ``log2(that) + 1`` values (``get_decode_cfgs``, exponential.py:88-140), the pool
    appended when the last is smaller (common.py:218-219); every pair with its neighbours
    in both ranges, no filter, no correction (``generate_buckets``, common.py:405-547); with
    speculative tokens the spec-decode buckets added (common.py:333-371).
    """
    batch_sizes = _exponential_range(1, 2, max_num_seqs, math.ceil(math.log2(max_num_seqs)) + 1)
    max_blocks = min(num_blocks, -(-max_model_len // block_size) * max_num_seqs)
    block_counts = _exponential_range(
        1, max_num_seqs, max_blocks, math.ceil(math.log2(max_blocks)) + 1
    )
    if block_counts[-1] < num_blocks:
        block_counts.append(num_blocks)
    buckets: set[Bucket] = set()
    for bs_index, ctx_index in itertools.product(range(len(batch_sizes)), range(len(block_counts))):
        for bs_next, ctx_next in itertools.product((0, 1), (0, 1)):
            if bs_index + bs_next < len(batch_sizes) and ctx_index + ctx_next < len(block_counts):
                buckets.add(
                    (batch_sizes[bs_index + bs_next], 1, block_counts[ctx_index + ctx_next])
                )
    if num_speculative_tokens:
        num_tokens = 1 + num_speculative_tokens
        for batch_size, query, ctx in list(buckets):
            if batch_size * num_tokens <= ctx:
                buckets.add((batch_size * num_tokens, query, ctx))
            buckets.add((batch_size * num_tokens, query, ctx * num_tokens))
    return sorted(buckets)


def find_decode_bucket(buckets: list[Bucket], batch_size: int, num_blocks: int) -> Bucket:
    """``find_decode_bucket`` (common.py:303-327): ``num_blocks`` capped at the largest
    prepared count, then the first bucket from the bisection point that holds both."""
    num_blocks = min(num_blocks, max(ctx for _, _, ctx in buckets))
    target = (batch_size, 1, num_blocks)
    start = next((i for i, bucket in enumerate(buckets) if bucket >= target), len(buckets))
    for bucket in buckets[start:]:
        if bucket[0] >= batch_size and bucket[2] >= num_blocks:
            return bucket
    raise AssertionError(f"no decode bucket holds {target}: the fallback is not modelled")
