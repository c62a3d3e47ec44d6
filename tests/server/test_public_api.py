"""Pins the public face of ``kvdefrag.server``.

Adding or removing a public name is an API change: update the set here on purpose.
"""

from __future__ import annotations

from support.public_api import assert_public_names

SERVER_NAMES = {
    "Engine",
    "EngineConfig",
    "Move",
    "MoveBatch",
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


def test_all_is_pinned_sorted_and_documented() -> None:
    assert_public_names("kvdefrag.server", SERVER_NAMES)
