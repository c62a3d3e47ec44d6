"""The ``kvdefrag`` command: ``demo``, ``record`` and ``replay``.

::

    kvdefrag demo [--steps N --num-blocks N --seed N --mode off|on|both --out PNG]
    kvdefrag record TRACE.jsonl [workload options] [--prefix-caching]
    kvdefrag replay TRACE.jsonl [--threshold N --max-moves-per-step N --no-placement
                                 --decode-buckets B1,B2,...]

``record`` runs the synthetic workload through a real server and client and writes every
step the client sends (``kvdefrag.client.record`` format); a production scheduler
records the same format with ``StepRecorder``. ``replay`` runs a trace through an
in-process engine with other settings, on an embedded CPU KV cache sized from the
trace's header, and prints the demo's summary (integrity check included), so an operator
can tune the threshold and move cap offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from kvdefrag.client.record import StepRecorder, Trace, load_trace
from kvdefrag.common import DefragError, InvalidArgument
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.tools import demo
from kvdefrag.tools._demo_worker import KvSignatures, LogicalPool
from kvdefrag.tools._report import Progress, RunLog, format_report, write_plot


# --- replay ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ReplaySettings:
    """The engine settings a trace is replayed with.

    Attributes:
        engine: The engine's settings (``prefix_caching`` comes from the trace header).
        check_every: Check every live (and cached) block every this many steps.
    """

    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    check_every: int = 250


def replay_trace(
    trace: Trace,
    settings: ReplaySettings,
    *,
    name: str = "<trace>",
    out: TextIO = sys.stdout,
) -> demo.ModeRun:
    """Runs a trace through an in-process engine and checks the KV data as it goes.

    The "worker" writes a new signature into every fresh block (the server's default
    when the trace says ``fresh: null``: every newly live block without prefix caching,
    none with it), and into a non-fresh block the first time it is seen (a trace that
    starts mid-run); every live block (with prefix caching, every written free block not
    evicted since) must keep it.

    Raises:
        InvalidArgument: The trace has no steps, or the engine refused one (the message
            names the trace line).
    """
    header = trace.header
    if not trace.steps:
        raise InvalidArgument(f"{name}: the trace has a header but no steps")
    cache_shape = demo.DemoOptions()
    kv_caches = cache_shape.make_kv_caches(header.num_blocks, header.block_size)
    engine = Engine(
        kv_caches,
        header.block_size,
        dataclasses.replace(settings.engine, prefix_caching=header.prefix_caching),
    )
    kv = KvSignatures(kv_caches, header.block_size, engine.kv_lock)
    pool = LogicalPool(header.num_blocks)
    log = RunLog()
    prefix_caching = header.prefix_caching
    num_steps = len(trace.steps)
    progress = Progress(out, f"replay {name}", num_steps, 2.0)
    stats = engine.stats()
    for index, events in enumerate(trace.steps):
        started = time.perf_counter()
        try:
            result = engine.step(events)
        except InvalidArgument as err:
            line = trace.line_numbers[index] if trace.line_numbers else index + 2
            raise InvalidArgument(
                f"{name} line {line}: the engine refused the step: {err}"
            ) from err
        latency_s = time.perf_counter() - started
        stats = result.stats
        became_live, became_free = pool.apply(events)
        if not prefix_caching:
            kv.forget(became_free)
        kv.forget(i for i in events.evicted if pool.refs[i] == 0)
        if events.fresh is None:
            fresh = set() if prefix_caching else set(became_live)
        else:
            fresh = set(events.fresh)
        fresh.update(i for i in became_live if kv.stamps[i] < 0)  # first sight
        written = sorted(fresh)
        kv.write(written, engine.resolve(written).tolist())
        moved = [
            logical_id
            for logical_id in result.block_mapping
            if logical_id not in fresh
            and (pool.refs[logical_id] > 0 or (prefix_caching and kv.stamps[logical_id] >= 0))
        ]
        log.add_check(
            "moved", index, len(moved), kv.corrupted(moved, engine.resolve(moved).tolist())
        )
        log.add_step(stats.num_live, pool.max_live(), stats.max_live, latency_s)
        is_last = index + 1 == num_steps
        if (index + 1) % settings.check_every == 0 or is_last:
            live = pool.live_ids()
            log.add_check(
                "live", index, len(live), kv.corrupted(live, engine.resolve(live).tolist())
            )
            if prefix_caching:
                cached = np.flatnonzero((kv.stamps >= 0) & (pool.refs == 0)).tolist()
                bad = kv.corrupted(cached, engine.resolve(cached).tolist())
                log.add_check("cached", index, len(cached), bad)
        progress.update(index + 1, log, stats.totals.num_moves, force=is_last)
    details = (
        f"trace: {name}: {num_steps:,} steps, {header.num_blocks:,} blocks x "
        f"{header.block_size} tokens, prefix caching {'on' if prefix_caching else 'off'}",
        f"kvdefrag: {demo.engine_settings(settings.engine)}; KV cache "
        f"{cache_shape.num_layers} layers on cpu",
    )
    report = log.report(
        f"replay of {name}", details, stats.totals, "step latency p50 / p99 (engine, in-process)"
    )
    return demo.ModeRun(report, log)


# --- record ---------------------------------------------------------------------------
def record_workload(
    path: str | os.PathLike[str],
    options: demo.DemoOptions,
    prefix_caching: bool,
    *,
    out: TextIO = sys.stdout,
) -> tuple[demo.ModeRun, int]:
    """Runs the synthetic workload through a server and client, recording every step.

    Returns:
        The run's summary, and the number of steps recorded.
    """
    workload = demo.workload_config(options, prefix_caching)
    metadata = {"source": "kvdefrag record", "workload": dataclasses.asdict(workload)}
    with StepRecorder(
        path,
        num_blocks=options.num_blocks,
        block_size=options.block_size,
        prefix_caching=prefix_caching,
        metadata=metadata,
    ) as recorder:
        run = demo.run_mode(options, prefix_caching, out=out, recorder=recorder)
        return run, recorder.num_steps


# --- the command line -----------------------------------------------------------------
def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = demo.DemoOptions()
    parser.add_argument("--steps", type=int, default=defaults.num_steps)
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--arrival-rate", type=float, help="mean arrivals per step")
    parser.add_argument("--prefix-caching", action="store_true")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ReplaySettings()
    demo.add_engine_arguments(parser)
    parser.add_argument("--check-every", type=int, default=defaults.check_every)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdefrag",
        description="kvdefrag's demo, and step traces: record them, replay them with other "
        "engine settings to tune offline.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo", help="the demo (same as python -m kvdefrag.tools.demo)", add_help=False
    )
    record = commands.add_parser("record", help="record the synthetic workload to a trace")
    record.add_argument("trace", metavar="TRACE.jsonl")
    _add_workload_arguments(record)
    _add_engine_arguments(record)
    replay = commands.add_parser("replay", help="replay a trace with other engine settings")
    replay.add_argument("trace", metavar="TRACE.jsonl")
    _add_engine_arguments(replay)
    replay.add_argument("--plot", help="also write a PNG plot here")
    return parser


def _print_run(run: demo.ModeRun, out: TextIO) -> None:
    print(file=out)
    print(format_report(run.report), file=out, flush=True)


def _record(args: argparse.Namespace, out: TextIO) -> int:
    options = demo.DemoOptions(
        num_steps=args.steps,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        seed=args.seed,
        arrival_rate=args.arrival_rate,
        engine=demo.engine_config_from_args(args),
        check_every=args.check_every,
    )
    run, num_steps = record_workload(args.trace, options, args.prefix_caching, out=out)
    _print_run(run, out)
    print(f"recorded {num_steps:,} steps to {Path(args.trace).resolve()}", file=out)
    return 0 if run.report.is_intact else 1


def _replay(args: argparse.Namespace, out: TextIO) -> int:
    settings = ReplaySettings(
        engine=demo.engine_config_from_args(args),
        check_every=args.check_every,
    )
    if settings.check_every < 1:
        raise InvalidArgument(f"check_every must be >= 1, got {settings.check_every}")
    trace = load_trace(args.trace)
    run = replay_trace(trace, settings, name=args.trace, out=out)
    _print_run(run, out)
    if args.plot:
        path = write_plot([(run.report.title, run.log)], Path(args.plot), trace.header.num_blocks)
        print(f"plot: {path.resolve()}", file=out)
    return 0 if run.report.is_intact else 1


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    """Runs ``kvdefrag COMMAND``; exit status 1 if a block was corrupted, 2 on errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return demo.main(argv[1:], prog="kvdefrag demo")
    args = build_parser().parse_args(argv)
    demo.use_one_torch_thread()
    try:
        if args.command == "record":
            return _record(args, out)
        return _replay(args, out)
    except DefragError as err:
        print(f"kvdefrag {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
