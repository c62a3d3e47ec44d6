"""The wire vocabulary shared by the kvdefrag server and client.

One definition of each concept both sides speak: the step (``StepEvents``), pool
statistics (``PoolStats``, ``Totals``), errors and their wire names, the null block id,
and the mapping digest. Shipped in the torch-free ``kvdefrag-client`` distribution so
both sides import the same definitions.
"""

from kvdefrag.common.digest import mapping_digest, pair_digest
from kvdefrag.common.errors import (
    ERROR_METADATA_KEY,
    WIRE_ERRORS,
    DefragError,
    EngineUnhealthy,
    EpochMismatch,
    InvalidArgument,
    MessageTooLarge,
    MirrorDiverged,
    NotFound,
    OutOfOrder,
    ServiceUnavailable,
    SessionConflict,
    StalePageToken,
    StepInFlight,
    StepOutcomeUnknown,
    StepPending,
)
from kvdefrag.common.events import NULL_BLOCK_ID, StepEvents
from kvdefrag.common.stats import PoolStats, Totals

__all__ = [
    "ERROR_METADATA_KEY",
    "NULL_BLOCK_ID",
    "WIRE_ERRORS",
    "DefragError",
    "EngineUnhealthy",
    "EpochMismatch",
    "InvalidArgument",
    "MessageTooLarge",
    "MirrorDiverged",
    "NotFound",
    "OutOfOrder",
    "PoolStats",
    "ServiceUnavailable",
    "SessionConflict",
    "StalePageToken",
    "StepEvents",
    "StepInFlight",
    "StepOutcomeUnknown",
    "StepPending",
    "Totals",
    "mapping_digest",
    "pair_digest",
]
