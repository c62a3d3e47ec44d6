"""bench/gaudi_buckets.py counts what each policy reads and moves, checked by hand.

The bench's own functions run on a three-step trace small enough to follow every block:
no timings, only the accounting (sum of decode buckets + 2 x blocks moved, and the
distinct buckets).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvdefrag.common import StepEvents
from kvdefrag.tools.workload import WorkloadStep

BENCH = Path(__file__).resolve().parents[2] / "bench"
NUM_BLOCKS = 64
BUCKETS = (8, 16, 32, 64)


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    """``bench/gaudi_buckets.py`` imported as the bench runs it (bench/ on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        import gaudi_buckets

        yield gaudi_buckets
    finally:
        sys.path.remove(str(BENCH))


def trace_step(index: int, max_live_id: int, num_live: int, **events: Any) -> WorkloadStep:
    return WorkloadStep(
        index=index,
        events=StepEvents(**events),
        num_scheduled_tokens={},
        num_live_blocks=num_live,
        max_live_block_id=max_live_id,
        num_running=0,
        num_waiting=0,
        num_preempted=0,
        num_prefix_hit_blocks=0,
    )


def tiny_trace() -> list[WorkloadStep]:
    """Blocks 1-18 become live; "a" (1-8) finishes; then a step with no events."""
    admitted = {"a": list(range(1, 9)), "b": list(range(9, 17)), "c": [17, 18]}
    return [
        trace_step(0, 18, 18, new_blocks=admitted, fresh=list(range(1, 19))),
        trace_step(1, 18, 10, finished=["a"]),
        trace_step(2, 18, 10),
    ]


def test_account_sums_buckets_and_twice_the_moves(bench: ModuleType) -> None:
    # Highest live id after each step, blocks moved in it: nothing live reads nothing.
    cost = bench.account("p", BUCKETS, NUM_BLOCKS, [(0, 0), (3, 0), (40, 2), (7, 0)])
    assert (cost.blocks_read, cost.blocks_moved) == (8 + 64 + 8, 2)
    assert cost.blocks_read_written == 80 + 2 * 2
    assert cost.buckets == {8, 64}
    assert cost.num_steps == 4


def test_every_policy_on_a_trace_followed_by_hand(bench: ModuleType) -> None:
    costs = bench.run_trace(tiny_trace(), NUM_BLOCKS, BUCKETS, threshold=2)
    got = {
        cost.policy: (cost.blocks_read, cost.blocks_moved, cost.blocks_read_written, cost.buckets)
        for cost in costs
    }
    # Without defragmentation: ids up to 18 stay, 19 blocks read: bucket 32 every step.
    # The seed (10 live, 8 holes > 2): 18..11 go to 1..8 in step 1, the highest is 10,
    # bucket 16 from then on. The threshold policy moves runs whole: in step 1, c's run
    # (17, 18) to 1, 2; b's run (9-16) fits no hole (3-8), so it stays: 17 blocks read,
    # bucket 32. In step 2 no run fits and nothing is fresh, so the pass packs: 16..11 go
    # to 3..8, the highest is 10: bucket 16.
    # Bucket-aware: 10 live fit bucket 16 packed, so only 18, 17 and 16 move (to 1, 2, 3),
    # leaving 15 the highest: bucket 16 too, with 3 moves instead of 8.
    assert got == {
        "none": (96, 0, 96, {32}),
        "seed": (32 + 16 + 16, 8, 64 + 16, {32, 16}),
        "kvdefrag threshold": (32 + 32 + 16, 2 + 6, 80 + 2 * 8, {32, 16}),
        "kvdefrag buckets": (64, 3, 64 + 6, {32, 16}),
    }
    assert [cost.num_steps for cost in costs] == [3, 3, 3, 3]


def test_goals_report_the_worst_trace(bench: ModuleType) -> None:
    def trace(load: str, aware: tuple[int, int, int], seed: tuple[int, int, int]) -> Any:
        rows = []
        for policy, (read_written, moved, num_buckets) in (
            ("none", (100, 0, 2)),
            ("seed", seed),
            ("kvdefrag buckets", aware),
        ):
            buckets = list(range(num_buckets))
            rows.append(
                {
                    "policy": policy,
                    "blocks_read_written": read_written,
                    "blocks_moved": moved,
                    "buckets": buckets,
                }
            )
        return {"load": load, "free_order": "lifo", "policies": rows}

    results = {
        "traces": [trace("light", (90, 4, 2), (95, 10, 2)), trace("mid", (80, 3, 3), (79, 4, 2))]
    }
    worst = bench.goals(results)
    assert worst["read_written_vs_seed"] == {
        "ratio": 80 / 79,
        "trace": "mid lifo",
        "measured": 80,
        "baseline": 79,
    }
    assert (worst["moved_vs_seed"]["ratio"], worst["moved_vs_seed"]["trace"]) == (0.75, "mid lifo")
    assert worst["buckets_vs_none"]["ratio"] == 1.5


def test_recorded_events_give_the_live_blocks_after_each_step(bench: ModuleType) -> None:
    events = [
        StepEvents(new_blocks={"a": [3, 1], "b": [2]}, fresh=[1, 2, 3]),
        StepEvents(new_blocks={"a": [7]}, fresh=[7]),
        StepEvents(finished=["a"], new_blocks={"c": [3]}, fresh=[3]),
        StepEvents(resumed={"b": [5, 4]}, fresh=[5, 4]),
        StepEvents(finished=["b", "c"]),
    ]
    steps = bench.steps_from_events(events)
    assert [(s.num_live_blocks, s.max_live_block_id) for s in steps] == [
        (3, 3),
        (4, 7),
        (2, 3),
        (3, 5),
        (0, 0),
    ]
    assert [s.events for s in steps] == events


def test_recorded_traces_are_read_back(bench: ModuleType, tmp_path: Path) -> None:
    import gzip

    from kvdefrag.client.record import StepRecorder

    path = tmp_path / "vllm-mid-fifo.jsonl.gz"
    with (
        gzip.open(path, "wt", encoding="utf-8") as file,
        StepRecorder(
            file,
            num_blocks=bench.NUM_BLOCKS,
            block_size=bench.BLOCK_SIZE,
            metadata={"load": "mid", "free_order": "fifo"},
            close_file=False,
        ) as recorder,
    ):
        recorder.record(StepEvents(new_blocks={"a": [9]}, fresh=[9]))
        recorder.record(StepEvents())
    ((metadata, steps),) = bench.recorded_traces(tmp_path)
    assert (metadata["load"], metadata["free_order"]) == ("mid", "fifo")
    assert [s.max_live_block_id for s in steps] == [9, 9]
