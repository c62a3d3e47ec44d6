"""kvdefrag's configuration, split by owner: ``EngineConfig`` and ``ServiceConfig``.

Both are frozen dataclasses holding the only copy of each default. ``load_config`` builds
the pair from explicit options and the ``KVDEFRAG_<FIELD>`` environment variables
(options > env > defaults), once, where a server is started: the command line
(``__main__``) and the vLLM worker. ``serve_in_process`` takes the pair typed and parses
nothing again. This is the only module that reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from kvdefrag.common import InvalidArgument
from kvdefrag.common.durations import check_duration

DEFAULT_PAD_BUCKETS = (8, 16, 32, 64, 128, 256, 512)
DEFAULT_ADDRESS = "unix:/tmp/kvdefrag.sock"
ENV_PREFIX = "KVDEFRAG_"
MAX_MESSAGE_BYTES_LIMIT = 2**31 - 1
"""The largest ``max_message_bytes``: gRPC keeps message limits in a C int."""
MAX_HANDSHAKE_TIMEOUT_S = 3600.0
MAX_PORT = 65535


def _option(name: str) -> str:
    """An option as an operator may have set it: the field, its variable and its flag."""
    return f"{name} ({ENV_PREFIX}{name.upper()}, --{name.replace('_', '-')})"


def _check_types(
    config: object, ints: tuple[str, ...], bools: tuple[str, ...], floats: tuple[str, ...] = ()
) -> None:
    for name in ints:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(f"{name} must be an int, got {value!r}")
    for name in floats:
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InvalidArgument(f"{name} must be a number, got {value!r}")
    for name in bools:
        if not isinstance(getattr(config, name), bool):
            raise InvalidArgument(f"{name} must be a bool, got {getattr(config, name)!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs: when and how it compacts. Owned by the ``Engine``.

    Attributes:
        threshold: Compaction runs when ``max_live - num_live`` exceeds this.
        max_moves_per_step: At most this many block moves per step.
        pad_buckets: Batch sizes a move batch is padded to on static-shape backends (HPU).
        enable_placement: Re-point fresh blocks to low free slots without copying.
        prefix_caching: Free blocks keep content worth keeping (from the scheduler's
            handshake, never guessed; a reset may change it).
        decode_buckets: The decode graph sizes of the backend, in blocks (strictly
            increasing, positive), for backends whose decode reads the first
            ``decode_bucket(max_live + 1)`` blocks (Gaudi's contiguous paged attention).
            Empty (the default): no buckets, compaction follows ``threshold``. Set: a
            step compacts only when its moves lower that bucket, and ``threshold`` is
            not used (docs/design/step.md). ``exponential_decode_buckets`` derives
            vllm-gaudi's default list for a pool and a model.
    """

    threshold: int = 32
    max_moves_per_step: int = 512
    pad_buckets: tuple[int, ...] = DEFAULT_PAD_BUCKETS
    enable_placement: bool = True
    prefix_caching: bool = False
    decode_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_types(
            self, ("threshold", "max_moves_per_step"), ("enable_placement", "prefix_caching")
        )
        if self.threshold < 0:
            raise InvalidArgument(f"threshold must be >= 0, got {self.threshold}")
        if self.max_moves_per_step < 1:
            raise InvalidArgument(f"max_moves_per_step must be >= 1, got {self.max_moves_per_step}")
        buckets = tuple(self.pad_buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise InvalidArgument(
                f"pad_buckets must be strictly increasing positive sizes, got {buckets}"
            )
        object.__setattr__(self, "pad_buckets", buckets)
        decode_buckets = tuple(self.decode_buckets)
        if any(
            not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in decode_buckets
        ) or list(decode_buckets) != sorted(set(decode_buckets)):
            raise InvalidArgument(
                "decode_buckets must be strictly increasing positive block counts, "
                f"got {decode_buckets}"
            )
        object.__setattr__(self, "decode_buckets", decode_buckets)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """The gRPC service's knobs: where it listens, how it is secured, what it bounds.

    Attributes:
        address: ``unix:PATH`` (default) or ``HOST:PORT``.
        metrics_port: Port of the Prometheus ``/metrics`` endpoint; None disables it.
        metrics_host: Interface the ``/metrics`` endpoint listens on (0.0.0.0 in a pod).
        metrics_max_connections: Connections the ``/metrics`` endpoint holds at once
            (1 to 1024); a newcomer past it closes the oldest. Its thread count is fixed.
        metrics_idle_timeout_s: Seconds a ``/metrics`` connection has to send its whole
            request, and again to take its reply, before it is closed (> 0, <= 300).
        insecure: Allow a non-loopback TCP address without TLS.
        tls_cert_file: Server certificate (PEM) for TLS.
        tls_key_file: Server private key (PEM) for TLS.
        tls_client_ca_file: CA bundle; when set, clients must present a certificate (mTLS).
        max_message_bytes: Largest gRPC message accepted or sent.
        replay_cache_size: Replies kept for exactly-once replay of resent steps.
        handshake_timeout_s: How long a new StepStream may take to send its ``open``
            before the server ends it (a silent stream holds a handler thread).
    """

    address: str = DEFAULT_ADDRESS
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_max_connections: int = 16
    metrics_idle_timeout_s: float = 10.0
    insecure: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    replay_cache_size: int = 64
    handshake_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _check_types(
            self,
            ("max_message_bytes", "replay_cache_size", "metrics_max_connections"),
            ("insecure",),
            ("handshake_timeout_s", "metrics_idle_timeout_s"),
        )
        if self.max_message_bytes < 1024:
            raise InvalidArgument(
                f"max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
        if self.max_message_bytes > MAX_MESSAGE_BYTES_LIMIT:
            raise InvalidArgument(
                f"{_option('max_message_bytes')} must be <= {MAX_MESSAGE_BYTES_LIMIT} (gRPC's "
                f"limit, 2 GiB - 1), got {self.max_message_bytes}"
            )
        if self.replay_cache_size < 1:
            raise InvalidArgument(f"replay_cache_size must be >= 1, got {self.replay_cache_size}")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= MAX_PORT
        ):
            raise InvalidArgument(
                f"{_option('metrics_port')} must be a TCP port 0-{MAX_PORT} (0 picks a free "
                f"one) or unset, got {self.metrics_port!r}"
            )
        if not 1 <= self.metrics_max_connections <= 1024:
            raise InvalidArgument(
                "metrics_max_connections must be >= 1 and <= 1024, "
                f"got {self.metrics_max_connections}"
            )
        if not 0 < self.metrics_idle_timeout_s <= 300:
            raise InvalidArgument(
                f"metrics_idle_timeout_s must be > 0 and <= 300, got {self.metrics_idle_timeout_s}"
            )
        object.__setattr__(
            self,
            "handshake_timeout_s",
            check_duration(
                _option("handshake_timeout_s"),
                self.handshake_timeout_s,
                max_s=MAX_HANDSHAKE_TIMEOUT_S,
            ),
        )


_CONFIG_CLASSES = (EngineConfig, ServiceConfig)


def _parse_bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"{name} must be a boolean (1/0, true/false), got {text!r}")


def _parse_field(field: dataclasses.Field[Any], name: str, text: str) -> Any:
    kind = str(field.type)
    try:
        if kind == "bool":
            return _parse_bool(name, text)
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "int | None":
            return None if text.strip().lower() in ("", "none") else int(text)
        if kind == "tuple[int, ...]":
            return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise InvalidArgument(f"{name} must be {kind}, got {text!r}") from err
    if kind == "str | None":
        return text or None
    return text


def option_names() -> tuple[str, ...]:
    """Every option ``load_config`` knows: the fields of both configs."""
    return tuple(field.name for cls in _CONFIG_CLASSES for field in dataclasses.fields(cls))


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Returns the options set by ``KVDEFRAG_<FIELD>`` variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for cls in _CONFIG_CLASSES:
        for field in dataclasses.fields(cls):
            name = ENV_PREFIX + field.name.upper()
            if name in environ:
                values[field.name] = _parse_field(field, name, environ[name])
    return values


def load_config(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ServiceConfig]:
    """Builds both configs: explicit overrides (CLI flags, keywords) > environment > defaults.

    Args:
        overrides: Option name -> value; None values mean "not given".
        environ: The environment to read (``os.environ`` when None).

    Raises:
        InvalidArgument: An unknown option, or a value that does not parse or validate.
    """
    known = set(option_names())
    values = config_from_env(environ)
    for key, value in (overrides or {}).items():
        if key not in known:
            raise InvalidArgument(f"unknown configuration option {key!r}")
        if value is not None:  # None means "not given"
            values[key] = value

    def pick(cls: type[Any]) -> dict[str, Any]:
        return {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}

    return EngineConfig(**pick(EngineConfig)), ServiceConfig(**pick(ServiceConfig))
