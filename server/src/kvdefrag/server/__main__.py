"""``python -m kvdefrag.server`` / ``kvdefrag-server``: a standalone service to try out.

It owns an embedded CPU KV cache sized by flags, so it needs no GPU and no vLLM. Service
options come from flags > ``KVDEFRAG_*`` environment variables > defaults; it stops
cleanly on SIGINT and SIGTERM.

Example:
    kvdefrag-server --address 127.0.0.1:50051 --num-blocks 4096
    grpcurl -plaintext 127.0.0.1:50051 kvdefrag.v1.DefragService/GetStats
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType

import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.common.durations import check_duration
from kvdefrag.server._server import serve_in_process
from kvdefrag.server.config import EngineConfig, ServiceConfig, load_config

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """The embedded KV cache: ``num_layers`` (key, value) pairs of
    ``[num_blocks * block_size, num_kv_heads, head_size]`` tensors."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def size_bytes(self) -> int:
        """Bytes of all the cache's tensors."""
        elements = self.num_blocks * self.block_size * self.num_kv_heads * self.head_size
        return 2 * self.num_layers * elements * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything the command line asks for."""

    cache: CacheShape
    engine_config: EngineConfig
    service_config: ServiceConfig
    grace_s: float


# How often the main thread wakes to run a signal handler that arrived on another thread.
_SIGNAL_POLL_S = 0.2


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _grace_s(text: str) -> float:
    try:
        return check_duration("--grace-s", float(text), allow_zero=True)
    except (ValueError, InvalidArgument) as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"comma-separated sizes expected, got {text!r}") from err


def build_parser() -> argparse.ArgumentParser:
    """The command line (service options default to None: "not given, ask env")."""
    parser = argparse.ArgumentParser(
        prog="kvdefrag-server",
        description="kvdefrag gRPC service with an embedded CPU KV cache.",
    )
    cache = parser.add_argument_group("embedded KV cache")
    cache.add_argument("--num-layers", type=_positive, default=2)
    cache.add_argument("--num-blocks", type=_positive, default=1024)
    cache.add_argument("--block-size", type=_positive, default=16)
    cache.add_argument("--num-kv-heads", type=_positive, default=4)
    cache.add_argument("--head-size", type=_positive, default=64)
    cache.add_argument("--dtype", choices=sorted(_DTYPES), default="float16")
    engine = parser.add_argument_group("engine (flags > KVDEFRAG_* env > defaults)")
    engine.add_argument("--threshold", type=int, help="compact when holes exceed this")
    engine.add_argument("--max-moves-per-step", type=int)
    engine.add_argument("--pad-buckets", type=_buckets, help="e.g. 8,16,32,64")
    engine.add_argument(
        "--decode-buckets", type=_buckets,
        help="decode graph sizes in blocks, e.g. 1,128,256,384: compact only to lower the bucket",
    )  # fmt: skip
    engine.add_argument(
        "--no-placement", dest="enable_placement", action="store_const", const=False,
        help="do not re-point fresh blocks to low free slots",
    )  # fmt: skip
    engine.add_argument("--prefix-caching", action="store_const", const=True)
    service = parser.add_argument_group("service (flags > KVDEFRAG_* env > defaults)")
    service.add_argument("--address", help="unix:/abs/path.sock or HOST:PORT")
    service.add_argument("--metrics-port", type=int, help="Prometheus /metrics port")
    service.add_argument("--metrics-host", help="interface of /metrics (default 127.0.0.1)")
    service.add_argument(
        "--metrics-max-connections", type=int,
        help="connections /metrics holds at once (past it the oldest is closed)",
    )  # fmt: skip
    service.add_argument(
        "--metrics-idle-timeout-s", type=float,
        help="seconds a /metrics connection has to send its request",
    )  # fmt: skip
    service.add_argument(
        "--insecure", action="store_const", const=True,
        help="allow a non-loopback TCP address without TLS",
    )  # fmt: skip
    service.add_argument("--tls-cert", dest="tls_cert_file", help="server certificate (PEM)")
    service.add_argument("--tls-key", dest="tls_key_file", help="server private key (PEM)")
    service.add_argument(
        "--tls-client-ca", dest="tls_client_ca_file", help="client CA (PEM): require mTLS"
    )
    service.add_argument("--max-message-bytes", type=int)
    service.add_argument("--replay-cache-size", type=int)
    service.add_argument(
        "--handshake-timeout-s", type=float, help="seconds a new step stream has to send open"
    )
    parser.add_argument(
        "--grace-s",
        type=_grace_s,
        default=5.0,
        help="seconds in-flight calls get on stop (0 to 86400)",
    )
    return parser


_CACHE_FLAGS = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size")


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Options:
    """Parses the command line; service options fall back to ``environ`` then defaults.

    Raises:
        SystemExit: A flag or an environment value is invalid (argparse's usage error).
    """
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    cache = CacheShape(
        **{name: args.pop(name) for name in _CACHE_FLAGS}, dtype=_DTYPES[args.pop("dtype")]
    )
    grace_s = args.pop("grace_s")
    try:
        engine_config, service_config = load_config(args, environ)
    except InvalidArgument as err:
        parser.error(str(err))
    return Options(cache, engine_config, service_config, grace_s)


def make_kv_caches(shape: CacheShape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocates the embedded cache (zeros) in the layout vLLM workers use."""
    rows = (shape.num_blocks * shape.block_size, shape.num_kv_heads, shape.head_size)
    return [
        (torch.zeros(rows, dtype=shape.dtype), torch.zeros(rows, dtype=shape.dtype))
        for _ in range(shape.num_layers)
    ]


def poke_commands(address: str, metrics_port: int | None) -> str:
    """Returns the grpcurl (and curl) command lines that inspect a server at ``address``."""
    if address.startswith("unix:"):
        flags, target = "-plaintext -unix", address.removeprefix("unix:")
    else:
        flags, target = "-plaintext", address.replace("0.0.0.0", "127.0.0.1")
    service = "kvdefrag.v1.DefragService"
    step = '{"seq": 1, "new_blocks": [{"request_id": "r1", "block_ids": [7, 9]}]}'
    resolve = '{"logical_block_ids": [7, 9]}'
    lines = [
        "try:",
        f"  grpcurl {flags} {target} list",
        f"  grpcurl {flags} {target} describe {service}",
        f"  grpcurl {flags} {target} grpc.health.v1.Health/Check",
        f"  grpcurl {flags} {target} {service}/GetStats",
        f"  grpcurl {flags} -d '{step}' {target} {service}/Step",
        f"  grpcurl {flags} -d '{resolve}' {target} {service}/Resolve",
    ]
    if metrics_port is not None:
        lines.append(f"  curl -s http://127.0.0.1:{metrics_port}/metrics")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the server until SIGINT or SIGTERM; returns the exit status."""
    options = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop_requested = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    shape = options.cache
    try:
        handle = serve_in_process(
            make_kv_caches(shape),
            shape.block_size,
            engine_config=options.engine_config,
            service_config=options.service_config,
        )
    except (InvalidArgument, OSError) as err:
        print(f"kvdefrag-server: {err}", file=sys.stderr)
        return 1
    print(
        f"kvdefrag-server listening on {handle.address} (epoch {handle.epoch}; "
        f"{shape.num_blocks} blocks x {shape.block_size} tokens, {shape.num_layers} layers, "
        f"{shape.size_bytes / 2**20:.1f} MiB on cpu)",
        flush=True,
    )
    if handle.metrics_port is not None:
        print(
            f"kvdefrag-server metrics on http://{options.service_config.metrics_host}:"
            f"{handle.metrics_port}/metrics",
            flush=True,
        )
    print(poke_commands(handle.address, handle.metrics_port), flush=True)
    # Wait in slices, not in one untimed wait: the kernel may hand SIGTERM to one of
    # gRPC's threads, and then nothing interrupts the main thread's lock wait, so the
    # Python handler would only run when the wait ends on its own, which is never.
    while not stop_requested.wait(_SIGNAL_POLL_S):
        pass
    print("kvdefrag-server: stopping", flush=True)
    handle.stop(options.grace_s)
    print("kvdefrag-server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
