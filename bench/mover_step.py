"""The step a worker waits for: ``Engine.step`` moving 512 scattered blocks, against memcpy.

Layout: 4 layers of (K, V) bfloat16 tensors shaped ``[num_blocks * block_size, 8, 64]``
(``num_blocks * block_size == 2048 * 128`` token slots, so 128 KiB per 128-token block and
tensor), the CPU swap executor. Each run builds a pool where every block is live, then
times the one step that finishes 512 single-block requests scattered over the lower
part: compaction moves the 512 highest blocks into those holes (one way; with prefix
caching the finished blocks stay cached and every move is a swap). The baseline is
``Tensor.copy_`` of the same bytes between contiguous ranges of the same tensors, timed
alternately in the same run; the step's bookkeeping is its wall time less the executor's
``swap_duration_s``.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from kvdefrag.server import Engine, EngineConfig

TOKEN_SLOTS = 2048 * 128
NUM_LAYERS = 4
NUM_MOVES = 512


def _kv() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The layers, every page written once (a worker's KV cache is resident; a first touch
    inside the timed step would time the page faults)."""
    return [
        (
            torch.full((TOKEN_SLOTS, 8, 64), 1.0, dtype=torch.bfloat16),
            torch.full((TOKEN_SLOTS, 8, 64), 2.0, dtype=torch.bfloat16),
        )
        for _ in range(NUM_LAYERS)
    ]


def _one_step(
    kv: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, two_way: bool, seed: int
) -> tuple[float, float, int]:
    """Returns the timed step's wall time, its executor time and its moves."""
    num_blocks = TOKEN_SLOTS // block_size
    engine = Engine(
        kv,
        block_size,
        EngineConfig(
            threshold=0,
            enable_placement=False,
            prefix_caching=two_way,
            max_moves_per_step=NUM_MOVES,
        ),
    )
    rng = random.Random(seed)
    top = num_blocks - NUM_MOVES
    holes = sorted(rng.sample(range(1, top), NUM_MOVES))
    hole_set = set(holes)
    new_blocks = {f"h{block_id}": [block_id] for block_id in holes}
    new_blocks["rest"] = [block_id for block_id in range(1, num_blocks) if block_id not in hole_set]
    engine.step(new_blocks=new_blocks, fresh=range(1, num_blocks))
    finished = [f"h{block_id}" for block_id in holes]
    started = time.perf_counter()
    result = engine.step(finished=finished)
    wall = time.perf_counter() - started
    return wall, result.swap_duration_s, len(result.moves)


def _copy_s(kv: list[tuple[torch.Tensor, torch.Tensor]], num_bytes: int) -> float:
    """``copy_`` of ``num_bytes`` spread over the same tensors, contiguous ranges."""
    tensors = [tensor for pair in kv for tensor in pair]
    per_tensor = num_bytes // len(tensors)
    flats = [tensor.view(torch.uint8).view(-1) for tensor in tensors]
    started = time.perf_counter()
    for flat in flats:
        flat[per_tensor : 2 * per_tensor].copy_(flat[:per_tensor])
    return time.perf_counter() - started


def run_mover_step(quick: bool) -> list[dict[str, Any]]:
    """One row per (block size, move kind): medians over the repeats."""
    repeats = 3 if quick else 5
    rows: list[dict[str, Any]] = []
    for block_size in (128, 16):
        kv = _kv()
        bytes_per_block = block_size * 8 * 64 * 2 * 2 * NUM_LAYERS
        for two_way in (False, True):
            num_bytes = NUM_MOVES * bytes_per_block * (2 if two_way else 1)
            walls, swaps, copies = [], [], []
            for repeat in range(repeats):
                wall, swap, num_moves = _one_step(kv, block_size, two_way, seed=repeat)
                assert num_moves == NUM_MOVES, f"expected {NUM_MOVES} moves, got {num_moves}"
                walls.append(wall)
                swaps.append(swap)
                copies.append(_copy_s(kv, num_bytes))
            wall, copy = statistics.median(walls), statistics.median(copies)
            rows.append(
                {
                    "block_size": block_size,
                    "two_way": two_way,
                    "step_gbps": num_bytes / wall / 1e9,
                    "copy_gbps": num_bytes / copy / 1e9,
                    "ratio": copy / wall,
                    "bookkeeping_ms": statistics.median(
                        w - s for w, s in zip(walls, swaps, strict=True)
                    )
                    * 1e3,
                }
            )
        del kv
    return rows


if __name__ == "__main__":
    for row in run_mover_step(quick=True):
        print(row)
