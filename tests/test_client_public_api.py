"""The client's public face: pinned exports, and an import that needs no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import kvdefrag.client
import kvdefrag.client.vllm


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
        "StepEvents",
        "StepReply",
        "Totals",
    ]
    for name in kvdefrag.client.__all__:
        assert getattr(kvdefrag.client, name).__module__.startswith("kvdefrag."), name


def test_vllm_exports_are_pinned() -> None:
    assert kvdefrag.client.vllm.__all__ == [
        "StepEvents",
        "VllmDefragAdapter",
        "copy_pairs",
        "events_from_scheduler_output",
    ]


def test_error_classes_are_the_shared_ones() -> None:
    import kvdefrag.common

    for name in ("DefragError", "InvalidArgument", "EpochMismatch", "MirrorDiverged"):
        assert getattr(kvdefrag.client, name) is getattr(kvdefrag.common, name)


# A finder that refuses the heavy packages the scheduler side must not need.
_BLOCK_AND_IMPORT = textwrap.dedent(
    """
    import sys

    BLOCKED = ("torch", "numpy", "kvdefrag.server")

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if any(name == top or name.startswith(top + ".") for top in BLOCKED):
                raise ImportError(f"blocked import of {name} in a torch-free client")
            return None

    sys.meta_path.insert(0, Refuse())
    import kvdefrag.client
    import kvdefrag.client.vllm
    from kvdefrag.client import DefragClient, StepEvents

    events = kvdefrag.client.vllm.events_from_scheduler_output
    assert DefragClient and StepEvents and events
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
    print("loaded:", loaded)
    """
)


def test_the_client_imports_without_torch_or_numpy() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loaded: []"


def test_the_blocking_finder_does_block() -> None:
    """The torch-free check above would pass vacuously if the finder never fired."""
    script = _BLOCK_AND_IMPORT + "\nimport torch\n"

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )

    assert result.returncode != 0
    assert "blocked import of torch" in result.stderr
