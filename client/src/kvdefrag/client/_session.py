"""StepSession: the client's step stream to one server, with the mirror it keeps in step.

Opening a session checks the server's state against the mirror (or, for a fresh client,
adopts it); a step is sent until its reply arrives, reopening the stream when it breaks::

    send_step() -> [pending seq N] -> Stream --StepRequest--> server
                         ^                                      |
    mirror.apply_step <--+-------------- StepResponse <---------+

The pending-step contract: a step whose reply does not arrive by the deadline stays
*pending* (``StepOutcomeUnknown``). While it is, ``send_step`` refuses new events without
sending them and ``require_settled_mirror`` refuses reads (``StepPending``); only
``complete_pending`` sends it again, and the server's replay cache makes that exactly once.
A server busy with that step answers a resend ``StepInFlight`` at once; the session
retries it with backoff until the deadline, and the step stays pending.

After ``EngineUnhealthy`` the failed step may have been applied (its placements
included) while the mirror did not change, so the session is unusable: reads and steps
are refused until ``forget_state()`` (``rebuild_mirror()`` or ``reset()``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

import grpc

from kvdefrag.client import _convert
from kvdefrag.client._channel import BACKOFF_MAX_S, BACKOFF_START_S
from kvdefrag.client._mirror import Mirror, ServerDigest
from kvdefrag.client._rebuild import fetch_mirror
from kvdefrag.client._stream import ReplyTimeout, Stream, StreamEnded
from kvdefrag.client._types import SessionInfo, StepReply
from kvdefrag.common import (
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    MirrorDiverged,
    OutOfOrder,
    ServiceUnavailable,
    SessionConflict,
    StepEvents,
    StepInFlight,
    StepOutcomeUnknown,
    StepPending,
)

_LOGGER = logging.getLogger(__name__)


class SessionSettings(Protocol):
    """The client settings a session reads, live (a changed ``timeout_s`` applies at once)."""

    address: str
    prefix_caching: bool
    timeout_s: float
    client_name: str
    max_message_bytes: int
    keep_mirror: bool


@dataclasses.dataclass
class _PendingStep:
    """A step whose reply has not arrived (it may have been applied already)."""

    seq: int
    events: StepEvents
    message: Any


class StepSession:
    """The step session with one server: its stream, epoch, seq, mirror and pending step.

    Invariants: while the session is usable (``check_usable()`` passes), the mirror equals
    the server's mapping as of the last acknowledged step; ``next_seq`` is the seq of the
    next step to send (or of the pending one); at most one step is pending. Epoch 0 means
    no session was adopted yet: the next open adopts the server's state.

    Not thread-safe: its owner serialises every call.
    """

    def __init__(self, settings: SessionSettings, stub: Any) -> None:
        """Creates a session that is not open yet (``open_stream()`` opens it).

        Args:
            settings: The owning client's settings, read at every use.
            stub: The service stub the stream and the mirror's rebuild calls go through.
        """
        self._settings = settings
        self._stub = stub
        self._stream: Stream | None = None
        self._has_had_session = False
        self._epoch = 0
        self._next_seq = 1
        self._mirror: Mirror | ServerDigest | None = None
        self._info: SessionInfo | None = None
        self._pending: _PendingStep | None = None
        self._unusable: DefragError | None = None

    # --- state ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The server epoch the mirror belongs to (0 before the first session)."""
        return self._epoch

    @property
    def next_seq(self) -> int:
        """The seq of the next step (or of the pending one)."""
        return self._next_seq

    @property
    def info(self) -> SessionInfo | None:
        """What the server said when the session last opened; None before that."""
        return self._info

    @property
    def has_pending_step(self) -> bool:
        """True when a step went unacknowledged; ``complete_pending()`` sends it again."""
        return self._pending is not None

    @property
    def has_had_session(self) -> bool:
        """True once a session was opened (the server may still hold it after a cut)."""
        return self._has_had_session

    @property
    def is_unusable(self) -> bool:
        """True after an epoch mismatch, a divergence or an engine failure, until
        ``forget_state()``."""
        return self._unusable is not None

    def check_usable(self) -> None:
        """Raises (a fresh copy of) the error that made the session unusable, if any."""
        if self._unusable is not None:
            raise type(self._unusable)(str(self._unusable))

    @property
    def pending_seq(self) -> int | None:
        """The seq of the pending step, None without one."""
        return None if self._pending is None else self._pending.seq

    def require_readable_mirror(self, what: str) -> Mirror:
        """Returns the mirror for a read the caller acts on (``resolve``, ...).

        Raises:
            StepPending: A step's outcome is unknown.
            EngineUnhealthy, EpochMismatch, MirrorDiverged: The session is unusable (the
                mirror may be stale): ``rebuild_mirror()`` or ``reset()`` first.
            InvalidArgument: The client keeps no mirror.
        """
        self.check_usable()
        return self.require_settled_mirror(what)

    def require_settled_mirror(self, what: str) -> Mirror:
        """Returns the mirror if no step's outcome is unknown; else raises ``StepPending``.

        Raises:
            InvalidArgument: The client keeps no mirror (``keep_mirror=False``).
        """
        known = self.require_settled_digest(what)
        if not isinstance(known, Mirror):
            raise InvalidArgument(
                f"{what}: this client keeps no mirror (keep_mirror=False); ask the server "
                "(list_requests(), stats()) or open a client with keep_mirror=True"
            )
        return known

    def require_settled_digest(self, what: str) -> Mirror | ServerDigest:
        """What the client knows of the server's mapping (its mirror, or only the digest),
        if no step's outcome is unknown; else raises ``StepPending``."""
        if self._pending is not None:
            seq = self._pending.seq
            raise StepPending(
                f"{what}: refused: the outcome of step seq {seq} is unknown (it is pending), "
                "so the mirror may be stale; call complete_pending_step() first",
                pending_seq=seq,
            )
        return self.require_mirror()

    def require_mirror(self) -> Mirror | ServerDigest:
        """Returns the mirror (only the digest when the client keeps none), or raises
        when the last (re)connect failed to set one up."""
        if self._mirror is None:
            raise DefragError(
                f"DefragClient for {self._settings.address} has no mirror: its last "
                "(re)connect failed; step(), rebuild_mirror() or reset() connects again"
            )
        return self._mirror

    def forget_state(self) -> None:
        """Forgets epoch, seq, mirror and pending step: the next open adopts the server's."""
        self._epoch = 0
        self._next_seq = 1
        self._mirror = None
        self._pending = None
        self._unusable = None

    # --- the step ---------------------------------------------------------------------
    def complete_pending(self, deadline: float) -> tuple[StepEvents, StepReply] | None:
        """Sends the pending step again until its reply arrives, if there is one.

        Returns:
            The step's events and reply, or None when no step was pending.

        Raises:
            StepOutcomeUnknown: Still no reply by ``deadline``; the step stays pending.
            DefragError: The server refused it (see ``DefragClient.step``).
        """
        if self._pending is None:
            return None
        pending = self._pending
        return pending.events, self._complete(pending, deadline, "pending step")

    def send_step(self, events: StepEvents, deadline: float) -> StepReply:
        """Sends a step and applies its reply to the mirror.

        Raises:
            StepPending: An earlier step is pending; these events were not sent.
            MessageTooLarge: The step exceeds ``max_message_bytes`` (nothing changed).
            StepOutcomeUnknown: No reply by ``deadline``; the step stays pending.
            DefragError: Any other refusal or failure (see ``DefragClient.step``).
        """
        if self._pending is not None:
            seq = self._pending.seq
            raise StepPending(
                f"step: not sent: step seq {seq} is pending (its outcome is unknown); call "
                "complete_pending_step(), then send these events again",
                pending_seq=seq,
            )
        if self._mirror is None:
            self.ensure_stream(deadline)  # seq and epoch come from the session
        if (events.pins or events.unpinned) and not (self._info and self._info.supports_pins):
            raise InvalidArgument(
                f"step seq {self._next_seq}: not sent: it pins or unpins blocks, and the "
                f"server at {self._settings.address} does not apply pins (an older "
                "kvdefrag); upgrade the server"
            )
        message = _convert.stream_step_request(self._next_seq, self._epoch, events)
        size_bytes = _convert.message_size(message)
        max_message_bytes = self._settings.max_message_bytes
        if size_bytes > max_message_bytes:
            raise MessageTooLarge(
                f"step seq {self._next_seq}: message of {size_bytes} bytes exceeds "
                f"max_message_bytes ({max_message_bytes})"
            )
        self._pending = _PendingStep(self._next_seq, events, message)
        return self._complete(self._pending, deadline, "step")

    def _complete(self, pending: _PendingStep, deadline: float, what: str) -> StepReply:
        """Sends a pending step until its reply arrives, reconnecting when the stream breaks."""
        settings = self._settings
        context = f"{what} seq {pending.seq}"
        backoff_s = BACKOFF_START_S
        while True:
            try:
                stream = self.ensure_stream(deadline)
            except ServiceUnavailable as err:
                raise StepOutcomeUnknown(
                    f"{context}: {err}; the step stays pending: complete_pending_step() "
                    "sends it again",
                    pending_seq=pending.seq,
                ) from err
            except DefragError:
                self._pending = None
                raise
            stream.send(pending.message)
            try:
                reply = stream.receive(deadline - time.monotonic())
            except ReplyTimeout:
                self.drop_stream(cancel=True)
                raise StepOutcomeUnknown(
                    f"{context}: no reply from {settings.address} within {settings.timeout_s} s; "
                    "the step stays pending: complete_pending_step() sends it again (the "
                    "server applies it once)",
                    pending_seq=pending.seq,
                ) from None
            except StreamEnded as ended:
                self.drop_stream(cancel=False)
                if self._is_transient(ended.error, reopening=False):
                    _LOGGER.warning(
                        "%s: the stream to %s broke (%s); reconnecting",
                        context,
                        settings.address,
                        _convert.describe(ended.error),
                    )
                    if time.monotonic() + backoff_s < deadline:
                        time.sleep(backoff_s)
                        backoff_s = min(2 * backoff_s, BACKOFF_MAX_S)
                        continue
                    raise StepOutcomeUnknown(
                        f"{context}: {self._why_no_reply(ended.error)}; the step stays "
                        "pending: complete_pending_step() sends it again (the server applies "
                        "it once)",
                        pending_seq=pending.seq,
                    ) from ended.error
                self._pending = None
                raise self._definitive_error(ended.error, context) from ended.error
            kind, body = _convert.stream_reply(reply)
            if kind != "step":
                self.drop_stream(cancel=True)
                self._pending = None
                raise self._diverged(f"{context}: the server answered {kind!r}, not a step")
            return self._accept(pending, body, context)

    def _accept(self, pending: _PendingStep, body: Any, context: str) -> StepReply:
        mirror = self.require_mirror()
        self._pending = None
        if body.seq != pending.seq or body.epoch != self._epoch:
            raise self._diverged(
                f"{context}: the reply is for seq {body.seq} of epoch {body.epoch}, "
                f"expected seq {pending.seq} of epoch {self._epoch}"
            )
        logical_ids, physical_ids = _convert.step_deltas(body)
        if isinstance(mirror, Mirror):
            try:
                digest = mirror.apply_step(pending.events, logical_ids, physical_ids)
            except InvalidArgument as err:
                raise self._diverged(f"{context}: {err}") from err
        else:
            digest = mirror.digest = body.digest
        self._next_seq = pending.seq + 1
        if digest != body.digest:
            raise self._diverged(
                f"{context}: the mirror's digest {digest:#018x} differs from the server's "
                f"{body.digest:#018x}"
            )
        return _convert.step_reply(body, dict(zip(logical_ids, physical_ids, strict=True)))

    # --- the stream -------------------------------------------------------------------
    def ensure_stream(self, deadline: float) -> Stream:
        """Returns the open stream, or opens a new session when it broke or is busy."""
        stream = self._stream
        if stream is not None and stream.is_idle_and_open:
            return stream
        self.drop_stream(cancel=True)
        return self.open_stream(deadline)

    def open_stream(self, deadline: float) -> Stream:
        """Opens a stream session and checks (or, for a fresh client, adopts) its state.

        Raises:
            ServiceUnavailable: The server did not answer by ``deadline``.
            SessionConflict: Another writer holds the server's session.
            EpochMismatch, MirrorDiverged: The server's state does not match the mirror.
            DefragError: Any other refusal of the session.
        """
        settings = self._settings
        backoff_s = BACKOFF_START_S
        busy: grpc.RpcError | None = None  # the last StepInFlight answer, if any
        while True:
            message = _convert.stream_open(
                self._epoch, settings.prefix_caching, settings.client_name
            )
            stream = Stream(self._stub, message)
            try:
                reply = stream.receive(deadline - time.monotonic())
            except ReplyTimeout:
                stream.cancel()
                if busy is not None:
                    raise ServiceUnavailable(f"open session: {self._why_no_reply(busy)}") from None
                raise ServiceUnavailable(
                    f"open session: no answer from {settings.address} within {settings.timeout_s} s"
                ) from None
            except StreamEnded as ended:
                stream.cancel()
                if (
                    isinstance(ended.error, grpc.RpcError)
                    and _convert.error_class(ended.error) is StepInFlight
                ):
                    busy = ended.error
                if (
                    self._is_transient(ended.error, reopening=self._has_had_session)
                    and time.monotonic() + backoff_s < deadline
                ):
                    time.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, BACKOFF_MAX_S)
                    continue
                if self._is_transient(ended.error, reopening=False):
                    raise ServiceUnavailable(
                        f"open session: {self._why_no_reply(ended.error)}"
                    ) from ended.error
                if self._is_transient(ended.error, reopening=self._has_had_session):
                    # NOTE: not SessionConflict: a pending step must stay pending, and the
                    # session the server still holds is most likely our own broken one.
                    raise ServiceUnavailable(
                        f"open session: {settings.address} still held a writer session after "
                        f"{settings.timeout_s} s (this client's broken one, not yet noticed "
                        "by the server, or another writer's)"
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

    def drop_stream(self, *, cancel: bool) -> None:
        """Ends the stream, if any: cancelled, or closed gracefully within ``timeout_s``."""
        stream, self._stream = self._stream, None
        if stream is None:
            return
        if cancel:
            stream.cancel()
        else:
            stream.close(self._settings.timeout_s)

    def _adopt_session(self, reply: Any) -> None:
        settings = self._settings
        kind, body = _convert.stream_reply(reply)
        if kind != "opened":
            raise DefragError(f"open session: the server answered {kind!r}, not 'opened'")
        info = _convert.session_info(body)
        if info.prefix_caching != settings.prefix_caching:
            raise SessionConflict(
                f"open session: the server runs with prefix_caching={info.prefix_caching}, "
                f"this client asked for {settings.prefix_caching}"
            )
        if self._epoch == 0:
            # NOTE: an epoch at seq 1 with an empty digest has applied nothing: identity.
            is_pristine = info.next_seq == 1 and info.digest == 0
            mirror: Mirror | ServerDigest
            if not settings.keep_mirror:
                mirror = ServerDigest(info.num_blocks, info.digest)
            elif is_pristine:
                mirror = Mirror(info.num_blocks)
            else:
                mirror = fetch_mirror(self._stub, info, timeout_s=settings.timeout_s)
            if not is_pristine:
                _LOGGER.info(
                    "adopted the state of %s: epoch %d, seq %d",
                    settings.address,
                    info.epoch,
                    info.next_seq,
                )
            self._info, self._epoch, self._next_seq = info, info.epoch, info.next_seq
            self._mirror = mirror
            return
        mirror = self.require_mirror()
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
        elif not (self._pending is not None and info.next_seq == expected_seq + 1):
            # NOTE: one seq ahead with a step pending is that step applied, even if this
            # client never got to send it: a vLLM worker applies the step its output
            # carries (ServerHandle.apply_planned_step) as soon as it runs. The resend
            # gets the cached reply; the server refuses it (OutOfOrder) if another
            # writer's events were applied under that seq.
            raise self._diverged(
                f"open session: the server expects seq {info.next_seq} but this client is "
                f"at seq {expected_seq}: another writer changed the server's state"
            )
        self._info = info

    # --- errors -----------------------------------------------------------------------
    def _why_no_reply(self, error: BaseException | None) -> str:
        """Why a transient failure lasted until the deadline, for a message."""
        settings = self._settings
        if isinstance(error, grpc.RpcError) and _convert.error_class(error) is StepInFlight:
            return (
                f"{settings.address} was still applying a step after {settings.timeout_s} s "
                f"({_convert.describe(error)})"
            )
        return f"the stream to {settings.address} kept breaking for {settings.timeout_s} s"

    @staticmethod
    def _is_transient(error: BaseException | None, *, reopening: bool) -> bool:
        """True for a broken transport, a server still busy with a step (StepInFlight:
        nothing changed, retry later), and, when reopening, our own stale session."""
        if error is None:
            return True
        if not isinstance(error, grpc.RpcError):
            return False
        if _convert.is_transport_failure(error):
            return True
        if _convert.error_class(error) is StepInFlight:
            return True
        # NOTE: after a cut, the server may not have noticed yet that our old stream
        # ended, so for a moment it still counts it as the open session.
        return reopening and _convert.error_class(error) is SessionConflict

    def _definitive_error(self, error: BaseException | None, context: str) -> DefragError:
        if not isinstance(error, grpc.RpcError):
            return DefragError(f"{context}: the stream failed: {error!r}")
        mapped = _convert.defrag_error(error, context)
        if isinstance(mapped, OutOfOrder):
            # The server disagrees with the seq this client counted (another writer's
            # step under it, or a seq it no longer caches): the mirror is stale.
            return self._diverged(str(mapped))
        if isinstance(mapped, EpochMismatch):
            return self._epoch_error(str(mapped))
        if isinstance(mapped, EngineUnhealthy):
            return self._unhealthy_error(str(mapped))
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

    def _unhealthy_error(self, message: str) -> EngineUnhealthy:
        """Makes the session unusable after the server's engine failed a KV move.

        NOTE: the step that failed was applied without its compaction, its placements
        included (docs/design/step.md), and the client cannot tell whether this refusal was
        that step or a later one, so the mirror may already differ from the server's
        mapping. Answering reads from it would send the forward pass to the old places,
        and whatever it wrote there would be lost once the mirror is rebuilt.
        """
        err = EngineUnhealthy(
            f"{message.rstrip('.')}; refused: the failed step may have been applied (its "
            "placements included) without this client's mirror, so reads and steps are "
            "refused until rebuild_mirror() adopts the server's state (or reset() starts over)"
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
