"""The DefragService servicer: sessions, exactly-once steps, errors and health.

State besides the engine (all changed under one lock, which a step holds while the
engine applies it, so steps are applied one at a time and in ``seq`` order)::

    epoch     random non-zero uint64, new at start and at every Reset
    next_seq  the seq the next applied step must carry (1 at the start of an epoch)
    ledger    the last ``replay_cache_size`` steps applied, by seq, with their events,
              path and result (exactly-once replay: ``_step_ledger``)
    session   the open stream session (one writer), or None

The read RPCs (Resolve, GetStats, GetRequest, ListRequests) never take that lock: they
read what the engine published (or take the engine lock only to copy a request table)
and build their replies with no lock held, so a large read never stalls the writer's
steps, and a step never stalls a probe.

No call waits long for that lock either, since a step may hold it for as long as the
device copy takes (or forever, if the executor hangs). gRPC has a few handler threads
for every call, probes included, so a call that needs the lock (``open``, a step,
Reset) waits at most ``LOCK_WAIT_S`` and is then answered ``StepInFlight``
(UNAVAILABLE): its caller retries later, and a retry holds no thread meanwhile. The
worker's ``wait_applied`` never takes the lock: it reads the published ``(epoch,
next_seq)`` under a leaf lock that is only held to publish it.

Every caller mistake is a ``DefragError``; ``ERROR_CODES`` is the one table that turns
it into a gRPC status, and the class name travels in the trailing metadata
``kvdefrag-error`` so the client can raise the same class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from kvdefrag.common import (
    ERROR_METADATA_KEY,
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    NotFound,
    OutOfOrder,
    PoolStats,
    ServiceUnavailable,
    SessionConflict,
    StalePageToken,
    StepEvents,
    StepInFlight,
)
from kvdefrag.common.errors import quote
from kvdefrag.server import _convert
from kvdefrag.server._engine import Engine, StepResult
from kvdefrag.server._limits import Handshakes
from kvdefrag.server._progress import StepProgress
from kvdefrag.server._step_ledger import (
    APPLIED_BY_RPC,
    APPLIED_IN_PROCESS,
    AppliedStep,
    StepLedger,
)
from kvdefrag.server._validate import check_client_name, check_request_id
from kvdefrag.server.config import ServiceConfig

_LOGGER = logging.getLogger(__name__)

# How long a call that needs the servicer lock (open, a step, Reset) waits for it before
# it is answered StepInFlight: long enough for any ordinary step, short enough that no
# handler thread stays behind a step that hangs.
LOCK_WAIT_S = 0.5

ERROR_CODES: dict[type[DefragError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    SessionConflict: grpc.StatusCode.FAILED_PRECONDITION,
    EpochMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    EngineUnhealthy: grpc.StatusCode.UNAVAILABLE,
    MessageTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    StalePageToken: grpc.StatusCode.ABORTED,
    StepInFlight: grpc.StatusCode.UNAVAILABLE,
}

Message = Any
_T = TypeVar("_T")

# ListRequests: requests per page when the caller names no page_size, and at most.
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10_000

# The longest status message sent (gRPC caps all trailing metadata at 16 KiB, and
# percent-encodes the message: up to 12 bytes per character).
MAX_ERROR_MESSAGE_CHARS = 1024


def status_code(err: DefragError) -> grpc.StatusCode:
    """Returns the gRPC status of an error (its nearest class in ``ERROR_CODES``)."""
    for cls in type(err).__mro__:
        code = ERROR_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


def new_epoch(previous: int = 0) -> int:
    """Returns a random non-zero 64-bit epoch different from ``previous``."""
    while True:
        epoch = secrets.randbits(64)
        if epoch not in (0, previous):
            return epoch


def check_message_limit(engine: Engine, config: ServiceConfig) -> None:
    """Refuses a ``max_message_bytes`` below the reply bound of a one-block step.

    NOTE: ServiceConfig alone cannot tell: the bound grows with ``num_blocks`` (the id
    width) and the engine's ``max_moves_per_step``. A smaller limit would start a server
    that refuses every step.
    """
    minimum = _convert.min_message_bytes(engine.num_blocks, engine.config.max_moves_per_step)
    if config.max_message_bytes < minimum:
        raise InvalidArgument(
            f"max_message_bytes={config.max_message_bytes} is too small: the reply to a "
            f"one-block step can reach {minimum} bytes with num_blocks={engine.num_blocks} "
            f"and max_moves_per_step={engine.config.max_moves_per_step}, so every step would "
            f"be refused; give max_message_bytes at least {minimum} or lower "
            "max_moves_per_step"
        )


def _check_step_number(what: str, seq: int) -> None:
    """Refuses a seq that names no step (an epoch's steps count from 1): below 1, it would
    read as applied long ago.

    Raises:
        InvalidArgument: ``seq`` is not an integer of at least 1.
    """
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise InvalidArgument(
            f"{what}: seq {seq!r} is not a step number (an epoch's steps count from 1)"
        )


class ServiceMetrics(Protocol):
    """What the servicer reports to the metrics layer."""

    def record_error(self, method: str, code: str) -> None: ...

    def record_replay(self) -> None: ...

    def record_step_wait(self, duration_s: float) -> None: ...

    def record_applied(self, path: str) -> None: ...


class _ShuttingDown(Exception):
    """The server is stopping: steps are refused with UNAVAILABLE (retry elsewhere)."""


@dataclasses.dataclass(eq=False)
class _Session:
    """One open stream session (compared by identity).

    ``reset_to`` is the epoch a forced reset started while this session held the
    service (0: none): its later steps are refused with ``EpochMismatch``.
    """

    client_name: str
    cancel_stream: Callable[[], object]
    reset_to: int = 0


class DefragServicer:
    """Serves ``kvdefrag.v1.DefragService`` on top of one engine.

    Invariants: ``next_seq - 1`` steps were applied in this epoch, each exactly once;
    the replay cache holds only replies of this epoch; at most one stream session is
    open, and while it is, only that stream applies steps and Reset is refused unless
    forced; ``_progress.applied`` is ``(epoch, next_seq)`` as of the last change to either.

    Args:
        engine: The engine to serve (the one owner of the pool state).
        config: Service options (``replay_cache_size``, ``max_message_bytes``).
        metrics: Optional error and replay counters.

    Raises:
        InvalidArgument: ``max_message_bytes`` is too small for any step's reply.
    """

    def __init__(
        self,
        engine: Engine,
        config: ServiceConfig,
        *,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        check_message_limit(engine, config)
        self._engine = engine
        self._max_message_bytes = config.max_message_bytes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._epoch = new_epoch()
        self._next_seq = 1
        # What wait_applied reads: published under a leaf lock, never the servicer's.
        self._progress = StepProgress(self._epoch, self._next_seq)
        self._ledger = StepLedger(config.replay_cache_size)
        self._session: _Session | None = None
        # Set without the lock: stop() must not wait behind a step that hangs.
        self._is_stopping = threading.Event()
        # Odd while a Reset runs: lock-free reads check it around what they read (_read).
        self._reset_version = 0
        self._handshakes = Handshakes(config.handshake_timeout_s, self._on_handshake_ended)

    @property
    def epoch(self) -> int:
        """The current epoch (lock-free: never waits for a step in flight)."""
        return self._progress.applied[0]

    @property
    def applied(self) -> tuple[int, int]:
        """``(epoch, next_seq)`` as published (lock-free)."""
        return self._progress.applied

    def wait_applied(self, epoch: int, seq: int, timeout_s: float) -> None:
        """Returns once step ``seq`` of ``epoch`` has been applied (for an in-process
        reader that must not act before a step it was told of, sent by someone else).

        Bounded by ``timeout_s`` whatever holds the servicer lock (a step that hangs in
        the executor included): it never takes that lock. ``begin_shutdown`` ends it at
        once.

        Raises:
            EpochMismatch: The server is at another epoch (restarted or reset).
            EngineUnhealthy: A KV move failed: the step may never be applied.
            ServiceUnavailable: The step was not applied within ``timeout_s``, or the
                server is stopping; the message names the step and the bound.
            InvalidArgument: ``seq`` is below 1 (no step has it).
        """
        _check_step_number("wait_applied", seq)
        started = time.monotonic()
        self._progress.wait_for(
            epoch,
            seq,
            timeout_s,
            unhealthy_reason=lambda: self._engine.unhealthy_reason,
            is_stopping=self._is_stopping.is_set,
        )
        if self._metrics is not None:
            self._metrics.record_step_wait(time.monotonic() - started)

    def _publish_progress(self) -> None:
        """Publishes ``(epoch, next_seq)`` and wakes ``wait_applied`` (under the lock)."""
        self._progress.publish(self._epoch, self._next_seq)

    @contextlib.contextmanager
    def _locked(self, what: str) -> Iterator[None]:
        """Holds the servicer lock, waiting at most ``LOCK_WAIT_S`` for it.

        NOTE: a step holds the lock for as long as its device copy takes. A call that
        waited for it without bound would keep its gRPC handler thread; a few retries
        behind a hung step would then take every thread, health checks' included. Bounded,
        each holds its thread for at most ``LOCK_WAIT_S``, so a client's retries (one
        after another) never pile up.

        Raises:
            StepInFlight: The lock stayed held (by a step, or a reset) past the wait.
        """
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            raise self._busy(what)
        try:
            yield
        finally:
            self._lock.release()

    def _busy(self, what: str) -> StepInFlight:
        return StepInFlight(
            f"{what}: refused for now: the service stayed busy for {LOCK_WAIT_S} s"
            + self._progress.describe_in_progress()
            + "; nothing changed, retry later (a resend of the step in flight is then "
            "answered from the replay cache)"
        )

    def begin_shutdown(self, timeout_s: float) -> bool:
        """Refuses every later step and ends the open stream once its step is done.

        Waits at most ``timeout_s`` for the lock, which a step in flight holds. A step
        that takes longer is left to finish (or fail) in its handler thread: the engine
        applies it whole, so it leaves nothing half-committed, and its reply goes nowhere.

        Returns:
            True when it got the lock within ``timeout_s``; False when a call still held
            it (a step in flight, or with no grace at all also a read that was running).
        """
        self._is_stopping.set()
        self._progress.wake_all()  # every wait_applied ends now
        is_idle = self._lock.acquire(timeout=max(timeout_s, 0.0))
        try:
            session = self._session
        finally:
            if is_idle:
                self._lock.release()
        self._handshakes.end_all()
        if session is not None:
            # NOTE: an open stream waits for the scheduler's next step and would hold
            # the server's stop for its whole grace period; the step in flight, if any,
            # has finished (we held the lock) or outlived the grace, so end it now.
            session.cancel_stream()
        return is_idle

    # --- RPCs -------------------------------------------------------------------------
    def StepStream(
        self, request_iterator: Iterator[Message], context: grpc.ServicerContext
    ) -> Iterator[Message]:
        """The hot path: an ``open`` message, then one reply per ``step`` message.

        The ``open`` must come within ``handshake_timeout_s``, and only a few streams may
        wait for theirs at once (``_limits``): a stream that sends nothing is ended.
        """
        finish_handshake = self._handshakes.begin(context.cancel)
        session: _Session | None = None
        try:
            for request in request_iterator:
                if session is None:
                    if not finish_handshake():
                        return  # ended meanwhile (too late, or pushed out): cancelled
                    session, reply = self._call(
                        "StepStream", context, functools.partial(self._open, request, context)
                    )
                    context.add_callback(functools.partial(self._release_soon, session))
                else:
                    reply = self._call(
                        "StepStream",
                        context,
                        functools.partial(self._stream_step, request, session),
                    )
                yield reply
        finally:
            finish_handshake()
            if session is not None:
                self._release(session)

    # NOTE: every request goes through _convert.parsed inside _call, so bytes that are
    # not a valid message are answered INVALID_ARGUMENT like any other caller mistake.
    def Step(self, request: Message, context: grpc.ServicerContext) -> Message:
        """One step without a stream; refused while a stream session is open."""
        return self._call("Step", context, lambda: self._step(_convert.parsed(request), None).step)

    def Resolve(self, request: Message, context: grpc.ServicerContext) -> Message:
        """Maps logical ids and block tables to physical ids."""
        return self._call("Resolve", context, lambda: self._resolve(_convert.parsed(request)))

    def GetStats(self, request: Message, context: grpc.ServicerContext) -> Message:
        """Pool statistics and session state, as of the last step (never waits for one)."""
        return self._call("GetStats", context, lambda: self._get_stats(_convert.parsed(request)))

    def GetRequest(self, request: Message, context: grpc.ServicerContext) -> Message:
        """The logical and physical blocks of one running request."""
        return self._call(
            "GetRequest", context, lambda: self._get_request(_convert.parsed(request))
        )

    def ListRequests(self, request: Message, context: grpc.ServicerContext) -> Message:
        """A page of the running requests with their logical blocks."""
        return self._call(
            "ListRequests", context, lambda: self._list_requests(_convert.parsed(request))
        )

    def Defragment(self, request: Message, context: grpc.ServicerContext) -> Message:
        """Makes the next step compact the pool whatever the threshold."""
        return self._call("Defragment", context, lambda: self._defragment(_convert.parsed(request)))

    def Reset(self, request: Message, context: grpc.ServicerContext) -> Message:
        """Forgets all state and starts a new epoch (healthy again)."""
        return self._call("Reset", context, lambda: self._reset(_convert.parsed(request)))

    # --- sessions and steps -----------------------------------------------------------
    def _stream_step(self, request: Message, session: _Session) -> Message:
        kind, body = _convert.stream_request(request)
        if kind == "open":
            raise SessionConflict(
                f"StepStream: the session of {quote(session.client_name)} is already open; "
                "'open' is only allowed as the first message"
            )
        if kind != "step":
            raise InvalidArgument("StepStreamRequest.kind: neither 'open' nor 'step' is set")
        return self._step(body, session)

    def _open(self, request: Message, context: grpc.ServicerContext) -> tuple[_Session, Message]:
        kind, body = _convert.stream_request(request)
        if kind != "open":
            raise SessionConflict(
                f"StepStream: the first message must be 'open', got {kind or 'an empty one'!r}"
            )
        args = _convert.open_args(body)
        check_client_name(args.client_name)
        engine = self._engine
        with self._locked("open"):
            if self._is_stopping.is_set():
                raise _ShuttingDown("the server is shutting down")
            if self._session is not None:
                raise SessionConflict(
                    f"open: another stream session (client_name="
                    f"{quote(self._session.client_name)}) is open; one writer at a time"
                )
            if args.epoch and args.epoch != self._epoch:
                raise EpochMismatch(
                    f"open.epoch {args.epoch} is not the server epoch {self._epoch}: the "
                    "server restarted or was reset, so the client's state is stale"
                )
            if args.epoch and engine.unhealthy_reason is not None:
                # NOTE: the writer's mirror may lack the events of the step whose move
                # failed; it may only reset, or adopt the state (an open without epoch).
                raise EngineUnhealthy(engine.unhealthy_reason)
            if args.prefix_caching != engine.config.prefix_caching:
                # NOTE: the engine owns the rule (``Engine.is_pristine``); a stream open
                # holds the servicer lock, so no step comes in between.
                if not engine.is_pristine:
                    raise SessionConflict(
                        f"open.prefix_caching={args.prefix_caching} but epoch {self._epoch} "
                        f"runs with prefix_caching={engine.config.prefix_caching} and has "
                        f"state (next_seq {self._next_seq}); Reset to change the mode"
                    )
                engine.change_mode(prefix_caching=args.prefix_caching)
            session = _Session(args.client_name or "unnamed", context.cancel)
            self._session = session
            opened = _convert.session_opened(
                epoch=self._epoch,
                next_seq=self._next_seq,
                num_blocks=engine.num_blocks,
                block_size=engine.block_size,
                prefix_caching=engine.config.prefix_caching,
                digest=engine.digest,
            )
        _LOGGER.info("stream session opened by %r", session.client_name)
        return session, opened

    def _on_handshake_ended(self, reason: str) -> None:
        _LOGGER.info("StepStream ended before its 'open': %s", reason)
        if self._metrics is not None:
            self._metrics.record_error("StepStream", grpc.StatusCode.CANCELLED.name)

    def _release(self, session: _Session) -> None:
        if self._session is not session:
            return  # NOTE: ended already (a forced reset, or the callback); never ours again
        with self._lock:
            self._release_locked(session)

    def _release_soon(self, session: _Session) -> None:
        """Releases the session when its stream ends, if the lock is free now.

        NOTE: gRPC runs this callback in its one polling thread: waiting there for the
        lock, which a step may hold for long, would stall every call of the server. When
        the lock is busy, the stream's handler releases the session as it finishes.
        """
        if self._lock.acquire(blocking=False):
            try:
                self._release_locked(session)
            finally:
                self._lock.release()

    def _release_locked(self, session: _Session) -> None:
        if self._session is session:
            self._session = None
            _LOGGER.info("stream session of %r closed", session.client_name)

    def apply_planned_step(self, epoch: int, seq: int, events: StepEvents) -> bool:
        """Applies step ``seq`` of ``epoch`` in process for the open stream session, unless
        it was applied already: the one entry point besides the RPCs.

        The vLLM integration's scheduler sends each step over its stream and hands the
        same events to the workers with the output; a worker whose step has not arrived
        yet applies it here, through the same checks as the stream's (``_admit``: only the
        open session's next seq of the current epoch). Whichever comes first applies it;
        the other finds it applied, and the stream's copy is answered from the replay
        cache (the same reply).

        Returns:
            True when this call applied the step, False when it was applied already.

        Raises:
            EpochMismatch: ``epoch`` is not the current epoch (restarted, or reset).
            SessionConflict: No stream session is open (ended, or a forced reset).
            OutOfOrder: ``seq`` skips ahead of the next seq (an earlier step is missing).
            StepInFlight: Another step held the service past ``LOCK_WAIT_S``.
            ServiceUnavailable: The server is stopping; nothing changed.
            InvalidArgument: ``epoch`` is 0 or ``seq`` below 1 (no step has it).
            EngineUnhealthy, InvalidArgument, MessageTooLarge: As a step from the
                stream; nothing changed.
        """
        _check_step_number("apply_planned_step", seq)
        started = time.monotonic()
        is_applied_here = False
        current_epoch, next_seq = self._progress.applied
        if not (current_epoch == epoch and next_seq > seq):
            if not epoch:
                raise InvalidArgument("apply_planned_step: epoch 0 names no epoch")
            with self._locked(f"step seq {seq}"):
                session = self._session
                if session is None:
                    raise SessionConflict(
                        f"step seq {seq}: no stream session is open to apply it for"
                    )
                is_applied = epoch == self._epoch and seq < self._next_seq
                try:
                    admitted = is_applied or self._admit(seq, epoch, session) is None
                except _ShuttingDown as err:
                    # NOTE: to a remote client a stopping server is a broken connection
                    # (no kvdefrag error); the worker in this process gets the public one.
                    raise ServiceUnavailable(
                        f"step seq {seq} of epoch {epoch} was not applied: {err}"
                    ) from None
                if admitted and not is_applied:
                    self._check_reply_bound(events)
                    self._record(seq, events, self._apply(seq, events), path=APPLIED_IN_PROCESS)
                    is_applied_here = True
        if self._metrics is not None:
            self._metrics.record_step_wait(time.monotonic() - started)
        return is_applied_here

    def _step(self, request: Message, session: _Session | None) -> Message:
        """Applies one step once; returns its reply as the stream sends it (a
        StepStreamResponse; the unary Step returns its ``step``). A resend of an applied
        seq gets the reply it got then."""
        seq = request.seq
        with self._locked(f"step seq {seq}"):
            applied = self._admit(seq, request.epoch, session)
            if applied is not None:
                return self._replay(seq, applied, request)
            events = _convert.step_events(request)
            self._check_reply_bound(events)
            return self._record(seq, events, self._apply(seq, events)).response()

    def _admit(self, seq: int, epoch: int, session: _Session | None) -> AppliedStep | None:
        """Whether ``session`` may apply step ``seq`` of ``epoch`` now (0: the current
        epoch); call it holding the servicer lock.

        Returns:
            None for the next step; the cached step for a seq applied already.

        Raises:
            _ShuttingDown, SessionConflict, EpochMismatch, EngineUnhealthy, OutOfOrder:
                Not this session's to apply, or not now; nothing changed.
        """
        if self._is_stopping.is_set():
            raise _ShuttingDown("the server is shutting down")
        if self._session is not session:
            if session is None:
                assert self._session is not None
                raise SessionConflict(
                    "Step: a stream session (client_name="
                    f"{quote(self._session.client_name)}) is open; unary steps are refused "
                    "while it is"
                )
            if session.reset_to:
                raise EpochMismatch(
                    f"step.epoch {epoch or 'current'}: a forced reset started epoch "
                    f"{session.reset_to} under this session and ended it; the client's "
                    "state is stale"
                )
            raise SessionConflict("step: this stream's session is closed")
        reason = self._engine.unhealthy_reason
        if reason is not None:
            raise EngineUnhealthy(reason)
        if epoch and epoch != self._epoch:
            raise EpochMismatch(
                f"step.epoch {epoch} is not the server epoch {self._epoch}: the server "
                "restarted or was reset"
            )
        if seq == 0:
            raise OutOfOrder(
                f"seq 0 is not a step number (an epoch's steps count from 1); expected "
                f"seq {self._next_seq}"
            )
        if seq > self._next_seq:
            raise OutOfOrder(f"seq {seq} skips ahead: expected seq {self._next_seq}")
        if seq == self._next_seq:
            return None
        cached = self._ledger.get(seq)
        if cached is None:
            raise OutOfOrder(
                f"seq {seq} was applied and its reply is no longer cached (the last "
                f"{self._ledger.size} are kept); expected seq {self._next_seq}"
            )
        return cached

    def _replay(self, seq: int, applied: AppliedStep, request: Message) -> Message:
        """Answers a call for the applied step ``seq`` with the reply it got then; call it
        holding the servicer lock.

        NOTE: the stream's copy of a step a worker applied first (from the same
        scheduler's output) is not a resend. A resend must carry the events that were
        applied: a client that reconnected finds the server one seq ahead and resends its
        pending step, which may be another writer's step under that seq, not its own.

        Raises:
            OutOfOrder: A resend whose events differ from those applied at ``seq``.
        """
        if not self._ledger.answer_call(applied):
            if _convert.step_events(request) != applied.events:
                raise OutOfOrder(
                    f"seq {seq} was applied with other events than this resend of it carries "
                    f"(another writer's step); the caller's state is stale; expected seq "
                    f"{self._next_seq}"
                )
            if self._metrics is not None:
                self._metrics.record_replay()
        return _convert.replayed_response(applied.response())

    def _apply(self, seq: int, events: StepEvents) -> StepResult:
        """Applies the admitted step ``seq`` to the engine; call it holding the servicer
        lock.

        Raises:
            InvalidArgument: The events do not fit the pool; nothing changed.
            EngineUnhealthy: Its KV move failed: the seq is used up (applied without its
                compaction, docs/design/step.md), and no reply is cached for it, since every
                step gets EngineUnhealthy until a Reset starts a new epoch.
        """
        engine = self._engine
        num_steps = engine.stats().totals.num_steps
        self._progress.begin_step(self._epoch, seq)
        try:
            return engine.apply_events(events)
        except EngineUnhealthy:
            if engine.stats().totals.num_steps > num_steps:
                self._next_seq += 1
            self._publish_progress()  # wait_applied sees the failure at once
            raise
        finally:
            self._progress.end_step()

    def _record(
        self, seq: int, events: StepEvents, result: StepResult, *, path: str = APPLIED_BY_RPC
    ) -> AppliedStep:
        """Records step ``seq`` in the ledger (for resends, by ``path``) and counts it
        applied; call it holding the servicer lock. Builds no reply: the caller does,
        when it needs one (``AppliedStep.response``)."""
        applied = self._ledger.record(seq, self._epoch, events, result, path)
        self._next_seq += 1
        if self._metrics is not None:
            self._metrics.record_applied(path)
        self._publish_progress()
        return applied

    # --- reads (no servicer lock) -----------------------------------------------------
    def _read(self, read: Callable[[], _T]) -> tuple[int, _T]:
        """Runs ``read`` without the lock; returns the epoch it belongs to with its value.

        NOTE: a seqlock. Reset makes ``_reset_version`` odd, resets the engine, changes
        the epoch, and makes it even again, all under the lock. A read that saw the same
        even version before and after ran wholly within one epoch; one that raced a
        Reset (rare) reads again once it is over, never waiting for the lock itself
        (a step may hold it for long).
        """
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            version = self._reset_version
            if version % 2 == 0:
                epoch = self._epoch
                value = read()
                if self._reset_version == version:
                    return epoch, value
            if time.monotonic() > deadline:
                raise StepInFlight(
                    f"read: a reset kept changing the state for {LOCK_WAIT_S} s; retry"
                )
            time.sleep(0.001)

    def _resolve(self, request: Message) -> Message:
        engine = self._engine
        logical_ids, tables = _convert.resolve_request(request, max_ids=engine.num_blocks)
        # One resolve_tables call: the ids and the tables come from one published mapping.
        epoch, resolved = self._read(lambda: engine.resolve_tables([logical_ids, *tables]))
        response = _convert.resolve_response(epoch, resolved[0], resolved[1:])
        return self._check_size("Resolve", response)

    def _get_stats(self, request: Message) -> Message:
        engine = self._engine

        def read() -> tuple[int, bool, tuple[int, PoolStats], str | None]:
            # NOTE: next_seq first: a step publishes the engine's figures before the
            # servicer counts it, so they are never older than next_seq says.
            return (
                self._next_seq,
                self._session is not None,
                engine.digest_and_stats(),
                engine.unhealthy_reason,
            )

        epoch, (next_seq, is_session_open, (digest, stats), reason) = self._read(read)
        return _convert.get_stats_response(
            epoch=epoch,
            next_seq=next_seq,
            is_session_open=is_session_open,
            digest=digest,
            stats=stats,
            unhealthy_reason=reason,
        )

    def _get_request(self, request: Message) -> Message:
        request_id = check_request_id("request_id", request.request_id)
        logical_ids, physical_ids = self._engine.resolve_request(request_id)
        response = _convert.get_request_response(request_id, logical_ids, physical_ids)
        return self._check_size("GetRequest", response)

    def _list_requests(self, request: Message) -> Message:
        """One page of the running requests.

        NOTE: a token names the epoch and the engine's generation (steps and resets
        applied) of the first page, and the position of the next request. Pages of one
        generation are slices of one request table, so the pages add up to one
        consistent table, with no snapshot kept on the server; once a step has changed
        the table, the next page is refused (StalePageToken) and the caller starts
        again. A client rebuilding its mirror holds the one writer session meanwhile,
        so no step can come between its pages.
        """
        page_size, token = _convert.list_requests_args(request)
        if page_size < 0:
            raise InvalidArgument(f"page_size must be >= 0, got {page_size}")
        max_requests = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        token_epoch, generation, start = (
            _convert.parse_page_token(token) if token else (None, None, 0)
        )
        engine = self._engine
        try:
            epoch, page = self._read(
                lambda: engine.list_requests_page(start, max_requests, generation)
            )
        except InvalidArgument as err:
            raise InvalidArgument(
                f"page_token {quote(token)} is not a next_page_token this server issued: {err}"
            ) from None
        if token_epoch is not None and token_epoch != epoch:
            raise StalePageToken(
                f"page_token belongs to epoch {token_epoch}, not to the server's epoch "
                f"{epoch} (it restarted or was reset); list again from the first page"
            )
        response = _convert.list_requests_response(
            epoch,
            page,
            start,
            num_blocks=engine.num_blocks,
            max_bytes=self._max_message_bytes,
        )
        return self._check_size("ListRequests", response)

    def _defragment(self, request: Message) -> Message:
        self._engine.schedule_defragment()
        return _convert.defragment_response()

    def _reset(self, request: Message) -> Message:
        epoch = self.reset(
            epoch=request.epoch, prefix_caching=request.prefix_caching, force=request.force
        )
        return _convert.reset_response(epoch)

    def reset(
        self, *, epoch: int = 0, prefix_caching: bool | None = None, force: bool = False
    ) -> int:
        """Resets the engine and starts a new epoch: the one way to reset a served engine.

        The Reset RPC and ``ServerHandle.reset`` both come here, so every reset changes
        the epoch: a client of the old epoch gets ``EpochMismatch`` at its next step.

        Refused while a writer session is open: a running vLLM's workers would go on
        translating block ids with the new identity mapping while the KV data stays where
        the moves put it (silent corruption). ``force`` resets anyway and ends that
        session; it means restarting vLLM (its scheduler and workers fail at their next
        step with ``EpochMismatch``).

        Args:
            epoch: The epoch being reset; 0 resets whatever is current.
            prefix_caching: The mode of the new epoch; None keeps the current one.
            force: Reset even while a writer session is open (restart vLLM after it).

        Returns:
            The new epoch.

        Raises:
            EpochMismatch: ``epoch`` is not 0 and not the current epoch.
            SessionConflict: A writer session is open and ``force`` is not set.
            StepInFlight: A step is still being applied; retry once it is done.
        """
        with self._locked("reset"):
            if epoch and epoch != self._epoch:
                raise EpochMismatch(f"reset.epoch {epoch} is not the server epoch {self._epoch}")
            session = self._session
            if session is not None and not force:
                raise SessionConflict(
                    f"reset refused: a writer session (client_name="
                    f"{quote(session.client_name)}) holds the service; resetting under it "
                    "would corrupt a running vLLM, whose workers would translate block ids "
                    "with the new identity mapping while the KV data stays where it was "
                    "moved. Stop the writer first, or pass force to reset anyway, which "
                    "means you must restart vLLM"
                )
            self._reset_version += 1
            try:
                # NOTE: the new epoch is published before the engine publishes the
                # identity mapping (holding kv_lock): a worker's pass that takes kv_lock
                # after the mapping changed finds its step's epoch gone and fails before
                # it runs, rather than reading logical ids as physical ones.
                self._epoch = new_epoch(self._epoch)
                self._next_seq = 1
                self._ledger.clear()
                self._publish_progress()
                self._engine.reset(prefix_caching=prefix_caching)
                if session is not None:
                    session.reset_to = self._epoch
                    self._session = None
            finally:
                self._reset_version += 1
                self._publish_progress()
            epoch = self._epoch
            is_prefix_caching = self._engine.config.prefix_caching
        if session is not None:
            _LOGGER.warning(
                "reset forced while %r held the writer session: its stream is ended and its "
                "state is stale (new epoch %d); restart vLLM",
                session.client_name,
                epoch,
            )
            session.cancel_stream()
        _LOGGER.info("reset: new epoch %d (prefix_caching=%s)", epoch, is_prefix_caching)
        return epoch

    # --- errors -----------------------------------------------------------------------
    def _check_size(self, method: str, response: Message) -> Message:
        size_bytes = response.ByteSize()
        if size_bytes > self._max_message_bytes:
            raise MessageTooLarge(
                f"{method}: the reply would be {size_bytes} bytes, over max_message_bytes="
                f"{self._max_message_bytes}; ask for less per call"
            )
        return response

    def _check_reply_bound(self, events: StepEvents) -> None:
        """Refuses a step whose reply might not fit in a message (before applying it).

        NOTE: a reply that gRPC cannot send would leave the step applied but its deltas
        unknown to the client, so the bound is checked while nothing has changed yet.
        """
        engine = self._engine
        bound_bytes = _convert.max_step_response_bytes(
            events, engine.num_blocks, engine.config.max_moves_per_step
        )
        if bound_bytes > self._max_message_bytes:
            raise MessageTooLarge(
                f"step: its reply could reach {bound_bytes} bytes, over max_message_bytes="
                f"{self._max_message_bytes}; send fewer blocks per step (or lower "
                "max_moves_per_step)"
            )

    def _call(self, method: str, context: grpc.ServicerContext, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except (DefragError, _ShuttingDown) as err:
            error: Exception = err
        except Exception as err:
            _LOGGER.exception("%s failed unexpectedly", method)
            error = err
        self._abort(context, method, error)

    def _abort(self, context: grpc.ServicerContext, method: str, err: Exception) -> NoReturn:
        """Ends the RPC with the status of ``err`` (the one place errors leave the server)."""
        details = str(err)
        if isinstance(err, DefragError):
            code = status_code(err)
            context.set_trailing_metadata(((ERROR_METADATA_KEY, type(err).__name__),))
        elif isinstance(err, _ShuttingDown):
            # NOTE: no kvdefrag-error metadata: to the client this is a broken connection,
            # which it handles by reconnecting (to this address once a server is back).
            code = grpc.StatusCode.UNAVAILABLE
        else:
            code = grpc.StatusCode.INTERNAL
            details = f"internal error: {type(err).__name__}: {err}"
        if len(details) > MAX_ERROR_MESSAGE_CHARS:
            details = f"{details[:MAX_ERROR_MESSAGE_CHARS]}... ({len(details)} characters)"
        if self._metrics is not None:
            self._metrics.record_error(method, code.name)
        context.abort(code, details)
