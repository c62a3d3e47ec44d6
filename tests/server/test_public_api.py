"""Pins the public face of ``kvdefrag.server``.

Adding or removing a public name is an API change: update the set here on purpose.
"""

from __future__ import annotations

from kvdefrag.server import ServerHandle

from support.public_api import assert_public_members, assert_public_names

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

# What the worker needs of its running server; the engine stays private, so every change
# to the served state goes through the servicer (a reset starts a new epoch).
SERVER_HANDLE_MEMBERS = {
    "address",
    "applied",
    "apply_planned_step",
    "epoch",
    "kv_lock",
    "metrics_port",
    "moves_since",
    "rebind_kv_caches",
    "release_kv_caches",
    "reset",
    "resolve",
    "stats",
    "stop",
    "wait",
    "wait_applied",
    "warmup",
}


def test_all_is_pinned_sorted_and_documented() -> None:
    assert_public_names("kvdefrag.server", SERVER_NAMES)


def test_server_handle_is_narrow_and_documented() -> None:
    assert_public_members(ServerHandle, SERVER_HANDLE_MEMBERS)
