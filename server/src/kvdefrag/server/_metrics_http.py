"""The ``/metrics`` HTTP endpoint: one thread, a fixed number of connections, deadlines.

prometheus_client's ``start_http_server`` starts a thread per connection and reads from it
without a timeout, so connections that send nothing hold a thread and a descriptor each,
without end (docs/design/metrics.md). This endpoint is a selector loop on one thread::

    listener ──accept──▶ connections, at most max_connections (past it the oldest is closed)
                             │ the request head: at most MAX_REQUEST_BYTES, complete
                             │ within idle_timeout_s of the accept
                             ▼
                         prometheus_client's WSGI app (the registry, its content
                             │ negotiation and gzip: the output of start_http_server)
                             ▼
                         the reply, sent within idle_timeout_s, then the connection is
                         closed (one request per connection, as before)

Its thread count never changes, and it holds at most ``max_connections + 4`` descriptors
(the connections, the listener, the selector and its wake-up pair).

NOTE: past the cap the *oldest* connection is closed, never the newcomer: an attacker
holding the cap's worth of idle sockets would otherwise lock every scraper out until its
sockets time out, and take the freed places again at once. A scraper sends its request
as soon as it connects, so it is read in the next pass of the loop; each pass reads before
it accepts, and accepts at most the cap, so a connection is never closed for room in the
pass that accepted it: a request already sent is answered however many connections arrive
with it or after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import errno
import logging
import re
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvdefrag.common import InvalidArgument

_LOGGER = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
"""Largest request head (request line and headers) read; past it the reply is 431."""

_RECV_BYTES = 4096
_LISTEN_BACKLOG = 128
# How long accepting pauses after accept() itself failed (out of descriptors, say), so
# a listener that stays readable does not spin the loop.
_ACCEPT_PAUSE_S = 0.1
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_REASONS = {
    400: "Bad Request",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclasses.dataclass(eq=False)
class _Connection:
    """One accepted client: reading its request head, then writing its reply."""

    sock: socket.socket
    deadline: float
    received: bytearray = dataclasses.field(default_factory=bytearray)
    reply: memoryview | None = None  # what is left to send, once answered
    is_open: bool = True


def _reply(status: str, headers: Iterable[tuple[str, str]], body: bytes, *, head: bool) -> bytes:
    lines = [
        f"HTTP/1.0 {status}",
        f"Date: {email.utils.formatdate(usegmt=True)}",
        *(f"{name}: {value}" for name, value in headers),
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    return "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + (b"" if head else body)


def _error_reply(code: int, detail: str) -> bytes:
    status = f"{code} {_REASONS[code]}"
    body = f"# HTTP {status}: {detail}\n".encode()
    return _reply(status, [("Content-Type", "text/plain; charset=utf-8")], body, head=False)


def answer(app: WsgiApp, head: bytes) -> bytes:
    """The whole reply to one request head (request line and headers, no blank line).

    The request is handed to ``app`` as a minimal WSGI environ: the method, path, query
    and the two headers prometheus_client reads (``Accept``, ``Accept-Encoding``).
    """
    lines = head.decode("latin-1").split("\n")
    request_line = lines[0].strip().split()
    if len(request_line) != 3 or not request_line[2].startswith("HTTP/"):
        return _error_reply(400, "bad request line")
    method, target, _ = request_line
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name.strip():
            return _error_reply(400, "bad header line")
        headers[name.strip().lower()] = value.strip()
    path, _, query = target.partition("?")
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "PATH_INFO": urllib.parse.unquote(path, "latin-1"),
        "QUERY_STRING": query,
    }
    for name in ("accept", "accept-encoding"):
        if name in headers:
            environ["HTTP_" + name.upper().replace("-", "_")] = headers[name]
    started: list[Any] = []

    def start_response(status: str, response_headers: list[tuple[str, str]], *_: Any) -> None:
        started[:] = [status, response_headers]

    try:
        body = b"".join(app(environ, start_response))
    except Exception:
        _LOGGER.exception("a /metrics request failed")
        return _error_reply(500, "collecting the metrics failed (see the server's log)")
    status, response_headers = started
    return _reply(status, response_headers, body, head=method == "HEAD")


class MetricsServer:
    """A running ``/metrics`` HTTP endpoint: one daemon thread, bounded connections.

    Invariants: at most ``max_connections`` connections are open at once; a connection
    is closed once its reply is sent, or ``idle_timeout_s`` after it was accepted if its
    request head has not arrived by then, or ``idle_timeout_s`` after its reply was ready
    if that is not sent by then; the thread and every socket are gone when ``stop()``
    returns.

    Attributes:
        host: The address it listens on.
        port: The port it listens on (the real one when 0 was asked for).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str,
        *,
        max_connections: int,
        idle_timeout_s: float,
    ) -> None:
        if max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {max_connections}")
        if not idle_timeout_s > 0:
            raise InvalidArgument(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self._app: WsgiApp = make_wsgi_app(registry)
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        try:
            family, _, _, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            self._listener = socket.create_server(
                address[:2], family=family, backlog=_LISTEN_BACKLOG
            )
        except OSError as err:
            raise OSError(
                err.errno, f"cannot serve metrics on {host}:{port} (metrics_port): {err.strerror}"
            ) from err
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        # Oldest first (insertion order): the first one is closed when a newcomer needs room.
        self._connections: dict[_Connection, None] = {}
        self._accept_paused_until = 0.0
        self._stopping = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvdefrag-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops serving; closes the listener and every connection (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        # NOTE: the send fails only if the loop already ended by an error (reported by
        # threading's excepthook) and closed its end; there is nothing left to wake then.
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"\0")
        self._thread.join()
        self._wake_writer.close()

    # --- the loop (its thread owns every socket but the wake-up writer) -----------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._serve_one_pass()
        finally:
            for connection in list(self._connections):
                self._close(connection)
            self._selector.close()
            self._listener.close()
            self._wake_reader.close()

    def _serve_one_pass(self) -> None:
        now = time.monotonic()
        wake_at = min((c.deadline for c in self._connections), default=now + 60.0)
        if self._accept_paused_until:
            wake_at = min(wake_at, self._accept_paused_until)
        events = self._selector.select(max(0.0, wake_at - now))
        is_listener_ready = False
        for key, mask in events:
            if key.fileobj is self._listener:
                is_listener_ready = True
            elif key.fileobj is self._wake_reader:
                self._wake_reader.recv(64)
            elif key.data.is_open:  # not closed earlier in this pass
                if mask & selectors.EVENT_READ:
                    self._read(key.data)
                else:
                    self._write(key.data)
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ)
        if is_listener_ready:  # after the reads: see the module's note
            self._accept(now)
        for connection in [c for c in self._connections if c.deadline <= now]:
            self._close(connection)

    def _accept(self, now: float) -> None:
        # At most the cap per pass (the rest wait in the backlog), so a newcomer only ever
        # closes a connection of an earlier pass, one the reads had a chance to answer.
        for _ in range(self._max_connections):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno == errno.ECONNABORTED:
                    continue
                _LOGGER.warning("the metrics endpoint cannot accept a connection: %s", err)
                self._selector.unregister(self._listener)
                self._accept_paused_until = now + _ACCEPT_PAUSE_S
                return
            if len(self._connections) >= self._max_connections:
                self._close(next(iter(self._connections)))
            sock.setblocking(False)
            connection = _Connection(sock, now + self._idle_timeout_s)
            self._connections[connection] = None
            self._selector.register(sock, selectors.EVENT_READ, connection)

    def _read(self, connection: _Connection) -> None:
        try:
            chunk = connection.sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client went away before its request was complete
            self._close(connection)
            return
        connection.received += chunk
        end = _HEAD_END.search(connection.received)
        if end is None and len(connection.received) <= MAX_REQUEST_BYTES:
            return
        if end is None or end.start() > MAX_REQUEST_BYTES:
            reply = _error_reply(431, f"the request head exceeds {MAX_REQUEST_BYTES} bytes")
        else:
            reply = answer(self._app, bytes(connection.received[: end.start()]))
        connection.reply = memoryview(reply)
        connection.deadline = time.monotonic() + self._idle_timeout_s
        self._selector.modify(connection.sock, selectors.EVENT_WRITE, connection)
        self._write(connection)

    def _write(self, connection: _Connection) -> None:
        assert connection.reply is not None, "a connection writes only once it is answered"
        try:
            num_sent = connection.sock.send(connection.reply)
        except BlockingIOError:
            return
        except OSError:
            self._close(connection)
            return
        connection.reply = connection.reply[num_sent:]
        if not connection.reply:
            self._close(connection)

    def _close(self, connection: _Connection) -> None:
        connection.is_open = False
        del self._connections[connection]
        self._selector.unregister(connection.sock)
        connection.sock.close()
