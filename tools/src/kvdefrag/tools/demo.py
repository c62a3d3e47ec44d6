"""``make demo`` / ``kvdefrag demo``: kvdefrag at work on a realistic workload, end to end.

For each prefix caching mode (off, then on) the demo starts a server in this process on
an embedded CPU KV cache and drives it through the real client::

    SyntheticWorkload --step--> DefragClient ==gRPC stream==> server --> engine --> KV cache
    (vLLM 0.33 block pool)      mirror <------- deltas -------'                        ^
           |                                                                           |
           '-- the "worker": writes a signature into every fresh block at the slot -----'
               the mirror resolves, and checks that every live (and cached) block
               still reads its own

then prints a summary per mode: the highest live block id and fragmentation ratio
without kvdefrag (the scheduler's logical ids) and with it (physical slots), blocks and
bytes moved, zero-copy placements, step latency, and the KV integrity check; and writes a
PNG plot. The same summary comes out of ``kvdefrag replay`` (see ``kvdefrag.tools.cli``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

from kvdefrag.client import DefragClient, DefragError, PoolStats
from kvdefrag.client.record import StepRecorder
from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig, ServiceConfig, SwapExecutor, serve_in_process
from kvdefrag.tools._demo_worker import KvSignatures, LogicalPool, make_kv_caches
from kvdefrag.tools._report import (
    ModeReport,
    Progress,
    RunLog,
    format_bytes,
    format_report,
    write_plot,
)
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig

# ModeReport is what DemoResult.reports and ModeRun.report hold.
__all__ = [
    "DemoOptions",
    "DemoResult",
    "ModeReport",
    "ModeRun",
    "main",
    "run_demo",
    "run_mode",
    "use_one_torch_thread",
    "workload_config",
]

# The workload's default shape is tuned for this pool; other pools scale it (see below).
_REFERENCE_TOKENS = 10_000 * 16
# NOTE: a little busier than the workload's default, so the pool runs out now and then
# and the scheduler preempts (fragmentation stays realistic: mean ratio ~1.2-1.45).
_REFERENCE_ARRIVAL_RATE = 0.09


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What the demo runs.

    Attributes:
        num_steps: Scheduling iterations per mode.
        num_blocks: KV blocks in the pool, null block included.
        block_size: Tokens per block.
        seed: Seed of the synthetic workload.
        arrival_rate: Mean request arrivals per step; None scales the default to the pool.
        engine: The engine's settings (its ``prefix_caching`` is set per mode).
        check_every: Check every live and cached block every this many steps (and at
            the end); the blocks a step moved are checked after every step.
        num_layers: Layers of the embedded KV cache (a key and a value tensor each).
        num_kv_heads: KV heads per token.
        head_size: Elements per head.
        progress_interval_s: Seconds between progress lines.
    """

    num_steps: int = 6_000
    num_blocks: int = 10_000
    block_size: int = 16
    seed: int = 0
    arrival_rate: float | None = None
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    check_every: int = 250
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 8
    progress_interval_s: float = 2.0

    def __post_init__(self) -> None:
        positive = ("num_steps", "block_size", "check_every")
        for name in (*positive, "num_layers", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 64:
            raise InvalidArgument(f"num_blocks must be >= 64, got {self.num_blocks}")

    def make_kv_caches(
        self, num_blocks: int | None = None, block_size: int | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The embedded CPU KV cache of this shape (for another pool size if given)."""
        return make_kv_caches(
            num_blocks or self.num_blocks,
            block_size or self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )

    @property
    def block_size_bytes(self) -> int:
        """Bytes one block occupies across every KV tensor (float32)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * 4


def workload_config(options: DemoOptions, prefix_caching: bool) -> WorkloadConfig:
    """The synthetic workload for a pool: the reference shape, scaled to its size.

    The reference (``WorkloadConfig``'s defaults: 10,000 blocks of 16 tokens) fills the
    pool with realistic lengths and fragments it as vLLM's allocator does.
    A smaller pool gets proportionally shorter requests arriving proportionally faster
    (the same number of requests in flight), a larger one more arrivals.
    """
    scale = options.num_blocks * options.block_size / _REFERENCE_TOKENS
    base = WorkloadConfig()
    length = min(scale, 1.0)

    def scaled(value: int, minimum: int) -> int:
        return max(minimum, round(value * length))

    return WorkloadConfig(
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        num_steps=options.num_steps,
        arrival_rate=(
            options.arrival_rate
            if options.arrival_rate is not None
            else _REFERENCE_ARRIVAL_RATE * (scale if scale > 1 else 1 / scale)
        ),
        initial_requests=scaled(base.initial_requests, 4),
        prompt_len_median=scaled(base.prompt_len_median, 8),
        prompt_len_max=scaled(base.prompt_len_max, 32),
        output_len_scale=scaled(base.output_len_scale, 4),
        output_len_max=scaled(base.output_len_max, 16),
        system_prompt_len=scaled(base.system_prompt_len, options.block_size),
        max_num_batched_tokens=max(256, scaled(base.max_num_batched_tokens, 1)),
        enable_prefix_caching=prefix_caching,
        seed=options.seed,
    )


# --- one mode of the demo -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModeRun:
    report: ModeReport
    log: RunLog


def run_mode(
    options: DemoOptions,
    prefix_caching: bool,
    *,
    out: TextIO = sys.stdout,
    recorder: StepRecorder | None = None,
    executor: SwapExecutor | None = None,
) -> ModeRun:
    """Runs the workload through a real server and client in one prefix caching mode.

    Args:
        options: The demo's settings.
        prefix_caching: The scheduler's prefix caching mode.
        out: Where progress lines go.
        recorder: Records every step the client sends (``kvdefrag record``).
        executor: A swap executor to use instead of the one built for the cache.

    Raises:
        DefragError: The service refused a step (a bug: the workload is valid).
    """
    mode = "on" if prefix_caching else "off"
    config = workload_config(options, prefix_caching)
    workload = SyntheticWorkload(config)
    kv_caches = options.make_kv_caches()
    log = RunLog()
    pool = LogicalPool(options.num_blocks)
    with tempfile.TemporaryDirectory(prefix="kvdefrag-demo-") as socket_dir:
        handle = serve_in_process(
            kv_caches,
            options.block_size,
            engine_config=dataclasses.replace(options.engine, prefix_caching=prefix_caching),
            service_config=ServiceConfig(address=f"unix:{socket_dir}/kvdefrag.sock"),
            executor=executor,
        )
        try:
            kv = KvSignatures(kv_caches, options.block_size, handle.kv_lock)
            with DefragClient(
                handle.address, prefix_caching=prefix_caching, client_name=f"kvdefrag-demo-{mode}"
            ) as client:
                stats = _drive(options, workload, client, kv, pool, log, out, recorder, mode)
        finally:
            handle.stop(1.0)
    details = (
        f"workload: {options.num_steps:,} steps, {options.num_blocks:,} blocks x "
        f"{options.block_size} tokens, seed {options.seed}; {log.num_requests:,} requests, "
        f"{log.num_preempted:,} preemptions, {log.num_prefix_hits:,} prefix-cache hit blocks",
        _settings_line(options),
    )
    report = log.report(
        f"prefix caching {mode}",
        details,
        stats.totals,
        "step latency p50 / p99 (client round trip)",
    )
    return ModeRun(report, log)


def _settings_line(options: DemoOptions) -> str:
    return (
        f"kvdefrag: {engine_settings(options.engine)}; KV cache "
        f"{options.num_layers} layers x {format_bytes(options.block_size_bytes)}/block on cpu"
    )


def _drive(
    options: DemoOptions,
    workload: SyntheticWorkload,
    client: DefragClient,
    kv: KvSignatures,
    pool: LogicalPool,
    log: RunLog,
    out: TextIO,
    recorder: StepRecorder | None,
    mode: str,
) -> PoolStats:
    """The scheduler and worker loop; returns the last reply's stats."""
    prefix_caching = workload.config.enable_prefix_caching
    block_pool = workload.pool
    progress = Progress(
        out, f"prefix caching {mode}", options.num_steps, options.progress_interval_s
    )
    requests_seen: set[str] = set()
    stats: PoolStats | None = None
    for step in workload:
        if recorder is not None:
            recorder.record(step.events)
        started = time.perf_counter()
        reply = client.step(step.events)
        latency_s = time.perf_counter() - started
        stats = reply.stats
        pool.apply(step.events)
        new_requests = [
            [block_id for block_id in block_ids if block_id]
            for request_id, block_ids in step.events.new_blocks.items()
            if request_id not in requests_seen
        ]
        physical = iter(client.resolve([i for ids in new_requests for i in ids]))
        for logical_ids in new_requests:
            log.add_prompt(logical_ids, [next(physical) for _ in logical_ids])
        requests_seen.update(step.events.new_blocks)
        log.num_requests = len(requests_seen)
        log.num_preempted += step.num_preempted
        log.num_prefix_hits += step.num_prefix_hit_blocks
        # The worker's forward pass fills the fresh blocks where the mirror says they are.
        fresh = sorted(set(step.events.fresh or ()))
        kv.write(fresh, client.resolve(fresh))
        fresh_set = set(fresh)
        moved = [
            logical_id
            for logical_id in reply.block_mapping
            if logical_id not in fresh_set
            and (
                pool.refs[logical_id] > 0
                or (prefix_caching and block_pool.block_key(logical_id) is not None)
            )
        ]
        log.add_check("moved", step.index, len(moved), kv.corrupted(moved, client.resolve(moved)))
        if stats.num_live != pool.num_live:
            raise DefragError(
                f"step {step.index}: the server counts {stats.num_live} live blocks, "
                f"the scheduler's events {pool.num_live}"
            )
        log.add_step(stats.num_live, pool.max_live(), stats.max_live, latency_s)
        is_last = step.index + 1 == options.num_steps
        if (step.index + 1) % options.check_every == 0 or is_last:
            _check_all(
                kv, client.resolve, pool, workload if prefix_caching else None, log, step.index
            )
        progress.update(step.index + 1, log, stats.totals.num_moves, force=is_last)
    assert stats is not None, "the workload yielded no step"
    return stats


def _check_all(
    kv: KvSignatures,
    resolve: Callable[[Sequence[int]], list[int]],
    pool: LogicalPool,
    workload: SyntheticWorkload | None,
    log: RunLog,
    step_index: int,
) -> None:
    """Checks every live block, and with prefix caching every cached free block."""
    live = pool.live_ids()
    log.add_check("live", step_index, len(live), kv.corrupted(live, resolve(live)))
    if workload is not None:
        cached = [i for i in workload.cached_free_blocks() if pool.refs[i] == 0]
        log.add_check("cached", step_index, len(cached), kv.corrupted(cached, resolve(cached)))


# --- the demo -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DemoResult:
    reports: list[ModeReport]
    plot_path: Path

    @property
    def exit_code(self) -> int:
        return 0 if all(report.is_intact for report in self.reports) else 1


MODES = {"off": (False,), "on": (True,), "both": (False, True)}


def run_demo(
    options: DemoOptions, mode: str = "both", plot_path: str | os.PathLike[str] = "out/demo.png",
    *, out: TextIO = sys.stdout,
) -> DemoResult:  # fmt: skip
    """Runs the demo in the given modes, prints the summaries and writes the plot."""
    if mode not in MODES:
        raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    runs: list[ModeRun] = []
    for prefix_caching in MODES[mode]:
        print(f"kvdefrag demo: prefix caching {'on' if prefix_caching else 'off'}", file=out)
        runs.append(run_mode(options, prefix_caching, out=out))
    plot = write_plot(
        [(run.report.title, run.log) for run in runs], Path(plot_path), options.num_blocks
    )
    print(file=out)
    for run in runs:
        print(format_report(run.report), file=out)
        print(file=out)
    print(f"plot: {plot.resolve()}", file=out, flush=True)
    return DemoResult([run.report for run in runs], plot)


def use_one_torch_thread() -> None:
    """Makes torch run its CPU kernels on one thread (for the command-line entry points).

    NOTE: the server, the client and the worker share this process; on a small machine
    torch's intra-op threads then wait for each other: a KV move of a few hundred small
    blocks took ~50 ms instead of ~0.5 ms on 2 busy cores. One thread is plenty here.
    """
    torch.set_num_threads(1)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvdefrag demo`` and ``python -m kvdefrag.tools.demo``."""
    defaults = DemoOptions()
    parser.add_argument("--steps", type=int, default=defaults.num_steps, help="steps per mode")
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--mode", choices=sorted(MODES), default="both",
                        help="prefix caching off, on, or both (default)")  # fmt: skip
    parser.add_argument("--out", default="out/demo.png", help="where the PNG plot goes")
    add_engine_arguments(parser)
    parser.add_argument("--check-every", type=int, default=defaults.check_every,
                        help="check every live block every N steps")  # fmt: skip


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    return DemoOptions(
        num_steps=args.steps,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        seed=args.seed,
        engine=engine_config_from_args(args),
        check_every=args.check_every,
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``EngineConfig`` knobs a run may tune (defaults are ``EngineConfig``'s)."""
    defaults = EngineConfig()
    parser.add_argument("--threshold", type=int, default=defaults.threshold)
    parser.add_argument("--max-moves-per-step", type=int, default=defaults.max_moves_per_step)
    parser.add_argument("--no-placement", dest="enable_placement", action="store_false")
    parser.add_argument(
        "--decode-buckets", type=_block_counts, default=defaults.decode_buckets,
        help="decode bucket sizes in blocks, e.g. 1,128,256: bucket-aware compaction",
    )  # fmt: skip


def _block_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"comma-separated block counts, got {text!r}") from err


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of ``add_engine_arguments``' flags (InvalidArgument if bad)."""
    return EngineConfig(
        threshold=args.threshold,
        max_moves_per_step=args.max_moves_per_step,
        enable_placement=args.enable_placement,
        decode_buckets=args.decode_buckets,
    )


def engine_settings(config: EngineConfig) -> str:
    """One line naming the engine settings of a run."""
    trigger = f"threshold {config.threshold}"
    if config.decode_buckets:
        trigger = f"decode buckets {','.join(map(str, config.decode_buckets))}"
    return (
        f"{trigger}, up to {config.max_moves_per_step} moves/step, "
        f"placement {'on' if config.enable_placement else 'off'}"
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m kvdefrag.tools.demo") -> int:
    """Runs the demo; exits 1 if any block was corrupted, 2 on a usage or service error."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="kvdefrag at work: a realistic vLLM workload through a real server and "
        "client, KV data checked, with and without prefix caching.",
    )
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    use_one_torch_thread()
    try:
        result = run_demo(options_from_args(args), args.mode, args.out)
    except DefragError as err:
        print(f"kvdefrag demo: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
