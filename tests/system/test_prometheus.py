"""A real Prometheus scrapes a real metrics endpoint; values are read back through its API.

Needs the ``prometheus`` binary (Debian package ``prometheus``; ``make test`` installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvdefrag.common import StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server.metrics import Metrics, MetricsServer, serve_metrics

BLOCK_SIZE = 4
WAIT_S = 60.0
_LISTENING = re.compile(r'msg="Listening on" address=(\S+)')


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(path).is_file():
        pytest.fail(
            "the prometheus binary is missing: run `make system-deps` "
            "(the Debian package prometheus)"
        )
    return path


def make_engine(registry: CollectorRegistry, num_blocks: int) -> Engine:
    key = torch.arange(num_blocks * BLOCK_SIZE, dtype=torch.float32).unsqueeze(1)
    engine = Engine([(key, key.clone())], config=EngineConfig(threshold=0), block_size=BLOCK_SIZE)
    Metrics(registry, engine)
    return engine


@pytest.fixture
def metrics_endpoint(registry: CollectorRegistry) -> Iterator[tuple[Engine, MetricsServer]]:
    engine = make_engine(registry, num_blocks=2560)
    server = serve_metrics(registry, 0)
    try:
        yield engine, server
    finally:
        server.stop()


@pytest.fixture
def prometheus(tmp_path: Path, metrics_endpoint: tuple[Engine, MetricsServer]) -> Iterator[str]:
    """Starts Prometheus on a free loopback port scraping the endpoint every second."""
    binary = prometheus_binary()
    _, server = metrics_endpoint
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        "  - job_name: kvdefrag\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                "--web.listen-address=127.0.0.1:0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield f"http://{wait_for_address(process, log_path)}"
    finally:
        process.terminate()  # SIGTERM to this PID only
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def wait_for_address(process: subprocess.Popen[bytes], log_path: Path) -> str:
    """Returns the HOST:PORT Prometheus logs once it listens."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        match = _LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(
        f"prometheus did not start listening (exit code {process.poll()}):\n"
        + log_path.read_text(errors="replace")[-3000:]
    )


def query(base_url: str, promql: str) -> dict[str, float]:
    """Runs an instant query; returns each series' value keyed by its sorted labels."""
    url = f"{base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return {
        ",".join(f"{k}={v}" for k, v in sorted(series["metric"].items()) if k != "instance"):
        float(series["value"][1])
        for series in body["data"]["result"]
    }  # fmt: skip


def wait_for_values(base_url: str, expected: dict[str, float]) -> None:
    """Polls until every query returns exactly the expected single value."""
    deadline = time.monotonic() + WAIT_S
    seen: dict[str, list[float]] = {}
    while time.monotonic() < deadline:
        seen = {promql: list(query(base_url, promql).values()) for promql in expected}
        if all(seen[promql] == [value] for promql, value in expected.items()):
            return
        time.sleep(0.25)
    wrong = {
        promql: seen.get(promql)
        for promql, value in expected.items()
        if seen.get(promql) != [value]
    }
    pytest.fail(f"after {WAIT_S:.0f} s Prometheus still answers {wrong}; expected {expected}")


@pytest.mark.slow
def test_prometheus_scrapes_counters_gauges_and_histograms(
    prometheus: str, metrics_endpoint: tuple[Engine, MetricsServer]
) -> None:
    engine, _ = metrics_endpoint
    engine.step(StepEvents(new_blocks={"far": list(range(1300, 2500))}, fresh=[]))
    while engine.stats().holes:
        engine.step(StepEvents())
    engine.step(StepEvents(finished=["never-seen"], new_blocks={"short": [2530, 2531]}))

    wait_for_values(
        prometheus,
        {
            'up{job="kvdefrag"}': 1,
            "kvdefrag_steps_total": 4,
            'kvdefrag_defrag_runs_total{result="moved"}': 3,
            'kvdefrag_defrag_runs_total{result="failed"}': 0,
            'kvdefrag_moved_blocks_total{direction="one_way"}': 1200,
            "kvdefrag_placements_total": 2,
            "kvdefrag_unknown_finished_requests_total": 1,
            "kvdefrag_live_blocks": 1202,
            "kvdefrag_max_live_block_id": 1202,
            "kvdefrag_fragmentation_ratio": 1,
            "kvdefrag_capacity_blocks": 2560,
            "kvdefrag_running_requests": 2,
            "kvdefrag_healthy": 1,
            "kvdefrag_swap_duration_seconds_count": 3,
            "kvdefrag_step_duration_seconds_count": 4,
            'count(kvdefrag_step_duration_seconds_bucket{le=~"5e-05|0.0001|0.0002|0.0005"})': 4,
        },
    )

    # Gauges are read at scrape time: the next scrapes see the pool empty out.
    engine.step(StepEvents(finished=["far", "short"]))
    wait_for_values(
        prometheus,
        {
            "kvdefrag_live_blocks": 0,
            "kvdefrag_running_requests": 0,
            "kvdefrag_steps_total": 5,
        },
    )
