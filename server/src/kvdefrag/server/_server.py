"""The in-process gRPC server: DefragService, health and reflection on one address.

``serve_in_process`` runs inside the worker, in background threads, next to the KV
tensors the engine moves. Addresses::

    unix:/abs/path.sock   default; file mode 0600, bound privately (see _socket_file); a
                          stale socket file is replaced; PATH.lock (flock) is held while
                          serving, and stop() removes the file only while holding it
    HOST:PORT             TCP; port 0 picks one; a non-loopback HOST needs TLS or insecure
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvdefrag.common import InvalidArgument, PoolStats, StepEvents
from kvdefrag.common._exit import call_at_exit
from kvdefrag.common.durations import check_duration
from kvdefrag.server import _convert, _identity, _socket_file
from kvdefrag.server._engine import Engine, StepObserver, StepResult
from kvdefrag.server._executor import KvCaches, SwapExecutor
from kvdefrag.server._limits import MAX_OTHER_STREAMS, MIN_WORKERS, StreamShare, StreamSlots
from kvdefrag.server._moves import MoveBatch
from kvdefrag.server._servicer import DefragServicer
from kvdefrag.server._socket_file import MAX_SOCKET_PATH_BYTES, SocketFile
from kvdefrag.server._tls import server_credentials
from kvdefrag.server.config import EngineConfig, ServiceConfig
from kvdefrag.server.metrics import Metrics, MetricsServer, serve_metrics

_LOGGER = logging.getLogger(__name__)

HEALTH_SERVICE_NAMES = ("", _convert.SERVICE_NAME)
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")
# How long stop() waits past its grace for gRPC to report the shutdown done.
_SHUTDOWN_WAIT_S = 1.0
# The grace of the stop at interpreter exit: a step in flight may finish, nothing more.
_EXIT_GRACE_S = 1.0


@dataclasses.dataclass(frozen=True)
class ListenAddress:
    """A parsed address: a unix socket path, or a TCP host and port."""

    socket_path: str | None = None
    host: str = ""
    port: int = 0

    @property
    def is_loopback(self) -> bool:
        """True for unix sockets and loopback TCP hosts."""
        if self.socket_path is not None:
            return True
        if self.host.lower() in _LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return False

    def target(self, port: int | None = None) -> str:
        """The gRPC target string (with ``port`` in place of the requested one)."""
        if self.socket_path is not None:
            return f"unix:{self.socket_path}"
        return f"{self.host}:{self.port if port is None else port}"


def parse_address(address: str) -> ListenAddress:
    """Parses ``unix:PATH`` (relative paths are made absolute) or ``HOST:PORT``.

    Raises:
        InvalidArgument: The address has neither form, or the port is out of range.
    """
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        if path.startswith("//"):  # unix:///abs/path
            path = path[2:]
        if not path:
            raise InvalidArgument(f"address {address!r}: the unix socket path is empty")
        path = os.path.abspath(path)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
            raise InvalidArgument(
                f"address {address!r}: a unix socket path is at most {MAX_SOCKET_PATH_BYTES} bytes"
            )
        return ListenAddress(socket_path=path)
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidArgument(
            f"address {address!r} must be 'unix:/path.sock' or 'HOST:PORT' "
            "(port 0-65535, 0 picks a free one)"
        )
    return ListenAddress(host=host, port=int(port_text))


def grpc_options(config: ServiceConfig) -> list[tuple[str, Any]]:
    """Channel options of the server: message limits, no port sharing, keepalive."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # NOTE: with SO_REUSEPORT a second server could bind a taken port silently.
        ("grpc.so_reuseport", 0),
        # A crashed or cut-off client on TCP must not hold the one writer session for
        # long: the connection of a silent peer ends within 15 s (a ping after 10 s of
        # silence, unanswered for 5 s), so its client, which notices within 10 s and
        # reconnects, can open the session again soon after.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        # NOTE: gRPC closes the connection when a ping goes unanswered for this long
        # (60 s by default), whatever keepalive_timeout_ms says.
        ("grpc.http2.ping_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # NOTE: the client pings every 5 s, with or without calls and data (its
        # _channel.KEEPALIVE_TIME_MS); a ping sooner than this minimum is a strike, and
        # after more than two the server ends the connection (GOAWAY too_many_pings).
        ("grpc.http2.min_ping_interval_without_data_ms", 4_000),
    ]


class ServerHandle:
    """A running service, as the worker that started it sees it.

    Narrow on purpose: the worker holds ``kv_lock`` during its forward pass and reads the
    mapping (``resolve``), the pool (``stats``) and the step it waits for
    (``wait_applied``, ``epoch``); it never reaches the engine itself. Every change to
    the served state goes through the servicer, so a reset (``reset``) always starts a
    new epoch and no client keeps stepping an engine that changed under it.

    The worker also owns its KV tensors' lifetime, so three calls follow it without
    touching the served state (mapping, requests, epoch): ``release_kv_caches`` when it
    frees them (vLLM's sleep), ``rebind_kv_caches`` when it allocates new ones (its
    wake-up), and ``warmup``, which runs the swap executor's warm-up again (after a
    wake-up: no graph is compiled inside a step).

    Built by ``serve_in_process``; call ``stop()`` (or use it as a context manager) when
    the worker shuts down.
    """

    def __init__(
        self,
        address: str,
        engine: Engine,
        server: grpc.Server,
        servicer: DefragServicer,
        health_servicer: Any,
        socket_file: SocketFile | None,
        thread_pool: futures.ThreadPoolExecutor,
        metrics_server: MetricsServer | None,
    ) -> None:
        self._address = address
        # NOTE: private: whoever holds the engine could step or reset it behind the
        # servicer's back (its epoch would not change). Tests read it for what the
        # handle does not offer (the request table, the engine config in force).
        self._engine = engine
        self._server = server
        self._servicer = servicer
        self._health = health_servicer
        self._socket_file = socket_file
        self._thread_pool = thread_pool
        self._metrics_server = metrics_server
        self._stop_lock = threading.Lock()
        self._stopped = threading.Event()
        self._is_stopped_cleanly = True
        call_at_exit(self._stop_at_exit)

    @property
    def address(self) -> str:
        """Where it listens (with the real port when port 0 was asked for)."""
        return self._address

    @property
    def kv_lock(self) -> threading.Lock:
        """The lock the worker holds during its forward pass: no block moves meanwhile.

        The engine takes it to move KV data and publish the new mapping, so ``resolve``
        and ``stats`` read under it see the mapping the KV data is in.
        """
        return self._engine.kv_lock

    def resolve(
        self, logical_ids: Sequence[int] | npt.ArrayLike | None = None
    ) -> npt.NDArray[np.int64]:
        """Maps logical block ids to physical ids, lock-free, as of the last step.

        Args:
            logical_ids: Ids in ``[0, num_blocks)``, any shape; None: the whole mapping
                (index ``i`` holds the physical id of logical id ``i``), a copy taken
                without checking or gathering ids, for a worker that reads it every pass.

        Raises:
            InvalidArgument: An id is not an integer or is out of range.
        """
        if logical_ids is None:
            return self._engine.mapping()
        return self._engine.resolve(logical_ids)

    def moves_since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None:
        """The compactions (KV data moved) since compaction number ``version``; call it
        holding ``kv_lock``. See ``Engine.moves_since``."""
        return self._engine.moves_since(version)

    def stats(self) -> PoolStats:
        """The pool as of the last step or reset (lock-free)."""
        return self._engine.stats()

    def wait_applied(self, epoch: int, seq: int, timeout_s: float) -> None:
        """Returns once the service has applied step ``seq`` of ``epoch``.

        For a worker told of a step that its scheduler sent without waiting for the reply
        (``kvdefrag.vllm``): call it before taking ``kv_lock`` (the step may need the lock
        to move KV data). ``timeout_s`` bounds it whatever the service is doing (a step
        that hangs in the executor included), and ``stop()`` ends it at once.

        Raises:
            EpochMismatch: The service is at another epoch (restarted or reset).
            EngineUnhealthy: A KV move failed; the step may never be applied.
            ServiceUnavailable: Not applied within ``timeout_s``, or the service stops;
                the message names the step (epoch, seq) and the bound.
            InvalidArgument: ``timeout_s`` is not a number of seconds in ``[0,
                MAX_DURATION_S]`` (a day; 0 only checks).
        """
        timeout_s = check_duration("wait_applied: timeout_s", timeout_s, allow_zero=True)
        self._servicer.wait_applied(epoch, seq, timeout_s)

    def apply_planned_step(self, epoch: int, seq: int, events: StepEvents) -> bool:
        """Applies step ``seq`` of ``epoch`` here, for the open stream session, unless it
        was applied already; its writer's own copy of the step is then answered from the
        replay cache.

        For a worker that was handed the step's events with its output (``kvdefrag.vllm``):
        it need not wait for the step's call to arrive. Only the open session's next seq of
        the current epoch is applied; anything else is refused and changes nothing. Call it
        before taking ``kv_lock``, as ``wait_applied``.

        Returns:
            True when this call applied the step, False when it was applied already.

        Raises:
            EpochMismatch: The service is at another epoch (restarted or reset).
            SessionConflict: No stream session is open (it ended, or a forced reset).
            OutOfOrder: ``seq`` is ahead of the next step (``wait_applied`` for it).
            StepInFlight: Another step kept the service busy; ``wait_applied`` for it.
            EngineUnhealthy, InvalidArgument, MessageTooLarge: As the step's call.
        """
        return self._servicer.apply_planned_step(epoch, seq, events)

    @property
    def metrics_port(self) -> int | None:
        """The port of the ``/metrics`` endpoint, None when it is not served."""
        return None if self._metrics_server is None else self._metrics_server.port

    @property
    def epoch(self) -> int:
        """The server's current epoch."""
        return self._servicer.epoch

    @property
    def applied(self) -> tuple[int, int]:
        """``(epoch, next_seq)``: the steps of which epoch are applied, up to which seq
        (lock-free).

        A Reset publishes its new epoch before the engine publishes the identity mapping
        (holding ``kv_lock``): a worker that holds ``kv_lock`` and reads the epoch of its
        step here knows that its step's mapping is the one in force.
        """
        return self._servicer.applied

    def reset(self, *, prefix_caching: bool | None = None, force: bool = False) -> int:
        """Resets the served engine through the servicer, as the Reset RPC does.

        Forgets every request, restores the identity mapping and starts a new epoch
        (healthy again): a client of the old epoch gets ``EpochMismatch`` at its next
        step, and a worker's ``wait_applied`` for a step of the old epoch raises it too.
        The KV data stays where it is.

        Refused while a writer session is open (a running vLLM scheduler): its workers
        would translate with the identity mapping while the data stays where it was
        moved. ``force`` resets anyway and ends that session: restart vLLM after it.

        Args:
            prefix_caching: The mode of the new epoch; None keeps the current one.
            force: Reset even while a writer session is open.

        Returns:
            The new epoch.

        Raises:
            SessionConflict: A writer session is open and ``force`` is not set.
            StepInFlight: A step is still being applied; retry once it is done.
        """
        return self._servicer.reset(prefix_caching=prefix_caching, force=force)

    def warmup(self) -> int:
        """Runs the swap executor's warm-up again, holding ``kv_lock``; call it without
        holding ``kv_lock``.

        On HPU every pad bucket runs once, one-way and two-way, as when the service bound
        the caches, with pad-only batches that move nothing, so no graph is compiled
        inside a step; the CPU and CUDA executors compile nothing and run no batch.

        Returns:
            The batches run (0 on CPU and CUDA, and while the KV caches are released).
        """
        return self._engine.warmup()

    def release_kv_caches(self) -> None:
        """Lets go of the KV tensors the service moves blocks in, so that freeing them
        frees their memory (vLLM's sleep discards the KV caches).

        The mapping, the requests and the epoch stay. Until ``rebind_kv_caches``, a step
        that needs to move blocks fails (the engine then needs a reset); vLLM schedules
        none while it sleeps.
        """
        self._engine.release_kv_caches()

    def rebind_kv_caches(
        self, kv_caches: KvCaches, *, executor: SwapExecutor | None = None
    ) -> None:
        """Moves blocks in ``kv_caches`` from now on: the worker re-allocated its KV caches.

        The tensors must be laid out as the bound ones (layers, shapes, dtypes, device
        kind). Their executor is built as ``serve_in_process`` builds it (on HPU it warms
        every pad bucket as it binds) and swapped in holding ``kv_lock``. The mapping,
        the requests and the epoch stay, so the scheduler's session goes on: correct
        when no request reads its KV data from before the re-allocation, as after vLLM's
        sleep, which preempts every running request and empties the prefix cache before
        the workers discard their caches (``Engine.rebind_kv_caches`` has the details).

        Args:
            kv_caches: The worker's new per-layer ``(key, value)`` KV tensors.
            executor: A swap executor for them, instead of the one built for them.

        Raises:
            InvalidArgument: ``kv_caches`` is malformed, two of its tensors share memory
                (both named), or it is not laid out as the bound caches (the message names
                the first difference); nothing changed.
        """
        self._engine.rebind_kv_caches(kv_caches, executor)

    def stop(self, grace_s: float | None = 5.0) -> bool:
        """Stops serving: health NOT_SERVING first, then in-flight steps finish.

        New steps are refused (UNAVAILABLE) from the moment health flips; RPCs still
        running after ``grace_s`` seconds (None: 0) are cancelled, and ``stop`` returns
        then, a step that hangs in the executor included: it finishes or fails later in
        its handler thread, applied whole by the engine
        (docs/design/sessions-and-faults.md). Idempotent.

        Returns:
            True when every step had finished by then; False when one was still running.

        Raises:
            InvalidArgument: ``grace_s`` is not None nor a number of seconds in ``[0,
                MAX_DURATION_S]`` (a day); nothing is stopped.
        """
        grace_s = (
            0.0 if grace_s is None else check_duration("stop: grace_s", grace_s, allow_zero=True)
        )
        with self._stop_lock:
            if self._stopped.is_set():
                return self._is_stopped_cleanly
            deadline = time.monotonic() + grace_s
            self._health.enter_graceful_shutdown()
            is_idle = self._servicer.begin_shutdown(grace_s)
            remaining_s = max(deadline - time.monotonic(), 0.0)
            # NOTE: gRPC cancels the calls left after the grace and then reports the
            # shutdown done, even while a handler thread still runs; the extra second
            # bounds the wait should it not.
            self._server.stop(remaining_s).wait(remaining_s + _SHUTDOWN_WAIT_S)
            self._thread_pool.shutdown(wait=False)
            if self._metrics_server is not None:
                self._metrics_server.stop()
            if self._socket_file is not None:
                self._socket_file.remove()
            self._is_stopped_cleanly = is_idle
            self._stopped.set()
        if is_idle:
            _LOGGER.info("kvdefrag server on %s stopped", self.address)
        else:
            _LOGGER.warning(
                "kvdefrag server on %s stopped after its %.1f s grace while a step was still "
                "running; it completes or fails in its handler thread, and its reply is lost",
                self.address,
                grace_s,
            )
        return is_idle

    def _stop_at_exit(self) -> None:
        """Stops at interpreter exit, with a short grace (see ``kvdefrag.common._exit``)."""
        if not self._stopped.is_set():
            _LOGGER.info("stopping kvdefrag server on %s: the interpreter exits", self.address)
            self.stop(_EXIT_GRACE_S)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until ``stop`` has finished; False if ``timeout_s`` passed first.

        Args:
            timeout_s: At most this long, in ``[0, MAX_DURATION_S]`` (a day); None: until
                ``stop`` has finished, however long that takes.

        Raises:
            InvalidArgument: ``timeout_s`` is out of range (not finite included).
        """
        if timeout_s is not None:
            timeout_s = check_duration("wait: timeout_s", timeout_s, allow_zero=True)
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _HealthReporter:
    """The one owner of ``grpc.health.v1`` status: an engine observer.

    NOT_SERVING after a failed KV move, whichever RPC the step came through; SERVING
    again after a reset (the Reset RPC or ``ServerHandle.reset``). Once the server stops,
    the health servicer's graceful shutdown keeps every name NOT_SERVING.
    """

    def __init__(self, health_servicer: Any) -> None:
        self._health = health_servicer

    def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICE_NAMES:
            self._health.set(name, status)

    def on_step(self, result: StepResult, duration_s: float) -> None:
        """Nothing to do: a step that returns leaves the engine healthy."""

    def on_move_failure(self) -> None:
        self.set_serving(False)

    def on_reset(self) -> None:
        self.set_serving(True)


def _listen(
    server: grpc.Server, address: ListenAddress, config: ServiceConfig
) -> tuple[str, SocketFile | None]:
    """Binds the server's port; returns the address it listens on and its socket file."""
    credentials = server_credentials(config)
    if not address.is_loopback and credentials is None and not config.insecure:
        raise InvalidArgument(
            f"address {config.address!r} is not a loopback address: give tls_cert_file and "
            "tls_key_file (TLS, optionally tls_client_ca_file for mTLS) or set insecure "
            "(--insecure) to serve it in plain text"
        )
    if address.socket_path is None:
        port = _add_port(server, address.target(), credentials, config)
        return address.target(port), None
    path = address.socket_path
    # NOTE: the path's lock, not the file's inode, says who owns it (see _socket_file);
    # it is held until the server stops and removes its file.
    lock = _socket_file.PathLock.acquire(path)
    try:
        _socket_file.check_path(path)
        # NOTE: gRPC creates the file with the process umask (0777 under umask 0) and
        # unlinks its bound path when it stops; binding in a private directory and linking
        # the finished 0600 file into place closes both holes (see _socket_file).
        with _socket_file.private_bind_path(path) as private_path:
            _add_port(server, f"unix:{private_path}", credentials, config)
            socket_file = _socket_file.publish(private_path, path, lock)
    except BaseException:
        lock.release()
        raise
    return address.target(), socket_file


def _add_port(
    server: grpc.Server,
    target: str,
    credentials: grpc.ServerCredentials | None,
    config: ServiceConfig,
) -> int:
    try:
        if credentials is None:
            return server.add_insecure_port(target)
        return server.add_secure_port(target, credentials)
    except RuntimeError as err:
        raise OSError(
            errno.EADDRINUSE,
            f"cannot listen on {config.address}: the address is taken or not local ({err})",
        ) from err


def serve_in_process(
    kv_caches: KvCaches,
    block_size: int,
    *,
    engine_config: EngineConfig | None = None,
    service_config: ServiceConfig | None = None,
    executor: SwapExecutor | None = None,
    stream: Any = None,
    kv_lock: threading.Lock | None = None,
    observer: StepObserver | None = None,
    registry: CollectorRegistry | None = None,
    max_workers: int = 8,
    identity_secret: bytes | None = None,
    metrics_labels: Mapping[str, str] | None = None,
) -> ServerHandle:
    """Starts the kvdefrag service in background threads of the calling process.

    The configs come in typed and are used as given: this reads no environment. Whoever
    starts the server (the command line, the vLLM worker) builds them once, with
    ``load_config`` from its flags and ``KVDEFRAG_*`` variables.

    Args:
        kv_caches: The worker's per-layer ``(key, value)`` KV tensors.
        block_size: Token slots per block.
        engine_config: The engine's knobs; None: ``EngineConfig()``.
        service_config: Where it listens and how (``address``, TLS, limits,
            ``metrics_port``); None: ``ServiceConfig()``.
        executor: A swap executor to use instead of the one built for the caches.
        stream: CUDA/HPU: the stream of the worker's forward pass.
        kv_lock: CPU: the lock the worker holds during its forward pass.
        observer: Also told about every step, besides the server's metrics and health.
        registry: Where the server's ``Metrics`` register, once the engine exists (a new
            registry if None); served on ``/metrics`` when ``metrics_port`` is set.
        max_workers: gRPC handler threads (a stream holds one while it is open), at
            least 7: streams get a bounded share, unary calls the rest (``_limits``).
        identity_secret: Also serve ``IdentityService``, proving to whoever was told
            this secret (at least 16 random bytes) that the server at the address is
            this one (``kvdefrag.common.identity``); None: not served.
        metrics_labels: Constant labels on every metric series (the vLLM worker sets
            ``rank``); None: none.

    Returns:
        The running server's handle; call ``stop()`` when the worker shuts down.

    Raises:
        InvalidArgument: A config that is not of its type, malformed KV caches or two
            KV tensors that share memory (both named), a bad address (its directory on a
            file system without ``flock`` included), a
            non-loopback TCP address without TLS or ``insecure``, a
            ``max_message_bytes`` too small for a step's reply, or an
            ``identity_secret`` under 16 bytes, or a bad metrics label name.
        OSError: The address is taken (``errno.EADDRINUSE``).
        ValueError: ``registry`` already holds kvdefrag's metrics.
    """
    engine_config = engine_config if engine_config is not None else EngineConfig()
    service_config = service_config if service_config is not None else ServiceConfig()
    for name, value, cls, article in (
        ("engine_config", engine_config, EngineConfig, "an"),
        ("service_config", service_config, ServiceConfig, "a"),
    ):
        if not isinstance(value, cls):
            raise InvalidArgument(
                f"{name} must be {article} {cls.__name__}, got {type(value).__name__} (build "
                "both configs with load_config from options and KVDEFRAG_* variables)"
            )
    if identity_secret is not None:
        _identity.check_secret(identity_secret)
    if max_workers < MIN_WORKERS:
        raise InvalidArgument(
            f"max_workers must be >= {MIN_WORKERS} (the writer, the streams' shares and room "
            f"for unary calls), got {max_workers}"
        )
    engine = Engine(
        kv_caches,
        block_size,
        engine_config,
        executor=executor,
        stream=stream,
        kv_lock=kv_lock,
        observer=observer,
    )
    metrics = Metrics(
        registry if registry is not None else CollectorRegistry(), engine, labels=metrics_labels
    )
    servicer = DefragServicer(engine, service_config, metrics=metrics)
    listen_address = parse_address(service_config.address)
    thread_pool = futures.ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix="kvdefrag-grpc"
    )
    other_streams = StreamShare(
        StreamSlots(
            MAX_OTHER_STREAMS,
            lambda reason: _LOGGER.info("a health or reflection stream was ended: %s", reason),
        ),
        exempt_methods=frozenset({f"/{_convert.SERVICE_NAME}/StepStream"}),
    )
    server = grpc.server(
        thread_pool, options=grpc_options(service_config), interceptors=[other_streams]
    )
    health_servicer = health.HealthServicer()
    health_reporter = _HealthReporter(health_servicer)
    engine.add_observer(health_reporter)
    _convert.add_service(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = [_convert.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
    if identity_secret is not None:
        _identity.add_identity_service(identity_secret, server)
        service_names.append(_identity.SERVICE_NAME)
    reflection.enable_server_reflection(service_names, server)
    metrics_server: MetricsServer | None = None
    socket_file: SocketFile | None = None
    try:
        bound_address, socket_file = _listen(server, listen_address, service_config)
        if service_config.metrics_port is not None:
            metrics_server = serve_metrics(
                metrics.registry,
                service_config.metrics_port,
                service_config.metrics_host,
                max_connections=service_config.metrics_max_connections,
                idle_timeout_s=service_config.metrics_idle_timeout_s,
            )
    except BaseException:
        server.stop(None)
        thread_pool.shutdown(wait=False)
        if socket_file is not None:
            socket_file.remove()
        raise
    health_reporter.set_serving(True)
    server.start()
    _LOGGER.info("kvdefrag server listening on %s", bound_address)
    return ServerHandle(
        bound_address,
        engine,
        server,
        servicer,
        health_servicer,
        socket_file,
        thread_pool,
        metrics_server,
    )
