"""The four distributions: what each ships, what it pulls in, which scripts it owns.

A scheduler installs kvdefrag-client alone (grpcio and protobuf), a worker adds
kvdefrag-server (torch), kvdefrag-vllm (both sides inside vLLM) depends on both, and
kvdefrag-tools (the demo, record/replay, the workload simulator) adds matplotlib on top of
client and server.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Wheel name -> source folder.
DISTRIBUTIONS = {
    "client": "client",
    "server": "server",
    "vllm": "integrations/vllm",
    "tools": "tools",
}
HEAVY = {"torch", "numpy", "matplotlib"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(distribution: str) -> set[str]:
    requirements = importlib.metadata.requires(distribution) or []
    return {normalized(re.split(r"[\s;<>=!~\[]", line, maxsplit=1)[0]) for line in requirements}


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def copy_sources(tmp_path: Path) -> Path:
    """The package folders, without the build leftovers a stale build could ship."""
    for folder in DISTRIBUTIONS.values():
        shutil.copytree(
            ROOT / folder,
            tmp_path / folder,
            ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
        )
    return tmp_path


# --- as installed by make install -----------------------------------------------------
def test_tools_declare_matplotlib_and_both_runtime_packages() -> None:
    assert requirement_names("kvdefrag-tools") >= {
        "kvdefrag-client",
        "kvdefrag-server",
        "matplotlib",
    }
    assert "matplotlib" not in requirement_names("kvdefrag-server")
    assert not HEAVY & requirement_names("kvdefrag-client")


def test_the_vllm_integration_depends_on_client_and_server_but_not_on_vllm() -> None:
    requirements = requirement_names("kvdefrag-vllm")

    assert {"kvdefrag-client", "kvdefrag-server", "torch"} <= requirements
    # NOTE: the engine's image brings its own vLLM build; pip must never replace it.
    assert "vllm" not in requirements
    assert not {"matplotlib", "kvdefrag-tools"} & requirements


def test_the_kvdefrag_script_is_the_tools_and_the_server_keeps_its_own() -> None:
    scripts = {
        entry.name: entry
        for entry in importlib.metadata.entry_points(group="console_scripts")
        if entry.name.startswith("kvdefrag")
    }

    assert sorted(scripts) == ["kvdefrag", "kvdefrag-server"]
    assert scripts["kvdefrag"].value == "kvdefrag.tools.cli:main"
    assert scripts["kvdefrag"].dist is not None
    assert scripts["kvdefrag"].dist.name == "kvdefrag-tools"
    assert scripts["kvdefrag-server"].value == "kvdefrag.server.__main__:main"
    assert scripts["kvdefrag-server"].dist is not None
    assert scripts["kvdefrag-server"].dist.name == "kvdefrag-server"


# --- as pip builds and resolves them --------------------------------------------------
@pytest.mark.slow
def test_the_client_alone_pulls_neither_torch_numpy_nor_matplotlib(tmp_path: Path) -> None:
    sources = copy_sources(tmp_path / "src")
    report = tmp_path / "report.json"

    done = pip(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        str(sources / "client"),
    )

    assert done.returncode == 0, done.stderr
    resolved = {
        normalized(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]
    }
    assert {"kvdefrag-client", "grpcio", "protobuf"} <= resolved
    assert not HEAVY & resolved
    assert not {"kvdefrag-server", "kvdefrag-vllm", "kvdefrag-tools"} & resolved


@pytest.mark.slow
def test_each_module_ships_in_one_wheel_and_the_tools_wheel_declares_matplotlib(
    tmp_path: Path,
) -> None:
    sources = copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"

    done = pip(
        "wheel",
        "--no-deps",
        "--wheel-dir",
        str(wheels),
        *(str(sources / folder) for folder in DISTRIBUTIONS.values()),
    )

    assert done.returncode == 0, done.stderr
    contents: dict[str, list[str]] = {}
    metadata: dict[str, str] = {}
    for name in DISTRIBUTIONS:
        (wheel,) = wheels.glob(f"kvdefrag_{name}-0.1.0-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            contents[name] = [path for path in archive.namelist() if path.startswith("kvdefrag/")]
            metadata[name] = archive.read(f"kvdefrag_{name}-0.1.0.dist-info/METADATA").decode()
    assert "kvdefrag/client/record.py" in contents["client"]
    assert not [path for path in contents["client"] if "workload" in path or "block_pool" in path]
    assert not [path for path in contents["server"] if "demo" in path]
    assert "kvdefrag/server/cli.py" not in contents["server"]
    assert {
        "kvdefrag/vllm/contract.py",
        "kvdefrag/vllm/scheduler.py",
        "kvdefrag/vllm/worker.py",
    } <= set(contents["vllm"])
    # The vLLM integration lives in kvdefrag-vllm alone.
    assert [path for path in contents["client"] if "vllm" in path] == []
    assert [path for path in contents["server"] if "vllm" in path] == []
    assert {
        "kvdefrag/tools/workload.py",
        "kvdefrag/tools/_block_pool.py",
        "kvdefrag/tools/demo.py",
        "kvdefrag/tools/_report.py",
        "kvdefrag/tools/_demo_worker.py",
        "kvdefrag/tools/cli.py",
    } <= set(contents["tools"])
    all_paths = [path for paths in contents.values() for path in paths]
    assert len(all_paths) == len(set(all_paths)), "a module ships in two distributions"
    assert "Requires-Dist: matplotlib>=3.8" in metadata["tools"].splitlines()
    assert "matplotlib" not in metadata["client"] + metadata["server"]
