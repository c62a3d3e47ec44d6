"""The share of gRPC's handler threads each kind of call may hold.

gRPC's Python server runs every call on one pool of ``max_workers`` threads, and a
streaming call holds its thread for as long as it is open. Left alone, a few streams
that open and never send take every thread: health checks, ``GetStats`` and the writer's
reconnect then wait in the pool's queue until their deadline. So streams get a bounded
share of the pool and unary calls keep the rest::

    max_workers threads
    ┌────────┬──────────────────────────┬─────────────────────────┬──────────────────┐
    │ writer │ StepStreams before open  │ other streams           │ unary calls      │
    │ 1      │ MAX_PENDING_STREAMS (2)  │ MAX_OTHER_STREAMS (2)   │ the rest (>= 2)  │
    └────────┴──────────────────────────┴─────────────────────────┴──────────────────┘

- The writer: the one StepStream whose ``open`` was accepted (one session at a time).
  Another stream's ``open`` is refused at once, so it does not stay.
- StepStreams that have not sent ``open`` yet: each must send it within
  ``handshake_timeout_s``, and at most ``MAX_PENDING_STREAMS`` wait at once.
- Other streams (``grpc.health.v1.Health/Watch``, server reflection): at most
  ``MAX_OTHER_STREAMS`` at once.
- Unary calls (Health/Check, GetStats, Resolve, ...) take the rest; each one's work is
  bounded (Resolve ids, ListRequests pages), so they come and go.

NOTE: past a bound the *oldest* stream is ended (CANCELLED), not the newcomer refused. A
writer reconnecting after a broken connection is always the newest stream and sends
``open`` at once, so silent streams can never lock it out; refusing newcomers would let
them hold the door until their timeout. gRPC's own ``maximum_concurrent_rpcs`` cannot do
this: it counts every call alike, so silent streams would use it up just as well. A
second pool for probes is not possible either: one server has one thread pool.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # the type stubs make it generic; at run time it is not
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.ServerInterceptor

MAX_PENDING_STREAMS = 2
MAX_OTHER_STREAMS = 2
MIN_UNARY_WORKERS = 2
# The writer, the streams' shares, and room for unary calls.
MIN_WORKERS = 1 + MAX_PENDING_STREAMS + MAX_OTHER_STREAMS + MIN_UNARY_WORKERS


class _Slot:
    """One stream's place (compared by identity); ``end`` ends the stream's call."""

    def __init__(self, end: Callable[[], object]) -> None:
        self.end = end


class StreamSlots:
    """At most ``limit`` streams at once; a stream past the limit ends the oldest one.

    Thread-safe. Invariant: at most ``limit`` slots are held; a slot taken away (the
    oldest when a newcomer came, or one whose time ran out) has had its ``end`` called.

    Args:
        limit: How many streams may hold a slot at once (>= 1).
        on_ended: Told, with a reason, about every stream the slots end.
    """

    def __init__(self, limit: int, on_ended: Callable[[str], None] | None = None) -> None:
        assert limit >= 1, f"a stream share holds at least one stream, got {limit}"
        self._limit = limit
        self._on_ended = on_ended
        self._lock = threading.Lock()
        self._slots: collections.OrderedDict[_Slot, None] = collections.OrderedDict()

    def enter(self, end: Callable[[], object]) -> _Slot:
        """Takes a slot for a new stream, ending the oldest if all are held.

        Args:
            end: Ends the stream's call (``context.cancel``).
        """
        slot = _Slot(end)
        with self._lock:
            self._slots[slot] = None
            evicted = []
            while len(self._slots) > self._limit:
                evicted.append(self._slots.popitem(last=False)[0])
        for oldest in evicted:
            self._end(oldest, "a newer stream needed its place")
        return slot

    def leave(self, slot: _Slot) -> bool:
        """Frees a slot; False when it had been taken away (its call was ended)."""
        with self._lock:
            return self._slots.pop(slot, False) is None

    def expire(self, slot: _Slot, reason: str) -> None:
        """Takes a slot away and ends its stream, unless it was freed already."""
        if self.leave(slot):
            self._end(slot, reason)

    def end_all(self, reason: str) -> None:
        """Ends every stream holding a slot (the server is stopping)."""
        with self._lock:
            slots = list(self._slots)
            self._slots.clear()
        for slot in slots:
            self._end(slot, reason)

    def _end(self, slot: _Slot, reason: str) -> None:
        slot.end()
        if self._on_ended is not None:
            self._on_ended(reason)


class Handshakes:
    """StepStreams waiting for their ``open``: a share of ``MAX_PENDING_STREAMS`` and a
    deadline of ``timeout_s`` each.

    Args:
        timeout_s: How long a stream may take to send ``open`` (> 0).
        on_ended: Told, with a reason, about every stream ended before its ``open``.
    """

    def __init__(self, timeout_s: float, on_ended: Callable[[str], None] | None = None) -> None:
        self._timeout_s = timeout_s
        self._slots = StreamSlots(MAX_PENDING_STREAMS, on_ended)

    def begin(self, end: Callable[[], object]) -> Callable[[], bool]:
        """Starts a stream's handshake.

        Args:
            end: Ends the stream's call (``context.cancel``).

        Returns:
            ``finish``: call it when the first message arrived (and again on the way
            out: it is idempotent); it returns False if the stream had been ended.
        """
        slot = self._slots.enter(end)
        # NOTE: one timer thread per waiting stream, of which there are at most
        # MAX_PENDING_STREAMS; an open stream's timer is cancelled at once.
        timer = threading.Timer(
            self._timeout_s,
            self._slots.expire,
            (slot, f"no 'open' within handshake_timeout_s={self._timeout_s}"),
        )
        timer.daemon = True
        timer.start()
        is_done = False
        was_ended = False

        def finish() -> bool:
            nonlocal is_done, was_ended
            if not is_done:
                is_done = True
                timer.cancel()
                was_ended = not self._slots.leave(slot)
            return not was_ended

        return finish

    def end_all(self) -> None:
        """Ends every stream still waiting for its ``open`` (the server is stopping)."""
        self._slots.end_all("the server is stopping")


class StreamShare(_ServerInterceptor):
    """Holds every streaming call but the ones it exempts to a ``StreamSlots`` share.

    Args:
        slots: The share (``MAX_OTHER_STREAMS``).
        exempt_methods: Full method names left alone (``/pkg.Service/Method``).
    """

    def __init__(self, slots: StreamSlots, exempt_methods: frozenset[str]) -> None:
        self._slots = slots
        self._exempt_methods = exempt_methods

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in self._exempt_methods:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._held(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _streaming(
        self, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def in_share(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            slot = self._slots.enter(context.cancel)
            try:
                yield from behavior(request, context)
            finally:
                self._slots.leave(slot)

        return in_share

    def _held(
        self, behavior: Callable[[Any, grpc.ServicerContext], Any]
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def in_share(request: Any, context: grpc.ServicerContext) -> Any:
            slot = self._slots.enter(context.cancel)
            try:
                return behavior(request, context)
            finally:
                self._slots.leave(slot)

        return in_share
