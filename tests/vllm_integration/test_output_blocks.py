"""Where a ``SchedulerOutput`` names blocks (``kvdefrag.vllm.output_blocks``): every block-id
field mapped and nothing else, copy pairs and their targets, and the fresh-block rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import pytest

from kvdefrag.vllm.output_blocks import copy_destinations, first_fresh_block_index, map_block_ids

from support.vllm_output import NewRequestData, cached, output


def test_every_block_id_field_is_mapped_and_nothing_else() -> None:
    out = output(
        new=[NewRequestData("a", ([3, 4], [5]), 0)],
        running=cached(("b", ([6],), 8), ("c", None, 4), ("d", ([7, 8],), 0), resumed={"d"}),
        finished={"z"},
        preempted_req_ids={"p"},
        new_block_ids_to_zero=[3, 6],
        kv_cache_block_copies=[(4, 6)],
    )
    seen: list[list[int]] = []

    def to_physical(logical_ids: Sequence[int]) -> list[int]:
        seen.append(list(logical_ids))
        return [100 + logical_id for logical_id in logical_ids]

    map_block_ids(out, to_physical)

    assert out.scheduled_new_reqs[0].block_ids == ([103, 104], [105])
    assert out.scheduled_cached_reqs.new_block_ids == [([106],), None, ([107, 108],)]
    assert out.new_block_ids_to_zero == [103, 106]
    assert out.kv_cache_block_copies == [(104, 106)]
    # the rest is left alone
    assert out.scheduled_cached_reqs.resumed_req_ids == {"d"}
    assert (out.finished_req_ids, out.preempted_req_ids) == ({"z"}, {"p"})
    assert sorted(id for ids in seen for id in ids) == [3, 3, 4, 4, 5, 6, 6, 6, 7, 8]


def test_copy_pairs_keep_their_type() -> None:
    class BlockCopy(NamedTuple):
        src: int
        dst: int

    out = output(kv_cache_block_copies=[BlockCopy(1, 2)])  # type: ignore[list-item]
    map_block_ids(out, lambda ids: [i * 10 for i in ids])
    assert out.kv_cache_block_copies == [BlockCopy(10, 20)]
    assert type(out.kv_cache_block_copies[0]) is BlockCopy


def test_copy_targets_come_from_the_outputs_copy_pairs() -> None:
    out = output(
        new=[NewRequestData("a", ([3],), 5)],
        running=cached(("b", ([6],), 8), ("c", None, 4)),
        kv_cache_block_copies=[(4, 6), (2, 9)],
    )
    assert copy_destinations(out) == frozenset({6, 9})
    assert copy_destinations(output()) == frozenset()


@pytest.mark.parametrize(
    ("num_computed_tokens", "expected"),
    # block size 4: a block holding any computed token keeps its data (ceil, not floor)
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (7, 2), (8, 2), (9, 3)],
)
def test_the_first_fresh_block_is_the_first_without_a_computed_token(
    num_computed_tokens: int, expected: int
) -> None:
    assert first_fresh_block_index(num_computed_tokens, 4) == expected
