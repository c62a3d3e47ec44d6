"""Gaudi check of the HPU mover and engine (run on a Gaudi machine: `make hpu-check`).

Both bind the caches as the worker does on Gaudi (``bind_vllm_kv_caches``), laid out as
vllm-gaudi's HPU runner allocates them (``HPUModelRunner.initialize_kv_cache``): per layer
``(key_cache, value_cache, key_scales, value_scales)`` over ``num_blocks + 1`` blocks, the
last its pad block, the scales (dynamic fp8 KV) one row per token slot and, for
``value_scales[1]``, one row per block.

1. The mover at every pad size: for each of the HPU executor's pad buckets (and one batch
   larger than the largest, which is split), one-way and two-way batches of random blocks
   are moved on HPU tensors (a float8 layer with its bfloat16 scales, a bfloat16 layer
   without) and compared, bit for bit, with the same moves applied to a copy of the
   caches by plain indexing on the host; the pad blocks must be untouched.
2. The identity run: the synthetic vLLM workload through an ``Engine`` bound to HPU KV
   tensors of that layout, in float32 (``cuda_check.run_integrity`` on the ``hpu``
   device), a distinct signature written into every fresh block of every tensor, scales
   included, every live block (and cached free block) checked after every step; then the
   pad blocks must still hold what they held.

3. The split order: ``DefragHPUWorkerMixin`` in front of a stand-in worker whose runner
   follows vllm-gaudi's split (``execute_model`` keeps the output and returns None,
   ``sample_tokens`` resolves through ``model_runner.defragmenter`` and reads the blocks),
   over a real service bound to HPU tensors of that layout; between the two halves of a
   step another step compacts. Every block the runner reads must hold its own signature,
   the compaction must wait for the end of ``sample_tokens``, and a dummy batch must
   resolve under ``kv_lock``.

Exits non-zero on any mismatch or corrupted block, or when no HPU is present.
``--dry-run-on-cpu`` runs both on CPU tensors with a stand-in ``habana_frameworks`` (the
logic of the script, not the device; the float8 layer's bytes as uint8, torch on CPU
having no ``index_copy_`` for float8), as the test suite does.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from kvdefrag.common import StepEvents
from kvdefrag.server import Move
from kvdefrag.server.config import DEFAULT_PAD_BUCKETS
from kvdefrag.vllm._worker.kv_binding import bind_vllm_kv_caches

BLOCK_SIZE = 16
NUM_BLOCKS = 2_048
NUM_HEADS = 8
HEAD_SIZE = 16
PAD_VALUE = -1.0  # what the pad blocks hold in the identity run (never a signature)

GaudiLayer = tuple[torch.Tensor, torch.Tensor | None, Any, Any]


def install_stand_in_habana() -> None:
    """A ``habana_frameworks.torch`` whose ``mark_step`` does nothing (CPU dry run)."""
    package = types.ModuleType("habana_frameworks")
    module = types.ModuleType("habana_frameworks.torch")
    module.core = types.SimpleNamespace(mark_step=lambda: None)  # type: ignore[attr-defined]
    package.torch = module  # type: ignore[attr-defined]
    sys.modules["habana_frameworks"] = package
    sys.modules["habana_frameworks.torch"] = module


def gaudi_layers(
    num_blocks: int,
    make: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    kv_dtype: torch.dtype,
    scale_dtype: torch.dtype,
) -> list[GaudiLayer]:
    """vllm-gaudi's ``kv_caches``: layer 0 with dynamic fp8 KV's scales (``kv_dtype`` and
    ``scale_dtype``), layer 1 without (``scale_dtype``, as vllm-gaudi's bfloat16 KV).
    ``make(shape, dtype)`` builds each tensor."""
    blocks = num_blocks + 1  # the last one is vllm-gaudi's pad block
    slots = blocks * BLOCK_SIZE
    kv_shape = (slots, NUM_HEADS, HEAD_SIZE)
    per_slot = (slots, NUM_HEADS, 1)
    with_scales = (
        make(kv_shape, kv_dtype),
        make(kv_shape, kv_dtype),
        make(per_slot, scale_dtype),
        (make(per_slot, scale_dtype), make((blocks, NUM_HEADS, HEAD_SIZE), scale_dtype)),
    )
    return [with_scales, (make(kv_shape, scale_dtype), make(kv_shape, scale_dtype), None, None)]


def layer_tensors(layers: list[GaudiLayer]) -> list[torch.Tensor]:
    """Every tensor of the layers, in order."""
    found: list[torch.Tensor] = []
    for item in layers:
        for inner in item:
            nested = inner if isinstance(inner, (tuple, list)) else (inner,)
            found.extend(tensor for tensor in nested if tensor is not None)
    return found


def block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the runner's layout as one row of bytes per block (pad block last)."""
    return tensor.view(NUM_BLOCKS + 1, -1).view(torch.uint8)


def random_moves(rng: random.Random, count: int, two_way: bool) -> list[Move]:
    """``count`` moves between distinct blocks (never the null block 0)."""
    slots = rng.sample(range(1, NUM_BLOCKS), 2 * count)
    return [Move(src, dst, two_way) for src, dst in zip(slots[:count], slots[count:], strict=True)]


def apply_on_host(reference: list[torch.Tensor], moves: list[Move]) -> None:
    """The moves, one by one, on host copies of the runner's tensors (the naive reference)."""
    for move in moves:
        for tensor in reference:
            rows = block_rows(tensor)
            from_src = rows[move.src_physical_id].clone()
            if move.is_two_way:
                rows[move.src_physical_id] = rows[move.dst_physical_id]
            rows[move.dst_physical_id] = from_src


def check_mover(device: torch.device, use_graphs: bool) -> int:
    """Runs every pad size one way and two way; returns the number of mismatched batches
    (a batch that wrote a pad block is one)."""
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    generator = torch.Generator().manual_seed(7)

    def random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=generator, dtype=dtype)
        return torch.randn(shape, generator=generator).to(dtype)

    # NOTE: torch on CPU has no index_copy_ for float8, so the dry run moves its bytes
    # as uint8; on HPU the layer is float8, as vllm-gaudi's (which index_copy_ writes).
    kv_dtype = torch.uint8 if device.type == "cpu" else torch.float8_e4m3fn
    host = layer_tensors(gaudi_layers(NUM_BLOCKS, random_tensor, kv_dtype, torch.bfloat16))
    on_device = iter([tensor.to(device, copy=True) for tensor in host])
    layers = gaudi_layers(
        NUM_BLOCKS, lambda shape, dtype: next(on_device), kv_dtype, torch.bfloat16
    )
    caches = layer_tensors(layers)
    executor = HpuSwapExecutor(
        bind_vllm_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE, use_graphs=use_graphs
    )
    pad_blocks = [block_rows(tensor)[NUM_BLOCKS].clone() for tensor in host]
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
                torch.equal(block_rows(cache.cpu()), block_rows(reference))
                for cache, reference in zip(caches, host, strict=True)
            )
            mismatched += not same
            print(
                f"mover: {count:4d} {'two-way' if two_way else 'one-way'} moves, "
                f"{report.num_padded} padded: {'ok' if same else 'MISMATCH'}"
            )
    written = sum(
        not torch.equal(block_rows(cache.cpu())[NUM_BLOCKS], pad)
        for cache, pad in zip(caches, pad_blocks, strict=True)
    )
    print(f"pad blocks: {written} of {len(caches)} written by the mover")
    return mismatched + written


def run_identity(
    prefix_caching: bool, device: torch.device, num_blocks: int, num_steps: int
) -> int:
    """The engine's signed identity run on vllm-gaudi's layout; returns the corrupted blocks
    seen, plus the tensors whose pad block changed."""
    from cuda_check import run_integrity  # the same identity run, on this device

    layers = gaudi_layers(
        num_blocks,
        lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device),
        torch.float32,  # the run's signatures are exact in float32 only
        torch.float32,
    )
    tensors = layer_tensors(layers)
    for tensor in tensors:
        tensor.view(num_blocks + 1, -1)[num_blocks] = PAD_VALUE
    corrupted = run_integrity(
        prefix_caching,
        device_name=device.type,
        num_blocks=num_blocks,
        num_steps=num_steps,
        kv_caches=bind_vllm_kv_caches(layers, num_blocks, BLOCK_SIZE),
    )
    written = sum(
        bool((tensor.view(num_blocks + 1, -1)[num_blocks] != PAD_VALUE).any().item())
        for tensor in tensors
    )
    if written:
        print(f"identity run: {written} of {len(tensors)} pad blocks written")
    return corrupted + written


class _SplitRunner:
    """vllm-gaudi's runner as far as the split goes (``hpu_model_runner.py`` at 091bbadd):
    ``execute_model`` keeps the output and returns None (L4151-4224), ``sample_tokens``
    resolves and reads (L4303), ``_dummy_run`` resolves block 0 (L5703-5730)."""

    def __init__(self, kv_caches: list[GaudiLayer], lock: Any) -> None:
        self.kv_caches = kv_caches
        self.defragmenter: Any = None
        self.lock = lock
        self.pending: list[int] | None = None
        self.num_read = 0
        self.num_wrong = 0
        self.unlocked_reads = 0

    def read(self, logical_ids: list[int]) -> None:
        if not self.lock.locked():
            self.unlocked_reads += 1
        (physical,) = self.defragmenter.resolve_all([logical_ids])
        rows = self.kv_caches[1][0].view(len(self.kv_caches[1][0]) // BLOCK_SIZE, -1)
        for logical, slot in zip(logical_ids, physical, strict=True):
            self.num_read += 1
            self.num_wrong += int(rows[slot, 0].item() != float(logical))

    def execute_model(self, output: Any) -> None:
        self.pending = list(output.live)
        return None

    def sample_tokens(self, grammar_output: Any) -> str:
        live, self.pending = self.pending, None
        assert live is not None, "sample_tokens without execute_model"
        self.read(live)
        return "sampled"


class _SplitWorker:
    """vllm-gaudi's ``HPUWorker`` around ``_SplitRunner`` (``hpu_worker.py`` L565-608)."""

    def __init__(self, runner: _SplitRunner) -> None:
        self.model_runner = runner
        self.rank = 0

    def execute_model(self, output: Any) -> Any:
        return self.model_runner.execute_model(output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self.model_runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        self.model_runner.read([0])


def check_split_order(device: torch.device, num_blocks: int = 256) -> int:
    """Step ``N``'s two halves with step ``N + 1``'s compaction between them, on a real
    service bound to ``device`` tensors; returns the wrong or unlocked reads, plus 1 if
    the compaction did not wait for the pass."""
    import tempfile
    import threading

    from kvdefrag.client import DefragClient
    from kvdefrag.server import EngineConfig, ServiceConfig, serve_in_process
    from kvdefrag.vllm.config import RUN_DIR_ENV
    from kvdefrag.vllm.contract import StepStamp, attach_step_stamp
    from kvdefrag.vllm.gaudi import DefragHPUWorkerMixin

    layers = gaudi_layers(
        num_blocks,
        lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device),
        torch.float32,
        torch.float32,
    )
    rows = layers[1][0].view(num_blocks + 1, -1)
    for block in range(num_blocks):
        rows[block] = float(block)  # block b's signature: its logical id (identity mapping)
    worker_cls = type("SplitWorker", (DefragHPUWorkerMixin, _SplitWorker), {})
    with tempfile.TemporaryDirectory() as run_dir:
        os.environ[RUN_DIR_ENV] = run_dir  # the worker reads its settings as in vLLM
        handle = serve_in_process(
            bind_vllm_kv_caches(layers, num_blocks, BLOCK_SIZE),
            BLOCK_SIZE,
            engine_config=EngineConfig(threshold=0),
            service_config=ServiceConfig(address=f"unix:{run_dir}/rank0.sock"),
        )
        runner = _SplitRunner(layers, handle.kv_lock)
        worker = worker_cls(runner)
        worker.kvdefrag_attach(handle, num_blocks)
        failures = 0
        try:
            with DefragClient(handle.address, prefix_caching=False, timeout_s=60) as client:
                low, high = list(range(1, 101)), list(range(200, 240))
                client.step(StepEvents(new_blocks={"low": low, "high": high}, fresh=[]))
                output = types.SimpleNamespace(live=high)
                attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
                worker.execute_model(output)
                moving = threading.Thread(target=lambda: client.step(StepEvents(finished=["low"])))
                moving.start()  # compacts "high" down: needs kv_lock
                moving.join(timeout=1.0)
                waited = moving.is_alive()
                worker.sample_tokens(None)
                moving.join(timeout=60)
                moved = handle.resolve(high).tolist() != high
                failures += int(not (waited and moved))
                worker.execute_dummy_batch()
                output = types.SimpleNamespace(live=high)
                attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
                worker.execute_model(output)
                worker.sample_tokens(None)  # reads "high" at its new slots
        finally:
            handle.stop(grace_s=0)
    failures += runner.num_wrong + runner.unlocked_reads
    print(
        f"split order: compaction waited for sample_tokens: {waited}, moved after: {moved}; "
        f"{runner.num_read} reads, {runner.num_wrong} wrong, {runner.unlocked_reads} unlocked"
    )
    return failures


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
    corrupted = sum(
        run_identity(prefix_caching, device, 4_096, 300 if dry_run else 1_500)
        for prefix_caching in (False, True)
    )
    split = check_split_order(device)
    print(
        f"hpu-check: {mismatched} mismatched batches, {corrupted} corrupted blocks, "
        f"{split} split-order failures"
    )
    return 1 if mismatched or corrupted or split else 0


if __name__ == "__main__":
    sys.exit(main())
