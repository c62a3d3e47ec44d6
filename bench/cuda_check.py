"""CUDA check of the swap executor and engine (run on a machine with a GPU: `make cuda-check`).

Runs the synthetic vLLM workload through an Engine bound to CUDA KV tensors, on a
non-default stream given as the worker's forward stream, writing a distinct signature
into every fresh block (on that stream, as a forward pass would) and checking after
every step that every live block (and, with prefix caching, every cached free block) still
reads its own signature. Then measures one-way move bandwidth against ``Tensor.copy_``.
Exits non-zero on any corrupted block, or when no CUDA device is present.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvdefrag.server import Engine, EngineConfig, Move, make_executor
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig

BLOCK_SIZE = 16

KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]


def _signature(logical_ids: torch.Tensor, versions: torch.Tensor | int) -> torch.Tensor:
    return (logical_ids.to(torch.float32) * 7 + versions) % 2039


def run_integrity(
    prefix_caching: bool,
    device_name: str = "cuda",
    num_blocks: int = 4_096,
    num_steps: int = 1_500,
    kv_caches: KvCaches | None = None,
) -> int:
    """Returns the number of corrupted blocks seen (0 is the only good answer).

    ``device_name="cpu"`` runs the same check without a GPU (a dry run of this script).
    ``kv_caches``: float32 ``(key, value)`` pairs of ``num_blocks`` blocks on that device
    to bind (``value`` may be None); None: two layers of ``[num_blocks * 16, 2, 8]``.
    """
    device = torch.device(device_name)
    stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
    shape = (num_blocks * BLOCK_SIZE, 2, 8)
    kv = (
        list(kv_caches)
        if kv_caches is not None
        else [
            (torch.zeros(shape, device=device), torch.zeros(shape, device=device)) for _ in range(2)
        ]
    )
    engine = Engine(
        kv,
        BLOCK_SIZE,
        config=EngineConfig(threshold=16, prefix_caching=prefix_caching),
        stream=stream,
    )
    config = WorkloadConfig(
        num_blocks=num_blocks,
        num_steps=num_steps,
        seed=3,
        enable_prefix_caching=prefix_caching,
        prompt_len_max=4_096,
        output_len_max=2_048,
    )
    written: dict[int, int] = {}  # logical id -> version of its content
    version = 0
    corrupted = 0
    workload = SyntheticWorkload(config)
    for step in workload:
        engine.step(step.events)
        version += 1
        fresh = list(step.events.fresh or [])
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with on_stream:  # the worker's forward pass writes fresh blocks on its stream
            if fresh:
                logical = torch.tensor(fresh, device=device)
                physical = torch.as_tensor(engine.resolve(fresh), device=device)
                for tensor in (tensor for pair in kv for tensor in pair if tensor is not None):
                    view = tensor.view(num_blocks, -1)
                    view[physical] = _signature(logical, version)[:, None].expand(-1, view.shape[1])
        for logical_id in fresh:
            written[logical_id] = version
        holding = {i for table in workload.block_tables().values() for i in table if i}
        if prefix_caching:
            holding |= set(workload.cached_free_blocks())
        check = sorted(i for i in holding if i in written)
        if not check:
            continue
        if stream is not None:
            stream.synchronize()
        logical = torch.tensor(check, device=device)
        physical = torch.as_tensor(engine.resolve(check), device=device)
        expected = torch.tensor([written[i] for i in check], device=device)
        for tensor in (tensor for pair in kv for tensor in pair if tensor is not None):
            got = tensor.view(num_blocks, -1)[physical][:, 0]
            corrupted += int((got != _signature(logical, expected)).sum().item())
    stats = engine.stats()
    print(
        f"{device.type} integrity (prefix caching {'on' if prefix_caching else 'off'}): "
        f"{stats.totals.num_moves:,} moves, {stats.totals.num_placements:,} placements, "
        f"{corrupted} corrupted"
    )
    return corrupted


def run_bandwidth(num_blocks: int = 8_192, batch: int = 512) -> None:
    device = torch.device("cuda")
    shape = (num_blocks * 128, 8, 128)
    kv = [(torch.zeros(shape, device=device, dtype=torch.bfloat16), None) for _ in range(4)]
    executor = make_executor(kv, 128)
    generator = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks - 1, generator=generator)[: 2 * batch] + 1
    moves = [Move(int(s), int(d), False) for s, d in zip(slots[:batch], slots[batch:], strict=True)]
    executor.execute(moves)
    torch.cuda.synchronize()
    started = time.perf_counter()
    report = executor.execute(moves)
    torch.cuda.synchronize()
    moved_s = time.perf_counter() - started
    source = torch.empty(report.num_bytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    started = time.perf_counter()
    target.copy_(source)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - started
    print(
        f"cuda one-way moves: {report.num_bytes / moved_s / 1e9:.1f} GB/s, Tensor.copy_ "
        f"{report.num_bytes / copy_s / 1e9:.1f} GB/s, ratio {copy_s / moved_s:.2f}x"
    )


def main(argv: list[str]) -> int:
    if argv[1:] == ["--dry-run-on-cpu"]:
        return (
            1
            if run_integrity(False, "cpu", 1_024, 300) + run_integrity(True, "cpu", 1_024, 300)
            else 0
        )
    if not torch.cuda.is_available():
        print("cuda check: no CUDA device here", file=sys.stderr)
        return 2
    corrupted = run_integrity(False) + run_integrity(True)
    run_bandwidth()
    return 1 if corrupted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
