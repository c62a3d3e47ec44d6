"""Pins the public faces of ``kvdefrag.server`` and ``kvdefrag.common``.

Adding or removing a public name is an API change: update the set here on purpose.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

import pytest

SERVER_NAMES = {
    "Engine",
    "EngineConfig",
    "Move",
    "MoveReport",
    "PoolStats",
    "ServerHandle",
    "ServiceConfig",
    "StepEvents",
    "StepObserver",
    "StepResult",
    "SwapExecutor",
    "Totals",
    "load_config",
    "make_executor",
    "serve_in_process",
}

COMMON_NAMES = {
    "ERROR_METADATA_KEY",
    "NULL_BLOCK_ID",
    "WIRE_ERRORS",
    "DefragError",
    "EngineUnhealthy",
    "EpochMismatch",
    "InvalidArgument",
    "MessageTooLarge",
    "MirrorDiverged",
    "NotFound",
    "OutOfOrder",
    "PoolStats",
    "ServiceUnavailable",
    "SessionConflict",
    "StalePageToken",
    "StepEvents",
    "Totals",
    "mapping_digest",
    "pair_digest",
}


@pytest.mark.parametrize(
    ("module_name", "names"),
    [("kvdefrag.server", SERVER_NAMES), ("kvdefrag.common", COMMON_NAMES)],
)
def test_all_is_pinned_sorted_and_documented(module_name: str, names: set[str]) -> None:
    module: ModuleType = importlib.import_module(module_name)
    assert set(module.__all__) == names
    # isort-style order (as ruff keeps it): constants, then classes, then functions
    assert list(module.__all__) == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    star: dict[str, object] = {}
    exec(f"from {module_name} import *", star)
    assert set(star) - {"__builtins__"} == names
    for name in names:
        if name.isupper():  # a constant: documented where it is defined
            continue
        assert getattr(module, name).__doc__, f"{module_name}.{name} has no docstring"


def test_every_common_error_is_a_defrag_error() -> None:
    common = importlib.import_module("kvdefrag.common")
    errors = [
        getattr(common, name)
        for name in COMMON_NAMES
        if name.endswith(
            (
                "Error",
                "Argument",
                "Order",
                "Conflict",
                "Mismatch",
                "Unhealthy",
                "Large",
                "Diverged",
                "Found",
                "Unavailable",
                "Token",
            )
        )
    ]
    assert len(errors) == 11
    assert all(issubclass(error, common.DefragError) for error in errors)
    assert set(common.WIRE_ERRORS.values()) == set(errors) - {
        common.DefragError,
        common.MirrorDiverged,
        common.ServiceUnavailable,
    }


def test_kvdefrag_common_imports_without_torch() -> None:
    script = "import sys, kvdefrag.common; print('torch' in sys.modules)"
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "False"
