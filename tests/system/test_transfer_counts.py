"""bench/transfer_counts.py counts descriptors and copies as the connectors post them,
checked by hand on block lists small enough to follow."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def counts() -> Iterator[ModuleType]:
    """``bench/transfer_counts.py`` imported as the bench imports it (bench/ on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        import transfer_counts

        yield transfer_counts
    finally:
        sys.path.remove(str(BENCH))


def test_runs_are_maximal_sequences_of_consecutive_ids(counts: ModuleType) -> None:
    assert counts.count_runs([]) == 0
    assert counts.count_runs([7]) == 1
    assert counts.count_runs([4, 5, 6, 9, 10]) == 2
    assert counts.count_runs([5, 4, 3]) == 3  # descending ids do not run
    assert counts.count_runs([1, 2, 2, 3]) == 2  # a repeat breaks the run


def test_joint_runs_break_where_either_side_breaks(counts: ModuleType) -> None:
    # local 10-13 runs on, remote breaks after its second id: two joint runs
    assert counts.count_joint_runs([10, 11, 12, 13], [40, 41, 50, 51]) == 2
    # both sides break at different places: three
    assert counts.count_joint_runs([10, 11, 20, 21], [40, 41, 42, 60]) == 3
    assert counts.count_joint_runs([3, 4, 5], [8, 9, 10]) == 1
    assert counts.count_joint_runs([], []) == 0


def test_nixl_posts_one_descriptor_per_region_and_block_unless_merged(
    counts: ModuleType,
) -> None:
    local, remote = [10, 11, 12, 13], [40, 41, 50, 51]
    assert counts.nixl_descriptors(local, remote, 6, merged=False) == 6 * 4
    assert counts.nixl_descriptors(local, remote, 6, merged=True) == 6 * 2


def test_offload_copies_one_per_block_and_layer_unless_runs_merge(counts: ModuleType) -> None:
    assert counts.offload_copies([4, 5, 6, 9, 10], 3, merged=False) == 3 * 5
    assert counts.offload_copies([4, 5, 6, 9, 10], 3, merged=True) == 3 * 2


def test_pages_touched_and_the_packed_floor(counts: ModuleType) -> None:
    # slots 1, 15 (page 0), 16 (page 1), 40 (page 2)
    assert counts.pages_touched([1, 15, 16, 40], page_blocks=16) == 3
    # 4 live blocks packed from slot 1 fill slots 1-4: one page; 15 fill slots 1-15: one;
    # 16 spill into the second page
    assert counts.pages_floor(4, page_blocks=16) == 1
    assert counts.pages_floor(15, page_blocks=16) == 1
    assert counts.pages_floor(16, page_blocks=16) == 2
    assert counts.pages_floor(0, page_blocks=16) == 0
