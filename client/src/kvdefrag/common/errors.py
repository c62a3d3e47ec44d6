"""Errors a caller of kvdefrag can see, on either side of the wire.

The server maps each class to one gRPC status code (one table, in the servicer); the
client maps the status back, so ``except InvalidArgument`` works the same in process and
over gRPC.
"""

# The trailing-metadata key under which the server names the error class of a failed call.
ERROR_METADATA_KEY = "kvdefrag-error"

# How much of a caller's value an error message repeats.
MAX_QUOTED_CHARS = 64


def quote(value: object, max_chars: int = MAX_QUOTED_CHARS) -> str:
    """Returns ``repr(value)`` for an error message, a long one cut to ``max_chars``.

    NOTE: an error message travels in gRPC's trailing metadata, which gRPC caps (16 KiB in
    all); past that the caller gets RESOURCE_EXHAUSTED instead of the error. Every value a
    caller sent (request ids, client names) is echoed through here, never as it came.
    """
    if isinstance(value, str):
        if len(value) <= max_chars:
            return repr(value)
        return f"{value[:max_chars]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text)} characters)"


class DefragError(Exception):
    """Base class of every error kvdefrag reports to its caller."""


class InvalidArgument(DefragError):
    """The request is malformed: the message names the field and the value."""


class OutOfOrder(DefragError):
    """A step arrived with a sequence number other than the expected one."""


class SessionConflict(DefragError):
    """Another writer holds the session, or the caller's session is not the active one."""


class EpochMismatch(DefragError):
    """The server's state is newer than the caller's view (it restarted or was reset)."""


class EngineUnhealthy(DefragError):
    """A KV move failed; the engine refuses steps until it is reset."""


class MessageTooLarge(DefragError):
    """A message exceeds the configured maximum size."""


class NotFound(DefragError):
    """The named object (for example a request id) does not exist."""


class StalePageToken(DefragError):
    """A ``ListRequests`` page token belongs to a state that has changed since its first
    page (a step or a reset was applied): list again from the first page."""


class MirrorDiverged(DefragError):
    """The client's mirror of the mapping no longer matches the server's (digest or seq).

    Raised by the client only; ``DefragClient.rebuild_mirror()`` or ``reset()`` recovers.
    """


class ServiceUnavailable(DefragError):
    """The service could not be reached, or did not answer within the deadline.

    Raised by the client for transport failures that carry no kvdefrag error, and in
    process by ``ServerHandle.wait_applied`` when its step is not applied in time.
    """


class StepInFlight(ServiceUnavailable):
    """Refused for now: a step (or a reset) is still being applied, and this call would
    wait behind it.

    The server answers at once (after a short bounded wait) instead of keeping one of its
    few handler threads per waiting call, so retries behind a slow step never starve its
    probes. Nothing changed: retry later. A resend of the step in flight is then answered
    from the replay cache, so it is still applied once.
    """


class StepOutcomeUnknown(ServiceUnavailable):
    """The caller's step got no reply in time: the server may or may not have applied it.

    The step is *pending*: it keeps its seq, and ``DefragClient.complete_pending_step()``
    sends it again until the server answers (applying it at most once). Until then
    ``step()`` and the mirror reads refuse with ``StepPending``. Raised by the client only.

    Attributes:
        pending_seq: The seq of the pending step.
    """

    def __init__(self, message: str, pending_seq: int = 0) -> None:
        super().__init__(message)
        self.pending_seq = pending_seq


class StepPending(DefragError):
    """Refused, nothing sent: an earlier step's outcome is unknown (it is pending).

    ``step()`` raises it without sending the caller's events, and the mirror reads
    (``resolve``, ``resolve_tables``, ``live_requests``) raise it rather than answer from
    a mapping the pending step may already have changed. Call
    ``DefragClient.complete_pending_step()``, then send the events again. Raised by the
    client only.

    Attributes:
        pending_seq: The seq of the pending step.
    """

    def __init__(self, message: str, pending_seq: int = 0) -> None:
        super().__init__(message)
        self.pending_seq = pending_seq


# Every class the server may name in ``ERROR_METADATA_KEY`` (the client-only classes,
# MirrorDiverged, ServiceUnavailable, StepOutcomeUnknown and StepPending, never cross the
# wire).
WIRE_ERRORS: dict[str, type[DefragError]] = {
    cls.__name__: cls
    for cls in (
        InvalidArgument,
        OutOfOrder,
        SessionConflict,
        EpochMismatch,
        EngineUnhealthy,
        MessageTooLarge,
        NotFound,
        StalePageToken,
        StepInFlight,
    )
}
