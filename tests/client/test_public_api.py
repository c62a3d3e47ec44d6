"""The client's public face: pinned exports, and an import that needs no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import kvdefrag.client

ROOT = Path(__file__).resolve().parents[2]


def test_client_exports_are_pinned() -> None:
    assert kvdefrag.client.__all__ == [
        "AuditReport",
        "DefragClient",
        "DefragError",
        "EngineUnhealthy",
        "EpochMismatch",
        "InvalidArgument",
        "MessageTooLarge",
        "MirrorDiverged",
        "NotFound",
        "OutOfOrder",
        "PoolStats",
        "ServiceStats",
        "ServiceUnavailable",
        "SessionConflict",
        "SessionInfo",
        "StalePageToken",
        "StepEvents",
        "StepInFlight",
        "StepOutcomeUnknown",
        "StepPending",
        "StepReply",
        "Totals",
        "identity_refusal",
    ]
    for name in kvdefrag.client.__all__:
        assert getattr(kvdefrag.client, name).__module__.startswith("kvdefrag."), name


def test_error_classes_are_the_shared_ones() -> None:
    import kvdefrag.common

    for name in ("DefragError", "InvalidArgument", "EpochMismatch", "MirrorDiverged"):
        assert getattr(kvdefrag.client, name) is getattr(kvdefrag.common, name)


# A finder that refuses what the scheduler side must not need: the heavy packages, and the
# server and tools distributions. Then every module the client distribution ships imports.
_BLOCK_AND_IMPORT = textwrap.dedent(
    """
    import importlib
    import pkgutil
    import sys

    BLOCKED = ("torch", "numpy", "matplotlib", "kvdefrag.server", "kvdefrag.tools")

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if any(name == top or name.startswith(top + ".") for top in BLOCKED):
                raise ImportError(f"blocked import of {name} in a torch-free client")
            return None

    sys.meta_path.insert(0, Refuse())
    import kvdefrag.client
    from kvdefrag.client import DefragClient, StepEvents

    assert DefragClient and StepEvents
    import kvdefrag.common
    import kvdefrag.v1

    modules = []
    for package in (kvdefrag.client, kvdefrag.common, kvdefrag.v1):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
            modules.append(info.name)
    heavy = ("torch", "numpy", "matplotlib")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
    print("loaded:", loaded)
    print("modules:", " ".join(sorted(modules)))
    """
)


def run_blocked_import(
    args: Sequence[str] = (), env: Mapping[str, str] | None = None, then: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args, "-c", _BLOCK_AND_IMPORT + then],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def test_the_client_imports_without_torch_numpy_matplotlib_server_or_tools() -> None:
    result = run_blocked_import()

    assert result.returncode == 0, result.stderr
    loaded, modules = result.stdout.splitlines()
    assert loaded == "loaded: []"
    assert "kvdefrag.client.record" in modules.split()


def test_the_client_sources_alone_hold_no_workload_simulator_or_tools() -> None:
    """Only client/src and the installed third-party packages on the path (no site, so no
    editable server or tools): the client's modules import, and none is a simulator."""
    paths = sysconfig.get_paths()
    site_packages = sorted({paths["purelib"], paths["platlib"]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client/src"), *site_packages])}
    show_namespace = "print('kvdefrag:', *kvdefrag.__path__)"

    result = run_blocked_import(["-S"], env, then=f"\n{show_namespace}\n")

    assert result.returncode == 0, result.stderr
    loaded, modules, namespace = result.stdout.splitlines()
    assert loaded == "loaded: []"
    names = modules.removeprefix("modules: ").split()
    assert "kvdefrag.client.record" in names
    assert not [name for name in names if "workload" in name or "block_pool" in name]
    assert namespace == f"kvdefrag: {ROOT / 'client/src/kvdefrag'}"


def test_the_blocking_finder_does_block() -> None:
    """The torch-free check above would pass vacuously if the finder never fired."""
    script = _BLOCK_AND_IMPORT + "\nimport torch\n"

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )

    assert result.returncode != 0
    assert "blocked import of torch" in result.stderr
