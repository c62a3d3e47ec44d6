"""``make bench-serve``: what turning kvdefrag on costs, in ``vllm bench serve`` terms.

    python serve_bench.py [--quick] [--pairs N] [--repeats N] [--num-prompts N]

For each configuration (synchronous and async scheduling, prefix caching off and on) it
starts ``vllm serve`` (``serve_launcher.py``: vLLM's CLI main in this venv) on a tiny
Llama with dummy weights and a hand-written word-level tokenizer (no hub access),
alternating plain vLLM and vLLM with kvdefrag (``--scheduler-cls``/``--worker-cls``,
``KVDEFRAG_VLLM_RUN_DIR``, ``KVDEFRAG_METRICS_PORT``): plain, kvdefrag, plain, kvdefrag.
Against each server it runs vLLM's own benchmark (``vllm.benchmarks.serve``, in this
process, as ``vllm bench serve --dataset-name random`` does) once to warm up, then
``--repeats`` times, and prints one table per configuration:

* output tokens/s, mean TPOT, median and p99 ITL: plain, kvdefrag (each the median of
  its runs), the kvdefrag/plain ratio and its range over the pairs;
* the server's CPU time per output token (every process of ``vllm serve``: API server,
  engine core and its threads, kvdefrag's included; ``/proc/<pid>/stat``): what the
  server spent, however the shared cores were handed out while it ran;
* blocks moved and placements (kvdefrag's ``/metrics``), preemptions;
* what kvdefrag adds per step on each side: the scheduler's time per ``schedule()``
  (``BridgeTotals.step_durations_s``), the service's time to apply a step (moves
  included, ``kvdefrag_step_duration_seconds``) and the worker's wait for its step
  before the forward pass (``serve_probes``).

The workload is the issue's: 160 random prompt tokens, 96 output tokens (``--ignore-eos``),
concurrency 32, through a 240-block pool of 32 tokens (vLLM preempts). Only ratios mean
anything, and only next to the machine's load (printed). vLLM's logs go to
``out/bench-serve/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "out" / "bench-serve"
BLOCK_SIZE = 32
NUM_BLOCKS = 240
SIDES = ("plain", "kvdefrag")
# (key in vLLM's result, label, unit); higher is better only for throughput.
METRICS = (
    ("output_throughput", "output tokens/s", ""),
    ("mean_tpot_ms", "mean TPOT", "ms"),
    ("median_itl_ms", "median ITL", "ms"),
    ("p99_itl_ms", "p99 ITL", "ms"),
    ("server_cpu_ms_per_token", "server CPU time per output token", "ms"),
)
# Clock ticks of /proc/<pid>/stat's utime and stime.
_TICKS_S = os.sysconf("SC_CLK_TCK")
SERVER_START_S = 300.0


@dataclasses.dataclass(frozen=True)
class Config:
    """vLLM's settings for one table."""

    async_scheduling: bool
    prefix_caching: bool

    @property
    def name(self) -> str:
        mode = "async" if self.async_scheduling else "sync"
        return f"{mode}-apc{'on' if self.prefix_caching else 'off'}"

    @property
    def title(self) -> str:
        mode = "async scheduling" if self.async_scheduling else "sync scheduling"
        return f"{mode}, prefix caching {'on' if self.prefix_caching else 'off'}"


CONFIGS = (
    Config(async_scheduling=False, prefix_caching=False),
    Config(async_scheduling=False, prefix_caching=True),
    Config(async_scheduling=True, prefix_caching=False),
    Config(async_scheduling=True, prefix_caching=True),
)


@dataclasses.dataclass
class ServerRun:
    """What one server gave: its benchmark runs and, with kvdefrag, what it measured."""

    side: str
    runs: list[dict[str, float]]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)
    worker_waits_s: list[float] = dataclasses.field(default_factory=list)
    worker_begins_s: list[float] = dataclasses.field(default_factory=list)


# --- the table (no vLLM needed) ---------------------------------------------------------
def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def side_value(servers: Sequence[ServerRun], side: str, key: str) -> float:
    """The median of ``key`` over every run of ``side``."""
    return _median([run[key] for server in servers if server.side == side for run in server.runs])


def pair_ratios(servers: Sequence[ServerRun], key: str) -> list[float]:
    """kvdefrag/plain for each (plain, kvdefrag) pair of servers, in order; each server's
    value is the median of its runs."""
    plain = [s for s in servers if s.side == "plain"]
    defrag = [s for s in servers if s.side == "kvdefrag"]
    return [
        _median([run[key] for run in d.runs]) / _median([run[key] for run in p.runs])
        for p, d in zip(plain, defrag, strict=False)
    ]


def metric_sum(servers: Sequence[ServerRun], prefix: str) -> float:
    """Sums the kvdefrag servers' ``/metrics`` samples whose name starts with ``prefix``."""
    return sum(
        value
        for server in servers
        for name, value in server.metrics.items()
        if name == prefix or name.startswith(prefix + "{")
    )


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return (
        f"{1e3 * _median(values):.2f} / {1e3 * _quantile(values, 0.99):.2f} / "
        f"{1e3 * statistics.fmean(values):.2f}"
    )


def format_table(title: str, servers: Sequence[ServerRun]) -> str:
    """One configuration's table: the benchmark's metrics with ratios, then kvdefrag's side."""
    rows = [("", "plain", "kvdefrag", "ratio", "per pair")]
    for key, label, unit in METRICS:
        plain, defrag = side_value(servers, "plain", key), side_value(servers, "kvdefrag", key)
        ratios = pair_ratios(servers, key)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        rows.append(
            (
                f"{label}{', ' + unit if unit else ''}",
                f"{plain:.2f}",
                f"{defrag:.2f}",
                f"{defrag / plain:.3f}x",
                spread,
            )
        )
    defrag_servers = [server for server in servers if server.side == "kvdefrag"]
    steps = [s for server in defrag_servers for s in server.scheduler.get("step_durations_s", [])]
    settles = [
        s for server in defrag_servers for s in server.scheduler.get("settle_durations_s", [])
    ]
    waits = [w for server in defrag_servers for w in server.worker_waits_s]
    begins = [b for server in defrag_servers for b in server.worker_begins_s]
    num_schedules = sum(server.scheduler.get("num_schedules", 0) for server in defrag_servers)
    num_sent = sum(server.scheduler.get("num_steps", 0) for server in defrag_servers)
    applied = metric_sum(defrag_servers, "kvdefrag_step_duration_seconds_count")
    apply_s = metric_sum(defrag_servers, "kvdefrag_step_duration_seconds_sum")
    moved = metric_sum(defrag_servers, "kvdefrag_moved_blocks_total")
    placed = metric_sum(defrag_servers, "kvdefrag_placements_total")
    preempted = sum(server.scheduler.get("num_preempted", 0) for server in defrag_servers)
    by_path = {
        path: sum(
            value
            for server in defrag_servers
            for name, value in server.metrics.items()
            if name.startswith("kvdefrag_applied_steps_total{") and f'path="{path}"' in name
        )
        for path in ("in_process", "rpc")
    }
    rows += [
        ("blocks moved / placed (kvdefrag servers)", "-", f"{moved:.0f} / {placed:.0f}", "", ""),
        ("preemptions (kvdefrag servers)", "-", f"{preempted}", "", ""),
        ("what kvdefrag adds, per step:", "", "", "", ""),
        ("  scheduler, per schedule(), p50/p99/mean ms", "-", _ms(steps), "", ""),
        ("    of which waiting for earlier steps' replies", "-", _ms(settles), "", ""),
        (
            "  schedule() calls that sent a step",
            "-",
            f"{num_sent}/{num_schedules}" if num_schedules else "-",
            "",
            "",
        ),
        (
            "  service, applying a step, mean ms",
            "-",
            f"{1e3 * apply_s / applied:.2f}" if applied else "-",
            "",
            "",
        ),
        (
            "  steps applied by the worker / by the call",
            "-",
            f"{by_path['in_process']:.0f} / {by_path['rpc']:.0f}",
            "",
            "",
        ),
        ("  worker, getting its step, p50/p99/mean ms", "-", _ms(waits), "", ""),
        ("  worker, lock + rows + translation, p50/p99/mean ms", "-", _ms(begins), "", ""),
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines = [title]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


# --- model, servers, benchmark --------------------------------------------------------
def write_model(model_dir: Path) -> None:
    """The tiny Llama's ``config.json`` (engine_run.py's) and a word-level tokenizer over
    its vocabulary (``w3`` ... ``w511``, split on whitespace), so that vLLM's random
    dataset can draw, decode and re-encode prompts without any hub access."""
    from engine_run import TINY_LLAMA, VOCAB_SIZE

    model_dir.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>"]
    vocab = {token: token_id for token_id, token in enumerate(special)}
    vocab |= {f"w{token_id}": token_id for token_id in range(len(special), VOCAB_SIZE)}
    as_written = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": token, **as_written, "special": True}
            for token_id, token in enumerate(special)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": TINY_LLAMA["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    for name, content in (
        ("config.json", TINY_LLAMA),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (model_dir / name).write_text(json.dumps(content))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_argv(config: Config, side: str, model_dir: Path, port: int) -> list[str]:
    """``serve_launcher.py`` with ``vllm serve``'s options for one server."""
    prefix_caching = "--" + ("" if config.prefix_caching else "no-") + "enable-prefix-caching"
    scheduling = "--async-scheduling" if config.async_scheduling else "--no-async-scheduling"
    argv = [sys.executable, os.fspath(HERE / "serve_launcher.py")]
    if config.async_scheduling:
        argv.append("--force-async")
    argv += ["serve", os.fspath(model_dir), "--host", "127.0.0.1", "--port", str(port),
             "--load-format", "dummy", "--enforce-eager", "--dtype", "float32",
             "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
             "--max-model-len", "512", "--seed", "0", "--disable-log-stats",
             prefix_caching, scheduling]  # fmt: skip
    prefix = "ModeAsync" if config.async_scheduling else "Mode"
    if side == "kvdefrag":
        prefix = "ProbedDefragAsync" if config.async_scheduling else "ProbedDefrag"
        argv += ["--worker-cls", "serve_probes.ProbedDefragWorker"]
    argv += ["--scheduler-cls", f"serve_probes.{prefix}Scheduler"]
    return argv


class Server:
    """One ``vllm serve`` process (its own session, so its engine core goes with it)."""

    def __init__(self, config: Config, side: str, model_dir: Path, run_dir: Path, log: Path):
        self.port = free_port()
        self.metrics_port = free_port()
        self.run_dir = run_dir
        python_path = os.environ.get("PYTHONPATH")
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_USE_V2_MODEL_RUNNER": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": os.path.join(sys.prefix, "vllm-cache"),
            "KVDEFRAG_VLLM_RUN_DIR": os.fspath(run_dir),
            "KVDEFRAG_METRICS_PORT": str(self.metrics_port),
            "PYTHONPATH": os.pathsep.join(filter(None, [os.fspath(HERE), python_path])),
        }
        env.pop("KVDEFRAG_VLLM_AUDIT_EVERY", None)  # what a user runs: no audit
        self._log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            serve_argv(config, side, model_dir, self.port),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + SERVER_START_S
        while not self._is_healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not start; see {log}")
            time.sleep(0.5)

    def _is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                return True
        except OSError:
            return False

    def mode(self) -> dict[str, Any]:
        mode: dict[str, Any] = json.loads((self.run_dir / "mode.json").read_text())
        return mode

    def scrape(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line.startswith("kvdefrag_"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def cpu_s(self) -> float:
        """User and system CPU time of every live process in the server's session."""
        total_ticks = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue  # it ended meanwhile
            # After the command: state ppid pgrp session ... utime (12th) stime (13th).
            if int(fields[3]) == self.process.pid:
                total_ticks += int(fields[11]) + int(fields[12])
        return total_ticks / _TICKS_S

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def benchmark(server: Server, model_dir: Path, num_prompts: int, log: Any) -> dict[str, float]:
    """vLLM's ``vllm bench serve --dataset-name random`` against one server, here, and the
    server's CPU time per output token meanwhile."""
    from serve_launcher import answer_vllm_version_with_vllm_cpu

    answer_vllm_version_with_vllm_cpu()
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--host", "127.0.0.1", "--port", str(server.port), "--model", os.fspath(model_dir),
         "--dataset-name", "random", "--random-input-len", "160",
         "--random-output-len", "96", "--num-prompts", str(num_prompts),
         "--max-concurrency", "32", "--ignore-eos", "--seed", "0", "--disable-tqdm"]
    )  # fmt: skip
    cpu_before_s = server.cpu_s()
    with contextlib.redirect_stdout(log):
        result = main(args)
    cpu_s = server.cpu_s() - cpu_before_s
    assert result["completed"] == num_prompts, f"{result['completed']}/{num_prompts} completed"
    result["server_cpu_ms_per_token"] = 1e3 * cpu_s / result["total_output_tokens"]
    return {key: float(result[key]) for key, _, _ in METRICS}


def run_server(
    config: Config, side: str, index: int, args: argparse.Namespace, model_dir: Path
) -> ServerRun:
    name = f"{config.name}-{index}-{side}"
    out = args.out
    # NOTE: a short private folder: the run directory holds the rank's unix socket.
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvdefrag-{name}-"))
    print(f"  {name}: starting vllm serve ...", end="", flush=True)
    started = time.monotonic()
    server = Server(config, side, model_dir, run_dir, out / f"{name}.log")
    try:
        mode = server.mode()
        want = {
            "async_scheduling": config.async_scheduling,
            "prefix_caching": config.prefix_caching,
        }
        if {key: mode[key] for key in want} != want:
            raise RuntimeError(f"{name}: the engine runs {mode}, not {want}")
        print(f" {time.monotonic() - started:.0f} s; benchmark", end="", flush=True)
        with open(out / f"{name}.bench.log", "w") as log:
            benchmark(server, model_dir, max(8, args.num_prompts // 3), log)  # warm-up
            runs = [
                benchmark(server, model_dir, args.num_prompts, log) for _ in range(args.repeats)
            ]
        result = ServerRun(side, runs)
        if side == "kvdefrag":
            result.metrics = server.scrape()
            time.sleep(0.5)  # scheduler.json is written as the last request finishes
            result.scheduler = json.loads((run_dir / "scheduler.json").read_text())
            waits = run_dir / "worker0_waits.jsonl"
            for line in waits.read_text().splitlines() if waits.exists() else ():
                probes = json.loads(line)
                result.worker_waits_s += probes["waits_s"]
                result.worker_begins_s += probes["begins_s"]
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    tokens_s = ", ".join(f"{run['output_throughput']:.0f}" for run in runs)
    print(f" {tokens_s} tokens/s ({time.monotonic() - started:.0f} s)", flush=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sync, prefix caching off, one pair")
    parser.add_argument("--pairs", type=int, default=2, help="(plain, kvdefrag) servers per table")
    parser.add_argument("--repeats", type=int, default=3, help="benchmark runs per server")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--configs", default="", help="comma-separated names, e.g. sync-apcoff")
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--out", type=Path, default=OUT, help="logs, model and run directories")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs, args.repeats, args.num_prompts = 1, 1, 48
        args.configs = args.configs or CONFIGS[0].name
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    write_model(model_dir)
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{args.num_prompts} prompts x {args.repeats} runs per server, {args.pairs} pairs; "
          f"logs: {args.out}/", flush=True)  # fmt: skip
    tables = []
    report: dict[str, Any] = {}
    for config in configs:
        print(config.title, flush=True)
        servers = [
            run_server(config, side, index, args, model_dir)
            for index in range(args.pairs)
            for side in SIDES
        ]
        report[config.name] = [dataclasses.asdict(server) for server in servers]
        tables.append(format_table(config.title, servers))
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("\n\n".join(tables))
    if args.json:
        args.json.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
