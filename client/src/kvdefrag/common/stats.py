"""Pool statistics, on either side of the wire: gauges of the pool apart from totals."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Totals:
    """What the engine has done since it started or was last reset (cumulative).

    Attributes:
        num_steps: Steps applied.
        num_moves: Blocks moved by compaction (one-way and two-way).
        num_two_way_moves: Moves that swapped contents with a cached free block.
        num_placements: Fresh blocks re-pointed to a lower slot without a copy.
        num_defrag_runs: Compaction passes that moved at least one block.
        num_bytes_moved: Bytes written to the KV tensors by moves.
        num_unknown_finished: Finished request ids the engine did not know.
        num_unknown_unpins: Unpinned keys that named no pin.
    """

    num_steps: int = 0
    num_moves: int = 0
    num_two_way_moves: int = 0
    num_placements: int = 0
    num_defrag_runs: int = 0
    num_bytes_moved: int = 0
    num_unknown_finished: int = 0
    num_unknown_unpins: int = 0


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool (gauges), with the engine's cumulative ``totals``.

    Attributes:
        num_blocks: Blocks in the pool, null block included.
        num_live: Blocks referenced by at least one request.
        max_live: Highest live physical id (0 when nothing is live).
        holes: ``max_live - num_live``: free slots below the highest live one.
        num_requests: Requests holding blocks.
        fragmentation_ratio: ``max_live / num_live``; 1.0 is packed (and when empty).
        is_healthy: False after a failed KV move, until a reset.
        num_pinned: Blocks pinned (a KV transfer in flight), live or free.
        totals: What the engine did since it started or was last reset.
    """

    num_blocks: int = 0
    num_live: int = 0
    max_live: int = 0
    holes: int = 0
    num_requests: int = 0
    fragmentation_ratio: float = 1.0
    is_healthy: bool = True
    num_pinned: int = 0
    totals: Totals = Totals()

    @classmethod
    def gauge_names(cls) -> tuple[str, ...]:
        """The names of the gauge fields (every field but ``totals``)."""
        return tuple(field.name for field in dataclasses.fields(cls) if field.name != "totals")
