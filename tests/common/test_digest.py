"""The mapping digest: order-free, updated in O(1) per pair, the same on both sides."""

from __future__ import annotations

import random

import pytest

from kvdefrag.common import digest, mapping_digest, pair_digest
from kvdefrag.common.digest import MASK64, MIN_VECTOR_PAIRS, pair_digests


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


@pytest.mark.parametrize("num_pairs", [0, 1, MIN_VECTOR_PAIRS - 1, MIN_VECTOR_PAIRS, 1000])
def test_pair_digests_of_a_batch_equal_pair_digest_of_each_pair(num_pairs: int) -> None:
    rng = random.Random(num_pairs)
    logical_ids = [rng.randrange(1 << 31) for _ in range(num_pairs)]
    physical_ids = [rng.randrange(1 << 31) for _ in range(num_pairs)]

    expected = [
        pair_digest(l_id, p_id) for l_id, p_id in zip(logical_ids, physical_ids, strict=True)
    ]
    assert pair_digests(logical_ids, physical_ids) == expected
    assert pair_digests(tuple(logical_ids), tuple(physical_ids)) == expected


def test_pair_digests_without_numpy_give_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    logical_ids, physical_ids = list(range(1, 101)), list(range(200, 100, -1))
    expected = pair_digests(logical_ids, physical_ids)
    monkeypatch.setattr(digest, "_numpy", lambda: None)  # as where numpy is not installed

    assert pair_digests(logical_ids, physical_ids) == expected


def test_pair_digests_refuse_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError):
        pair_digests(list(range(40)), list(range(41)))
    with pytest.raises(ValueError):
        pair_digests([1], [])
