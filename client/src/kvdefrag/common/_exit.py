"""Interpreter-exit hooks that run before Python waits for its threads (both sides use it).

At exit CPython first runs threading's exit hooks (latest first), then joins every
non-daemon thread, and only then runs ``atexit`` hooks::

    threading exit hooks:  ours (registered later) ... concurrent.futures: join workers
    join non-daemon threads
    atexit hooks

A gRPC server's handler threads are ``concurrent.futures`` workers, and one that serves an
open stream waits for the stream's next message, so the process would never exit: a
server and a client in one process, or a client in another that does not hang up. A
``atexit`` hook would come too late; a threading exit hook that stops the server first
lets the join finish.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable

_LOGGER = logging.getLogger(__name__)


def call_at_exit(method: Callable[[], object]) -> None:
    """Calls the bound ``method`` when the interpreter exits, if its object still lives.

    The hook holds a weak reference, so it keeps nothing alive; a failure is logged.
    """
    method_ref = weakref.WeakMethod(method)

    def hook() -> None:
        bound = method_ref()
        if bound is None:
            return
        try:
            bound()
        except Exception:
            _LOGGER.exception("exit hook %s failed", getattr(bound, "__qualname__", bound))

    # NOTE: threading._register_atexit is what concurrent.futures registers its join
    # with (CPython 3.9+); a plain atexit hook is the fallback elsewhere.
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is already exiting
        register(hook)
