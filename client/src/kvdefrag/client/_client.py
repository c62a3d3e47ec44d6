"""DefragClient: the scheduler's side of the kvdefrag step stream.

One long-lived ``StepStream`` carries the steps, one in flight at a time::

    step() --StepEvents--> [pending seq N] --StepRequest--> server
                                  ^                            |
         mirror.apply_step <------+------- StepResponse <------+
         digest check                (deltas, digest, stats)

A step stays *pending* until its reply arrives. When the stream breaks, the client
reopens it (``open.epoch`` = its epoch) and resends the pending step; the server applies
each seq exactly once and answers a resent, already applied seq from its replay cache,
so the mirror applies every step's deltas exactly once, in order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvdefrag.client import _convert
from kvdefrag.client._mirror import Mirror
from kvdefrag.client._stream import ReplyTimeout, Stream, StreamEnded
from kvdefrag.client._types import (
    AuditReport,
    ServiceStats,
    SessionInfo,
    StepEvents,
    StepReply,
)
from kvdefrag.client.record import StepRecorder
from kvdefrag.common import (
    DefragError,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    MirrorDiverged,
    ServiceUnavailable,
    SessionConflict,
)

_LOGGER = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Resolve at most this many ids per call when rebuilding the mirror (keeps messages small).
_RESOLVE_CHUNK = 1 << 18
_BACKOFF_START_S = 0.02
_BACKOFF_MAX_S = 0.5


@dataclasses.dataclass
class _PendingStep:
    """A step whose reply has not arrived; ``is_sent`` once it went out on a stream."""

    seq: int
    events: StepEvents
    message: Any
    is_sent: bool = False


def _default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class DefragClient:
    """The torch-free client of one kvdefrag server: steps, a local mirror, audits.

    Invariants: while the client is usable, its mirror equals the server's mapping as of
    the last acknowledged step (checked by digest after every step); ``next_seq`` is the
    seq of the next step to send (or of the pending one).

    The constructor connects and opens the step session at once (one writer per
    server: a second client is refused with ``SessionConflict``). A client that meets a
    server with state it has not seen (a restarted scheduler) adopts that state by
    fetching the server's tables; call ``reset()`` to start from scratch instead.

    Thread-safe: one lock serialises steps and mirror reads.

    Example:
        >>> with DefragClient("unix:/tmp/kvdefrag.sock") as client:  # doctest: +SKIP
        ...     reply = client.step(new_blocks={"req-a": [5, 9]})
        ...     client.resolve([5, 9])
        [1, 2]
    """

    def __init__(
        self,
        address: str,
        prefix_caching: bool = False,
        *,
        timeout_s: float = 10.0,
        client_name: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        interceptors: Sequence[Any] = (),
        record_to: str | os.PathLike[str] | None = None,
    ) -> None:
        """Connects and opens the step session.

        Args:
            address: ``unix:/abs/path.sock`` or ``HOST:PORT``.
            prefix_caching: The scheduler's prefix caching mode; the server's engine is
                switched to it if it holds no state, refused otherwise.
            timeout_s: Deadline of every call, and of every step including reconnects.
            client_name: A name for the server's logs and errors (host:pid by default).
            root_certificates: PEM CA bundle; any TLS argument makes the channel TLS.
            private_key: PEM client key (mTLS).
            certificate_chain: PEM client certificate chain (mTLS).
            max_message_bytes: Largest message sent or received (match the server's).
            interceptors: ``grpc`` client interceptors (tracing, tests).
            record_to: A JSON-lines file that receives every step the server applied,
                for ``kvdefrag replay`` (offline tuning).

        Raises:
            InvalidArgument: A setting is out of range.
            SessionConflict: Another writer holds the server's session.
            ServiceUnavailable: The server did not answer within ``timeout_s``.
            DefragError: Any other refusal of the session.
        """
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        if max_message_bytes < 1024:
            raise InvalidArgument(f"max_message_bytes must be >= 1024, got {max_message_bytes}")
        self.address = address
        self.prefix_caching = prefix_caching
        self.timeout_s = float(timeout_s)
        self.client_name = client_name or _default_client_name()
        self.max_message_bytes = max_message_bytes
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # NOTE: a sidecar is local; come back quickly after a restart.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if root_certificates or private_key or certificate_chain:
            credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
            channel = grpc.secure_channel(address, credentials, options)
        else:
            channel = grpc.insecure_channel(address, options)
        self._channel: grpc.Channel = channel
        if interceptors:
            channel = grpc.intercept_channel(channel, *interceptors)
        self._stub = _convert.stub(channel)
        self._lock = threading.RLock()
        self._stream: Stream | None = None
        self._has_had_session = False
        self._epoch = 0
        self._next_seq = 1
        self._mirror: Mirror | None = None
        self._session: SessionInfo | None = None
        self._pending: _PendingStep | None = None
        self._unusable: DefragError | None = None
        self._is_closed = False
        self._recorder: StepRecorder | None = None
        try:
            with self._lock:
                self._open_stream(self._deadline())
                if record_to is not None:
                    self._recorder = StepRecorder(
                        record_to,
                        num_blocks=self.num_blocks,
                        block_size=self.block_size,
                        prefix_caching=prefix_caching,
                    )
        except BaseException:
            self._channel.close()
            raise

    # --- properties -------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The server epoch the mirror belongs to."""
        return self._epoch

    @property
    def next_seq(self) -> int:
        """The seq of the next step (or of the pending one)."""
        return self._next_seq

    @property
    def num_blocks(self) -> int:
        """Blocks in the server's pool, null block included."""
        return self._require_mirror().num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block of the server's KV cache (0 before the first session)."""
        return self._session.block_size if self._session is not None else 0

    @property
    def digest(self) -> int:
        """Digest of the mirror's live mapping."""
        return self._require_mirror().digest

    @property
    def has_pending_step(self) -> bool:
        """True when a step timed out unacknowledged; the next ``step()`` resends it."""
        return self._pending is not None

    def live_requests(self) -> dict[str, list[int]]:
        """The client's view of running requests: request id -> logical block ids."""
        with self._lock:
            return {rid: list(ids) for rid, ids in self._require_mirror().requests.items()}

    # --- the step ---------------------------------------------------------------------
    def step(
        self,
        *,
        finished: Iterable[str] = (),
        new_blocks: Mapping[str, Sequence[int]] | None = None,
        resumed: Mapping[str, Sequence[int]] | None = None,
        fresh: Iterable[int] | None = None,
        evicted: Iterable[int] = (),
    ) -> StepReply:
        """Sends one scheduling iteration's block events and applies the reply.

        Args:
            finished: Request ids that finished or were preempted (blocks released).
            new_blocks: Request id -> logical ids appended this step.
            resumed: Request id -> full new block list of a resumed request (replaces).
            fresh: Logical ids among the new/resumed ones that hold no data yet; None:
                every newly live block without prefix caching, none with it.
            evicted: Logical ids dropped from the prefix cache.

        Returns:
            The step's reply; its mapping changes are already in the mirror.

        Raises:
            InvalidArgument: A field is malformed (nothing changed on either side).
            MessageTooLarge: The step exceeds ``max_message_bytes`` (nothing changed).
            EngineUnhealthy: The server's engine failed a KV move; ``reset()`` recovers.
            EpochMismatch: The server restarted or was reset under this client.
            MirrorDiverged: The reply does not match the mirror.
            ServiceUnavailable: No reply within ``timeout_s``; the step stays pending
                and is resent (exactly once on the server) before the next one.
            DefragError: Any other refusal (``OutOfOrder``, ``SessionConflict``).
        """
        events = StepEvents.build(
            finished=finished,
            new_blocks=new_blocks,
            resumed=resumed,
            fresh=fresh,
            evicted=evicted,
        )
        return self.step_events(events)

    def step_events(self, events: StepEvents) -> StepReply:
        """``step()`` with the events already built (see ``kvdefrag.client.vllm``)."""
        with self._lock:
            self._check_usable()
            deadline = self._deadline()
            if self._pending is not None:
                earlier = self._pending
                self._complete(earlier, deadline, "earlier unacknowledged step")
                self._record(earlier.events)
            if self._mirror is None:
                self._ensure_stream(deadline)  # seq and epoch come from the session
            request = _convert.step_request(self._next_seq, self._epoch, events)
            message = _convert.stream_step(request)
            size_bytes = _convert.message_size(message)
            if size_bytes > self.max_message_bytes:
                raise MessageTooLarge(
                    f"step seq {self._next_seq}: message of {size_bytes} bytes exceeds "
                    f"max_message_bytes ({self.max_message_bytes})"
                )
            self._pending = _PendingStep(self._next_seq, events, message)
            reply = self._complete(self._pending, deadline, "step")
            self._record(events)
            return reply

    def _record(self, events: StepEvents) -> None:
        """Appends a step the server applied to the trace, when recording."""
        if self._recorder is not None:
            self._recorder.record_events(events)

    def _complete(self, pending: _PendingStep, deadline: float, what: str) -> StepReply:
        """Sends a pending step until its reply arrives, reconnecting when the stream breaks."""
        context = f"{what} seq {pending.seq}"
        backoff_s = _BACKOFF_START_S
        while True:
            try:
                stream = self._ensure_stream(deadline)
            except ServiceUnavailable:
                raise  # the step stays pending
            except DefragError:
                self._pending = None
                raise
            stream.send(pending.message)
            pending.is_sent = True
            try:
                reply = stream.receive(deadline - time.monotonic())
            except ReplyTimeout:
                self._drop_stream(cancel=True)
                raise ServiceUnavailable(
                    f"{context}: no reply from {self.address} within {self.timeout_s} s; "
                    "the step stays pending and is resent (applied once) before the next step"
                ) from None
            except StreamEnded as ended:
                self._drop_stream(cancel=False)
                if self._is_transient(ended.error, reopening=False):
                    _LOGGER.warning(
                        "%s: the stream to %s broke (%s); reconnecting",
                        context,
                        self.address,
                        _convert.describe(ended.error),
                    )
                    if time.monotonic() + backoff_s < deadline:
                        time.sleep(backoff_s)
                        backoff_s = min(2 * backoff_s, _BACKOFF_MAX_S)
                        continue
                    raise ServiceUnavailable(
                        f"{context}: the stream to {self.address} kept breaking for "
                        f"{self.timeout_s} s; the step stays pending and is resent (applied "
                        "once) before the next step"
                    ) from ended.error
                self._pending = None
                raise self._definitive_error(ended.error, context) from ended.error
            kind, body = _convert.stream_reply(reply)
            if kind != "step":
                self._drop_stream(cancel=True)
                self._pending = None
                raise self._diverged(f"{context}: the server answered {kind!r}, not a step")
            return self._accept(pending, body, context)

    def _accept(self, pending: _PendingStep, body: Any, context: str) -> StepReply:
        mirror = self._require_mirror()
        self._pending = None
        if body.seq != pending.seq or body.epoch != self._epoch:
            raise self._diverged(
                f"{context}: the reply is for seq {body.seq} of epoch {body.epoch}, "
                f"expected seq {pending.seq} of epoch {self._epoch}"
            )
        logical_ids, physical_ids = _convert.step_deltas(body)
        try:
            digest = mirror.apply_step(pending.events, logical_ids, physical_ids)
        except InvalidArgument as err:
            raise self._diverged(f"{context}: {err}") from err
        self._next_seq = pending.seq + 1
        if digest != body.digest:
            raise self._diverged(
                f"{context}: the mirror's digest {digest:#018x} differs from the server's "
                f"{body.digest:#018x}"
            )
        return _convert.step_reply(body, dict(zip(logical_ids, physical_ids, strict=True)))

    # --- the stream -------------------------------------------------------------------
    def _ensure_stream(self, deadline: float) -> Stream:
        stream = self._stream
        if stream is not None and stream.is_idle_and_open:
            return stream
        self._drop_stream(cancel=True)
        return self._open_stream(deadline)

    def _open_stream(self, deadline: float) -> Stream:
        """Opens a stream session and checks (or, for a fresh client, adopts) its state."""
        backoff_s = _BACKOFF_START_S
        while True:
            message = _convert.stream_open(self._epoch, self.prefix_caching, self.client_name)
            stream = Stream(self._stub, message)
            try:
                reply = stream.receive(deadline - time.monotonic())
            except ReplyTimeout:
                stream.cancel()
                raise ServiceUnavailable(
                    f"open session: no answer from {self.address} within {self.timeout_s} s"
                ) from None
            except StreamEnded as ended:
                stream.cancel()
                if (
                    self._is_transient(ended.error, reopening=self._has_had_session)
                    and time.monotonic() + backoff_s < deadline
                ):
                    time.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, _BACKOFF_MAX_S)
                    continue
                if self._is_transient(ended.error, reopening=False):
                    raise ServiceUnavailable(
                        f"open session: the stream to {self.address} kept breaking for "
                        f"{self.timeout_s} s"
                    ) from ended.error
                raise self._definitive_error(ended.error, "open session") from ended.error
            try:
                self._adopt_session(reply)
            except BaseException:
                stream.cancel()
                raise
            self._stream = stream
            self._has_had_session = True
            return stream

    def _adopt_session(self, reply: Any) -> None:
        kind, body = _convert.stream_reply(reply)
        if kind != "opened":
            raise DefragError(f"open session: the server answered {kind!r}, not 'opened'")
        info = _convert.session_info(body)
        if info.prefix_caching != self.prefix_caching:
            raise SessionConflict(
                f"open session: the server runs with prefix_caching={info.prefix_caching}, "
                f"this client asked for {self.prefix_caching}"
            )
        if self._epoch == 0:
            # NOTE: an epoch at seq 1 with an empty digest has applied nothing: identity.
            is_pristine = info.next_seq == 1 and info.digest == 0
            mirror = Mirror(info.num_blocks) if is_pristine else self._fetch_mirror(info)
            if not is_pristine:
                _LOGGER.info(
                    "adopted the state of %s: epoch %d, seq %d, %d requests",
                    self.address,
                    info.epoch,
                    info.next_seq,
                    len(mirror.requests),
                )
            self._session, self._epoch, self._next_seq = info, info.epoch, info.next_seq
            self._mirror = mirror
            return
        mirror = self._require_mirror()
        expected_seq = self._next_seq
        if info.epoch != self._epoch:
            raise self._epoch_error(f"open session: the server is at epoch {info.epoch}")
        if info.num_blocks != mirror.num_blocks:
            raise self._diverged(
                f"open session: the server has {info.num_blocks} blocks, the mirror "
                f"{mirror.num_blocks}"
            )
        if info.next_seq == expected_seq:
            if info.digest != mirror.digest:
                raise self._diverged(
                    f"open session: server digest {info.digest:#018x} at seq "
                    f"{info.next_seq - 1}, mirror digest {mirror.digest:#018x}"
                )
        elif not (
            self._pending is not None
            and self._pending.is_sent
            and info.next_seq == expected_seq + 1
        ):
            raise self._diverged(
                f"open session: the server expects seq {info.next_seq} but this client is "
                f"at seq {expected_seq}: another writer changed the server's state"
            )
        self._session = info

    def _fetch_mirror(self, info: SessionInfo) -> Mirror:
        """Builds a mirror from the server's tables (call while holding the session)."""
        epoch, requests = _convert.request_lists(
            self._unary("ListRequests", _convert.list_requests_request(), "rebuild mirror")
        )
        fwd: list[int] = []
        for start in range(0, info.num_blocks, _RESOLVE_CHUNK):
            ids = list(range(start, min(start + _RESOLVE_CHUNK, info.num_blocks)))
            resolve_epoch, physical_ids = _convert.resolved_ids(
                self._unary("Resolve", _convert.resolve_request(ids), "rebuild mirror")
            )
            if resolve_epoch != info.epoch:
                epoch = resolve_epoch
            fwd += physical_ids
        if epoch != info.epoch:
            raise MirrorDiverged(
                f"rebuild mirror: the server moved from epoch {info.epoch} to {epoch} "
                "meanwhile (reset by someone else); try again"
            )
        try:
            mirror = Mirror.from_tables(fwd, requests)
        except InvalidArgument as err:
            raise MirrorDiverged(f"rebuild mirror: {err}") from err
        if mirror.digest != info.digest:
            raise MirrorDiverged(
                f"rebuild mirror: the tables' digest {mirror.digest:#018x} differs from the "
                f"server's {info.digest:#018x}"
            )
        return mirror

    def _drop_stream(self, *, cancel: bool) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if cancel:
            stream.cancel()
        else:
            stream.close(self.timeout_s)

    @staticmethod
    def _is_transient(error: BaseException | None, *, reopening: bool) -> bool:
        """True for a broken transport (and, when reopening, our own stale session)."""
        if error is None:
            return True
        if not isinstance(error, grpc.RpcError):
            return False
        if _convert.is_transport_failure(error):
            return True
        # NOTE: after a cut, the server may not have noticed yet that our old stream
        # ended, so for a moment it still counts it as the open session.
        return reopening and _convert.error_class(error) is SessionConflict

    def _definitive_error(self, error: BaseException | None, context: str) -> DefragError:
        if not isinstance(error, grpc.RpcError):
            return DefragError(f"{context}: the stream failed: {error!r}")
        mapped = _convert.defrag_error(error, context)
        if isinstance(mapped, EpochMismatch):
            return self._epoch_error(str(mapped))
        return mapped

    def _epoch_error(self, message: str) -> EpochMismatch:
        err = EpochMismatch(
            f"{message}; this client's mirror belongs to epoch {self._epoch}: the server "
            "restarted or was reset, so its mapping and KV data are new. Drop the "
            "scheduler's requests and call reset() (or rebuild_mirror() to adopt the "
            "server's state)"
        )
        self._unusable = err
        self._pending = None
        return err

    def _diverged(self, message: str) -> MirrorDiverged:
        err = MirrorDiverged(
            f"{message}; the mirror can no longer be trusted: call rebuild_mirror() or reset()"
        )
        self._unusable = err
        return err

    def _check_usable(self) -> None:
        if self._is_closed:
            raise DefragError(f"DefragClient for {self.address} is closed")
        if self._unusable is not None:
            raise type(self._unusable)(str(self._unusable))

    def _require_mirror(self) -> Mirror:
        if self._mirror is None:
            raise DefragError(
                f"DefragClient for {self.address} has no mirror: its last (re)connect "
                "failed; step(), rebuild_mirror() or reset() connects again"
            )
        return self._mirror

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    # --- local reads ------------------------------------------------------------------
    def resolve(self, logical_ids: Iterable[int]) -> list[int]:
        """Maps logical ids to physical ids from the mirror (no round trip).

        Raises:
            InvalidArgument: An id is not an integer or is outside ``[0, num_blocks)``.
            EpochMismatch, MirrorDiverged: The mirror is stale.
        """
        with self._lock:
            self._check_usable()
            return self._require_mirror().resolve(logical_ids)

    def resolve_tables(self, tables: Iterable[Iterable[int]]) -> list[list[int]]:
        """Maps every block table (logical ids per request) to physical ids, locally."""
        with self._lock:
            self._check_usable()
            return self._require_mirror().resolve_tables(tables)

    # --- unary calls ------------------------------------------------------------------
    def _unary(self, method: str, request: Any, context: str, *, is_idempotent: bool = True) -> Any:
        """Calls a unary RPC within ``timeout_s``, retrying a broken transport if idempotent.

        NOTE: a call can fail on a connection that broke a moment ago (a cut, a server
        restart) before the channel noticed; reads and Defragment are safe to repeat,
        Reset is not (a second one would start yet another epoch).
        """
        deadline = self._deadline()
        backoff_s = _BACKOFF_START_S
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(deadline - time.monotonic(), 0.0), wait_for_ready=True
                )
            except grpc.RpcError as err:
                if (
                    is_idempotent
                    and _convert.is_transport_failure(err)
                    and time.monotonic() + backoff_s < deadline
                ):
                    time.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, _BACKOFF_MAX_S)
                    continue
                raise _convert.defrag_error(err, context) from err

    def stats(self) -> ServiceStats:
        """Fetches the server's statistics and session state (``GetStats``)."""
        return _convert.service_stats(
            self._unary("GetStats", _convert.get_stats_request(), "stats")
        )

    def list_requests(self) -> dict[str, list[int]]:
        """Fetches every running request's logical block ids from the server."""
        return _convert.request_lists(
            self._unary("ListRequests", _convert.list_requests_request(), "list requests")
        )[1]

    def defragment(self) -> None:
        """Makes the server compact the pool in the next step, whatever the threshold."""
        self._unary("Defragment", _convert.defragment_request(), "defragment")

    def audit(self, *, strict: bool = False) -> AuditReport:
        """Compares the client's live requests and digest with the server's.

        Args:
            strict: Raise instead of returning a report with differences.

        Raises:
            MirrorDiverged: ``strict`` and the two sides differ.
        """
        with self._lock:
            stats = self.stats()
            epoch, server_requests = _convert.request_lists(
                self._unary("ListRequests", _convert.list_requests_request(), "audit")
            )
            mirror = self._require_mirror()
            report = AuditReport.compare(
                epoch=epoch,
                client_epoch=self._epoch,
                client_requests=mirror.requests,
                server_requests=server_requests,
                client_digest=mirror.digest,
                server_digest=stats.digest,
            )
        if strict and not report.is_consistent:
            raise MirrorDiverged(f"audit: {report.describe()}")
        return report

    # --- recovery ---------------------------------------------------------------------
    def rebuild_mirror(self) -> None:
        """Adopts the server's current state: epoch, seq, mapping and requests.

        Reopens the session as a fresh client and fetches the server's tables while
        holding it, so no other writer can change them meanwhile. A pending step is
        dropped: the server's tables say whether it was applied.
        """
        with self._lock:
            self._check_open()
            self._drop_stream(cancel=False)
            self._forget_state()
            self._open_stream(self._deadline())

    def reset(self) -> None:
        """Resets the server (new epoch, identity mapping, healthy) and the mirror.

        The scheduler must drop its requests and prefix cache too: the KV data stays
        where it is but no longer belongs to anyone.
        """
        with self._lock:
            self._check_open()
            self._drop_stream(cancel=False)
            epoch = 0 if self._unusable is not None else self._epoch
            self._unary(
                "Reset",
                _convert.reset_request(epoch, self.prefix_caching),
                "reset",
                is_idempotent=False,
            )
            self._forget_state()
            self._open_stream(self._deadline())

    def _forget_state(self) -> None:
        self._epoch = 0
        self._next_seq = 1
        self._mirror = None
        self._pending = None
        self._unusable = None

    def _check_open(self) -> None:
        if self._is_closed:
            raise DefragError(f"DefragClient for {self.address} is closed")

    # --- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Ends the session and closes the channel (idempotent)."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            try:
                self._drop_stream(cancel=False)
            finally:
                self._channel.close()
                if self._recorder is not None:
                    self._recorder.close()

    def __enter__(self) -> DefragClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
