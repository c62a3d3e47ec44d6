"""``make bench-serve --quick`` end to end: ``vllm serve`` plain and with kvdefrag, vLLM's
own benchmark against each (bench/vllm_cpu/serve_bench.py).

Nothing here is timed: the test checks that the benchmark ran every request against both
servers, that each engine ran in the mode asked for, that kvdefrag moved blocks (its
/metrics), and that its probes reported the scheduler's and the worker's side.
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
    for server in servers:
        assert len(server["runs"]) == 1
        assert server["runs"][0]["output_throughput"] > 0
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
