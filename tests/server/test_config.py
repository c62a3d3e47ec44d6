"""Configuration errors are clear InvalidArguments naming the option."""

import re

import pytest

from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig, ServiceConfig, load_config


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
