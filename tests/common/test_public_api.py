"""Pins the public face of ``kvdefrag.common``, and its import that needs no torch.

Adding or removing a public name is an API change: update the set here on purpose.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

from support.public_api import assert_public_names

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
    "StepEvents",
    "Totals",
    "mapping_digest",
    "pair_digest",
}


def test_all_is_pinned_sorted_and_documented() -> None:
    assert_public_names("kvdefrag.common", COMMON_NAMES)


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
            )
        )
    ]
    assert len(errors) == 10
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
