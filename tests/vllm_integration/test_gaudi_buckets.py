"""The decode buckets read from a vllm-gaudi runner, without vllm-gaudi: fake runners
shaped like its ``HPUModelRunner`` and ``HPUBucketingManager`` after warm-up."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig
from kvdefrag.server.buckets import exponential_decode_buckets
from kvdefrag.vllm._worker.gaudi_buckets import runner_decode_buckets

from support.hpu_buckets import decode_buckets


def make_runner(
    decode_buckets: Sequence[Any],
    *,
    use_contiguous_pa: bool = True,
    bucketing: bool = True,
) -> SimpleNamespace:
    """A runner as vllm-gaudi leaves it after ``warmup_model``: its manager's decode
    buckets are sorted ``(batch_size, query_len, num_blocks)`` tuples."""
    manager = SimpleNamespace(
        initialized=bucketing,
        prompt_buckets=[(1, 128, 0)] if bucketing else [],
        decode_buckets=list(decode_buckets),
        seed_decode_buckets=None,
        num_hpu_blocks=8192,
    )
    return SimpleNamespace(use_contiguous_pa=use_contiguous_pa, bucketing_manager=manager)


def test_the_block_counts_are_distinct_and_sorted() -> None:
    runner = make_runner(
        [(1, 1, 1), (1, 1, 128), (1, 1, 8192), (2, 1, 1), (2, 1, 256), (2, 1, 8192), (4, 1, 128)]
    )
    assert runner_decode_buckets(runner) == (1, 128, 256, 8192)


def test_the_list_vllm_gaudi_builds_under_contiguous_pa_reads_back_whole() -> None:
    # Under contiguous PA every batch size is paired with every block count, query 1.
    block_counts = (1, 128, 256, 384, 512, 640, 768, 1024, 1408, 1792, 2304, 3072, 4096, 8192)
    batch_sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    runner = make_runner(
        sorted((size, 1, count) for size, count in itertools.product(batch_sizes, block_counts))
    )
    buckets = runner_decode_buckets(runner)
    assert buckets == block_counts
    assert buckets == exponential_decode_buckets(
        8192, max_num_seqs=128, max_model_len=4096, block_size=128
    )
    assert EngineConfig(decode_buckets=buckets).decode_buckets == block_counts


def test_a_fallback_bucket_added_at_runtime_is_read_too() -> None:
    runner = make_runner([(1, 1, 1), (1, 1, 128), (1, 1, 2048)])
    runner.bucketing_manager.decode_buckets.append((256, 1, 160))  # as find_decode_bucket does
    runner.bucketing_manager.decode_buckets.sort()
    assert runner_decode_buckets(runner) == (1, 128, 160, 2048)


def test_a_bucket_of_no_blocks_is_left_out() -> None:
    assert runner_decode_buckets(make_runner([(1, 1, 0), (1, 1, 16), (2, 1, 0)])) == (16,)
    assert runner_decode_buckets(make_runner([(1, 1, 0)])) is None


@pytest.mark.parametrize(
    "runner",
    [
        pytest.param(SimpleNamespace(use_contiguous_pa=True), id="no bucketing manager"),
        pytest.param(make_runner([], bucketing=False), id="bucketing off"),
        pytest.param(make_runner([]), id="pooling model"),
        pytest.param(make_runner([(1, 1, 128)], use_contiguous_pa=False), id="no contiguous PA"),
        pytest.param(SimpleNamespace(bucketing_manager=None), id="manager None"),
    ],
)
def test_a_runner_without_usable_buckets_gives_none(runner: Any) -> None:
    assert runner_decode_buckets(runner) is None


def test_a_runner_that_does_not_say_takes_contiguous_pa() -> None:
    runner = make_runner([(1, 1, 64), (1, 1, 512)])
    del runner.use_contiguous_pa
    assert runner_decode_buckets(runner) == (64, 512)


@pytest.mark.parametrize("bucket", [(1, 1), (1, 1, "128"), (1, 1, True), (1, 1, 2.0), 128, None])
def test_a_bucket_of_another_shape_is_named(bucket: object) -> None:
    runner = make_runner([(1, 1, 64), bucket])
    message = (
        "model_runner.bucketing_manager.decode_buckets must hold (batch_size, query_len, "
        f"num_blocks) int triples, got {bucket!r}"
    )
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        runner_decode_buckets(runner)


@pytest.mark.parametrize(
    ("num_blocks", "max_num_seqs", "max_model_len", "block_size"),
    [(96, 16, 512, 16), (8192, 128, 4096, 128), (2048, 128, 16_384, 128), (4096, 16, 12_288, 256)],
)
def test_the_runner_models_buckets_agree_with_the_products_restatement(
    num_blocks: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> None:
    """Two restatements of vllm-gaudi's decode buckets, written apart: the HPU runner
    model's and ``exponential_decode_buckets``; the worker reads the model's list as the
    runner's (``runner_decode_buckets``)."""
    modelled = decode_buckets(
        max_num_seqs=max_num_seqs,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        block_size=block_size,
    )
    runner = SimpleNamespace(bucketing_manager=SimpleNamespace(decode_buckets=modelled))
    assert runner_decode_buckets(runner) == exponential_decode_buckets(
        num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size
    )
