"""kvdefrag client side (torch-free): talks to the sidecar from the vLLM scheduler.

Example:
    >>> from kvdefrag.client import DefragClient, StepEvents
    >>> with DefragClient("unix:/tmp/kvdefrag.sock") as client:  # doctest: +SKIP
    ...     reply = client.step(StepEvents(new_blocks={"req-a": [5, 9]}))
    ...     physical_ids = client.resolve([5, 9])

kvdefrag inside vLLM (both sides) is the ``kvdefrag-vllm`` distribution: ``kvdefrag.vllm``.
"""

from kvdefrag.client._client import DefragClient
from kvdefrag.client._identity import identity_refusal
from kvdefrag.client._types import AuditReport, ServiceStats, SessionInfo, StepReply
from kvdefrag.common import (
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    MirrorDiverged,
    NotFound,
    OutOfOrder,
    PoolStats,
    ServiceUnavailable,
    SessionConflict,
    StalePageToken,
    StepEvents,
    StepInFlight,
    StepOutcomeUnknown,
    StepPending,
    Totals,
)

__all__ = [
    "AuditReport",
    "DefragClient",
    "DefragError",
    "EngineUnhealthy",
    "EpochMismatch",
    "InvalidArgument",
    "MessageTooLarge",
    "MirrorDiverged",
    "NotFound",
    "OutOfOrder",
    "PoolStats",
    "ServiceStats",
    "ServiceUnavailable",
    "SessionConflict",
    "SessionInfo",
    "StalePageToken",
    "StepEvents",
    "StepInFlight",
    "StepOutcomeUnknown",
    "StepPending",
    "StepReply",
    "Totals",
    "identity_refusal",
]
