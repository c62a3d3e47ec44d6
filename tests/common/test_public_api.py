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
    "StalePageToken",
    "StepEvents",
    "StepInFlight",
    "StepOutcomeUnknown",
    "StepPending",
    "Totals",
    "mapping_digest",
    "pair_digest",
}


def test_all_is_pinned_sorted_and_documented() -> None:
    assert_public_names("kvdefrag.common", COMMON_NAMES)


def test_every_common_error_is_a_defrag_error() -> None:
    common = importlib.import_module("kvdefrag.common")
    classes = [getattr(common, name) for name in COMMON_NAMES]
    errors = {cls for cls in classes if isinstance(cls, type) and issubclass(cls, Exception)}
    assert len(errors) == 14
    assert all(issubclass(error, common.DefragError) for error in errors)
    client_only = {"DefragError", "MirrorDiverged", "ServiceUnavailable", "StepOutcomeUnknown"}
    client_only.add("StepPending")
    assert set(common.WIRE_ERRORS.values()) == {e for e in errors if e.__name__ not in client_only}


def test_kvdefrag_common_imports_without_torch() -> None:
    script = "import sys, kvdefrag.common; print('torch' in sys.modules)"
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "False"
