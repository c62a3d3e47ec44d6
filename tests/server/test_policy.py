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
from kvdefrag.server._policy import (
    plan_compaction,
    plan_copies,
    plan_placement,
    should_compact,
)
from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server.buckets import decode_bucket
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


def packing(tracker: BlockTracker, max_moves: int = 512) -> list[Move]:
    """What a scheduled pass plans: the highest live slots to the lowest free ones."""
    return list(
        plan_compaction(tracker, EngineConfig(max_moves_per_step=max_moves), is_forced=True)
    )


def bucket_compaction(
    tracker: BlockTracker, buckets: tuple[int, ...], max_moves: int = 512
) -> list[Move]:
    """What a bucket-aware step plans: nothing unless ``should_compact`` says so."""
    config = EngineConfig(threshold=0, max_moves_per_step=max_moves, decode_buckets=buckets)
    moves = plan_compaction(tracker, config)
    if not should_compact(tracker, config, is_forced=False):
        assert not moves, "the trigger is necessary: no plan without it"
    return list(moves)


def bucket_after(tracker: BlockTracker, buckets: tuple[int, ...], moves: list[Move]) -> int:
    """Commits ``moves`` and returns the decode bucket of ``max_live + 1`` after them."""
    tracker.move_live_blocks(
        [move.src_physical_id for move in moves], [move.dst_physical_id for move in moves]
    )
    return decode_bucket(buckets, tracker.max_live + 1, NUM_BLOCKS)


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
    # Slot 0 is free (nothing ever references it) and the lowest, but never chosen: the
    # run 3-4 moves whole, in order, to 1-2.
    tracker = pool(live=[3, 4])
    assert compaction(tracker) == [Move(3, 1, False), Move(4, 2, False)]


def test_nothing_moves_in_a_packed_pool() -> None:
    assert compaction(pool(live=[1, 2, 3, 4])) == []
    assert compaction(pool(live=[1, 2, 3], cached=[4, 5])) == []  # cached above: packed
    assert compaction(pool(live=[])) == []


def test_a_cached_destination_is_a_swap() -> None:
    tracker = pool(live=[1, 5, 6], cached=[2])  # free: 2 (cached), 3, 4
    # No live slot stays above the destinations' room, so the cached slot is taken.
    assert compaction(tracker) == [Move(5, 2, True), Move(6, 3, False)]


def test_without_prefix_caching_no_move_is_a_swap() -> None:
    tracker = pool(live=[1, 5, 6], prefix_caching=False)
    assert compaction(tracker) == [Move(5, 2, False), Move(6, 3, False)]


def test_a_capped_pass_prefers_an_empty_destination_to_a_cached_one() -> None:
    # A packing pass capped at 2 (the run 8-10 is longer than the cap): 9 -> 2 (cached)
    # and 10 -> 3 would swap once. 8 stays, so the empty slot 4 (below 8) replaces the
    # cached one: two copies, the same sources, as packed.
    tracker = pool(live=[1, 8, 9, 10], cached=[2])
    assert compaction(tracker, max_moves=2) == [Move(9, 3, False), Move(10, 4, False)]


def test_the_highest_cached_destination_gives_way_first() -> None:
    # One empty slot (4) below the block that stays (5): it replaces 3, the higher of the
    # two cached destinations; 2 stays a swap.
    tracker = pool(live=[1, 5, 9, 10], cached=[2, 3, 6, 7, 8])
    assert packing(tracker, max_moves=2) == [Move(9, 2, True), Move(10, 4, False)]


def test_empty_slots_above_the_block_that_stays_are_not_used() -> None:
    # 4 stays; the empty slots 5-8 are above it: taking them would leave the pool less
    # packed, so both moves swap into the cached slots.
    tracker = pool(live=[1, 4, 9, 10], cached=[2, 3])
    assert packing(tracker, max_moves=2) == [Move(9, 2, True), Move(10, 3, True)]


def test_a_full_pass_swaps_into_cached_slots_below_empty_ones() -> None:
    # Uncapped, every live block above a free slot moves and nothing stays above the
    # destinations: the lowest free slots are taken, cached or not.
    tracker = pool(live=[1, 12, 13], cached=[2, 3])
    assert compaction(tracker) == [Move(12, 2, True), Move(13, 3, True)]
    assert packing(tracker) == [Move(12, 2, True), Move(13, 3, True)]


# --- the copies ---------------------------------------------------------------------------
def test_a_fresh_block_swapped_with_a_cached_one_copies_only_the_cached_data_up() -> None:
    # 13 is fresh (no data yet), 12 holds data: both go into cached slots.
    tracker = pool(live=[1, 12, 13], cached=[2, 3])
    moves = plan_compaction(tracker, EngineConfig())
    assert list(plan_copies(tracker, moves, fresh_ids=[13])) == [
        Move(12, 2, True),
        Move(3, 13, False),  # the cached block's data goes up, nothing comes down
    ]
    assert list(plan_copies(tracker, moves, fresh_ids=[])) == list(moves)


def test_a_fresh_block_moved_onto_an_empty_slot_is_copied_as_planned() -> None:
    tracker = pool(live=[1, 5, 6], cached=[2])  # free: 2 (cached), 3 (empty), 4
    moves = plan_compaction(tracker, EngineConfig())
    assert list(plan_copies(tracker, moves, fresh_ids=[5, 6])) == [
        Move(2, 5, False),
        Move(6, 3, False),
    ]


def test_copies_follow_fresh_blocks_to_the_slots_placement_gave_them() -> None:
    tracker = pool(live=[1], cached=[2, 3])
    tracker.append_requests({"new": [9, 10]})
    tracker.place_blocks([10], [4])  # an evicted slot was free for one of them: 10 -> 4
    moves = plan_compaction(tracker, EngineConfig())
    assert list(moves) == [Move(4, 3, True), Move(9, 2, True)]
    assert list(plan_copies(tracker, moves, fresh_ids=[9, 10])) == [
        Move(3, 4, False),
        Move(2, 9, False),
    ]


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


# --- bucket-aware compaction (decode_buckets) ---------------------------------------------
def test_a_decode_bucket_is_the_smallest_that_holds_the_blocks_else_the_pool() -> None:
    assert [decode_bucket((4, 8), n, 16) for n in (1, 4, 5, 8, 9, 16)] == [4, 4, 8, 8, 16, 16]


def test_buckets_compact_when_the_moves_lower_the_bucket() -> None:
    tracker = pool(live=[1, 2, 9])  # reads 10 blocks: bucket 16; packed, 4 fit bucket 4
    moves = bucket_compaction(tracker, (4, 8, 16))
    assert moves == [Move(9, 3, False)]
    assert bucket_after(tracker, (4, 8, 16), moves) == 4


def test_buckets_ignore_holes_that_do_not_change_the_bucket() -> None:
    # 3 holes below 7 (the threshold policy at 0 would move the run 6-7 to 3-4), but
    # packed the 4 live blocks still need 5 slots: bucket 8 either way.
    tracker = pool(live=[1, 2, 6, 7])
    assert compaction(tracker) == [Move(6, 3, False), Move(7, 4, False)]
    config = EngineConfig(threshold=0, decode_buckets=(4, 8, 16))
    assert not should_compact(tracker, config, is_forced=False)
    assert bucket_compaction(tracker, (4, 8, 16)) == []


def test_buckets_move_only_the_blocks_above_the_lower_bucket() -> None:
    # Bucket 8 holds the 3 live blocks; 5 already sits inside it and stays (the threshold
    # pass would also move it down to 3).
    tracker = pool(live=[1, 5, 13])
    assert compaction(tracker) == [Move(13, 2, False), Move(5, 3, False)]
    assert bucket_compaction(tracker, (8, 16)) == [Move(13, 2, False)]


def test_buckets_aim_at_the_lowest_bucket_within_reach() -> None:
    # 3 live blocks fit bucket 4, not just 8: both blocks above 3 move.
    tracker = pool(live=[1, 6, 13])
    moves = bucket_compaction(tracker, (4, 8, 16))
    assert moves == [Move(6, 3, False), Move(13, 2, False)]
    assert bucket_after(tracker, (4, 8, 16), moves) == 4


def test_capped_moves_that_cannot_reach_a_lower_bucket_do_nothing() -> None:
    # Packed, 6 slots fit bucket 8, but 3 blocks sit at 8 or above: a cap of 2 leaves 12
    # in place, still in bucket 16, so nothing moves.
    tracker = pool(live=[1, 2, 12, 13, 14])
    config = EngineConfig(max_moves_per_step=2, decode_buckets=(8, 16))
    assert should_compact(tracker, config, is_forced=False)
    assert bucket_compaction(tracker, (8, 16), max_moves=2) == []
    assert bucket_compaction(tracker, (8, 16), max_moves=3) == [
        Move(12, 3, False),
        Move(13, 4, False),
        Move(14, 5, False),
    ]


def test_a_cap_that_reaches_an_intermediate_bucket_goes_there() -> None:
    # Packed, 6 slots fit bucket 8, out of reach with a cap of 1 (13 stays). Moving 14
    # alone leaves 14 blocks to read (0..13): bucket 14, below 16, so that one move runs.
    tracker = pool(live=[1, 2, 3, 13, 14])
    moves = bucket_compaction(tracker, (8, 14, 16), max_moves=1)
    assert moves == [Move(14, 4, False)]
    assert bucket_after(tracker, (8, 14, 16), moves) == 14


def test_above_the_last_bucket_the_pool_is_the_bucket() -> None:
    tracker = pool(live=[1, 12])  # 13 blocks: past bucket 8, so the pool's 16
    assert bucket_compaction(tracker, (8,)) == [Move(12, 2, False)]


def test_a_bucket_pass_prefers_an_empty_destination_below_the_bucket() -> None:
    tracker = pool(live=[1, 13], cached=[2])
    assert bucket_compaction(tracker, (8, 16)) == [Move(13, 3, False)]
    # No empty slot below bucket 8 (2-7 live or cached): the cached one is swapped.
    tracker = pool(live=[1, 2, 3, 4, 5, 13], cached=[6, 7])
    assert bucket_compaction(tracker, (8, 16)) == [Move(13, 6, True)]


def test_a_scheduled_pass_with_buckets_packs_like_the_threshold_policy() -> None:
    tracker = pool(live=[1, 2, 6, 7])
    config = EngineConfig(decode_buckets=(4, 8, 16))
    assert should_compact(tracker, config, is_forced=True)
    assert list(plan_compaction(tracker, config, is_forced=True)) == compaction(tracker)


def test_buckets_never_trigger_on_an_empty_or_packed_pool() -> None:
    config = EngineConfig(threshold=0, decode_buckets=(4, 8, 16))
    for tracker in (pool(live=[]), pool(live=[1, 2, 3, 4, 5])):
        assert not should_compact(tracker, config, is_forced=False)
        assert list(plan_compaction(tracker, config)) == []
