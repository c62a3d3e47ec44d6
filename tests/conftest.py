"""Fixtures for the resources tests share: running servers and a metrics registry.

Helpers that are not resources (KV caches, models, workloads, certificates) are plain
functions and classes in ``support``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvdefrag.server import ServerHandle

from support.kv import SignedKv
from support.server import BLOCK_SIZE, NUM_BLOCKS, Serve, running_server


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """Starts in-process servers for one test; every one is stopped at teardown.

    ``serve(address=None, *, kv=None, num_blocks=64, block_size=4, **options)`` serves
    ``kv`` (default: fresh ``SignedKv`` caches) on ``address`` (default: a new unix socket
    in ``tmp_path``) and returns the ``ServerHandle``; ``options`` go to
    ``serve_in_process``. Stopping a server early (``handle.stop()``) is allowed.
    """
    numbers = itertools.count()
    with contextlib.ExitStack() as servers:

        def start(
            address: str | None = None,
            *,
            kv: SignedKv | None = None,
            num_blocks: int = NUM_BLOCKS,
            block_size: int = BLOCK_SIZE,
            **options: Any,
        ) -> ServerHandle:
            if address is None:
                address = f"unix:{tmp_path}/server{next(numbers)}.sock"
            server = running_server(
                address, kv=kv, num_blocks=num_blocks, block_size=block_size, **options
            )
            return servers.enter_context(server)

        yield start


@pytest.fixture
def registry() -> CollectorRegistry:
    """A fresh Prometheus registry: one test's metrics never meet another's."""
    return CollectorRegistry()
