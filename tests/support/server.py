"""The one way tests start a kvdefrag server: in process, on signed KV caches.

The ``serve`` fixture (tests/conftest.py) wraps ``running_server`` for one test and
stops every server it started at teardown; code that cannot take a function-scoped
fixture (a hypothesis test starts one server per example) uses ``running_server``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from kvdefrag.server import ServerHandle, load_config, serve_in_process
from kvdefrag.server.config import option_names

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
        **options: Options of either config (``threshold``, ``tls_cert_file``, ...),
            built into typed configs here as the command line does (without the
            environment), and keywords of ``serve_in_process`` (``executor``,
            ``registry``, ...).

    Yields:
        The running server's handle.
    """
    kv = kv if kv is not None else SignedKv.create(num_blocks, block_size=block_size)
    config_options = {name: options.pop(name) for name in option_names() if name in options}
    engine_config, service_config = load_config({**config_options, "address": address}, {})
    handle = serve_in_process(
        kv.kv_caches,
        kv.block_size,
        engine_config=engine_config,
        service_config=service_config,
        **options,
    )
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
