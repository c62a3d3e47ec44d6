"""One bidirectional ``StepStream`` call that can wait for a reply with a timeout.

gRPC's streaming iterators block without a timeout, so the call is fed from a queue (the
request iterator blocks between steps, which keeps the call open) and read by its own
thread into a second queue::

    send() -> requests queue -> gRPC -> server -> gRPC -> reader thread -> replies queue
                                                                 receive(timeout_s) <-'
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any


class StreamEnded(Exception):
    """The call ended; ``error`` is the gRPC error, or None for a clean end."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__(repr(error))
        self.error = error


class ReplyTimeout(Exception):
    """No reply arrived within the timeout."""


class Stream:
    """One ``StepStream`` call, fed by a queue, read by its own thread.

    Invariant: the reader thread puts every reply, then exactly one end marker (the
    call's error, or None for a clean end), on the replies queue.
    """

    _END = object()

    def __init__(self, stub: Any, first_message: Any) -> None:
        """Starts the call with its first message (``open``).

        NOTE: ``wait_for_ready`` makes a call to a server that is restarting wait (up
        to the caller's timeout) instead of failing at once.
        """
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._requests.put(first_message)
        self._call = stub.StepStream(self._iter_requests(), wait_for_ready=True)
        self._reader = threading.Thread(
            target=self._read, name="kvdefrag-step-stream-reader", daemon=True
        )
        self._reader.start()

    def _iter_requests(self) -> Iterator[Any]:
        while True:
            message = self._requests.get()
            if message is self._END:
                return
            yield message

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put((True, reply))
        except Exception as err:  # handed over to the caller's thread
            self._replies.put((False, err))
        else:
            self._replies.put((False, None))

    @property
    def is_idle_and_open(self) -> bool:
        """True when the call is still open and nothing unread arrived."""
        return self._reader.is_alive() and self._replies.empty()

    def send(self, message: Any) -> None:
        self._requests.put(message)

    def receive(self, timeout_s: float) -> Any:
        """Returns the next reply.

        Raises:
            StreamEnded: The call ended (with its error, or cleanly).
            ReplyTimeout: Nothing arrived within ``timeout_s``.
        """
        try:
            is_reply, payload = self._replies.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise ReplyTimeout from None
        if not is_reply:
            raise StreamEnded(payload)
        return payload

    def close(self, timeout_s: float) -> None:
        """Half-closes the call and waits for the server to end it; cancels if it does not.

        NOTE: the server releases the session before it ends the call, so after a clean
        close a new stream can open at once.
        """
        self._requests.put(self._END)
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            self.cancel()

    def cancel(self) -> None:
        """Ends the call at once (the server sees it cancelled)."""
        self._call.cancel()
        self._requests.put(self._END)
        self._reader.join(1.0)
