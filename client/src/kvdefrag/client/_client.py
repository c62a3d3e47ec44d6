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

The pending-step contract, for a scheduler that calls ``step()`` once per iteration:

* ``step()`` returns: the step was applied once; its mapping is in the mirror.
* ``step()`` raises ``StepOutcomeUnknown`` (a ``ServiceUnavailable``): no reply within
  ``timeout_s``; the server may have applied the step and moved KV data. The step is
  pending. ``complete_pending_step()`` sends it again (retry it until it returns, or give
  up with ``reset()``); the server applies it at most once and the reply is the same.
* While a step is pending, ``step()`` raises ``StepPending`` without sending the new
  events, and ``resolve``/``resolve_tables``/``live_requests`` raise ``StepPending``
  instead of answering from a mirror the pending step may have changed. So the caller's
  events are never dropped silently and never applied twice: calling ``step()`` again
  with the same events is refused, not duplicated.
* Any other error: the step was refused and nothing changed (or, for ``EpochMismatch``
  and ``MirrorDiverged``, the client needs ``reset()`` or ``rebuild_mirror()``).
* ``EngineUnhealthy``: a KV move failed on the server. The step may have been applied
  without its compaction (its placements included), so the mirror may be stale: reads
  and steps raise ``EngineUnhealthy`` until ``rebuild_mirror()`` or ``reset()``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvdefrag.client import _convert
from kvdefrag.client._channel import BACKOFF_MAX_S, BACKOFF_START_S, call_unary, open_channel
from kvdefrag.client._rebuild import fetch_requests
from kvdefrag.client._session import StepSession
from kvdefrag.client._types import AuditReport, ServiceStats, StepReply
from kvdefrag.client.record import StepRecorder
from kvdefrag.common import (
    DefragError,
    InvalidArgument,
    MirrorDiverged,
    SessionConflict,
    StepEvents,
    StepInFlight,
)
from kvdefrag.common._exit import call_at_exit
from kvdefrag.common.durations import check_duration
from kvdefrag.common.events import require_step_events

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_MESSAGE_BYTES_LIMIT = 2**31 - 1  # gRPC keeps message limits in a C int
# At interpreter exit, how long closing waits for a step running in another thread.
_EXIT_LOCK_WAIT_S = 1.0


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
        ...     reply = client.step(StepEvents(new_blocks={"req-a": [5, 9]}))
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
        keep_mirror: bool = True,
    ) -> None:
        """Connects and opens the step session.

        Args:
            address: ``unix:/abs/path.sock`` or ``HOST:PORT``.
            prefix_caching: The scheduler's prefix caching mode; the server's engine is
                switched to it if it holds no state, refused otherwise.
            timeout_s: Deadline of every call, and of every step including reconnects:
                ``(0, MAX_DURATION_S]`` seconds (a day).
            client_name: A name for the server's logs and errors (host:pid by default).
            root_certificates: PEM CA bundle; any TLS argument makes the channel TLS.
            private_key: PEM client key (mTLS).
            certificate_chain: PEM client certificate chain (mTLS).
            max_message_bytes: Largest message sent or received (match the server's).
            interceptors: ``grpc`` client interceptors (tracing, tests).
            record_to: A JSON-lines file that receives every step the server applied,
                for ``kvdefrag replay`` (offline tuning).
            keep_mirror: Keep a local copy of the mapping (``resolve``,
                ``live_requests``, ``audit`` and a digest check of every reply). False
                keeps only the digest of the last reply, for a writer that never
                resolves through the client and checks the digests itself (the vLLM
                scheduler compares its ranks'); those reads are then refused.

        Raises:
            InvalidArgument: A setting is out of range.
            SessionConflict: Another writer holds the server's session.
            ServiceUnavailable: The server did not answer within ``timeout_s``.
            DefragError: Any other refusal of the session.
        """
        self._timeout_s = check_duration("timeout_s", timeout_s)
        if not 1024 <= max_message_bytes <= MAX_MESSAGE_BYTES_LIMIT:
            raise InvalidArgument(
                f"max_message_bytes must be >= 1024 and <= {MAX_MESSAGE_BYTES_LIMIT} (gRPC's "
                f"limit), got {max_message_bytes}"
            )
        self.address = address
        self.prefix_caching = prefix_caching
        self.client_name = client_name or _default_client_name()
        self.max_message_bytes = max_message_bytes
        self.keep_mirror = keep_mirror
        channel = open_channel(
            address,
            max_message_bytes=max_message_bytes,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
        )
        self._channel: grpc.Channel = channel
        if interceptors:
            channel = grpc.intercept_channel(channel, *interceptors)
        self._stub = _convert.stub(channel)
        self._lock = threading.RLock()
        # NOTE: the session reads this client's settings live, so a changed timeout_s
        # applies to the next step.
        self._session = StepSession(self, self._stub)
        self._is_closed = False
        self._recorder: StepRecorder | None = None
        try:
            with self._lock:
                self._session.open_stream(self._deadline())
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
        call_at_exit(self._close_at_exit)

    # --- properties -------------------------------------------------------------------
    @property
    def timeout_s(self) -> float:
        """Deadline of every call and step, in seconds: ``(0, MAX_DURATION_S]`` (a day).

        Settable; a new value applies from the next call.

        Raises:
            InvalidArgument: (on set) The value is out of range; the old one stays.
        """
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, timeout_s: float) -> None:
        self._timeout_s = check_duration("timeout_s", timeout_s)

    @property
    def epoch(self) -> int:
        """The server epoch the mirror belongs to."""
        return self._session.epoch

    @property
    def next_seq(self) -> int:
        """The seq of the next step (or of the pending one)."""
        return self._session.next_seq

    @property
    def num_blocks(self) -> int:
        """Blocks in the server's pool, null block included."""
        return self._session.require_mirror().num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block of the server's KV cache (0 before the first session)."""
        info = self._session.info
        return info.block_size if info is not None else 0

    @property
    def digest(self) -> int:
        """Digest of the mirror's live mapping (without a mirror: the last reply's).

        Raises:
            StepPending: A step's outcome is unknown (see ``complete_pending_step()``).
            EngineUnhealthy, EpochMismatch, MirrorDiverged: The mirror may be stale.
        """
        with self._lock:
            self._session.check_usable()
            return self._session.require_settled_digest("digest").digest

    @property
    def has_pending_step(self) -> bool:
        """True when a step's outcome is unknown (see ``complete_pending_step()``)."""
        return self._session.has_pending_step

    @property
    def pending_seq(self) -> int | None:
        """The seq of the pending step, None when no step is pending."""
        return self._session.pending_seq

    def live_requests(self) -> dict[str, list[int]]:
        """The client's view of running requests: request id -> logical block ids.

        Raises:
            StepPending: A step's outcome is unknown (see ``complete_pending_step()``).
            EngineUnhealthy, EpochMismatch, MirrorDiverged: The mirror may be stale.
        """
        with self._lock:
            requests = self._session.require_readable_mirror("live_requests").requests
            return {rid: list(ids) for rid, ids in requests.items()}

    # --- the step ---------------------------------------------------------------------
    def step(self, events: StepEvents, /) -> StepReply:
        """Sends one scheduling iteration's block events and applies the reply.

        ``events`` was type-checked when it was made (``StepEvents``) and is sent as it
        is: leave it unchanged, it is kept until the reply is applied.

        Args:
            events: The step's events.

        Returns:
            The step's reply; its mapping changes are already in the mirror.

        Raises:
            StepPending: An earlier step is pending: these events were NOT sent; call
                ``complete_pending_step()`` and send them again.
            StepOutcomeUnknown: No reply within ``timeout_s``: the step is pending (the
                server may have applied it); call ``complete_pending_step()``.
            InvalidArgument: ``events`` is not a ``StepEvents`` (nothing changed on
                either side).
            MessageTooLarge: The step exceeds ``max_message_bytes`` (nothing changed).
            EngineUnhealthy: The server's engine failed a KV move; ``reset()`` recovers.
            EpochMismatch: The server restarted or was reset under this client.
            MirrorDiverged: The reply does not match the mirror.
            DefragError: Any other refusal (``OutOfOrder``, ``SessionConflict``).
        """
        events = require_step_events(events)
        with self._lock:
            self._check_usable()
            reply = self._session.send_step(events, self._deadline())
            self._record(events)
            return reply

    def complete_pending_step(self) -> StepReply | None:
        """Sends the pending step again until the server answers; applies its reply.

        The server applies a step at most once (a resent, already applied seq is answered
        from its replay cache), so this is safe to call again after it fails.

        Returns:
            The pending step's reply (its mapping now in the mirror), or None when no step
            was pending.

        Raises:
            StepOutcomeUnknown: Still no reply within ``timeout_s``; still pending.
            DefragError: The server refused the step (it is no longer pending), or the
                session needs ``reset()``/``rebuild_mirror()`` (see ``step()``).
        """
        with self._lock:
            self._check_usable()
            completed = self._session.complete_pending(self._deadline())
            if completed is None:
                return None
            events, reply = completed
            self._record(events)
            return reply

    def _record(self, events: StepEvents) -> None:
        """Appends a step the server applied to the trace, when recording."""
        if self._recorder is not None:
            self._recorder.record(events)

    def _check_usable(self) -> None:
        self._check_open()
        self._session.check_usable()

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    # --- local reads ------------------------------------------------------------------
    def resolve(self, logical_ids: Iterable[int]) -> list[int]:
        """Maps logical ids to physical ids from the mirror (no round trip).

        Raises:
            InvalidArgument: An id is not an integer or is outside ``[0, num_blocks)``.
            StepPending: A step's outcome is unknown (see ``complete_pending_step()``).
            EngineUnhealthy, EpochMismatch, MirrorDiverged: The mirror may be stale
                (``rebuild_mirror()`` or ``reset()`` recovers).
        """
        with self._lock:
            self._check_open()
            return self._session.require_readable_mirror("resolve").resolve(logical_ids)

    def resolve_tables(self, tables: Iterable[Iterable[int]]) -> list[list[int]]:
        """Maps every block table (logical ids per request) to physical ids, locally.

        Raises:
            StepPending: A step's outcome is unknown (see ``complete_pending_step()``).
            EngineUnhealthy, EpochMismatch, MirrorDiverged: The mirror may be stale.
        """
        with self._lock:
            self._check_open()
            mirror = self._session.require_readable_mirror("resolve_tables")
            return mirror.resolve_tables(tables)

    # --- unary calls ------------------------------------------------------------------
    def _unary(self, method: str, request: Any, context: str, *, is_idempotent: bool = True) -> Any:
        """Calls a unary RPC within ``timeout_s`` (see ``_channel.call_unary``)."""
        return call_unary(
            self._stub,
            method,
            request,
            context,
            timeout_s=self.timeout_s,
            is_idempotent=is_idempotent,
        )

    def probe_connection(self, timeout_s: float) -> str | None:
        """Says why nobody serves the address now, if that is so, without waiting for it.

        One ``GetStats`` call on this client's channel, without gRPC's wait-for-ready and
        without a retry, so it may run while another thread sends a step. A connection
        that fails (no socket file, connection refused, a server stopping) fails the call
        at once.

        Args:
            timeout_s: Deadline of the call.

        Returns:
            gRPC's reason when the connection failed; None when the server answered
            (its stats, or any kvdefrag error) or did not answer within ``timeout_s``
            (busy, or a peer that drops packets: nothing known).

        Raises:
            InvalidArgument: ``timeout_s`` is not a duration.
        """
        timeout_s = check_duration("timeout_s", timeout_s)
        self._check_open()
        try:
            self._stub.GetStats(
                _convert.get_stats_request(), timeout=timeout_s, wait_for_ready=False
            )
        except grpc.RpcError as err:
            if _convert.is_connection_failure(err):
                return _convert.describe(err)
        return None

    def stats(self) -> ServiceStats:
        """Fetches the server's statistics and session state (``GetStats``)."""
        return _convert.service_stats(
            self._unary("GetStats", _convert.get_stats_request(), "stats")
        )

    def list_requests(self) -> dict[str, list[int]]:
        """Fetches every running request's logical block ids from the server (page by
        page; a listing that a step invalidates starts again)."""
        return fetch_requests(self._stub, "list requests", timeout_s=self.timeout_s)[1]

    def defragment(self) -> None:
        """Makes the server compact the pool in the next step, whatever the threshold."""
        self._unary("Defragment", _convert.defragment_request(), "defragment")

    def audit(self, *, strict: bool = False) -> AuditReport:
        """Compares the client's live requests and digest with the server's.

        Args:
            strict: Raise instead of returning a report with differences.

        Raises:
            MirrorDiverged: ``strict`` and the two sides differ.
            StepPending: A step's outcome is unknown (see ``complete_pending_step()``).
        """
        with self._lock:
            stats = self.stats()
            epoch, server_requests = fetch_requests(self._stub, "audit", timeout_s=self.timeout_s)
            mirror = self._session.require_settled_mirror("audit")
            report = AuditReport.compare(
                epoch=epoch,
                client_epoch=self._session.epoch,
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
            self._session.drop_stream(cancel=False)
            self._session.forget_state()
            self._session.open_stream(self._deadline())

    def reset(self, *, force: bool = False) -> None:
        """Resets the server (new epoch, identity mapping, healthy) and the mirror.

        The scheduler must drop its requests and prefix cache too: the KV data stays
        where it is but no longer belongs to anyone. This client ends its own session
        first; the server refuses a reset while another writer's session is open
        (``SessionConflict``: a running vLLM would go on with the old mapping).

        Args:
            force: Reset even while another writer's session is open, ending it. That
                writer (a vLLM scheduler and its workers) is then stale: restart vLLM.

        Raises:
            SessionConflict: Another writer's session is open and ``force`` is not set.
            ServiceUnavailable: No answer within ``timeout_s`` (``StepInFlight``: the
                server was still applying a step; nothing changed).
        """
        with self._lock:
            self._check_open()
            self._session.drop_stream(cancel=False)
            had_session = self._session.has_had_session
            epoch = 0 if self._session.is_unusable else self._session.epoch
            deadline = self._deadline()
            backoff_s = BACKOFF_START_S
            while True:
                try:
                    self._unary(
                        "Reset",
                        _convert.reset_request(epoch, self.prefix_caching, force),
                        "reset",
                        is_idempotent=False,
                    )
                    break
                except (SessionConflict, StepInFlight):
                    # NOTE: the session the server still holds may be this client's own
                    # (its stream cut while a step ran, not yet noticed), or the server
                    # is finishing a step; neither changed anything, so try again.
                    if not had_session or time.monotonic() + backoff_s >= deadline:
                        raise
                    time.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, BACKOFF_MAX_S)
            self._session.forget_state()
            self._session.open_stream(self._deadline())

    def _check_open(self) -> None:
        if self._is_closed:
            raise DefragError(f"DefragClient for {self.address} is closed")

    # --- lifetime ---------------------------------------------------------------------
    def close(self, *, wait_s: float | None = None) -> None:
        """Ends the session and closes the channel (idempotent).

        Args:
            wait_s: How long to wait for a step another thread is sending; None: until it
                ends. Past that the channel is closed under it: its call is cancelled, it
                fails in that thread, and nobody waits for it (its outcome stays unknown).
        """
        if wait_s is None:
            self._close(cancel=False)
            return
        if not self._lock.acquire(timeout=check_duration("wait_s", wait_s, allow_zero=True)):
            self._is_closed = True
            self._channel.close()
            return
        try:
            self._close(cancel=False)
        finally:
            self._lock.release()

    def _close(self, *, cancel: bool) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            try:
                self._session.drop_stream(cancel=cancel)
            finally:
                self._channel.close()
                if self._recorder is not None:
                    self._recorder.close()

    def _close_at_exit(self) -> None:
        """Ends the session at interpreter exit without waiting for the server.

        NOTE: a step still running in another thread holds the lock; closing the
        channel under it cancels that step's call, and nobody waits for it.
        """
        if not self._lock.acquire(timeout=_EXIT_LOCK_WAIT_S):
            self._channel.close()
            return
        try:
            self._close(cancel=True)
        finally:
            self._lock.release()

    def __enter__(self) -> DefragClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
