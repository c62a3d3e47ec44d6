"""Digest of a logical->physical mapping, kept incrementally on both sides of the wire.

The digest of a set of live ``(logical_id, physical_id)`` pairs is the XOR of a 64-bit
mix of each pair. XOR makes it order-free and lets either side update it in O(1) per
change: XOR a pair in when it appears, XOR it out when it goes.

The mixing constants are public so that a vectorised implementation (the server's numpy
batch path) computes the very same values.
"""

from collections.abc import Iterable

MASK64 = (1 << 64) - 1
# splitmix64: the golden-ratio increment and the two finaliser multipliers.
DIGEST_INCREMENT = 0x9E3779B97F4A7C15
DIGEST_MULTIPLIER_1 = 0xBF58476D1CE4E5B9
DIGEST_MULTIPLIER_2 = 0x94D049BB133111EB


def pair_digest(logical_id: int, physical_id: int) -> int:
    """Returns the 64-bit mix of one (logical, physical) pair (splitmix64 finaliser)."""
    z = ((logical_id << 32) ^ physical_id ^ DIGEST_INCREMENT) & MASK64
    z = ((z ^ (z >> 30)) * DIGEST_MULTIPLIER_1) & MASK64
    z = ((z ^ (z >> 27)) * DIGEST_MULTIPLIER_2) & MASK64
    return z ^ (z >> 31)


def mapping_digest(pairs: Iterable[tuple[int, int]]) -> int:
    """Returns the digest of a whole mapping (for audits and tests; O(len(pairs)))."""
    digest = 0
    for logical_id, physical_id in pairs:
        digest ^= pair_digest(logical_id, physical_id)
    return digest
