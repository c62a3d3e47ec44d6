"""kvdefrag's configuration: one frozen dataclass, filled from CLI flags > env > defaults.

This is the only module that reads the environment (``KVDEFRAG_*`` variables).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from kvdefrag.common import InvalidArgument

DEFAULT_PAD_BUCKETS = (8, 16, 32, 64, 128, 256, 512)
DEFAULT_ADDRESS = "unix:/tmp/kvdefrag.sock"
ENV_PREFIX = "KVDEFRAG_"


@dataclasses.dataclass(frozen=True)
class Config:
    """Every knob of kvdefrag, engine and service alike.

    Attributes:
        threshold: Compaction runs when ``max_live - num_live`` exceeds this.
        max_moves_per_step: At most this many block moves per step.
        pad_buckets: Batch sizes a move batch is padded to on static-shape backends (HPU).
        enable_placement: Re-point fresh blocks to low free slots without copying.
        prefix_caching: Free blocks keep content worth keeping (from the scheduler's
            handshake, never guessed).
        address: ``unix:PATH`` (default) or ``HOST:PORT``.
        metrics_port: Port of the Prometheus ``/metrics`` endpoint; None disables it.
        metrics_host: Interface the ``/metrics`` endpoint listens on (0.0.0.0 in a pod).
        insecure: Allow a non-loopback TCP address without TLS.
        tls_cert_file: Server certificate (PEM) for TLS.
        tls_key_file: Server private key (PEM) for TLS.
        tls_client_ca_file: CA bundle; when set, clients must present a certificate (mTLS).
        max_message_bytes: Largest gRPC message accepted or sent.
        replay_cache_size: Replies kept for exactly-once replay of resent steps.
    """

    threshold: int = 32
    max_moves_per_step: int = 512
    pad_buckets: tuple[int, ...] = DEFAULT_PAD_BUCKETS
    enable_placement: bool = True
    prefix_caching: bool = False
    address: str = DEFAULT_ADDRESS
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    insecure: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    replay_cache_size: int = 64

    def __post_init__(self) -> None:
        for name in ("threshold", "max_moves_per_step", "max_message_bytes", "replay_cache_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"{name} must be an int, got {value!r}")
        for name in ("enable_placement", "prefix_caching", "insecure"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.threshold < 0:
            raise InvalidArgument(f"threshold must be >= 0, got {self.threshold}")
        if self.max_moves_per_step < 1:
            raise InvalidArgument(f"max_moves_per_step must be >= 1, got {self.max_moves_per_step}")
        buckets = tuple(self.pad_buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise InvalidArgument(
                f"pad_buckets must be strictly increasing positive sizes, got {buckets}"
            )
        if self.max_message_bytes < 1024:
            raise InvalidArgument(
                f"max_message_bytes must be >= 1024, got {self.max_message_bytes}"
            )
        if self.replay_cache_size < 1:
            raise InvalidArgument(f"replay_cache_size must be >= 1, got {self.replay_cache_size}")
        object.__setattr__(self, "pad_buckets", buckets)


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
        if kind == "int | None":
            return None if text.strip().lower() in ("", "none") else int(text)
        if kind == "tuple[int, ...]":
            return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise InvalidArgument(f"{name} must be {kind}, got {text!r}") from err
    if kind == "str | None":
        return text or None
    return text


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Returns the Config fields set by ``KVDEFRAG_<FIELD>`` variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(Config):
        name = ENV_PREFIX + field.name.upper()
        if name in environ:
            values[field.name] = _parse_field(field, name, environ[name])
    return values


def load_config(
    overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Builds a Config: explicit overrides (CLI flags, keywords) > environment > defaults.

    Raises:
        InvalidArgument: An unknown key, or a value that does not parse or validate.
    """
    known = {field.name for field in dataclasses.fields(Config)}
    values = config_from_env(environ)
    for key, value in (overrides or {}).items():
        if key not in known:
            raise InvalidArgument(f"unknown configuration option {key!r}")
        if value is not None:  # None means "not given"
            values[key] = value
    return Config(**values)
