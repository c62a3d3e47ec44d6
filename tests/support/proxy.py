"""The one socket proxy: forwards connections byte for byte until a test breaks them.

``SocketProxy`` listens on a unix socket or a loopback TCP port and forwards every
connection it accepts to a target address. A test breaks the path in the ways a network
does::

    proxy.cut()          # every open connection is closed (a client reconnects through us)
    proxy.blackhole()    # every open connection goes silent for good, still open
                         # (half-open); connections accepted later are forwarded
    proxy.mode = "stall" # every connection holds its bytes while the mode lasts
    proxy.mode = "delay" # every chunk waits up to 50 ms
    proxy.start_chaos(seed)  # the mode flickers at random, with cuts; calm() ends it

Addresses are gRPC's: ``unix:/abs/path.sock`` or ``HOST:PORT``.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

MODES = ("pass", "delay", "stall")
# The chaos draws from these: mostly faithful, sometimes broken.
CHAOS_MODES = ("pass", "pass", "pass", "delay", "cut", "stall")
_POLL_S = 0.05


def _connect(address: str) -> socket.socket:
    if address.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address.removeprefix("unix:"))
        except OSError:
            sock.close()
            raise
        return sock
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def _listen(address: str) -> tuple[socket.socket, str]:
    """Binds ``address`` (TCP port 0: a free one); returns the socket and its address."""
    if address.startswith("unix:"):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address.removeprefix("unix:"))
        listener.listen()
        return listener, address
    host, port = address.rsplit(":", 1)
    listener = socket.create_server((host, int(port)))
    return listener, f"{host}:{listener.getsockname()[1]}"


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class _Connection:
    """One forwarded connection: its two sockets, closed when both pumps are done."""

    def __init__(self, downstream: socket.socket, upstream: socket.socket) -> None:
        self.sockets = (downstream, upstream)
        self.is_blackholed = False
        self._num_pumps = 2
        self._lock = threading.Lock()

    def shut(self) -> None:
        for sock in self.sockets:
            _shut(sock)

    def pump_done(self) -> None:
        with self._lock:
            self._num_pumps -= 1
            is_last = not self._num_pumps
        if is_last:
            for sock in self.sockets:
                sock.close()


class SocketProxy:
    """Forwards connections from ``listen`` to ``target``; a test cuts, stalls, delays or
    blackholes them.

    Attributes:
        address: What clients dial (a TCP port 0 resolved to the one bound).
        mode: ``"pass"``, ``"delay"`` or ``"stall"``, applied to every connection live.
        num_accepted: Connections forwarded so far.
        num_cuts: ``cut()`` calls so far (the chaos's included).
        chaos_counts: How often the chaos picked each of ``CHAOS_MODES``.
    """

    def __init__(self, target: str, listen: str = "127.0.0.1:0") -> None:
        """Starts forwarding.

        Args:
            target: The address every connection is forwarded to.
            listen: The address to listen on: ``unix:/path`` or ``HOST:PORT``.
        """
        self._target = target
        self._listener, self.address = _listen(listen)
        self._listener.settimeout(_POLL_S)
        self.mode = "pass"
        self.num_accepted = 0
        self.num_cuts = 0
        self.chaos_counts = dict.fromkeys(CHAOS_MODES, 0)
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._is_stopping = threading.Event()
        self._is_calm = threading.Event()
        self._start(self._accept_loop)

    @property
    def port(self) -> int:
        """The TCP port clients dial (TCP proxies only)."""
        return int(self.address.rsplit(":", 1)[1])

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        with self._lock:
            self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._is_stopping.is_set():
            try:
                downstream, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = _connect(self._target)
            except OSError:
                _shut(downstream)
                downstream.close()
                continue
            connection = _Connection(downstream, upstream)
            with self._lock:
                self._connections.append(connection)
                self.num_accepted += 1
            self._start(self._pump, connection, downstream, upstream)
            self._start(self._pump, connection, upstream, downstream)

    def _pump(self, connection: _Connection, source: socket.socket, sink: socket.socket) -> None:
        try:
            while not self._is_stopping.is_set():
                if connection.is_blackholed:
                    self._is_stopping.wait()  # silent for good, yet open: half-open
                    return
                # NOTE: select, not a socket timeout: the sockets stay blocking, so a
                # sendall to a slow peer never times out halfway.
                if not select.select([source], [], [], _POLL_S)[0]:
                    continue
                data = source.recv(1 << 16)
                if not data:
                    _shut(sink)
                    return
                while self.mode == "stall" and not self._is_stopping.is_set():
                    time.sleep(0.005)  # hold the bytes: the peer sees silence
                if self.mode == "delay":
                    time.sleep(self._rng.uniform(0.0, _POLL_S))
                if connection.is_blackholed:
                    continue  # dropped, as a dead path drops it
                sink.sendall(data)
        except (OSError, ValueError):
            pass  # cut (or closed) under us
        finally:
            connection.shut()
            connection.pump_done()

    # --- breaking the path --------------------------------------------------------------
    def cut(self) -> None:
        """Closes every open connection; later ones are forwarded."""
        self.num_cuts += 1
        self._cut_all()

    def _cut_all(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.shut()

    def blackhole(self) -> None:
        """Every open connection stops forwarding for good but stays open; later ones are
        forwarded."""
        with self._lock:
            for connection in self._connections:
                connection.is_blackholed = True

    def start_chaos(self, seed: int) -> None:
        """Changes the mode at random every few milliseconds, with cuts, until ``calm()``.

        A stall usually flickers, but may outlast a client's deadline (its step's outcome
        becomes unknown).
        """
        self._rng = random.Random(seed)
        self._start(self._chaos_loop)

    def calm(self) -> None:
        """Ends the chaos: forwards faithfully from now on."""
        self._is_calm.set()
        self.mode = "pass"

    def _chaos_loop(self) -> None:
        duration_s = 0.01
        while not self._is_stopping.wait(duration_s):
            if self._is_calm.is_set():
                self.mode = "pass"
                return
            kind = self._rng.choice(CHAOS_MODES)
            self.chaos_counts[kind] += 1
            if kind == "cut":
                self.cut()
                kind = "pass"
            self.mode = kind
            is_long = kind == "stall" and self._rng.random() < 0.3
            duration_s = self._rng.uniform(0.3, 1.0) if is_long else self._rng.uniform(0.005, 0.05)

    # --- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Stops forwarding and closes every connection and the listener."""
        self._is_stopping.set()
        self._cut_all()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5.0)
        self._listener.close()

    def __enter__(self) -> SocketProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
