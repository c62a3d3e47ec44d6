"""Configuration errors are clear InvalidArguments naming the option."""

import re

import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig, ServiceConfig, load_config
from kvdefrag.server.config import exponential_decode_buckets


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"threshold": 2.5}, "threshold must be an int, got 2.5"),
        ({"threshold": "3"}, "threshold must be an int, got '3'"),
        ({"max_moves_per_step": True}, "max_moves_per_step must be an int, got True"),
        ({"prefix_caching": 1}, "prefix_caching must be a bool, got 1"),
        ({"threshold": -1}, "threshold must be >= 0, got -1"),
        ({"pad_buckets": (16, 8)}, "pad_buckets must be strictly increasing"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        EngineConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_message_bytes": 10}, "max_message_bytes must be >= 1024, got 10"),
        ({"replay_cache_size": 0}, "replay_cache_size must be >= 1, got 0"),
        ({"insecure": "yes"}, "insecure must be a bool, got 'yes'"),
    ],
)
def test_bad_service_options_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        ServiceConfig(**options)  # type: ignore[arg-type]


def test_each_option_belongs_to_one_config() -> None:
    engine_config, service_config = load_config({"threshold": 8, "replay_cache_size": 4}, {})
    assert engine_config == EngineConfig(threshold=8)
    assert service_config == ServiceConfig(replay_cache_size=4)


def test_environment_is_below_explicit_options() -> None:
    environ = {"KVDEFRAG_THRESHOLD": "64", "KVDEFRAG_PREFIX_CACHING": "true"}
    config, _ = load_config({"threshold": 8}, environ)
    assert (config.threshold, config.prefix_caching) == (8, True)
    with pytest.raises(InvalidArgument, match="KVDEFRAG_THRESHOLD must be int"):
        load_config({}, {"KVDEFRAG_THRESHOLD": "many"})
    with pytest.raises(InvalidArgument, match="unknown configuration option 'treshold'"):
        load_config({"treshold": 8}, {})


@pytest.mark.parametrize("buckets", [(256, 128), (128, 128), (0, 128), (True, 128), (1.5, 128)])
def test_bad_decode_buckets_name_the_option_and_value(buckets: tuple[object, ...]) -> None:
    message = f"decode_buckets must be strictly increasing positive block counts, got {buckets}"
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        EngineConfig(decode_buckets=buckets)  # type: ignore[arg-type]


def test_decode_buckets_default_to_none_and_come_from_the_environment() -> None:
    assert EngineConfig().decode_buckets == ()
    config, _ = load_config({}, {"KVDEFRAG_DECODE_BUCKETS": "1, 128,256,4096"})
    assert config.decode_buckets == (1, 128, 256, 4096)
    config, _ = load_config({}, {"KVDEFRAG_DECODE_BUCKETS": ""})
    assert config.decode_buckets == ()
    assert EngineConfig(decode_buckets=[8, 16]).decode_buckets == (8, 16)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="KVDEFRAG_DECODE_BUCKETS must be tuple"):
        load_config({}, {"KVDEFRAG_DECODE_BUCKETS": "128,lots"})
    with pytest.raises(InvalidArgument, match="decode_buckets must be strictly increasing"):
        load_config({}, {"KVDEFRAG_DECODE_BUCKETS": "256,128"})


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
