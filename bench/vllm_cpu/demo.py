"""``make demo-vllm``: a real vLLM CPU engine with kvdefrag off and on, as one table.

Runs ``engine_run.py plain,defrag`` twice (prefix caching off, then on): the same 96
greedy requests through vLLM 0.32's CPU engine on a tiny Llama with drawn weights and a
40-block pool (vLLM preempts), once with vLLM's own scheduler and worker and once with
``DefragScheduler`` and ``DefragWorker``. The table compares:

* fragmentation, sampled after every ``schedule()`` that leaves a block live: the highest
  live physical block id over the number of live blocks (kvdefrag's
  ``fragmentation_ratio``; block 0 is vLLM's null block, so a packed pool reads 1.0).
  Without kvdefrag from the KV cache manager's block lists, with kvdefrag from the pool
  stats each step's reply carries;
* blocks moved (compaction copies) and placements (fresh blocks re-pointed lower, no
  copy), from the rank service;
* the scheduler-side overhead per ``schedule()`` (``BridgeTotals.step_durations_s``: read
  what changed, plan, send; the reply is checked at the next ``schedule()``), and the
  worker's wait for the step before its forward pass (under synchronous scheduling, as
  here, the round trip lands there; under async scheduling it overlaps the forward pass
  before);
* preemptions, prefix-cache hits, and whether every request generated the same tokens.

vLLM's own output goes to ``out/demo-vllm/*.log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ENGINE_RUN = Path(__file__).resolve().parent / "engine_run.py"
OUT = ROOT / "out" / "demo-vllm"
NUM_REQUESTS = 96


def run_pair(prefix_caching: bool) -> dict[str, dict[str, Any]]:
    """Runs plain vLLM, then kvdefrag, with one setting; returns the results by mode."""
    name = f"apc-{'on' if prefix_caching else 'off'}"
    argv = [sys.executable, os.fspath(ENGINE_RUN), "plain,defrag",
            os.fspath(OUT / "model"),
            os.fspath(OUT / name), "--num-requests", str(NUM_REQUESTS)]  # fmt: skip
    if prefix_caching:
        argv.append("--prefix-caching")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = OUT / f"{name}.log"
    print(f"prefix caching {'on' if prefix_caching else 'off'}: plain vLLM, then kvdefrag "
          f"(log: "
          f"{log.relative_to(ROOT)}) ...", end="", flush=True)  # fmt: skip
    started = time.monotonic()
    with open(log, "w") as file:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=file, text=True, env=env)
        file.write(done.stdout)
    print(f" {time.monotonic() - started:.0f} s", flush=True)
    if done.returncode != 0:
        sys.exit(f"engine_run.py failed (exit {done.returncode}); see {log}")
    results = [
        json.loads(line.removeprefix("RESULT "))
        for line in done.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    return {result["mode"]: result for result in results}


def _ratio(values: list[float], percentile: float | None = None) -> str:
    if not values:
        return "-"
    if percentile is None:
        return f"{float(np.mean(values)):.3f}"
    return f"{float(np.percentile(values, percentile)):.3f}"


def _percentiles(values_s: list[float]) -> str:
    """p50/p99/mean of durations in seconds, as milliseconds."""
    ms = [value * 1e3 for value in values_s]
    return f"{np.percentile(ms, 50):.2f}/{np.percentile(ms, 99):.2f}/{np.mean(ms):.2f}"


def _overhead(result: dict[str, Any] | None) -> str:
    """Scheduler-side time per ``schedule()``."""
    return "-" if result is None else _percentiles(result["scheduler"]["step_durations_s"])


def _waits(result: dict[str, Any] | None) -> str:
    """Rank 0's wait for the step planned with each output it ran."""
    if result is None or not result.get("worker_waits_s"):
        return "-"
    return _percentiles(result["worker_waits_s"])


def _same(result: dict[str, Any] | None, plain: dict[str, Any]) -> str:
    if result is None:
        return "-"
    num_same = sum(got == want for got, want in zip(result["tokens"], plain["tokens"], strict=True))
    return (
        f"{'yes' if num_same == len(plain['tokens']) else 'NO'} ({num_same}/{len(plain['tokens'])})"
    )


def columns(runs: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The two columns (without, with kvdefrag) of one setting, one cell per row."""
    plain, defrag = runs["plain"], runs["defrag"]
    cells = []
    for result in (plain, defrag):
        scheduler = result["scheduler"]
        is_defrag = result is defrag
        cells.append(
            [
                _ratio(scheduler["fragmentation"]),
                _ratio(scheduler["fragmentation"], 99),
                f"{scheduler['num_moves']:,}" if is_defrag else "-",
                f"{scheduler['num_placements']:,}" if is_defrag else "-",
                _overhead(defrag) if is_defrag else "-",
                _waits(defrag) if is_defrag else "-",
                f"{scheduler['num_preempted']:,}",
                f"{result['num_cached_tokens']:,}",
                _same(defrag, plain) if is_defrag else "-",
            ]
        )
    return cells


ROWS = (
    "fragmentation (max live id / live), mean",
    "fragmentation, p99",
    "blocks moved",
    "placements (no copy)",
    "scheduler overhead per step p50/p99/mean, ms",
    "  the worker's wait for the step",
    "preemptions",
    "prefix-cache hit tokens",
    "outputs identical to plain vLLM",
)


def format_table(off: dict[str, dict[str, Any]], on: dict[str, dict[str, Any]]) -> str:
    cells = columns(off) + columns(on)
    width = max(len(row) for row in ROWS)
    header_1 = f"{'':{width}}  {'prefix caching off':>36}  {'prefix caching on':>36}"
    header_2 = f"{'':{width}}  " + "  ".join(
        f"{title:>17}" for title in ("without kvdefrag", "with kvdefrag") * 2
    )
    lines = [header_1, header_2]
    for index, row in enumerate(ROWS):
        lines.append(f"{row:{width}}  " + "  ".join(f"{column[index]:>17}" for column in cells))
    return "\n".join(lines)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    print(
        f"vLLM 0.32 CPU engine, tiny Llama with drawn weights: {NUM_REQUESTS} greedy requests "
        "(3 in 4 share a prefix) through 40 blocks of 32 tokens, with and without kvdefrag"
    )
    off = run_pair(prefix_caching=False)
    on = run_pair(prefix_caching=True)
    print()
    print(format_table(off, on))


if __name__ == "__main__":
    main()
