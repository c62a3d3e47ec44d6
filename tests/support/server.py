"""The one way tests start a kvdefrag server: in process, on signed KV caches.

The ``serve`` fixture (tests/conftest.py) wraps ``running_server`` for one test and
stops every server it started at teardown; code that cannot take a function-scoped
fixture (a hypothesis test starts one server per example) uses ``running_server``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from kvdefrag.server import ServerHandle, serve_in_process

from support.kv import SignedKv

NUM_BLOCKS = 64
BLOCK_SIZE = 4
STOP_GRACE_S = 1.0


@contextlib.contextmanager
def running_server(
    address: str,
    *,
    kv: SignedKv | None = None,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
    **options: Any,
) -> Iterator[ServerHandle]:
    """Serves KV caches on ``address`` and stops the server when the block ends.

    Args:
        address: ``unix:/path.sock``, or ``HOST:PORT`` (port 0: a free one).
        kv: The caches to serve; by default ``SignedKv.create(num_blocks,
            block_size=block_size)``, every block signed.
        num_blocks: Blocks of the default caches.
        block_size: Token slots per block of the default caches.
        **options: Keywords of ``serve_in_process`` (``executor``, ``metrics``,
            ``threshold``, ``tls_cert_file``, ...).

    Yields:
        The running server's handle.
    """
    kv = kv if kv is not None else SignedKv.create(num_blocks, block_size=block_size)
    handle = serve_in_process(kv.kv_caches, kv.block_size, address, **options)
    try:
        yield handle
    finally:
        handle.stop(STOP_GRACE_S)


class Serve(Protocol):
    """The ``serve`` fixture's factory: ``running_server`` on a fresh unix socket by default.

    ``address`` None: ``unix:<the test's tmp_path>/server<n>.sock``.
    """

    def __call__(
        self,
        address: str | None = None,
        *,
        kv: SignedKv | None = None,
        num_blocks: int = NUM_BLOCKS,
        block_size: int = BLOCK_SIZE,
        **options: Any,
    ) -> ServerHandle: ...
