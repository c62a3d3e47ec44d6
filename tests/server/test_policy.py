"""The compaction policy's decisions on small hand-built pools.

Each pool is built through the tracker with the identity mapping (logical id == slot):
``live`` slots are held by a request, ``cached`` slots were held and released under
prefix caching, every other slot but 0 is empty (expendable). Each test pins one decision:
it fails when the policy pairs, places or triggers differently.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvdefrag.server import Move, MoveBatch
from kvdefrag.server._policy import plan_compaction, plan_placement, should_compact
from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server.config import EngineConfig

NUM_BLOCKS = 16


def pool(
    live: Iterable[int], cached: Iterable[int] = (), *, prefix_caching: bool | None = None
) -> BlockTracker:
    """A tracker whose ``live`` slots are live and ``cached`` slots free and cached."""
    cached = sorted(cached)
    if prefix_caching is None:
        prefix_caching = bool(cached)
    assert prefix_caching or not cached, "only prefix caching keeps free blocks cached"
    tracker = BlockTracker(NUM_BLOCKS, prefix_caching)
    if cached:
        tracker.append_requests({"gone": cached})
        tracker.drop_request("gone")
    if live:
        tracker.append_requests({"live": sorted(live)})
    assert tracker.fwd == list(range(NUM_BLOCKS))
    return tracker


def compaction(tracker: BlockTracker, max_moves: int = 512) -> list[Move]:
    moves = plan_compaction(tracker, EngineConfig(max_moves_per_step=max_moves))
    assert isinstance(moves, MoveBatch)
    return list(moves)


def fresh(tracker: BlockTracker, logical_ids: list[int]) -> tuple[list[int], list[int]]:
    """Makes ``logical_ids`` live (a new request), then asks where they go."""
    tracker.append_requests({"new": logical_ids})
    return plan_placement(tracker, logical_ids)


# --- the trigger --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("threshold", "expected"),
    [(0, True), (1, True), (2, False), (3, False)],
)
def test_compacts_only_when_holes_exceed_the_threshold(threshold: int, expected: bool) -> None:
    tracker = pool(live=[1, 2, 5])  # max_live 5, 3 live: 2 holes
    config = EngineConfig(threshold=threshold)
    assert should_compact(tracker, config, is_forced=False) is expected


def test_a_scheduled_pass_compacts_whatever_the_threshold() -> None:
    config = EngineConfig(threshold=100)
    assert should_compact(pool(live=[1, 2, 5]), config, is_forced=True)
    assert should_compact(pool(live=[1, 2, 3]), config, is_forced=True)
    assert not should_compact(pool(live=[1, 2, 3]), EngineConfig(threshold=0), is_forced=False)


def test_an_empty_pool_has_no_holes() -> None:
    assert not should_compact(pool(live=[]), EngineConfig(threshold=0), is_forced=False)


# --- pairing ------------------------------------------------------------------------------
def test_highest_live_slots_pair_with_lowest_free_slots_while_below() -> None:
    tracker = pool(live=[1, 2, 5, 7, 9])  # free: 3, 4, 6, 8
    # 9 -> 3 and 7 -> 4; then 5's lowest free slot is 6, above it: the pass ends.
    assert compaction(tracker) == [Move(9, 3, False), Move(7, 4, False)]


def test_the_move_cap_keeps_the_highest_pairs() -> None:
    tracker = pool(live=[1, 2, 5, 7, 9])
    assert compaction(tracker, max_moves=1) == [Move(9, 3, False)]


def test_planning_changes_nothing() -> None:
    tracker = pool(live=[1, 5, 9], cached=[2], prefix_caching=True)
    fwd, digest = list(tracker.fwd), tracker.digest
    compaction(tracker, max_moves=1)
    plan_placement(tracker, [9])
    assert (tracker.fwd, tracker.digest, tracker.take_remapped()) == (fwd, digest, [])


def test_null_block_is_never_a_destination() -> None:
    # Slot 0 is free (nothing ever references it) and the lowest, but never chosen.
    tracker = pool(live=[3, 4])
    assert compaction(tracker) == [Move(4, 1, False), Move(3, 2, False)]


def test_nothing_moves_in_a_packed_pool() -> None:
    assert compaction(pool(live=[1, 2, 3, 4])) == []
    assert compaction(pool(live=[1, 2, 3], cached=[4, 5])) == []  # cached above: packed
    assert compaction(pool(live=[])) == []


def test_a_cached_destination_is_a_swap() -> None:
    tracker = pool(live=[1, 5, 6], cached=[2])  # free: 2 (cached), 3, 4
    # No live slot stays above the destinations' room, so the cached slot is taken.
    assert compaction(tracker) == [Move(6, 2, True), Move(5, 3, False)]


def test_without_prefix_caching_no_move_is_a_swap() -> None:
    tracker = pool(live=[1, 5, 6], prefix_caching=False)
    assert compaction(tracker) == [Move(6, 2, False), Move(5, 3, False)]


def test_a_capped_pass_prefers_an_empty_destination_to_a_cached_one() -> None:
    # Capped at 2: 10 -> 2 (cached) and 9 -> 3 would swap once. 8 stays, so the empty
    # slot 4 (below 8) replaces the cached one: two copies, the same sources, as packed.
    tracker = pool(live=[1, 8, 9, 10], cached=[2])
    assert compaction(tracker, max_moves=2) == [Move(10, 3, False), Move(9, 4, False)]


def test_the_highest_cached_destination_gives_way_first() -> None:
    # One empty slot (4) below the block that stays (5): it replaces 3, the higher of the
    # two cached destinations; 2 stays a swap.
    tracker = pool(live=[1, 5, 9, 10], cached=[2, 3, 6, 7, 8])
    assert compaction(tracker, max_moves=2) == [Move(10, 2, True), Move(9, 4, False)]


def test_empty_slots_above_the_block_that_stays_are_not_used() -> None:
    # 4 stays; the empty slots 5-8 are above it: taking them would leave the pool less
    # packed, so both moves swap into the cached slots.
    tracker = pool(live=[1, 4, 9, 10], cached=[2, 3])
    assert compaction(tracker, max_moves=2) == [Move(10, 2, True), Move(9, 3, True)]


def test_a_full_pass_swaps_into_cached_slots_below_empty_ones() -> None:
    # Uncapped, every live block above a free slot moves and nothing stays above the
    # destinations: the lowest free slots are taken, cached or not.
    tracker = pool(live=[1, 12, 13], cached=[2, 3])
    assert compaction(tracker) == [Move(13, 2, True), Move(12, 3, True)]


# --- placement ----------------------------------------------------------------------------
def test_fresh_blocks_go_to_the_lowest_expendable_slots_in_order() -> None:
    tracker = pool(live=[1, 2])  # expendable: 3, 4, ...
    assert fresh(tracker, [9, 7]) == ([9, 7], [3, 4])
    tracker = pool(live=[1, 2])
    assert fresh(tracker, [7, 9]) == ([7, 9], [3, 4])


def test_a_fresh_block_with_no_expendable_slot_below_stays() -> None:
    tracker = pool(live=[1, 2, 3])
    assert fresh(tracker, [4, 9]) == ([9], [5])  # 4 has nothing below; 9 takes 5


def test_placement_never_targets_the_null_slot() -> None:
    assert fresh(pool(live=[]), [1]) == ([], [])


def test_a_later_fresh_block_takes_a_slot_vacated_by_an_earlier_one() -> None:
    # Expendable below 10: 5 and 8. 6 goes to 5 and vacates 6, lower than 8: 10 takes 6.
    tracker = pool(live=[1, 2, 3, 4, 7, 9])
    assert fresh(tracker, [6, 10]) == ([6, 10], [5, 6])


def test_placement_skips_cached_slots() -> None:
    tracker = pool(live=[1], cached=[2, 3])  # expendable: 4, 5, ...
    assert fresh(tracker, [9]) == ([9], [4])


def test_repeated_fresh_ids_are_placed_once() -> None:
    tracker = pool(live=[1])
    tracker.append_requests({"new": [9]})
    assert plan_placement(tracker, [9, 9]) == ([9], [2])


def test_the_tracker_commits_a_placement_as_planned() -> None:
    tracker = pool(live=[1, 2, 3, 4, 7, 9])
    placed_ids, targets = fresh(tracker, [6, 10])
    changed = tracker.place_blocks(placed_ids, targets)
    # 6 -> 5 (the empty block 5 takes 6), then 10 -> 6 (block 5 moves on to 10).
    assert [tracker.fwd[i] for i in (6, 10, 5)] == [5, 6, 10]
    assert sorted(set(changed)) == [5, 6, 10]
    assert fresh(tracker, []) == ([], [])
    assert plan_placement(tracker, [6, 10]) == ([], [])  # placed: nothing lower is left
