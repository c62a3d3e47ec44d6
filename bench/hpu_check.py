"""Gaudi check of the HPU mover and engine (run on a Gaudi machine: `make hpu-check`).

1. The mover at every pad size: for each of the HPU executor's pad buckets (and one batch
   larger than the largest, which is split), one-way and two-way batches of random blocks
   are moved on HPU tensors and compared, bit for bit, with the same moves applied to a
   copy of the caches by plain indexing on the host.
2. The identity run: the synthetic vLLM workload through an ``Engine`` bound to HPU KV
   tensors (``cuda_check.run_integrity`` on the ``hpu`` device), a distinct signature
   written into every fresh block, every live block (and cached free block) checked after
   every step.

Exits non-zero on any mismatch or corrupted block, or when no HPU is present.
``--dry-run-on-cpu`` runs both on CPU tensors with a stand-in ``habana_frameworks`` (the
logic of the script, not the device), as the test suite does.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types

import torch

from kvdefrag.server import Move
from kvdefrag.server.config import DEFAULT_PAD_BUCKETS

BLOCK_SIZE = 16
NUM_BLOCKS = 2_048


def install_stand_in_habana() -> None:
    """A ``habana_frameworks.torch`` whose ``mark_step`` does nothing (CPU dry run)."""
    package = types.ModuleType("habana_frameworks")
    module = types.ModuleType("habana_frameworks.torch")
    module.core = types.SimpleNamespace(mark_step=lambda: None)  # type: ignore[attr-defined]
    package.torch = module  # type: ignore[attr-defined]
    sys.modules["habana_frameworks"] = package
    sys.modules["habana_frameworks.torch"] = module


def random_moves(rng: random.Random, count: int, two_way: bool) -> list[Move]:
    """``count`` moves between distinct blocks (never the null block 0)."""
    slots = rng.sample(range(1, NUM_BLOCKS), 2 * count)
    return [Move(src, dst, two_way) for src, dst in zip(slots[:count], slots[count:], strict=True)]


def apply_on_host(reference: list[torch.Tensor], moves: list[Move]) -> None:
    """The moves, one by one, on host copies of the flat caches (the naive reference)."""
    for move in moves:
        src = slice(move.src_physical_id * BLOCK_SIZE, (move.src_physical_id + 1) * BLOCK_SIZE)
        dst = slice(move.dst_physical_id * BLOCK_SIZE, (move.dst_physical_id + 1) * BLOCK_SIZE)
        for cache in reference:
            from_src = cache[src].clone()
            if move.is_two_way:
                cache[src] = cache[dst]
            cache[dst] = from_src


def check_mover(device: torch.device, use_graphs: bool) -> int:
    """Runs every pad size one way and two way; returns the number of mismatched batches."""
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    generator = torch.Generator().manual_seed(7)
    host = [torch.randn(NUM_BLOCKS * BLOCK_SIZE, 8, 16, generator=generator) for _ in range(4)]
    caches = [tensor.to(device, copy=True) for tensor in host]
    executor = HpuSwapExecutor(
        [(caches[0], caches[1]), (caches[2], caches[3])], BLOCK_SIZE, use_graphs=use_graphs
    )
    rng = random.Random(11)
    mismatched = 0
    # every bucket exactly, sizes padded up to one, and one batch split in two
    counts = sorted({5, 100, *DEFAULT_PAD_BUCKETS, DEFAULT_PAD_BUCKETS[-1] + 3})
    for count in counts:
        for two_way in (False, True):
            moves = random_moves(rng, count, two_way)
            report = executor.execute(moves)
            apply_on_host(host, moves)
            same = all(
                torch.equal(cache.cpu(), reference)
                for cache, reference in zip(caches, host, strict=True)
            )
            mismatched += not same
            print(
                f"mover: {count:4d} {'two-way' if two_way else 'one-way'} moves, "
                f"{report.num_padded} padded: {'ok' if same else 'MISMATCH'}"
            )
    return mismatched


def main() -> int:
    dry_run = "--dry-run-on-cpu" in sys.argv[1:]
    if dry_run:
        install_stand_in_habana()
        device = torch.device("cpu")
    elif importlib.util.find_spec("habana_frameworks") is None:
        print("hpu-check: no habana_frameworks here (run it on a Gaudi machine)")
        return 2
    else:
        import habana_frameworks.torch  # noqa: F401  (registers the hpu device)

        device = torch.device("hpu")
    mismatched = check_mover(device, use_graphs=not dry_run)
    from cuda_check import run_integrity  # the same identity run, on this device

    corrupted = sum(
        run_integrity(prefix_caching, device_name=device.type, num_steps=300 if dry_run else 1_500)
        for prefix_caching in (False, True)
    )
    print(f"hpu-check: {mismatched} mismatched batches, {corrupted} corrupted blocks")
    return 1 if mismatched or corrupted else 0


if __name__ == "__main__":
    sys.exit(main())
