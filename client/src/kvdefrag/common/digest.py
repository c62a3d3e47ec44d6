"""Digest of a logical->physical mapping, kept incrementally on both sides of the wire.

The digest of a set of live ``(logical_id, physical_id)`` pairs is the XOR of a 64-bit
mix of each pair. XOR makes it order-free and lets either side update it in O(1) per
change: XOR a pair in when it appears, XOR it out when it goes.
"""

from collections.abc import Iterable

_MASK64 = (1 << 64) - 1


def pair_digest(logical_id: int, physical_id: int) -> int:
    """Returns the 64-bit mix of one (logical, physical) pair (splitmix64 finaliser)."""
    z = ((logical_id << 32) ^ physical_id ^ 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mapping_digest(pairs: Iterable[tuple[int, int]]) -> int:
    """Returns the digest of a whole mapping (for audits and tests; O(len(pairs)))."""
    digest = 0
    for logical_id, physical_id in pairs:
        digest ^= pair_digest(logical_id, physical_id)
    return digest
