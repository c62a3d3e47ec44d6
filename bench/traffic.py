"""KV traffic over its lower bound, per prefix-caching mode: what defragmentation costs and saves.

A contiguous paged-attention decode reads every block up to the highest live id, so a
step reads ``max live id`` blocks; moving a block costs 2 block transfers one way (read,
write) and 4 as a two-way swap. Traffic over a stream is the sum of both; its lower
bound is a perfectly packed pool that never moves anything (the sum of live blocks). The
table reports ``traffic / bound - 1`` for:

* without defragmentation (vLLM's own ids);
* the seed-equivalent algorithm (``seed_baseline.py``: every pair a swap with prefix
  caching, since it cannot know which free blocks hold cached data);
* kvdefrag, with and without placement of fresh blocks, and with compaction deferred
  (thresholds above the default, so fresh blocks fill holes by placement first); each
  with its mean packed ratio (max live id / live blocks) beside it.

The stream is the synthetic workload (``kvdefrag.tools.workload``), whose block pool
follows vLLM's allocator rules and reports evictions exactly as the vLLM integration does
(a cached block reused, or a freed block that was never full).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from seed_baseline import SeedEquivalentDefragmenter

from kvdefrag.server import Engine, EngineConfig, Move, MoveReport
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig, WorkloadStep


class CountingExecutor:
    """A swap executor that moves nothing and counts what it was asked to move."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_one_way = 0
        self.num_two_way = 0

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        two_way = sum(move.is_two_way for move in moves)
        self.num_two_way += two_way
        self.num_one_way += len(moves) - two_way
        return MoveReport(num_moves=len(moves), num_padded=0, num_bytes=0)

    @property
    def num_blocks_copied(self) -> int:
        """Blocks written: one per one-way move, two per swap."""
        return self.num_one_way + 2 * self.num_two_way


@dataclasses.dataclass
class Traffic:
    """Block transfers of one policy over one stream."""

    name: str
    blocks_read: int = 0
    num_one_way: int = 0
    num_two_way: int = 0
    packed_ratio: float = 0.0  # mean of max live id / live blocks over the steps

    @property
    def transfers(self) -> int:
        return self.blocks_read + 2 * self.num_one_way + 4 * self.num_two_way


NUM_BLOCKS = 10_000
DEFERRED_THRESHOLDS = (128, 512)


def _stream(prefix_caching: bool, num_steps: int) -> list[WorkloadStep]:
    config = WorkloadConfig(
        num_blocks=NUM_BLOCKS, num_steps=num_steps, enable_prefix_caching=prefix_caching
    )
    return list(SyntheticWorkload(config))


def _kvdefrag(stream: list[WorkloadStep], config: EngineConfig, name: str) -> Traffic:
    executor = CountingExecutor(NUM_BLOCKS)
    engine = Engine([], config=config, executor=executor)
    traffic = Traffic(name)
    ratios = []
    for step in stream:
        engine.step(step.events)
        stats = engine.stats()
        traffic.blocks_read += stats.max_live
        ratios.append(stats.fragmentation_ratio)
    traffic.num_one_way, traffic.num_two_way = executor.num_one_way, executor.num_two_way
    traffic.packed_ratio = sum(ratios) / len(ratios)
    return traffic


def _seed(stream: list[WorkloadStep], prefix_caching: bool) -> Traffic:
    pairs = [0]

    def swap(batch: list[tuple[int, int]], bucket: int) -> None:
        pairs[0] += len(batch)

    seed = SeedEquivalentDefragmenter(swap)
    traffic = Traffic("seed-equivalent")
    ratios = []
    for step in stream:
        seed.step(**step.events.as_kwargs())
        traffic.blocks_read += seed.max_used
        ratios.append(seed.max_used / step.num_live_blocks if step.num_live_blocks else 1.0)
    traffic.packed_ratio = sum(ratios) / len(ratios)
    if prefix_caching:
        traffic.num_two_way = pairs[0]
    else:
        traffic.num_one_way = pairs[0]
    return traffic


def run_traffic(quick: bool) -> list[dict[str, Any]]:
    """Traffic over the bound for every policy, prefix caching off and on."""
    rows: list[dict[str, Any]] = []
    for prefix_caching in (False, True):
        stream = _stream(prefix_caching, num_steps=1_500 if quick else 3_000)
        bound = sum(step.num_live_blocks for step in stream)
        without = Traffic("without defragmentation")
        without.blocks_read = sum(step.max_live_block_id for step in stream)
        without.packed_ratio = sum(
            step.max_live_block_id / step.num_live_blocks if step.num_live_blocks else 1.0
            for step in stream
        ) / len(stream)
        base = EngineConfig(prefix_caching=prefix_caching)
        policies = [
            without,
            _seed(stream, prefix_caching),
            _kvdefrag(stream, base, "kvdefrag"),
            _kvdefrag(
                stream,
                dataclasses.replace(base, enable_placement=False),
                "kvdefrag, placement off",
            ),
        ]
        # Deferring compaction (a higher threshold) leaves holes for fresh blocks to fill
        # by placement, which costs no copy: does it save moves without packing worse?
        policies += [
            _kvdefrag(
                stream,
                dataclasses.replace(base, threshold=threshold),
                f"kvdefrag, deferred ({threshold})",
            )
            for threshold in DEFERRED_THRESHOLDS
        ]
        for traffic in policies:
            rows.append(
                {
                    "prefix_caching": prefix_caching,
                    "policy": traffic.name,
                    "over_bound": traffic.transfers / bound - 1.0,
                    "one_way": traffic.num_one_way,
                    "two_way": traffic.num_two_way,
                    "packed_ratio": traffic.packed_ratio,
                    "num_steps": len(stream),
                }
            )
    return rows


def format_traffic(rows: list[dict[str, Any]]) -> str:
    """One line per policy and mode."""
    lines = [
        "KV traffic over the packed bound (reads up to the highest live id + 2 per one-way "
        "move + 4 per swap):",
        f"  {'prefix caching':<15}{'policy':<28}{'over bound':>11}{'one-way':>9}{'swaps':>8}"
        f"{'max/live':>10}",
    ]
    for row in rows:
        lines.append(
            f"  {'on' if row['prefix_caching'] else 'off':<15}{row['policy']:<28}"
            f"{row['over_bound']:>10.2%}{row['one_way']:>9}{row['two_way']:>8}"
            f"{row['packed_ratio']:>10.4f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_traffic(run_traffic(quick=True)))
