"""vllm-gaudi's decode bucket list as ``exponential_decode_buckets`` restates it."""

from __future__ import annotations

import re

import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig
from kvdefrag.server.buckets import exponential_decode_buckets


def _gaudi_buckets(
    num_blocks: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[int, ...]:
    return exponential_decode_buckets(
        num_blocks, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size
    )


def test_exponential_decode_buckets_stop_at_the_worst_case_then_add_the_pool() -> None:
    # The worst case, 128 sequences of ceil(4096 / 128) = 32 blocks = 4096 blocks, is
    # below the pool: 13 points from 128 to 4096, rounded up to 128, then the pool.
    assert _gaudi_buckets(8192, 128, 4096, 128) == (
        1, 128, 256, 384, 512, 640, 768, 1024, 1408, 1792, 2304, 3072, 4096, 8192,
    )  # fmt: skip
    # ceil(4097 / 128) = 33 blocks a sequence: the range tops out at 33 * 128 = 4224.
    assert _gaudi_buckets(8192, 128, 4097, 128) == (
        1, 128, 256, 384, 512, 768, 896, 1152, 1536, 1920, 2560, 3328, 4224, 8192,
    )  # fmt: skip


def test_exponential_decode_buckets_with_the_pool_below_the_worst_case() -> None:
    # 128 x ceil(16384 / 128) = 16384 blocks > the pool: 12 points from 128 to 2048.
    assert _gaudi_buckets(2048, 128, 16384, 128) == (
        1, 128, 256, 384, 512, 640, 768, 1024, 1280, 1664, 2048,
    )  # fmt: skip
    assert _gaudi_buckets(4096, 128, 1 << 20, 128) == (
        1, 128, 256, 384, 512, 640, 768, 1024, 1408, 1792, 2304, 3072, 4096,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # One block: a range of one point, the pool itself.
        ((1, 128, 4096, 128), (1,)),
        # The worst case is one block (one sequence of one block): just 1, then the pool.
        ((50, 1, 100, 128), (1, 50)),
        # The range tops out below the step: every point rounds up past it and is dropped.
        ((100, 128, 16384, 128), (1, 100)),
        # 129 blocks: the points above 128 round up to 256, above the top, so are dropped.
        ((129, 128, 16384, 128), (1, 128, 129)),
        # Step 1 rounds nothing but the float error: 32 ** ((1 / 5) * 3) is
        # 8.000000000000002, so 9, and 32 ** ((1 / 5) * 4) is 16.000000000000004, so 17.
        ((32, 1, 4096, 128), (1, 2, 4, 9, 17, 32)),
    ],
)
def test_exponential_decode_buckets_edge_cases(
    args: tuple[int, int, int, int], expected: tuple[int, ...]
) -> None:
    assert _gaudi_buckets(*args) == expected


def test_exponential_decode_buckets_are_a_valid_option_value() -> None:
    for num_blocks, max_num_seqs, max_model_len, block_size in [
        (10_000, 256, 32_768, 16),
        (2_000, 64, 8_192, 128),
        (100, 1, 100_000, 1),
        (2, 128, 4_096, 128),
        (70_000, 3, 1_000, 7),
    ]:
        buckets = _gaudi_buckets(num_blocks, max_num_seqs, max_model_len, block_size)
        top = min(num_blocks, -(-max_model_len // block_size) * max_num_seqs)
        assert buckets[0] == 1 and buckets[-1] == num_blocks and top in buckets
        assert all(b % max_num_seqs == 0 for b in buckets if 1 < b < top)
        EngineConfig(decode_buckets=buckets)  # strictly increasing and positive


@pytest.mark.parametrize("name", ["num_blocks", "max_num_seqs", "max_model_len", "block_size"])
@pytest.mark.parametrize("value", [0, -4, True, 2.0, "8", None])
def test_exponential_decode_buckets_name_a_bad_argument(name: str, value: object) -> None:
    arguments: dict[str, object] = {
        "num_blocks": 4096,
        "max_num_seqs": 128,
        "max_model_len": 4096,
        "block_size": 128,
    }
    arguments[name] = value
    message = f"{name} must be an int >= 1, got {value!r}"
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        exponential_decode_buckets(**arguments)  # type: ignore[arg-type]


def test_exponential_decode_buckets_take_the_model_by_keyword() -> None:
    with pytest.raises(TypeError):
        exponential_decode_buckets(4096, 128)  # type: ignore[call-arg]
