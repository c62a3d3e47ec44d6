"""The scheduler side's ledger without vLLM: each step planned from what changed."""

from __future__ import annotations

import pytest

from kvdefrag.common import StepEvents
from kvdefrag.vllm._scheduler.ledger import (
    DEFERRED_PREFIX,
    BlockLedger,
    LedgerDiverged,
    StepChanges,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def never_cached(block_id: int) -> bool:
    return False


def ledger(*, prefix_caching: bool = False) -> BlockLedger:
    return BlockLedger(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prefix_caching=prefix_caching)


def test_a_new_request_is_new_blocks_and_its_uncomputed_blocks_are_fresh() -> None:
    book = ledger()

    # 5 computed tokens: blocks 0 and 1 hold data (a partly computed block keeps it)
    events = book.plan(
        StepChanges(full_rows={"a": [3, 4, 5, 6]}, num_computed_tokens={"a": 5}), never_cached
    )

    assert events == StepEvents(new_blocks={"a": [3, 4, 5, 6]}, fresh=[5, 6])
    assert book.held == {"a": [3, 4, 5, 6]}
    assert [book.refs[i] for i in (3, 4, 5, 6, 7)] == [1, 1, 1, 1, 0]


def test_a_running_request_appends_and_only_appended_blocks_past_the_computed_are_fresh() -> None:
    book = ledger()
    book.plan(StepChanges(full_rows={"a": [3, 4]}, num_computed_tokens={"a": 0}), never_cached)

    # 9 computed tokens: the request's third block (index 2, appended) already holds one
    events = book.plan(
        StepChanges(appended={"a": [9, 10]}, num_computed_tokens={"a": 9}), never_cached
    )

    assert events == StepEvents(new_blocks={"a": [9, 10]}, fresh=[10])
    assert book.held == {"a": [3, 4, 9, 10]}


def test_a_request_not_scheduled_has_no_fresh_block() -> None:
    book = ledger()
    book.plan(StepChanges(full_rows={"a": [3]}, num_computed_tokens={"a": 0}), never_cached)

    events = book.plan(StepChanges(appended={"a": [7]}), never_cached)

    assert events == StepEvents(new_blocks={"a": [7]}, fresh=[])


def test_a_replaced_list_is_resumed_and_a_released_request_finished() -> None:
    book = ledger()
    book.plan(
        StepChanges(
            full_rows={"a": [3, 4], "b": [5], "c": [6]},
            num_computed_tokens={"a": 0, "b": 0, "c": 0},
        ),
        never_cached,
    )

    # b preempted; a recomputed into other blocks; c untouched; z was never known
    events = book.plan(
        StepChanges(released=["b", "z"], full_rows={"a": [8, 4, 2]}, num_computed_tokens={"a": 0}),
        never_cached,
    )

    assert events == StepEvents(finished=("b",), resumed={"a": [8, 4, 2]}, fresh=[8, 4, 2])
    assert [book.refs[i] for i in (2, 3, 4, 5, 6, 8)] == [1, 0, 1, 0, 1, 1]


def test_a_request_released_and_readmitted_in_one_step_is_in_both_fields() -> None:
    book = ledger()
    book.plan(StepChanges(full_rows={"a": [3, 4]}, num_computed_tokens={"a": 0}), never_cached)

    events = book.plan(
        StepChanges(released=["a"], full_rows={"a": [7]}, num_computed_tokens={"a": 0}),
        never_cached,
    )

    assert events == StepEvents(finished=("a",), new_blocks={"a": [7]}, fresh=[7])


def test_the_null_block_and_copy_targets_are_never_fresh() -> None:
    events = ledger().plan(
        StepChanges(
            full_rows={"a": [0, 0, 5, 6]}, num_computed_tokens={"a": 0}, not_fresh=frozenset({6})
        ),
        never_cached,
    )

    assert events.fresh == [5]
    assert events.new_blocks == {"a": [0, 0, 5, 6]}


def test_a_block_two_requests_get_in_one_step_is_fresh_once() -> None:
    events = ledger(prefix_caching=True).plan(
        StepChanges(full_rows={"a": [5, 6], "b": [5, 7]}, num_computed_tokens={"a": 0, "b": 0}),
        never_cached,
    )

    assert events.fresh == [5, 6, 7]


def test_parked_blocks_stay_live_until_they_return_then_they_are_freed() -> None:
    book = ledger(prefix_caching=True)
    book.plan(StepChanges(full_rows={"a": [3, 4]}, num_computed_tokens={"a": 0}), never_cached)
    parked = f"{DEFERRED_PREFIX}0"

    events = book.plan(StepChanges(released=["a"], parked={parked: [3, 4]}), never_cached)

    # released and parked at once: the engines keep the blocks live, nothing evicted
    assert events == StepEvents(finished=("a",), new_blocks={parked: [3, 4]}, fresh=[])
    assert book.refs[3] == book.refs[4] == 1
    hashed = {4}

    events = book.plan(StepChanges(unparked=[parked]), hashed.__contains__)

    assert events == StepEvents(finished=(parked,), evicted=[3], fresh=[])
    assert book.cached_free == {4}


def test_with_prefix_caching_freed_blocks_stay_cached_until_their_hash_is_dropped() -> None:
    book = ledger(prefix_caching=True)
    book.plan(StepChanges(full_rows={"a": [3, 4, 5]}, num_computed_tokens={"a": 0}), never_cached)
    hashed = {3, 4}

    events = book.plan(StepChanges(released=["a"]), hashed.__contains__)

    # 5 had no hash: dropped at once; 3 and 4 stay cached free blocks
    assert events == StepEvents(finished=("a",), evicted=[5], fresh=[])
    assert book.cached_free == {3, 4}

    # b hits 3 (computed, so not fresh): no longer free
    events = book.plan(
        StepChanges(full_rows={"b": [3]}, num_computed_tokens={"b": BLOCK_SIZE}),
        hashed.__contains__,
    )
    assert events == StepEvents(new_blocks={"b": [3]}, fresh=[])
    assert book.cached_free == {4}

    # reset_prefix_cache: every cached free block loses its content
    events = book.plan(StepChanges(is_cache_reset=True), hashed.__contains__)
    assert events == StepEvents(evicted=[4], fresh=[])
    assert book.cached_free == set()


def test_a_block_still_held_by_another_request_is_not_freed() -> None:
    book = ledger(prefix_caching=True)
    book.plan(
        StepChanges(full_rows={"a": [3, 4], "b": [3, 6]}, num_computed_tokens={"a": 0, "b": 0}),
        never_cached,
    )

    events = book.plan(StepChanges(released=["a"]), never_cached)

    assert events == StepEvents(finished=("a",), evicted=[4], fresh=[])
    assert book.refs[3] == 1


def test_without_prefix_caching_nothing_is_cached_or_evicted() -> None:
    book = ledger()
    book.plan(StepChanges(full_rows={"a": [3, 4]}, num_computed_tokens={"a": 0}), never_cached)

    events = book.plan(StepChanges(released=["a"]), lambda block_id: True)

    assert events == StepEvents(finished=("a",), fresh=[])
    assert book.cached_free == set()


def test_plans_do_not_depend_on_the_order_of_the_changes() -> None:
    rows = {"b": [7, 8], "a": [3], "c": [9]}
    first = ledger().plan(
        StepChanges(full_rows=rows, num_computed_tokens={"a": 0, "b": 0, "c": 0}), never_cached
    )
    second = ledger().plan(
        StepChanges(full_rows=dict(reversed(rows.items())), num_computed_tokens={"c": 0}),
        never_cached,
    )

    assert list(first.new_blocks) == list(second.new_blocks) == ["a", "b", "c"]


# --- the audit ------------------------------------------------------------------------
def test_the_audit_passes_when_the_ledger_matches_vllm() -> None:
    book = ledger(prefix_caching=True)
    book.plan(
        StepChanges(full_rows={"a": [3, 4], "b": [5]}, num_computed_tokens={"a": 0}),
        never_cached,
    )
    book.plan(StepChanges(released=["b"], parked={f"{DEFERRED_PREFIX}0": [5]}), never_cached)
    book.plan(StepChanges(released=[]), never_cached)
    book.held["gone"] = []  # an empty list is no request: vLLM leaves those out too
    del book.held["gone"]

    book.audit({"a": [3, 4], "idle": []}, [[5]], never_cached)


def test_the_audit_names_every_difference() -> None:
    book = ledger(prefix_caching=True)
    book.plan(
        StepChanges(full_rows={"a": [3, 4], "b": [5]}, num_computed_tokens={"a": 0}),
        never_cached,
    )
    hashed = {9}

    with pytest.raises(LedgerDiverged) as raised:
        book.audit({"a": [3, 7], "c": [8]}, [[6]], hashed.__contains__)

    message = str(raised.value)
    assert "requests vLLM holds but the ledger does not: ['c'] (1)" in message
    assert "requests the ledger holds but vLLM does not: ['b'] (1)" in message
    assert "request 'a': vLLM [3, 7], ledger [3, 4]" in message
    assert "deferred frees: vLLM [[6]], ledger []" in message
    assert "cached free blocks: vLLM has [9] (1) that the ledger lacks" in message
