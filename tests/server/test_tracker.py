"""Tracker internals the engine relies on for speed: batch digests, the slot sets' chunked
queries and the numpy view."""

import random

import numpy as np

from kvdefrag.common import pair_digest
from kvdefrag.common.digest import pair_digest_array, pair_digests
from kvdefrag.server._policy import plan_compaction, plan_placement
from kvdefrag.server._snapshot import MappingSnapshots
from kvdefrag.server._tracker import BlockTracker, _SlotSet
from kvdefrag.server.config import EngineConfig


def test_batch_digest_equals_the_scalar_digest_on_both_paths() -> None:
    rng = random.Random(7)
    for size in (0, 1, 31, 32, 33, 500):
        logical = [rng.randrange(1, 1 << 31) for _ in range(size)]
        physical = [rng.randrange(1, 1 << 31) for _ in range(size)]
        expected = [pair_digest(l_id, p_id) for l_id, p_id in zip(logical, physical, strict=True)]
        assert pair_digests(logical, physical) == expected
        assert pair_digest_array(logical, physical).tolist() == expected  # the tracker's


def test_slot_set_queries_equal_a_plain_scan_across_chunks() -> None:
    # Pools of one chunk, exactly a chunk, a chunk and a slot, and several; sets from empty
    # to full; every query bound, including 0, 1 and beyond the pool.
    rng = random.Random(11)
    for num_blocks in (2, 3, 1024, 1025, 2048, 5000):
        for density in (0.0, 0.02, 0.5, 0.98, 1.0):
            members = {slot for slot in range(1, num_blocks) if rng.random() < density}
            slots = _SlotSet(num_blocks)
            slots.add(sorted(members))
            if members:
                slots.remove([rng.choice(sorted(members))])  # counts follow removals too
                members = {slot for slot in range(1, num_blocks) if slots.mask[slot]}
            non_members = [slot for slot in range(1, num_blocks) if slot not in members]
            assert slots.max() == max(members, default=0)
            for _ in range(20):
                max_slots = rng.choice([0, 1, 7, 512, num_blocks + 2])
                below = rng.choice([0, 1, 2, rng.randrange(num_blocks + 2), num_blocks + 1])
                expected_in = sorted(slot for slot in members if slot < below)[:max_slots]
                expected_out = [slot for slot in non_members if slot < below][:max_slots]
                assert slots.lowest(max_slots, below, is_in=True).tolist() == expected_in
                assert slots.lowest(max_slots, below, is_in=False).tolist() == expected_out
                expected_high = sorted(members, reverse=True)[:max_slots]
                assert slots.highest(max_slots).tolist() == expected_high


def test_published_mapping_follows_fwd_after_a_compaction() -> None:
    tracker = BlockTracker(4096, prefix_caching=False)
    rng = random.Random(3)
    live = rng.sample(range(2048, 4096), 600)
    for logical_id in live:
        tracker.acquire(logical_id)
    moves = plan_compaction(tracker, EngineConfig(max_moves_per_step=512))
    src_ids = [move.src_physical_id for move in moves]
    dst_ids = [move.dst_physical_id for move in moves]
    assert len(src_ids) == 512 and all(dst < src for src, dst in zip(src_ids, dst_ids, strict=True))
    snapshots = MappingSnapshots(4096)
    snapshots.publish(tracker.fwd, tracker.take_remapped())
    everything = np.arange(4096)
    assert snapshots.read(everything).tolist() == tracker.fwd
    tracker.move_live_blocks(src_ids, dst_ids)
    assert snapshots.read(everything).tolist() != tracker.fwd  # not until published
    snapshots.publish(tracker.fwd, tracker.take_remapped())
    assert snapshots.read(everything).tolist() == tracker.fwd
    assert tracker.take_remapped() == []
    assert sorted(tracker.fwd) == list(range(4096))
    assert all(tracker.bwd[tracker.fwd[i]] == i for i in range(4096))
    live_pairs = [(i, tracker.fwd[i]) for i in live]
    digest = 0
    for logical_id, physical_id in live_pairs:
        digest ^= pair_digest(logical_id, physical_id)
    assert tracker.digest == digest


def test_blocks_made_live_unmixed_enter_the_digest_once_where_placement_leaves_them() -> None:
    # A step's order: releases, appends with the digests unmixed, placement, then one mix.
    # Batches below and above the vector threshold, with and without prefix caching.
    rng = random.Random(5)
    for prefix_caching in (False, True):
        for batch in (3, 40):
            deferred = BlockTracker(2048, prefix_caching)
            at_once = BlockTracker(2048, prefix_caching)
            held = rng.sample(range(1, 2048), 300)
            for tracker in (deferred, at_once):
                tracker.append_requests({f"r{i}": [block] for i, block in enumerate(held)})
                tracker.drop_requests([f"r{i}" for i in range(0, 300, 2)])
                for block in held[0:300:2]:
                    tracker.evict(block)
            free = [block for block in range(1, 2048) if not deferred.refs[block]]
            fresh = rng.sample(free[len(free) // 2 :], batch)  # high: placement moves them
            lists = {"new": fresh}
            newly_live = deferred.append_requests(lists, mix_digests=False)
            placed_ids, targets = plan_placement(deferred, fresh)
            deferred.place_blocks(placed_ids, targets, mix_digests=False)
            deferred.mix_live_digests(newly_live)
            at_once.append_requests(lists)
            assert plan_placement(at_once, fresh) == (placed_ids, targets)
            at_once.place_blocks(placed_ids, targets)
            assert placed_ids
            assert deferred.fwd == at_once.fwd
            live = [block for block in range(1, 2048) if deferred.refs[block]]
            expected = 0
            for logical_id in live:
                expected ^= pair_digest(logical_id, deferred.fwd[logical_id])
            assert deferred.digest == at_once.digest == expected


def assert_slot_sets_match_the_blocks(tracker: BlockTracker) -> None:
    """The live and expendable sets (masks and chunk counts) against a plain scan."""
    refs, cached, bwd = tracker.refs, tracker.cached, tracker.bwd
    slots = range(tracker.num_blocks)
    live = [slot for slot in slots if refs[bwd[slot]]]
    expendable = [slot for slot in slots if slot and not refs[bwd[slot]] and not cached[bwd[slot]]]
    for slot_set, members in ((tracker._live, live), (tracker._expendable, expendable)):
        assert np.flatnonzero(slot_set.mask).tolist() == members
        counts = np.bincount(
            np.asarray(members, dtype=np.intp) >> 10, minlength=len(slot_set.counts)
        )
        assert slot_set.counts.tolist() == counts.tolist()


def test_placements_and_moves_keep_both_slot_sets_exact() -> None:
    # Batches below and above the scalar-update limit, with targets that an earlier block of
    # the same batch vacated, on pools of several chunks; then a compaction of the result.
    rng = random.Random(13)
    num_vacated_targets = 0
    for prefix_caching in (False, True):
        for batch in (5, 12, 60):
            tracker = BlockTracker(3000, prefix_caching)
            held = rng.sample(range(1, 3000), 1500)
            tracker.append_requests({f"r{i}": [block] for i, block in enumerate(held)})
            tracker.drop_requests([f"r{i}" for i in range(0, 1500, 3)])
            free = [block for block in range(1, 3000) if not tracker.refs[block]]
            fresh = rng.sample(free, batch)
            tracker.append_requests({"new": fresh})
            placed_ids, targets = plan_placement(tracker, fresh)
            vacated = {tracker.fwd[logical_id] for logical_id in placed_ids}
            num_vacated_targets += len(vacated & set(targets))
            tracker.place_blocks(placed_ids, targets)
            assert_slot_sets_match_the_blocks(tracker)
            moves = plan_compaction(tracker, EngineConfig(max_moves_per_step=100))
            assert moves
            tracker.move_live_blocks(moves.src_ids, moves.dst_ids)
            assert_slot_sets_match_the_blocks(tracker)
    assert num_vacated_targets > 0
