"""Digest of a logical->physical mapping, kept incrementally on both sides of the wire.

The digest of a set of live ``(logical_id, physical_id)`` pairs is the XOR of a 64-bit
mix of each pair. XOR makes it order-free and lets either side update it in O(1) per
change: XOR a pair in when it appears, XOR it out when it goes.

The mixing constants are public; ``pair_digests`` computes many pairs at once with numpy
when it is installed (the server always has it; the client does not require it), giving
the very same values.
"""

import functools
import importlib.util
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

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


# Below this many pairs the pure-Python loop is as fast as numpy's fixed costs.
MIN_VECTOR_PAIRS = 32


def pair_digests(logical_ids: Sequence[int], physical_ids: Sequence[int]) -> list[int]:
    """``pair_digest`` of many pairs, position by position (numpy for batches)."""
    numpy = _numpy() if len(logical_ids) >= MIN_VECTOR_PAIRS else None
    if numpy is None:
        return [
            pair_digest(logical_id, physical_id)
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True)
        ]
    if len(logical_ids) != len(physical_ids):
        raise ValueError(f"{len(logical_ids)} logical ids but {len(physical_ids)} physical ids")
    digests: list[int] = pair_digest_array(logical_ids, physical_ids).tolist()
    return digests


def pair_digest_array(logical_ids: Any, physical_ids: Any) -> Any:
    """``pair_digest`` of many pairs as a numpy ``uint64`` array (numpy must be installed).

    Args:
        logical_ids: Logical ids (a sequence or an integer array).
        physical_ids: Physical ids, position by position.
    """
    numpy = _numpy()
    assert numpy is not None, "pair_digest_array needs numpy"
    uint64 = numpy.uint64
    z = numpy.asarray(logical_ids, dtype=uint64) << uint64(32)
    z ^= numpy.asarray(physical_ids, dtype=uint64)
    z ^= uint64(DIGEST_INCREMENT)
    z = (z ^ (z >> uint64(30))) * uint64(DIGEST_MULTIPLIER_1)
    z = (z ^ (z >> uint64(27))) * uint64(DIGEST_MULTIPLIER_2)
    z ^= z >> uint64(31)
    return z


@functools.cache
def _numpy() -> ModuleType | None:
    """numpy, or None where it is not installed (looked up once)."""
    if importlib.util.find_spec("numpy") is None:
        return None
    return importlib.import_module("numpy")
