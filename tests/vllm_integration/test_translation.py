"""What turns a worker's block ids physical (``kvdefrag.vllm._worker.translation``): the
output's ids resolved in one lookup, the V1 and V2 runners' persistent rows following the
blocks the rank's service moved, and the engine's log of those moves."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvdefrag.common import StepEvents
from kvdefrag.server import Engine, EngineConfig, Move
from kvdefrag.vllm._worker.translation import (
    BlockIdTranslator,
    Remap,
    remap_v1_runner_rows,
    remap_v2_runner_rows,
    translate_scheduler_output,
)
from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag
from kvdefrag.vllm.refusals import check_v2_runner

from support.runners import (
    NUM_BLOCKS,
    FakeMoveHistory,
    block_naming_output,
    v1_runner,
    v2_runner,
)

BLOCK_SIZE = 4


def test_the_workers_translation_names_every_block_at_its_place() -> None:
    mapping = np.array([0, 5, 6, 7, 1, 2, 3, 4])
    output = block_naming_output()
    translate_scheduler_output(output, mapping)
    assert output.scheduled_new_reqs[0].block_ids == ([5, 6],)
    assert output.scheduled_cached_reqs.new_block_ids == [None, ([7],)]
    assert output.new_block_ids_to_zero == [7]
    assert output.kv_cache_block_copies == [(5, 1)]


def test_the_runners_rows_follow_the_blocks_that_moved() -> None:
    service = FakeMoveHistory()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    assert translator.advance()[1] is None
    runner = v1_runner([[1, 2, 3], [4]])
    # the engine swapped the data of physical 1 and 6, and moved 4 to 5 (5 was free)
    service.compact([0, 6, 2, 3, 5, 4, 1, 7], (1, 6, True), (4, 5, False))
    resolve, remap = translator.advance()
    assert remap is not None and resolve(np.array([1, 4])).tolist() == [6, 5]
    assert sorted(remap.old_ids.tolist()) == [1, 4, 6]
    remap_v1_runner_rows(runner, remap)
    assert runner.requests["r0"].block_ids == ([6, 2, 3],)
    assert runner.requests["r1"].block_ids == ([5],)
    table = runner.input_batch.block_table.block_tables[0].block_table.np
    assert table[0, :3].tolist() == [6, 2, 3] and table[1, :1].tolist() == [5]
    assert table[2:].sum() == 0  # unused rows and the null block stay 0
    assert translator.advance()[1] is None
    service.compact([0, 6, 2, 3, 5, 4, 7, 1], (6, 7, True))  # the next pass's own moves
    _, remap = translator.advance()
    assert remap is not None and np.flatnonzero(remap.is_moved).tolist() == [6, 7]
    assert remap[np.arange(NUM_BLOCKS)].tolist() == [0, 1, 2, 3, 4, 5, 7, 6]


def test_the_lists_of_requests_in_the_batch_follow_their_rows_and_the_others_are_scanned() -> None:
    runner = v1_runner([[1, 2, 3], [4, 6]])
    runner.input_batch.req_ids = ["r0", "r1", None, None]
    runner.requests["out"] = SimpleNamespace(block_ids=([6, 2],))  # preempted: not in the batch
    table = runner.input_batch.block_table.block_tables[0].block_table.np
    table[1, 2] = 1  # a stale entry past row 1's length (2): rewritten, but no list holds it
    # swapped the data of physical 1 and 6, moved 4 to 5
    remap = Remap(np.array([0, 6, 2, 3, 5, 4, 1, 7]), np.array([1, 4, 6]))

    assert remap_v1_runner_rows(runner, remap) == 4  # the entries naming 1, 4 or 6

    assert runner.requests["r0"].block_ids == ([6, 2, 3],)
    assert runner.requests["r1"].block_ids == ([5, 1],)
    assert runner.requests["out"].block_ids == ([1, 2],)
    assert table[0, :3].tolist() == [6, 2, 3] and table[1, :3].tolist() == [5, 1, 6]


def test_rows_are_rewritten_only_where_they_name_a_block_live_before_its_step() -> None:
    """Prefix caching, every free block cached: a shared block that moves is rewritten in
    each row naming it, a finished request's row is left as it is, and a fresh block
    swapped down in the step that allocated it (every later step here) costs the rows
    nothing: the pass has no remap at all."""
    num_blocks = 16
    kv = [(torch.zeros(num_blocks * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0, prefix_caching=True))
    engine.step(StepEvents(new_blocks={"r": list(range(1, num_blocks))}, fresh=[]))
    engine.step(StepEvents(finished=["r"]))
    truth = {"c": [1], "a": [2, 4], "b": [3, 4]}  # 4: a prefix both share
    engine.step(StepEvents(new_blocks=truth, fresh=[]))
    translator = BlockIdTranslator(engine, num_blocks)
    runner = v1_runner(list(truth.values()))
    runner.input_batch.req_ids = [*truth, None]
    runner.requests = {rid: SimpleNamespace(block_ids=(list(ids),)) for rid, ids in truth.items()}
    block_table = runner.input_batch.block_table.block_tables[0]

    def rows() -> dict[str, list[int]]:
        return {
            rid: block_table.block_table.np[index, : block_table.num_blocks_per_row[index]].tolist()
            for index, rid in enumerate(runner.input_batch.req_ids)
            if rid is not None
        }

    def execute(**events: Any) -> int | None:
        """A step, then the worker's pass: rows follow, then the runner's own updates."""
        engine.step(StepEvents(**events))
        resolve, remap = translator.advance()
        num_rewritten = None if remap is None else remap_v1_runner_rows(runner, remap)
        for rid in events.get("finished", []):
            index = runner.input_batch.req_ids.index(rid)
            runner.input_batch.req_ids[index] = None
            block_table.num_blocks_per_row[index] = 0
            del runner.requests[rid], truth[rid]
        for rid, logical_ids in events.get("new_blocks", {}).items():
            index = runner.input_batch.req_ids.index(rid)
            start = block_table.num_blocks_per_row[index]
            physical_ids = resolve(np.array(logical_ids)).tolist()
            block_table.block_table.np[index, start : start + len(physical_ids)] = physical_ids
            block_table.num_blocks_per_row[index] += len(physical_ids)
            runner.requests[rid].block_ids[0].extend(physical_ids)
            truth[rid] += logical_ids
        expected = {rid: engine.resolve(ids).tolist() for rid, ids in truth.items()}
        assert rows() == expected
        assert {rid: state.block_ids[0] for rid, state in runner.requests.items()} == expected
        return num_rewritten

    assert execute(finished=["c"]) == 2  # the shared block: 4 -> 1, in a's and b's rows
    for rid, fresh_id in [("a", 15), ("b", 14), ("a", 13)]:
        assert execute(new_blocks={rid: [fresh_id]}, fresh=[fresh_id]) is None
    assert engine.stats().totals.num_moves == 4


def test_moves_over_several_compactions_compose() -> None:
    """Data that moved twice between two passes is followed to where it is now; a slot
    whose data moved away one way is not where anything went."""
    service = FakeMoveHistory()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.compact(list(range(NUM_BLOCKS)), (7, 3, False), (5, 1, True))
    service.compact(list(range(NUM_BLOCKS)), (3, 2, False), (1, 6, True))
    _, remap = translator.advance()
    assert remap is not None
    # 7 -> 3 -> 2; 5 -> 1 -> 6; 1 -> 5 (swapped with 5), then 6 -> 1 (swapped with 1)
    assert {old: int(remap.table[old]) for old in remap.old_ids.tolist()} == {
        7: 2,
        5: 6,
        1: 5,
        6: 1,
    }
    assert remap.table[3] == 3 and remap.table[4] == 4
    # the next pass starts from the identity again
    service.compact(list(range(NUM_BLOCKS)), (2, 4, False))
    _, remap = translator.advance()
    assert remap is not None and remap.old_ids.tolist() == [2] and remap.table[7] == 7


def test_a_translator_that_lost_track_stops_the_pass() -> None:
    service = FakeMoveHistory()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.is_truncated = True
    service.compact(list(range(NUM_BLOCKS)), (2, 4, False))
    with pytest.raises(
        PassRefused, match="rows cannot follow the KV data any more: its service compacted"
    ):
        translator.advance()


def test_an_outputs_ids_are_resolved_in_one_lookup() -> None:
    service = FakeMoveHistory()
    service.mapping = np.array([0, 6, 2, 3, 5, 4, 1, 7])
    output = block_naming_output()
    calls = []

    def resolve(logical_ids: Any) -> Any:
        calls.append(logical_ids.tolist())
        return service.resolve(logical_ids)

    translate_scheduler_output(output, resolve)

    assert calls == [[1, 2, 3, 3, 1, 4]]
    assert output.scheduled_new_reqs[0].block_ids == ([6, 2],)
    assert output.scheduled_cached_reqs.new_block_ids == [None, ([3],)]
    assert output.new_block_ids_to_zero == [3]
    assert output.kv_cache_block_copies == [(6, 5)]


def test_the_engines_log_gives_where_blocks_live_before_their_step_went() -> None:
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0))
    version, batches = engine.moves_since(None) or (None, None)
    assert batches == []
    # live high, moved in the step they became live in (6 -> 1, 5 -> 2): no output before
    # this step's names them, so no row follows them
    result = engine.step(StepEvents(new_blocks={"a": [5], "b": [6]}, fresh=[]))
    assert len(result.moves) == 2
    assert engine.moves_since(version) == (version, [])
    engine.step(StepEvents(finished=["b"]))  # a hole at 1 below a (at 2): a moves
    found = engine.moves_since(version)
    assert found is not None
    now, batches = found
    assert now == version + 1 and batches == [[Move(2, 1, False)]]
    assert engine.moves_since(now) == (now, [])
    engine.reset()  # the scheduler's session opens with one, after the worker attached
    after_reset = engine.moves_since(version)
    assert after_reset is not None and after_reset[1] == []  # what came before is not followed
    engine.step(StepEvents(new_blocks={"c": [7], "d": [6]}, fresh=[]))
    engine.step(StepEvents(finished=["c"]))
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(2, 1, False)]]  # only since the reset


def test_the_engines_log_follows_a_block_released_and_taken_again_in_one_step() -> None:
    """As the scheduler parks a finished request's blocks while a step in flight still
    reads them: the block is live before and after the step, so its move is logged."""
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0))
    engine.step(StepEvents(new_blocks={"x": [1], "a": [2]}, fresh=[]))
    version, _ = engine.moves_since(None) or (None, None)
    assert version is not None
    engine.step(StepEvents(finished=["x", "a"], new_blocks={"parked": [2]}, fresh=[]))
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(2, 1, False)]]


def test_the_engines_log_leaves_out_blocks_that_became_live_and_the_free_half_of_swaps() -> None:
    """One compaction moves a block live before its step (a swap, logged as a one-way
    move) and a fresh block that became live in it (its cached hole copied up, not
    logged) into cached holes."""
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0, prefix_caching=True))
    engine.step(StepEvents(new_blocks={"r": list(range(1, NUM_BLOCKS))}, fresh=[]))
    engine.step(StepEvents(finished=["r"]))  # every free block is cached
    engine.step(StepEvents(new_blocks={"a": [1], "b": [2], "c": [3]}, fresh=[]))
    version, _ = engine.moves_since(None) or (None, None)
    assert version is not None
    # a and b finish (cached holes at 1 and 2); d arrives at 7, no empty slot to place it on
    result = engine.step(StepEvents(finished=["a", "b"], new_blocks={"d": [7]}, fresh=[7]))
    # the same moves whatever order the policy lists them in (one batch: they happen at once)
    assert sorted(result.moves) == [Move(1, 7, False), Move(3, 2, True)]
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(3, 2, False)]]


def test_the_v2_runners_table_follows_the_blocks_that_moved_on_its_device() -> None:
    runner = v2_runner([[1, 2, 3], [4], [7, 7]])
    table = runner.block_tables.block_tables[0].gpu
    before = table.data_ptr()
    # the engine swapped the data of physical 1 and 6, and moved 4 to 5 (5 was free)
    remap_v2_runner_rows(runner, Remap(np.array([0, 6, 2, 3, 5, 4, 1, 7]), np.array([1, 4, 6])))
    assert table.data_ptr() == before and table.dtype == torch.int32  # rewritten in place
    assert table[0, :3].tolist() == [6, 2, 3]
    assert table[1, :1].tolist() == [5]
    assert table[2, :2].tolist() == [7, 7]
    assert table[3].sum() == 0 and table[0, 3:].sum() == 0  # the null block stays 0
    with pytest.raises(AssertionError, match="null block"):
        remap_v2_runner_rows(runner, np.array([1, 0, 2, 3, 4, 5, 6, 7]))


def test_a_v2_runner_without_the_expected_block_table_is_refused_by_name() -> None:
    check_v2_runner(v2_runner([[1]]))
    with pytest.raises(
        UnsupportedByKvdefrag, match=r"no list model_runner\.block_tables\.block_tables"
    ):
        check_v2_runner(SimpleNamespace(kv_caches=[]))
    with pytest.raises(UnsupportedByKvdefrag, match="has 2 block tables"):
        check_v2_runner(v2_runner([[1]], num_groups=2))
    wrong = [
        (SimpleNamespace(cpu=torch.zeros(4, 6)), "is NoneType"),
        (SimpleNamespace(gpu=np.zeros((4, 6))), "is ndarray"),
        (SimpleNamespace(gpu=torch.zeros(4, 6)), "torch.float32 tensor of shape \\(4, 6\\)"),
        (SimpleNamespace(gpu=torch.zeros(6, dtype=torch.int32)), "shape \\(6,\\)"),
    ]
    for staged, found in wrong:
        runner = SimpleNamespace(block_tables=SimpleNamespace(block_tables=[staged]))
        with pytest.raises(
            UnsupportedByKvdefrag, match=f"gpu of the V2 model runner .* {found}; expected"
        ):
            check_v2_runner(runner)
