"""The scheduler side's ledger without vLLM: each step planned from two truths."""

from __future__ import annotations

from kvdefrag.common import StepEvents
from kvdefrag.vllm._ledger import BlockLedger, WorkerRows

BLOCK_SIZE = 4


def never_cached(block_id: int) -> bool:
    return False


def test_a_new_request_is_new_blocks_and_its_uncomputed_blocks_are_fresh() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)

    # 5 computed tokens: blocks 0 and 1 hold data (a partly computed block keeps it)
    plan = ledger.plan({"a": [3, 4, 5, 6]}, {"a": 5}, never_cached)

    assert plan.events == StepEvents(new_blocks={"a": [3, 4, 5, 6]}, fresh=[5, 6])
    assert plan.full_rows == frozenset({"a"})
    assert ledger.held == {"a": [3, 4, 5, 6]}


def test_a_running_request_appends_and_only_its_appended_blocks_can_be_fresh() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)
    ledger.plan({"a": [3, 4]}, {"a": 0}, never_cached)

    plan = ledger.plan({"a": [3, 4, 9]}, {"a": 0}, never_cached)

    assert plan.events == StepEvents(new_blocks={"a": [9]}, fresh=[9])
    assert plan.full_rows == frozenset()


def test_a_request_not_scheduled_has_no_fresh_block() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)
    ledger.plan({"a": [3]}, {"a": 0}, never_cached)

    plan = ledger.plan({"a": [3, 7]}, {}, never_cached)

    assert plan.events == StepEvents(new_blocks={"a": [7]}, fresh=[])


def test_a_replaced_list_is_resumed_and_a_vanished_request_finished() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)
    ledger.plan({"a": [3, 4], "b": [5], "c": [6]}, {"a": 0, "b": 0, "c": 0}, never_cached)

    # b preempted and gone; a recomputed into other blocks; c untouched
    plan = ledger.plan({"a": [8, 4, 2], "c": [6]}, {"a": 0}, never_cached)

    assert plan.events == StepEvents(finished=("b",), resumed={"a": [8, 4, 2]}, fresh=[8, 4, 2])
    assert plan.full_rows == frozenset({"a"})


def test_the_null_block_and_copy_targets_are_never_fresh() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)

    plan = ledger.plan({"a": [0, 0, 5, 6]}, {"a": 0}, never_cached, frozenset({6}))

    assert plan.events.fresh == [5]
    assert plan.events.new_blocks == {"a": [0, 0, 5, 6]}


def test_a_block_two_requests_get_in_one_step_is_fresh_once() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=True)

    plan = ledger.plan({"a": [5, 6], "b": [5, 7]}, {"a": 0, "b": 0}, never_cached)

    assert plan.events.fresh == [5, 6, 7]


def test_with_prefix_caching_freed_blocks_stay_cached_until_their_hash_is_dropped() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=True)
    ledger.plan({"a": [3, 4, 5]}, {"a": 0}, never_cached)
    hashed = {3, 4}

    plan = ledger.plan({}, {}, hashed.__contains__)

    # 5 had no hash: dropped at once; 3 and 4 stay cached free blocks
    assert plan.events == StepEvents(finished=("a",), evicted=[5], fresh=[])
    assert ledger.cached_free == {3, 4}

    hashed.discard(4)  # the pool reused 4 (or reset_prefix_cache ran)
    plan = ledger.plan({"b": [3]}, {"b": BLOCK_SIZE}, hashed.__contains__)

    # b hits 3 (computed, so not fresh); 4 lost its hash
    assert plan.events == StepEvents(new_blocks={"b": [3]}, evicted=[4], fresh=[])
    assert ledger.cached_free == set()


def test_without_prefix_caching_nothing_is_cached_or_evicted() -> None:
    ledger = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=False)
    ledger.plan({"a": [3, 4]}, {"a": 0}, lambda block_id: True)

    plan = ledger.plan({}, {}, lambda block_id: True)

    assert plan.events == StepEvents(finished=("a",), fresh=[])
    assert ledger.cached_free == set()


def test_plans_do_not_depend_on_the_order_of_the_truth() -> None:
    one = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=True)
    other = BlockLedger(block_size=BLOCK_SIZE, prefix_caching=True)
    truth = {"b": [7, 8], "a": [3], "c": [9]}

    first = one.plan(truth, {"a": 0, "b": 0, "c": 0}, never_cached)
    second = other.plan(dict(reversed(truth.items())), {"c": 0, "a": 0, "b": 0}, never_cached)

    assert first.events == second.events
    assert list(first.events.new_blocks) == ["a", "b", "c"]


def test_worker_rows_go_stale_only_when_a_block_they_name_moved() -> None:
    rows = WorkerRows()
    rows.set_row("a", [3, 4])
    rows.set_row("b", [5])
    rows.append("b", [6])
    held = {"a": [3, 4], "b": [5, 6]}
    mapping = {3: 3, 4: 1, 5: 5, 6: 6}  # logical 4 moved to physical 1

    rows.mark_moved([4], held, lambda ids: [mapping[i] for i in ids])

    assert rows.stale == {"a"}
    rows.set_row("a", [3, 1])
    assert rows.stale == set()
    rows.mark_moved([4], {"a": [3, 4]}, lambda ids: [mapping[i] for i in ids])
    assert rows.stale == set()  # its row already names 4 where it is now
    rows.forget(["a", "b"])
    assert rows.rows == {}
