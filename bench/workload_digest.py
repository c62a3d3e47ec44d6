"""One digest over what the engine decides on the bench's workloads.

Runs the bench's event streams through ``Engine.step`` (a counting executor: no KV bytes)
and hashes every step's result: the changed mapping entries, the moves (with their kind),
the live-mapping digest and the pool statistics. Two trees that print the same digest
make the same decisions on these workloads, step for step; a refactor must leave it as it
was (``python bench/workload_digest.py`` before and after).

Workloads: the engine bench's synthetic stream (10k blocks, both prefix-caching modes,
threshold and eager compaction) and the Gaudi bench's recorded vLLM 0.33 traces
(``bench/traces/``) with the threshold and the bucket-aware policy.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Sequence

from gaudi_buckets import BLOCK_SIZE, MAX_MODEL_LEN, MAX_NUM_SEQS, NUM_BLOCKS, recorded_traces
from run import make_stream

from kvdefrag.server import Engine, EngineConfig, Move, MoveReport
from kvdefrag.server.buckets import exponential_decode_buckets
from kvdefrag.tools.workload import WorkloadStep

NUM_STEPS = 1_500


class _CountingExecutor:
    """Moves nothing; reports the moves it was given."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        return MoveReport(len(moves), 0, 0)


def _digest_run(
    hasher: object, steps: Iterable[WorkloadStep], num_blocks: int, config: EngineConfig
) -> int:
    engine = Engine([], block_size=1, config=config, executor=_CountingExecutor(num_blocks))
    count = 0
    for step in steps:
        result = engine.step(step.events)
        record = (
            sorted(result.block_mapping.items()),
            list(
                zip(
                    result.moves.src_ids, result.moves.dst_ids, result.moves.is_two_way, strict=True
                )
            ),
            result.num_placed,
            result.digest,
            result.stats.max_live,
            result.stats.num_live,
        )
        hasher.update(repr(record).encode())  # type: ignore[attr-defined]
        count += 1
    return count


def main() -> int:
    hasher = hashlib.sha256()
    num_steps = 0
    for prefix_caching in (False, True):
        stream = make_stream(10_000, NUM_STEPS, prefix_caching)
        for threshold in (0, 32):
            config = EngineConfig(threshold=threshold, prefix_caching=prefix_caching)
            num_steps += _digest_run(hasher, stream, 10_000, config)
    buckets = exponential_decode_buckets(
        NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE
    )
    for _, steps in recorded_traces():
        for config in (
            EngineConfig(threshold=32),
            EngineConfig(threshold=32, decode_buckets=tuple(buckets)),
        ):
            num_steps += _digest_run(hasher, steps, NUM_BLOCKS, config)
    print(f"{num_steps} steps: {hasher.hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
