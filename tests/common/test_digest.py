"""The mapping digest: order-free, updated in O(1) per pair, the same on both sides."""

from __future__ import annotations

import random

from kvdefrag.common import mapping_digest, pair_digest
from kvdefrag.common.digest import MASK64


def test_the_digest_does_not_depend_on_the_order_of_the_pairs() -> None:
    rng = random.Random(11)
    pairs = [(logical_id, rng.randrange(1, 1 << 20)) for logical_id in range(1, 200)]
    shuffled = rng.sample(pairs, len(pairs))

    assert mapping_digest(pairs) == mapping_digest(shuffled) != 0
    assert mapping_digest([]) == 0


def test_a_pair_is_xored_in_and_out() -> None:
    pairs = [(5, 1), (9, 2), (12, 3)]
    digest = mapping_digest(pairs)

    moved = digest ^ pair_digest(12, 3) ^ pair_digest(12, 4)  # block 12 moves 3 -> 4

    assert moved == mapping_digest([(5, 1), (9, 2), (12, 4)])
    assert moved ^ pair_digest(12, 4) ^ pair_digest(12, 3) == digest


def test_pair_digests_are_64_bit_and_tell_logical_from_physical() -> None:
    values = {
        pair_digest(logical_id, physical_id)
        for logical_id in range(64)
        for physical_id in range(64)
    }

    assert len(values) == 64 * 64
    assert all(0 <= value <= MASK64 for value in values)
    assert pair_digest(1, 2) != pair_digest(2, 1)
