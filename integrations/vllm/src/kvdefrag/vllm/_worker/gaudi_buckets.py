"""The decode block buckets a vllm-gaudi HPU runner runs, read from the runner itself.

``EngineConfig.decode_buckets`` should be the decode sizes the backend actually uses;
``kvdefrag.server.buckets.exponential_decode_buckets`` restates vllm-gaudi's default, and
this reads the list the runner built, which also covers bucketing from a file, the linear
and padding-aware strategies and speculative decoding. Where vllm-gaudi keeps it (commit
091bbadd):

* ``vllm_gaudi/v1/worker/hpu_model_runner.py``: the runner's ``bucketing_manager``, an
  ``HPUBucketingManager`` (L1520), initialized only with bucketing on (L1523-1533);
  ``warmup_model`` fills its decode buckets (L6167), or empties them for a pooling model
  (L6170-6171), before it warms anything up, with ``skip_warmup`` too (L6218).
  ``use_contiguous_pa`` (L1264) says whether decode reads blocks by id.
* ``vllm_gaudi/extension/bucketing/common.py``: ``HPUBucketingManager.decode_buckets``, a
  sorted list of ``(batch_size, query_len, num_blocks)`` tuples (L53, L225-234, L547);
  empty when bucketing is off (L243-244). A decode that finds no bucket later appends a
  fallback one (L317-324).
"""

from __future__ import annotations

from typing import Any

from kvdefrag.common import InvalidArgument


def runner_decode_buckets(model_runner: Any) -> tuple[int, ...] | None:
    """The distinct decode block counts of a warmed-up vllm-gaudi runner, sorted.

    Call it after the runner's ``warmup_model`` (the worker's
    ``compile_or_warm_up_model``): before that the list is empty.

    NOTE: with speculative decoding vllm-gaudi adds buckets whose block count is a seed
    bucket's times ``1 + num_speculative_tokens`` (``py`` L333-371), so some counts
    may be above the pool, or run only at some batch sizes; they are kept, as the runner
    lists them. For a hybrid model whose attention block size differs from the KV
    cache's, the counts are in attention blocks (``hpu_model_runner.py`` L6164-6165).

    Args:
        model_runner: vllm-gaudi's ``HPUModelRunner`` (or anything shaped like it).

    Returns:
        The block counts (strictly increasing, positive: a valid
        ``EngineConfig.decode_buckets``), or None when the runner has no buckets kvdefrag
        can use: no ``bucketing_manager``, bucketing off, a pooling model (no decode),
        or decode without contiguous paged attention (``use_contiguous_pa`` False: its
        buckets pad the number of blocks read, which compaction cannot lower). A runner
        without ``use_contiguous_pa`` is taken to have it.

    Raises:
        InvalidArgument: A decode bucket that is not a ``(batch_size, query_len,
            num_blocks)`` triple of ints (named, with its value).
    """
    if getattr(model_runner, "use_contiguous_pa", True) is False:
        return None
    manager = getattr(model_runner, "bucketing_manager", None)
    decode_buckets = getattr(manager, "decode_buckets", None) or ()
    block_counts = set()
    for bucket in decode_buckets:
        if not _is_int_triple(bucket):
            raise InvalidArgument(
                "model_runner.bucketing_manager.decode_buckets must hold (batch_size, "
                f"query_len, num_blocks) int triples, got {bucket!r}"
            )
        # NOTE: a bucket of no blocks reads nothing, so it has no size for kvdefrag.
        if bucket[2] > 0:
            block_counts.add(bucket[2])
    return tuple(sorted(block_counts)) or None


def _is_int_triple(bucket: object) -> bool:
    return (
        isinstance(bucket, (tuple, list))
        and len(bucket) == 3
        and all(isinstance(part, int) and not isinstance(part, bool) for part in bucket)
    )
