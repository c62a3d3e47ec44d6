"""The wire contract shared by the kvdefrag server and client: errors and the mapping digest.

Shipped in the torch-free ``kvdefrag-client`` distribution so both sides import the same
definitions.
"""

from kvdefrag.common.digest import mapping_digest, pair_digest
from kvdefrag.common.errors import (
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
)

__all__ = [
    "DefragError",
    "EngineUnhealthy",
    "EpochMismatch",
    "InvalidArgument",
    "MessageTooLarge",
    "MirrorDiverged",
    "NotFound",
    "OutOfOrder",
    "ServiceUnavailable",
    "SessionConflict",
    "mapping_digest",
    "pair_digest",
]
