"""The step a worker waits for: ``Engine.step`` moving 512 scattered blocks, against memcpy.

Layout: 4 layers of (K, V) bfloat16 tensors shaped ``[num_blocks * block_size, 8, 64]``
(``num_blocks * block_size == 2048 * 128`` token slots, so 128 KiB per 128-token block and
tensor), the CPU swap executor; and, 128-token one way, other common layouts (``OTHERS``:
MLA with value None, fp8, 32 layers). Each run builds a pool where every block is live, then
times the one step that finishes 512 single-block requests scattered over the lower
part: compaction moves the 512 highest blocks into those holes (one way; with prefix
caching the finished blocks stay cached and every move is a swap). The baseline is
``Tensor.copy_`` of the same bytes between contiguous ranges of the same tensors, timed
alternately in the same run; the step's bookkeeping is its wall time less the executor's
``swap_duration_s``.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

import torch

from kvdefrag.common import StepEvents
from kvdefrag.server import Engine, EngineConfig

TOKEN_SLOTS = 2048 * 128
NUM_LAYERS = 4
NUM_MOVES = 512


@dataclasses.dataclass(frozen=True)
class Layout:
    """One KV layout: per layer a key tensor ``[token_slots, heads, head_size]`` and a value
    tensor like it, or none (MLA: one latent tensor per layer)."""

    name: str
    num_layers: int
    heads: int
    head_size: int
    dtype: torch.dtype
    has_value: bool = True
    token_slots: int = TOKEN_SLOTS

    def bytes_per_block(self, block_size: int) -> int:
        per_tensor = block_size * self.heads * self.head_size * self.dtype.itemsize
        return per_tensor * self.num_layers * (2 if self.has_value else 1)


MAIN = Layout("4 layers bf16 K,V [.,8,64]", NUM_LAYERS, 8, 64, torch.bfloat16)
# Other common layouts, 128-token blocks, one way: DeepSeek-style MLA (one 576-wide latent
# per layer, value None), fp8 K,V, and many layers of a TP-sharded model (2 KV heads).
OTHERS = (
    Layout("8 layers MLA bf16 [.,1,576], value None", 8, 1, 576, torch.bfloat16, False),
    Layout("4 layers fp8 K,V [.,8,64]", NUM_LAYERS, 8, 64, torch.float8_e4m3fn),
    Layout("32 layers bf16 K,V [.,2,64]", 32, 2, 64, torch.bfloat16),
)


def _kv(layout: Layout = MAIN) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The layers, every page written once (a worker's KV cache is resident; a first touch
    inside the timed step would time the page faults)."""

    def tensor(fill: int) -> torch.Tensor:
        shape = (layout.token_slots, layout.heads, layout.head_size * layout.dtype.itemsize)
        return torch.full(shape, fill, dtype=torch.uint8).view(layout.dtype)

    return [(tensor(1), tensor(2) if layout.has_value else None) for _ in range(layout.num_layers)]


def _one_step(
    kv: list[tuple[torch.Tensor, torch.Tensor | None]], block_size: int, two_way: bool, seed: int
) -> tuple[float, float, int]:
    """Returns the timed step's wall time, its executor time and its moves."""
    num_blocks = kv[0][0].shape[0] // block_size
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
    engine.step(StepEvents(new_blocks=new_blocks, fresh=range(1, num_blocks)))
    finished = [f"h{block_id}" for block_id in holes]
    started = time.perf_counter()
    result = engine.step(StepEvents(finished=finished))
    wall = time.perf_counter() - started
    return wall, result.swap_duration_s, len(result.moves)


def _copy_s(kv: list[tuple[torch.Tensor, torch.Tensor | None]], num_bytes: int) -> float:
    """``copy_`` of ``num_bytes`` spread over the same tensors, contiguous ranges."""
    tensors = [tensor for pair in kv for tensor in pair if tensor is not None]
    per_tensor = num_bytes // len(tensors)
    flats = [tensor.view(torch.uint8).view(-1) for tensor in tensors]
    started = time.perf_counter()
    for flat in flats:
        flat[per_tensor : 2 * per_tensor].copy_(flat[:per_tensor])
    return time.perf_counter() - started


def _row(
    kv: list[tuple[torch.Tensor, torch.Tensor | None]],
    layout: Layout,
    block_size: int,
    two_way: bool,
    repeats: int,
) -> dict[str, Any]:
    """Medians over ``repeats`` steps, each against ``copy_`` of its bytes."""
    num_bytes = NUM_MOVES * layout.bytes_per_block(block_size) * (2 if two_way else 1)
    walls, swaps, copies = [], [], []
    for repeat in range(repeats):
        wall, swap, num_moves = _one_step(kv, block_size, two_way, seed=repeat)
        assert num_moves == NUM_MOVES, f"expected {NUM_MOVES} moves, got {num_moves}"
        walls.append(wall)
        swaps.append(swap)
        copies.append(_copy_s(kv, num_bytes))
    wall, copy = statistics.median(walls), statistics.median(copies)
    return {
        "layout": layout.name,
        "block_size": block_size,
        "two_way": two_way,
        "step_gbps": num_bytes / wall / 1e9,
        "copy_gbps": num_bytes / copy / 1e9,
        "ratio": copy / wall,
        "bookkeeping_ms": statistics.median(w - s for w, s in zip(walls, swaps, strict=True)) * 1e3,
    }


def run_mover_step(quick: bool) -> list[dict[str, Any]]:
    """One row per (layout, block size, move kind): medians over the repeats."""
    repeats = 3 if quick else 5
    rows: list[dict[str, Any]] = []
    for block_size in (128, 16):
        kv = _kv(MAIN)
        for two_way in (False, True):
            rows.append(_row(kv, MAIN, block_size, two_way, repeats))
        del kv
    for layout in OTHERS:
        kv = _kv(layout)
        rows.append(_row(kv, layout, 128, False, repeats))
        del kv
    return rows


if __name__ == "__main__":
    for row in run_mover_step(quick=True):
        print(row)
