"""One bidirectional ``StepStream`` call that can wait for a reply with a timeout.

gRPC's streaming iterators block without a timeout. The caller's thread reads the reply
itself (no hand-over to another thread on the hot path) while a watchdog thread cancels
the call if the reply is late; the request side is fed from a queue (the request iterator
blocks between steps, which keeps the call open)::

    send() -> requests queue -> gRPC -> server -> gRPC -> receive(timeout_s)
                                                             ^ watchdog cancels when late
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

# How often an idle watchdog looks at the clock; a late reply is detected within this.
_WATCHDOG_POLL_S = 0.05


class StreamEnded(Exception):
    """The call ended; ``error`` is the gRPC error, or None for a clean end."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__(repr(error))
        self.error = error


class ReplyTimeout(Exception):
    """No reply arrived within the timeout (the call is cancelled)."""


class _Watchdog:
    """Cancels a call when the reply it waits for is late.

    Invariant: ``fired`` is True exactly when this watchdog cancelled the call.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._is_closed = False
        self.fired = False
        self._thread = threading.Thread(
            target=self._watch, name="kvdefrag-step-stream-watchdog", daemon=True
        )
        self._thread.start()

    def arm(self, timeout_s: float) -> None:
        with self._lock:
            self._deadline = time.monotonic() + max(timeout_s, 0.0)

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        with self._lock:
            self._is_closed = True

    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._is_closed:
                    return
                deadline = self._deadline
                if deadline is not None and time.monotonic() >= deadline:
                    self.fired = True
                    self._deadline = None
                    self._call.cancel()
                    return
            wait_s = _WATCHDOG_POLL_S
            if deadline is not None:
                wait_s = min(wait_s, max(deadline - time.monotonic(), 0.0))
            time.sleep(wait_s)


class Stream:
    """One ``StepStream`` call, fed by a queue, read by the caller.

    Invariant: once ``receive`` has raised ``StreamEnded`` or ``ReplyTimeout`` the call is
    over and every later ``receive`` raises ``StreamEnded`` again.
    """

    _END = object()

    def __init__(self, stub: Any, first_message: Any) -> None:
        """Starts the call with its first message (``open``).

        NOTE: ``wait_for_ready`` makes a call to a server that is restarting wait (up
        to the caller's timeout) instead of failing at once.
        """
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._requests.put(first_message)
        self._call = stub.StepStream(self._iter_requests(), wait_for_ready=True)
        self._ended: StreamEnded | None = None
        self._watchdog = _Watchdog(self._call)

    def _iter_requests(self) -> Iterator[Any]:
        while True:
            message = self._requests.get()
            if message is self._END:
                return
            yield message

    @property
    def is_idle_and_open(self) -> bool:
        """True when the call is still open (no reply is ever unread between steps)."""
        return self._ended is None and bool(self._call.is_active())

    def send(self, message: Any) -> None:
        self._requests.put(message)

    def receive(self, timeout_s: float) -> Any:
        """Returns the next reply.

        Raises:
            StreamEnded: The call ended (with its error, or cleanly).
            ReplyTimeout: Nothing arrived within ``timeout_s``; the call is cancelled.
        """
        if self._ended is not None:
            raise self._ended
        self._watchdog.arm(timeout_s)
        try:
            return next(self._call)
        except StopIteration:
            self._ended = StreamEnded(None)
        except grpc.RpcError as err:  # handed to the caller as StreamEnded
            self._ended = StreamEnded(err)
        finally:
            self._watchdog.disarm()
        self._watchdog.close()
        if self._watchdog.fired:
            raise ReplyTimeout
        raise self._ended

    def close(self, timeout_s: float) -> None:
        """Half-closes the call and waits for the server to end it; cancels if it does not.

        NOTE: the server releases the session before it ends the call, so after a clean
        close a new stream can open at once.
        """
        self._requests.put(self._END)
        if self._ended is None:
            self._watchdog.arm(timeout_s)
            # Drain until the server ends the call; an error (the watchdog's cancel
            # included) ends it too, which is all a close needs.
            with contextlib.suppress(grpc.RpcError):
                for _ in self._call:
                    pass
            self._ended = StreamEnded(None)
        self._watchdog.close()

    def cancel(self) -> None:
        """Ends the call at once (the server sees it cancelled)."""
        self._call.cancel()
        self._requests.put(self._END)
        self._watchdog.close()
        if self._ended is None:
            self._ended = StreamEnded(None)
