"""One test per rule of docs/design/step.md, on real CPU KV tensors with signed blocks."""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch

from kvdefrag.common import InvalidArgument, NotFound, StepEvents, mapping_digest
from kvdefrag.server import Engine, EngineConfig, Move, StepResult

from support.doubles import ScriptedExecutor
from support.kv import SignedKv, make_kv_caches
from support.reference_model import (
    ReferenceModel,
    assert_engine_agrees,
    assert_step_result,
    physical_layout,
)

BLOCK_SIZE = 4
NO_TRIGGER = 10_000  # a threshold compaction never reaches in these small pools


class Harness:
    """An engine, its signed KV caches and the reference model, stepped together."""

    def __init__(
        self,
        num_blocks: int = 32,
        *,
        threshold: int = NO_TRIGGER,
        prefix_caching: bool = False,
        kv_lock: threading.Lock | None = None,
        **options: Any,
    ) -> None:
        self.kv = SignedKv.create(num_blocks, block_size=BLOCK_SIZE)
        self.executor = ScriptedExecutor.for_kv(self.kv)
        self.engine = Engine(
            self.kv.kv_caches,
            BLOCK_SIZE,
            EngineConfig(threshold=threshold, prefix_caching=prefix_caching, **options),
            executor=self.executor,
            kv_lock=kv_lock,
        )
        self.model = ReferenceModel(num_blocks, prefix_caching)

    def step(self, step_events: StepEvents | None = None) -> StepResult:
        """Steps engine and model, writes fresh blocks, checks everything that must agree."""
        step_events = StepEvents() if step_events is None else step_events
        before = physical_layout(self.engine)
        result = self.engine.step(step_events)
        outcome = self.model.apply(step_events)
        after = assert_engine_agrees(self.engine, self.model)
        assert_step_result(
            result,
            before,
            after,
            outcome.newly_referenced,
            self.engine.config.max_moves_per_step,
        )
        assert result.num_unknown_finished == outcome.num_unknown_finished
        assert result.digest == self.engine.digest
        assert result.stats == self.engine.stats()
        self.kv.write_fresh(self.engine, outcome.fresh)
        assert self.lost_blocks() == []
        return result

    def lost_blocks(self) -> list[int]:
        """Blocks whose content must survive but do not read their signature."""
        return self.kv.lost_blocks(self.engine, self.model.holds_data())

    def snapshot(self) -> tuple[Any, ...]:
        engine = self.engine
        return (
            engine.stats(),
            engine.digest,
            physical_layout(engine).tolist(),
            engine.list_requests(),
            self.kv.lost_blocks(engine, range(engine.num_blocks)),
        )


def one_block_requests(first: int, last: int) -> dict[str, list[int]]:
    """Requests r<i> holding the single block i, for i in [first, last]."""
    return {f"r{i}": [i] for i in range(first, last + 1)}


# --- order of events -------------------------------------------------------------------
def test_finished_then_resumed_then_new_blocks() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"a": [1, 2], "b": [3, 4], "c": [5]}))
    h.step(
        StepEvents(
            finished=["a", "b"],
            resumed={"b": [6, 3]},
            new_blocks={"a": [1, 7], "b": [8]},
        )
    )
    # "a" was finished, then re-admitted; "b" finished, resumed with a new list, then grew.
    assert h.engine.list_requests() == {"a": [1, 7], "b": [6, 3, 8], "c": [5]}
    assert h.engine.stats().num_live == 6


def test_request_finished_and_readmitted_in_one_step_keeps_its_new_blocks() -> None:
    h = Harness(threshold=0)
    h.step(StepEvents(new_blocks={"r": [3, 4], "s": [10]}))
    result = h.step(StepEvents(finished=["r"], new_blocks={"r": [12, 13]}))
    assert h.engine.request_blocks("r") == [12, 13]
    assert {12, 13} <= set(result.block_mapping)
    # The new blocks stay live through later churn and compaction.
    h.step(StepEvents(finished=["s"], new_blocks={"t": [20, 21, 22]}))
    h.step(StepEvents(finished=["t"]))
    assert h.engine.request_blocks("r") == [12, 13]
    assert h.engine.stats().num_live == 2


def test_block_freed_and_reallocated_in_one_step_stays_live() -> None:
    h = Harness(threshold=0)
    h.step(StepEvents(new_blocks={"a": [1, 2, 3]}))
    h.step(StepEvents(finished=["a"], new_blocks={"b": [2, 3]}))
    assert h.engine.stats().num_live == 2
    assert h.engine.request_blocks("b") == [2, 3]


def test_resumed_list_replaces_the_old_one() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"r": [1, 2, 3], "s": [4]}))
    h.step(StepEvents(resumed={"r": [5, 2]}))
    assert h.engine.list_requests() == {"r": [5, 2], "s": [4]}
    assert h.engine.stats().num_live == 3
    # The released blocks are really free: another request may take them as fresh.
    h.step(StepEvents(new_blocks={"t": [1, 3]}, fresh=[1, 3]))
    assert h.engine.stats().num_live == 5


def test_a_fresh_block_may_be_one_its_only_holder_releases_in_the_same_step() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"a": [1, 2], "b": [2, 3]}))
    before = h.engine.digest
    # Block 2 is held by "a" and "b": finishing "a" alone leaves it holding b's data.
    with pytest.raises(InvalidArgument, match="fresh: block id 2 still holds data"):
        h.engine.step(StepEvents(finished=["a"], new_blocks={"c": [2, 4]}, fresh=[4, 2]))
    assert h.engine.digest == before
    assert h.engine.list_requests() == {"a": [1, 2], "b": [2, 3]}  # nothing changed
    # Finishing both releases every reference, so it may be reused as fresh.
    h.step(StepEvents(finished=["a", "b"], new_blocks={"c": [2, 4]}, fresh=[4, 2]))
    assert h.engine.list_requests() == {"c": [2, 4]}
    assert h.lost_blocks() == []


def test_resumed_request_keeps_cached_content_of_its_old_blocks() -> None:
    h = Harness(prefix_caching=True)
    h.step(StepEvents(new_blocks={"r": [1, 2, 3]}, fresh=[1, 2, 3]))
    h.step(StepEvents(resumed={"r": [2, 3, 9]}, fresh=[9]))  # a prefix-cache hit on its own blocks
    assert h.engine.request_blocks("r") == [2, 3, 9]
    assert h.model.cached == {1}
    assert h.lost_blocks() == []


def test_resumed_and_new_blocks_of_one_request_are_appended_in_order() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"r": [1]}))
    h.step(StepEvents(resumed={"r": [2, 3]}, new_blocks={"r": [4]}))
    assert h.engine.request_blocks("r") == [2, 3, 4]


def test_unknown_finished_ids_are_tolerated_and_counted() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"a": [1]}))
    result = h.step(StepEvents(finished=["ghost", "a", "a"]))
    assert result.num_unknown_finished == 2  # "ghost", and "a" a second time
    assert h.engine.list_requests() == {}
    h.step(StepEvents(finished=["ghost"]))
    assert h.engine.stats().totals.num_unknown_finished == 3


# --- validation: all-or-nothing --------------------------------------------------------
LONG_ID = "x" * 257

INVALID_STEPS = [
    ({"new_blocks": {"c": [4, 4]}}, "new_blocks['c']", "4"),
    ({"resumed": {"a": [5, 5]}}, "resumed['a']", "5"),
    ({"new_blocks": {"c": [32]}}, "new_blocks['c']", "32"),
    ({"new_blocks": {"c": [-1]}}, "new_blocks['c']", "-1"),
    ({"resumed": {"a": [99]}}, "resumed['a']", "99"),
    ({"evicted": [32]}, "evicted", "32"),
    ({"evicted": [-3]}, "evicted", "-3"),
    ({"new_blocks": {"c": [4]}, "fresh": [40]}, "fresh", "40"),
    ({"new_blocks": {"c": [4]}, "fresh": [-2]}, "fresh", "-2"),
    ({"new_blocks": {"c": [1.5]}}, "new_blocks['c']", "1.5"),
    ({"new_blocks": {"c": ["4"]}}, "new_blocks['c']", "'4'"),
    ({"new_blocks": {"c": 4}}, "new_blocks['c']", "4"),
    ({"evicted": [None]}, "evicted", "None"),
    ({"new_blocks": {"c": [4]}, "fresh": [4.0]}, "fresh", "4.0"),
    ({"new_blocks": {"": [4]}}, "new_blocks", "''"),
    ({"finished": [""]}, "finished", "''"),
    ({"resumed": {"": [4]}}, "resumed", "''"),
    ({"new_blocks": {LONG_ID: [4]}}, "new_blocks", "256"),
    ({"finished": [LONG_ID]}, "finished", "256"),
    ({"finished": [7]}, "finished", "7"),
    ({"new_blocks": {7: [4]}}, "new_blocks", "7"),
    ({"finished": "a"}, "finished", "str"),
    ({"new_blocks": {"c": [4]}, "fresh": [5]}, "fresh", "5"),  # not allocated this step
    ({"new_blocks": {"c": [1]}, "fresh": [1]}, "fresh", "1"),  # still live in "a"
    ({"new_blocks": {"c": [0]}, "fresh": [0]}, "fresh", "0"),  # the null block
    # A valid part does not get applied when another part is invalid.
    ({"finished": ["a"], "new_blocks": {"c": [4]}, "evicted": [32]}, "evicted", "32"),
    ({"new_blocks": {"c": [4], "d": [5, 5]}}, "new_blocks['d']", "5"),
    ({"finished": ["a"], "resumed": {"b": [6, 40]}}, "resumed['b']", "40"),
]


@pytest.mark.parametrize(("events", "field", "value"), INVALID_STEPS)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_invalid_step_is_refused_and_changes_nothing(
    events: dict[str, Any], field: str, value: str, prefix_caching: bool
) -> None:
    h = Harness(threshold=2, prefix_caching=prefix_caching)
    h.step(
        StepEvents(new_blocks={"a": [1, 2], "b": [3], "y": [4], "z": [5]}, fresh=[1, 2, 3, 4, 5])
    )
    h.step(StepEvents(finished=["y"]))
    h.engine.schedule_defragment()  # pending: must neither run nor be lost
    before = h.snapshot()
    with pytest.raises(InvalidArgument) as info:
        h.engine.step(StepEvents(**events))
    message = str(info.value)
    assert field in message
    assert value in message
    assert h.snapshot() == before
    result = h.step()
    assert result.moves == (Move(5, 4, prefix_caching),)


def test_request_id_of_the_maximum_length_is_accepted() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"y" * 256: [1]}))
    assert h.engine.request_blocks("y" * 256) == [1]


def test_block_lists_must_be_a_mapping_and_nothing_changes() -> None:
    engine = Engine([(torch.zeros(64 * 4, 2), None)], 4, config=EngineConfig(threshold=0))
    engine.step(StepEvents(new_blocks={"a": [9, 10]}))
    before = (engine.stats(), engine.digest, engine.resolve(list(range(64))).tolist())
    with pytest.raises(InvalidArgument, match="new_blocks: expected a mapping"):
        engine.step(StepEvents(new_blocks=[1, 2]))  # type: ignore[arg-type]
    assert (engine.stats(), engine.digest, engine.resolve(list(range(64))).tolist()) == before


# --- the two forms of step() -------------------------------------------------------------
STEPS_AS_KEYWORDS: list[dict[str, Any]] = [
    {"new_blocks": {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7]}},
    {"finished": ["b"], "new_blocks": {"d": [40, 41]}, "fresh": [40]},
    {"finished": ["a"], "resumed": {"c": [6, 7, 50]}, "fresh": []},
    {"new_blocks": {"e": [60]}},
]


def engine_state(engine: Engine) -> tuple[Any, ...]:
    return (
        engine.stats(),
        engine.digest,
        engine.resolve(list(range(engine.num_blocks))).tolist(),
        engine.list_requests(),
    )


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_step_events_value_steps_as_its_keywords_do(prefix_caching: bool) -> None:
    config = EngineConfig(threshold=2, prefix_caching=prefix_caching)
    by_keywords, by_events = (
        Engine(make_kv_caches(64, block_size=BLOCK_SIZE), BLOCK_SIZE, config) for _ in range(2)
    )
    num_moves = 0
    for keywords in STEPS_AS_KEYWORDS:
        expected = by_keywords.step(StepEvents(**keywords))
        got = by_events.step(StepEvents(**keywords))
        assert dataclasses.replace(got, swap_duration_s=0.0) == dataclasses.replace(
            expected, swap_duration_s=0.0
        )
        num_moves += len(got.moves)
    assert engine_state(by_events) == engine_state(by_keywords)
    assert num_moves > 0, "the steps should have compacted"


def test_events_are_applied_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(make_kv_caches(64, block_size=BLOCK_SIZE), BLOCK_SIZE)
    events = StepEvents(new_blocks={"a": [5, 9]})
    applied: list[StepEvents] = []
    apply_events = engine.apply_events
    monkeypatch.setattr(engine, "apply_events", lambda e: applied.append(e) or apply_events(e))
    engine.step(events)
    assert applied == [events] and applied[0] is events
    assert engine.request_blocks("a") == [5, 9]


def test_events_of_another_type_are_refused_and_nothing_changes() -> None:
    engine = Engine(make_kv_caches(64, block_size=BLOCK_SIZE), BLOCK_SIZE)
    engine.step(StepEvents(new_blocks={"a": [9, 10]}))
    before = engine_state(engine)
    for wrong in ({"new_blocks": {"b": [3]}}, None):
        with pytest.raises(InvalidArgument, match="step: expected a StepEvents, got a"):
            engine.step(wrong)  # type: ignore[arg-type]
        assert engine_state(engine) == before
    with pytest.raises(InvalidArgument, match=r"new_blocks\['b'\]: block id '7' is not an"):
        engine.step(StepEvents(new_blocks={"b": ["7"]}))  # type: ignore[list-item]
    assert engine_state(engine) == before


# --- block 0 ---------------------------------------------------------------------------
def test_null_block_is_never_tracked_or_moved() -> None:
    h = Harness(threshold=0, enable_placement=False)
    # vLLM block tables may hold the null block (sliding window); it is never live.
    result = h.step(StepEvents(new_blocks={"a": [0, 0, 5], "b": [0, 9]}, evicted=[0]))
    assert 0 not in result.block_mapping
    assert h.engine.stats().num_live == 2
    assert h.engine.request_blocks("a") == [0, 0, 5]
    for _ in range(3):
        h.step(StepEvents(new_blocks={"c": [30, 31]}, finished=["a"]))
        h.step(StepEvents(finished=["c"], new_blocks={"a": [0, 28]}))
    assert h.engine.resolve([0]).tolist() == [0]
    moved = [m for batch in h.executor.calls for m in batch]
    assert moved, "the scenario should have compacted"
    assert all(0 not in (m.src_physical_id, m.dst_physical_id) for m in moved)


# --- trigger, cap, convergence ---------------------------------------------------------
def test_trigger_boundary_holes_equal_to_threshold_do_not_trigger() -> None:
    h = Harness(threshold=4)
    h.step(StepEvents(new_blocks=one_block_requests(1, 20)))
    result = h.step(StepEvents(finished=["r2", "r4", "r6", "r8"]))
    assert result.moves == ()
    assert result.stats.holes == 4
    assert h.executor.calls == []

    result = h.step(StepEvents(finished=["r10"]))  # holes = threshold + 1
    assert result.moves == (
        Move(20, 2, False),
        Move(19, 4, False),
        Move(18, 6, False),
        Move(17, 8, False),
        Move(16, 10, False),
    )
    assert result.stats.holes == 0
    assert result.stats.max_live == 15
    assert result.num_bytes_moved == 5 * h.executor.bytes_per_block
    assert h.engine.stats().totals.num_defrag_runs == 1


def test_zero_threshold_triggers_on_a_single_hole() -> None:
    h = Harness(threshold=0)
    h.step(StepEvents(new_blocks=one_block_requests(1, 6)))
    result = h.step(StepEvents(finished=["r3"]))
    assert result.moves == (Move(6, 3, False),)
    assert h.engine.resolve([6]).tolist() == [3]


def test_move_cap_and_convergence_over_several_steps() -> None:
    h = Harness(threshold=0, max_moves_per_step=3)
    h.step(StepEvents(new_blocks=one_block_requests(1, 20)))
    holes = []
    result = h.step(StepEvents(finished=[f"r{i}" for i in range(1, 11)]))  # 10 holes at the bottom
    holes.append(result.stats.holes)
    while result.moves:
        assert len(result.moves) <= 3
        result = h.step()
        holes.append(result.stats.holes)
    assert holes == [7, 4, 1, 0, 0]
    assert h.engine.stats().max_live == 10
    assert h.engine.stats().totals.num_moves == 10


def test_decode_buckets_compact_only_when_the_bucket_drops() -> None:
    h = Harness(decode_buckets=(8, 16, 32))  # the threshold is not used
    h.step(StepEvents(new_blocks=one_block_requests(1, 12)))  # reads 13 blocks: bucket 16
    result = h.step(StepEvents(finished=["r2", "r3", "r4"]))  # 9 live need 10 slots: still 16
    assert result.moves == ()
    assert result.stats.holes == 3
    result = h.step(StepEvents(finished=["r5", "r6"]))  # 7 live fit in 8 slots: bucket 8
    assert result.moves == (  # slots 8-12 in a row: they keep their order
        Move(8, 2, False),
        Move(9, 3, False),
        Move(10, 4, False),
        Move(11, 5, False),
        Move(12, 6, False),
    )
    assert (result.stats.max_live, result.stats.holes) == (7, 0)
    result = h.step(StepEvents(new_blocks={"r13": [13]}))  # fresh, placed at 8: 9 blocks, bucket 16
    assert (result.moves, result.stats.max_live) == ((), 8)
    result = h.step(StepEvents(finished=["r1"]))  # 7 live again: slot 8's block goes down to 1
    assert result.moves == (Move(8, 1, False),)


def test_moves_go_down_and_pair_highest_live_with_lowest_free() -> None:
    h = Harness(threshold=1, max_moves_per_step=2)
    h.step(StepEvents(new_blocks={"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8]}))
    result = h.step(StepEvents(finished=["a"]))
    assert result.moves == (Move(7, 1, False), Move(8, 2, False))  # c's run, whole
    result = h.step()
    assert result.moves == ()  # one hole left, threshold 1


# --- shared blocks ---------------------------------------------------------------------
def test_shared_blocks_keep_their_reference_count_when_moved() -> None:
    h = Harness(threshold=3)
    h.step(StepEvents(new_blocks={"low": list(range(1, 9)), "a": [10, 11, 12]}, fresh=[]))
    h.step(StepEvents(new_blocks={"b": [10, 11, 13]}))  # prefix sharing: 10 and 11 referenced twice
    shared_slots = set(h.engine.resolve([10, 11]).tolist())
    result = h.step(StepEvents(finished=["low"]))
    moved_sources = {m.src_physical_id for m in result.moves}
    assert shared_slots <= moved_sources, "the shared blocks should have moved"
    assert h.engine.list_requests() == {"a": [10, 11, 12], "b": [10, 11, 13]}

    h.step(StepEvents(finished=["a"]))  # 10 and 11 are still held by "b"
    assert h.engine.stats().num_live == 3
    assert h.lost_blocks() == []
    h.step(StepEvents(finished=["b"]))
    assert h.engine.stats().num_live == 0


# --- copy direction --------------------------------------------------------------------
def test_moves_are_one_way_without_prefix_caching() -> None:
    h = Harness(threshold=0)
    h.step(StepEvents(new_blocks={"a": [1, 2], "b": [3, 4]}))
    result = h.step(StepEvents(finished=["a"]))
    assert result.moves == (Move(3, 1, False), Move(4, 2, False))
    # One-way: the freed blocks' old content was overwritten, not kept.
    assert h.kv.lost_blocks(h.engine, [1, 2]) == [1, 2]


def test_moves_swap_with_cached_targets_and_copy_one_way_onto_evicted_ones() -> None:
    h = Harness(threshold=3, prefix_caching=True)
    h.step(
        StepEvents(
            new_blocks={"low": [1, 2, 3], "mid": [4, 5, 6, 7], "high": [8]}, fresh=range(1, 9)
        )
    )
    result = h.step(StepEvents(finished=["low"]))  # 1, 2, 3 stay cached; holes == threshold
    assert result.moves == ()
    h.engine.schedule_defragment()
    result = h.step(StepEvents(evicted=[2]))
    assert result.moves == (Move(6, 1, True), Move(7, 2, False), Move(8, 3, True))
    assert h.model.cached == {1, 3}
    assert h.engine.resolve([1, 2, 3, 8, 7, 6]).tolist() == [6, 7, 8, 3, 2, 1]
    stats = h.engine.stats()
    assert (stats.totals.num_moves, stats.totals.num_two_way_moves) == (3, 2)
    bytes_per_block = h.executor.bytes_per_block
    assert result.num_bytes_moved == 5 * bytes_per_block


def test_a_capped_pass_moves_onto_an_empty_slot_rather_than_swap_with_a_cached_one() -> None:
    h = Harness(threshold=0, prefix_caching=True, max_moves_per_step=1, enable_placement=False)
    h.step(StepEvents(new_blocks={"gone": [1, 2], "a": [3, 4]}, fresh=range(1, 5)))
    result = h.step(StepEvents(finished=["gone"], evicted=[2]))  # slot 1 cached, slot 2 empty
    # One move allowed: the top block leaves either way and the pool ends as packed
    # (slot 3 stays live), but onto the empty slot it is a copy, not a swap.
    assert result.moves == (Move(4, 2, False),)
    assert h.engine.stats().max_live == 3
    assert h.model.cached == {1}


def test_cached_blocks_survive_compaction_and_are_reused_as_prefix_hits() -> None:
    h = Harness(threshold=0, prefix_caching=True)
    h.step(StepEvents(new_blocks={"a": [1, 2, 3], "b": [4, 5, 6]}, fresh=range(1, 7)))
    h.step(StepEvents(finished=["a"]))  # cached 1..3 below live 4..6: two-way swaps
    assert h.engine.stats().totals.num_two_way_moves == 3
    h.step(StepEvents(new_blocks={"c": [1, 2, 9]}, fresh=[9]))  # prefix-cache hit on 1, 2
    assert h.engine.request_blocks("c") == [1, 2, 9]


def test_a_fresh_block_moved_into_a_cached_hole_pushes_only_the_cached_data_up() -> None:
    """Prefix caching, every free slot cached: a fresh block allocated high has no empty
    slot to be placed on, so compaction moves it down; one copy of the cached block's
    data into its slot, not a swap. The cached block is then a prefix hit where it went."""
    h = Harness(threshold=0, prefix_caching=True)
    h.step(StepEvents(new_blocks={"warm": list(range(1, 32))}, fresh=range(1, 32)))
    h.step(StepEvents(finished=["warm"]))  # every free block cached
    h.step(StepEvents(new_blocks={"a": [1, 2]}, fresh=[]))  # prefix hits, in place
    result = h.step(StepEvents(new_blocks={"a": [20]}, fresh=[20]))
    assert result.num_placed == 0
    assert result.moves == (Move(3, 20, False),)  # the fresh block takes 3, cached 3 goes up
    assert h.engine.resolve([20, 3]).tolist() == [3, 20]
    assert h.engine.stats().totals.num_two_way_moves == 0
    assert result.num_bytes_moved == h.executor.bytes_per_block
    h.step(StepEvents(new_blocks={"b": [3]}, fresh=[]))  # the harness checks it reads its data


# --- placement -------------------------------------------------------------------------
def test_fresh_blocks_are_placed_without_copying() -> None:
    h = Harness(threshold=0)
    result = h.step(StepEvents(new_blocks={"a": [7, 12, 30]}))
    assert result.block_mapping == {7: 1, 12: 2, 30: 3, 1: 7, 2: 12, 3: 30}
    assert result.num_placed == 3
    assert result.moves == ()
    assert result.stats.holes == 0
    result = h.step(StepEvents(new_blocks={"a": [20], "b": [5, 6]}))
    assert h.engine.resolve([20, 5, 6]).tolist() == [4, 5, 6]
    assert result.num_placed == 1
    assert h.executor.calls == []  # placement is a mapping change only
    assert h.engine.stats().totals.num_placements == 4


def test_without_placement_fresh_blocks_are_compacted_by_copying() -> None:
    h = Harness(threshold=0, enable_placement=False)
    result = h.step(StepEvents(new_blocks={"a": [7, 12, 30]}))
    assert result.num_placed == 0
    assert result.moves == (Move(30, 1, False), Move(12, 2, False), Move(7, 3, False))
    assert len(h.executor.calls) == 1


def test_placement_skips_cached_slots_and_uses_evicted_ones() -> None:
    h = Harness(prefix_caching=True)
    h.step(StepEvents(new_blocks={"a": [1, 2, 3]}, fresh=[1, 2, 3]))
    h.step(StepEvents(finished=["a"]))
    h.step(StepEvents(new_blocks={"b": [10]}, fresh=[10]))
    assert h.engine.resolve([10]).tolist() == [4]
    h.step(StepEvents(new_blocks={"c": [11]}, fresh=[11], evicted=[2]))
    assert h.engine.resolve([11]).tolist() == [2]
    assert h.model.cached == {1, 3}
    assert h.executor.calls == []


def test_fresh_none_places_every_newly_live_block_without_prefix_caching() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"a": [1]}))
    result = h.step(StepEvents(new_blocks={"b": [1, 9]}))  # 1 is shared: holds data, not fresh
    assert result.num_placed == 1
    assert h.engine.resolve([1, 9]).tolist() == [1, 2]


def test_fresh_none_places_nothing_with_prefix_caching() -> None:
    h = Harness(prefix_caching=True)
    result = h.step(StepEvents(new_blocks={"a": [5, 9]}))
    assert result.num_placed == 0
    assert h.engine.resolve([5, 9]).tolist() == [5, 9]
    result = h.step(StepEvents(new_blocks={"b": [20]}, fresh=[20]))
    assert result.num_placed == 1


def test_fresh_none_and_explicit_fresh_agree_without_prefix_caching() -> None:
    implicit, explicit = Harness(threshold=2), Harness(threshold=2)
    steps: list[dict[str, Any]] = [
        {"new_blocks": {"a": [9, 4, 17]}},
        {"new_blocks": {"b": [22, 9]}},
        {"finished": ["a"], "new_blocks": {"c": [4, 30]}},
    ]
    fresh_lists = [[9, 4, 17], [22], [4, 30]]
    for events, fresh in zip(steps, fresh_lists, strict=True):
        a = implicit.step(StepEvents(**events))
        b = explicit.step(StepEvents(**events, fresh=fresh))
        assert (a.block_mapping, a.moves, a.digest) == (b.block_mapping, b.moves, b.digest)


# --- determinism -----------------------------------------------------------------------
def random_events(seed: int, num_blocks: int, num_steps: int) -> list[StepEvents]:
    """A reproducible stream of valid steps with churn, sharing and request id reuse."""
    rng = random.Random(seed)
    model = ReferenceModel(num_blocks, prefix_caching=False)
    stream = []
    for _ in range(num_steps):
        running = sorted(model.requests)
        finished = tuple(rid for rid in running if rng.random() < 0.3)
        trial = model.copy()
        for rid in finished:
            trial.release_request(rid)
        free = sorted(trial.free())
        rng.shuffle(free)
        new_blocks: dict[str, list[int]] = {}
        for _ in range(rng.randrange(3)):
            rid = f"r{rng.randrange(8)}"
            take = min(rng.randrange(1, 5), len(free))
            new_blocks.setdefault(rid, []).extend(free.pop() for _ in range(take))
        live = sorted(trial.live())
        if live and rng.random() < 0.3:
            new_blocks.setdefault(f"s{rng.randrange(4)}", []).append(rng.choice(live))
        events = StepEvents(finished=finished, new_blocks=new_blocks)
        model.apply(events)
        stream.append(events)
    return stream


def test_same_events_give_the_same_moves_and_mapping() -> None:
    stream = random_events(seed=7, num_blocks=64, num_steps=80)
    kv_a = make_kv_caches(64, block_size=BLOCK_SIZE)
    kv_b = make_kv_caches(64, block_size=BLOCK_SIZE, dtype=torch.bfloat16, mla=True)
    config = EngineConfig(threshold=3, max_moves_per_step=4)
    engines = [Engine(kv, BLOCK_SIZE, config) for kv in (kv_a, kv_b)]
    num_moves = 0
    for events in stream:
        assert events.fresh is None
        results = [engine.step(events) for engine in engines]
        first, second = (
            (
                r.block_mapping,
                r.moves,
                r.num_placed,
                r.digest,
                dataclasses.replace(
                    r.stats, totals=dataclasses.replace(r.stats.totals, num_bytes_moved=0)
                ),
            )
            for r in results
        )
        assert first == second
        num_moves += len(results[0].moves)
    assert num_moves > 0 and engines[0].stats().totals.num_placements > 0
    assert physical_layout(engines[0]).tolist() == physical_layout(engines[1]).tolist()


# --- forced passes, reset, digest ------------------------------------------------------
def test_schedule_defragment_forces_a_pass_in_the_next_step_only() -> None:
    h = Harness(threshold=10)
    h.step(StepEvents(new_blocks=one_block_requests(1, 8)))
    result = h.step(StepEvents(finished=["r1", "r2"]))
    assert result.moves == ()
    h.engine.schedule_defragment()
    assert h.executor.calls == []  # nothing moves outside a step
    result = h.step()
    assert result.moves == (Move(7, 1, False), Move(8, 2, False))
    h.step(StepEvents(finished=["r3"]))
    result = h.step()
    assert result.moves == ()
    assert result.stats.holes == 1


def test_reset_forgets_everything_and_restores_the_identity() -> None:
    h = Harness(threshold=10)
    h.step(StepEvents(new_blocks={"a": [5, 6, 7], "b": [9]}))
    h.step(StepEvents(finished=["a"]))
    h.engine.schedule_defragment()
    h.engine.reset()
    stats = h.engine.stats()
    assert (stats.num_live, stats.max_live, stats.holes, stats.num_requests) == (0, 0, 0, 0)
    assert stats.is_healthy
    assert h.engine.digest == 0
    assert physical_layout(h.engine).tolist() == list(range(32))
    assert h.engine.list_requests() == {}
    # The engine works from scratch; the pending forced pass was dropped.
    result = h.engine.step(StepEvents(new_blocks={"c": [1, 5]}, fresh=[]))
    assert result.moves == () and result.num_placed == 0
    assert result.stats.holes == 3


def test_a_reset_while_a_pass_holds_kv_lock_publishes_the_identity_after_the_pass() -> None:
    """A worker's pass reads one mapping from its start to its end: Reset waits for
    ``kv_lock`` before it publishes the identity."""
    kv_lock = threading.Lock()
    h = Harness(threshold=0, kv_lock=kv_lock)
    h.step(StepEvents(new_blocks={"a": [5, 6, 7], "b": [9, 10]}))
    h.step(StepEvents(finished=["a"]))  # b moves down
    moved = physical_layout(h.engine).tolist()
    assert moved != list(range(32))
    with kv_lock:  # a pass is running
        resetting = threading.Thread(target=h.engine.reset)
        resetting.start()
        resetting.join(timeout=0.5)
        assert resetting.is_alive()
        assert physical_layout(h.engine).tolist() == moved
        assert h.engine.resolve([9, 10]).tolist() == [moved[9], moved[10]]
    resetting.join(timeout=10)
    assert not resetting.is_alive()
    assert physical_layout(h.engine).tolist() == list(range(32))


def test_digest_is_the_mapping_digest_of_the_live_pairs() -> None:
    h = Harness(threshold=1)
    assert h.engine.digest == 0 == mapping_digest([])
    h.step(StepEvents(new_blocks={"a": [4, 8, 15], "b": [16, 23]}))
    result = h.step(StepEvents(finished=["a"], new_blocks={"c": [10, 8]}))
    mapping = physical_layout(h.engine)
    live = [8, 10, 16, 23]
    assert result.digest == mapping_digest((i, int(mapping[i])) for i in live)


def test_block_mapping_covers_every_newly_referenced_or_moved_id() -> None:
    h = Harness(threshold=0)
    h.step(StepEvents(new_blocks={"a": [1, 2, 3, 4], "b": [5, 6]}))
    result = h.step(StepEvents(finished=["a"], new_blocks={"b": [5 + 20]}, fresh=[]))
    # 25 is not fresh (says the caller), so it is compacted by a copy.
    moved_sources = {m.src_physical_id for m in result.moves}
    assert moved_sources == {25, 6, 5}
    assert set(result.block_mapping) == {1, 2, 3, 25, 6, 5}


# --- construction errors ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "field", "value"),
    [
        ({"threshold": -1}, "threshold", "-1"),
        ({"max_moves_per_step": 0}, "max_moves_per_step", "0"),
        ({"pad_buckets": ()}, "pad_buckets", "()"),
        ({"pad_buckets": (16, 8)}, "pad_buckets", "(16, 8)"),
        ({"pad_buckets": (0, 8)}, "pad_buckets", "(0, 8)"),
        ({"pad_buckets": (8, 8)}, "pad_buckets", "(8, 8)"),
    ],
)
def test_bad_configuration_is_refused(options: dict[str, Any], field: str, value: str) -> None:
    with pytest.raises(InvalidArgument, match=field) as info:
        EngineConfig(**options)
    assert value in str(info.value)


def test_a_bad_block_size_is_refused() -> None:
    kv = make_kv_caches(8, block_size=BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match="block_size") as info:
        Engine(kv, 0)
    assert "0" in str(info.value)


def test_engine_takes_the_documented_positional_and_keyword_arguments() -> None:
    kv = make_kv_caches(8, block_size=16)
    engine = Engine(kv, 16, EngineConfig(threshold=32))
    assert (engine.num_blocks, engine.block_size, engine.config.threshold) == (8, 16, 32)
    assert engine.config == EngineConfig()
    assert engine.config.max_moves_per_step == 512
    assert engine.config.pad_buckets == (8, 16, 32, 64, 128, 256, 512)
    with pytest.raises(TypeError):
        Engine(kv, 16, EngineConfig(), None)  # type: ignore[misc]
    with pytest.raises(InvalidArgument, match="EngineConfig"):
        Engine(kv, 16, 32)  # type: ignore[arg-type]


def _tensor(slots: int) -> torch.Tensor:
    return torch.zeros(slots, 2, 4)


@pytest.mark.parametrize(
    ("kv_caches", "message"),
    [
        ([(_tensor(32), _tensor(28))], "token slots"),
        ([(_tensor(32), _tensor(32)), (_tensor(36), None)], "token slots"),
        ([(_tensor(30), _tensor(30))], "multiple of block_size"),
        ([], "empty"),
        ([(_tensor(32),)], "(key, value) pair"),
        ([(None, _tensor(32))], "kv_caches[0].key"),
        ([(_tensor(32), "value")], "kv_caches[0].value"),
        ([(torch.tensor(1.0), None)], "kv_caches[0].key"),
        ([(_tensor(4), _tensor(4))], "at least 2"),
    ],
)
def test_bad_kv_caches_are_refused(kv_caches: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Engine(kv_caches, BLOCK_SIZE)
    assert message in str(info.value)


def test_num_blocks_comes_from_the_tensors_and_mla_values_may_be_none() -> None:
    kv = make_kv_caches(40, block_size=BLOCK_SIZE, mla=True)
    engine = Engine(kv, BLOCK_SIZE)
    assert engine.num_blocks == 40
    assert engine.resolve(np.arange(40)).tolist() == list(range(40))


def test_an_engine_given_an_executor_needs_no_caches() -> None:
    """As the benches run it: an executor that only counts moves, no KV tensors."""
    executor = ScriptedExecutor.without_kv(32)
    executor.drops_moves = True
    engine = Engine([], BLOCK_SIZE, EngineConfig(threshold=0), executor=executor)
    assert engine.num_blocks == 32
    engine.step(StepEvents(new_blocks={"a": [5, 6]}, fresh=[]))
    assert engine.resolve([5, 6]).tolist() == [1, 2]  # the run 5-6 moved whole
    assert [len(batch) for batch in executor.calls] == [2]


# --- reads -----------------------------------------------------------------------------
def test_resolve_is_vectorised_and_refuses_bad_ids() -> None:
    h = Harness()
    h.step(StepEvents(new_blocks={"a": [7, 12]}))
    assert h.engine.resolve([7, 12, 0]).tolist() == [1, 2, 0]
    assert h.engine.resolve(np.array([[7], [12]])).tolist() == [[1], [2]]
    assert h.engine.resolve([]).tolist() == []
    assert h.engine.resolve_tables([[7, 12], [], [12]]) == [[1, 2], [], [2]]
    for bad, shown in (([32], "32"), ([-1], "-1"), ([1.5], "float")):
        with pytest.raises(InvalidArgument, match="resolve") as info:
            h.engine.resolve(bad)
        assert shown in str(info.value)


def test_request_blocks_of_an_unknown_request_is_not_found() -> None:
    h = Harness()
    with pytest.raises(NotFound, match="'nobody'"):
        h.engine.request_blocks("nobody")


def test_kv_lock_is_taken_only_to_move_blocks() -> None:
    kv_lock = threading.Lock()
    h = Harness(threshold=0, kv_lock=kv_lock)
    assert h.engine.kv_lock is kv_lock
    with kv_lock:  # the worker's forward pass is running
        result = h.step(StepEvents(new_blocks={"a": [7, 12]}))  # placement only: no KV access
        assert result.num_placed == 2
        worker = threading.Thread(
            target=h.engine.step,
            args=(StepEvents(finished=["a"], new_blocks={"b": [30]}, fresh=[]),),
        )
        worker.start()
        worker.join(timeout=0.2)
        assert worker.is_alive(), "the move did not wait for the forward pass"
        assert h.executor.calls == []
    worker.join()
    assert h.executor.calls == [[Move(30, 1, False)]]


def test_the_mode_changes_only_while_the_engine_is_pristine() -> None:
    h = Harness(prefix_caching=False)
    assert h.engine.is_pristine
    h.engine.change_mode(prefix_caching=True)
    assert h.engine.config.prefix_caching and h.engine.is_pristine
    h.engine.step(StepEvents(new_blocks={"req-a": [3, 4]}))
    assert not h.engine.is_pristine
    digest = h.engine.digest
    with pytest.raises(InvalidArgument, match="reset to change the mode"):
        h.engine.change_mode(prefix_caching=False)
    assert h.engine.config.prefix_caching and h.engine.digest == digest
    assert h.engine.request_blocks("req-a") == [3, 4]
    h.engine.reset()
    h.engine.change_mode(prefix_caching=False)
    assert not h.engine.config.prefix_caching
