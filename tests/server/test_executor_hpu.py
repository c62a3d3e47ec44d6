"""The HPU backend's logic, run on CPU tensors with a stand-in ``habana_frameworks``.

The real backend needs a Gaudi; what can be checked anywhere is that it pads every batch
to a bucket with the null pair, never negative, calls ``mark_step`` around each swap,
pre-warms every bucket, and moves (or swaps) exactly the right blocks.
"""

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from kvdefrag.server import Move


@pytest.fixture
def fake_habana(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Installs a stand-in ``habana_frameworks.torch`` that records mark_step calls."""
    calls: list[str] = []
    package = types.ModuleType("habana_frameworks")
    module = types.ModuleType("habana_frameworks.torch")
    module.core = types.SimpleNamespace(mark_step=lambda: calls.append("mark_step"))  # type: ignore[attr-defined]
    package.torch = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "habana_frameworks", package)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch", module)
    monkeypatch.delitem(sys.modules, "kvdefrag.server._executor_hpu", raising=False)
    yield calls
    sys.modules.pop("kvdefrag.server._executor_hpu", None)  # imported against the stand-in


def _signed_caches(num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    caches = []
    for layer in range(2):
        key = torch.arange(num_blocks, dtype=torch.float32).repeat_interleave(block_size)
        key = (key + 1000 * layer).reshape(-1, 1).repeat(1, 3)
        caches.append((key, -key.clone()))
    return caches


def _block_ids(tensor: torch.Tensor, block_size: int) -> list[int]:
    return tensor[::block_size, 0].abs().remainder(1000).long().tolist()


def test_hpu_backend_pads_swaps_and_prewarms(fake_habana: list[str]) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 40, 4
    caches = _signed_caches(num_blocks, block_size)
    executor = HpuSwapExecutor(caches, block_size, pad_buckets=(4, 8), use_graphs=False)
    assert fake_habana.count("mark_step") == 2 * 2 * 2  # 2 buckets x (one-way, two-way)
    assert _block_ids(caches[0][0], block_size) == list(range(num_blocks))  # warm-up: no-op

    fake_habana.clear()
    moves = [Move(30, 1, False), Move(31, 2, False), Move(32, 3, True)]
    report = executor.execute(moves)
    assert (report.num_moves, report.num_padded) == (3, 1)
    assert fake_habana == ["mark_step", "mark_step"]
    expected = list(range(num_blocks))
    # A batch with a two-way move runs as swaps: a swap is also a correct one-way move.
    for move in moves:
        src, dst = move.src_physical_id, move.dst_physical_id
        expected[src], expected[dst] = expected[dst], expected[src]
    for key, value in caches:
        assert _block_ids(key, block_size) == expected
        assert _block_ids(value, block_size) == expected
    assert report.num_bytes == executor._bytes_per_block * 4  # 3 moves, one of them two-way


def test_hpu_backend_splits_batches_over_the_largest_bucket(fake_habana: list[str]) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 64, 2
    caches = _signed_caches(num_blocks, block_size)
    executor = HpuSwapExecutor(caches, block_size, pad_buckets=(4,), use_graphs=False)
    moves = [Move(50 + i, 1 + i, False) for i in range(6)]
    report = executor.execute(moves)
    assert (report.num_moves, report.num_padded) == (6, 2)  # 4 + (2 padded to 4)
    ids = _block_ids(caches[0][0], block_size)
    assert ids[1:7] == list(range(50, 56))
    assert ids[0] == 0  # the pad pair (0 -> 0) left the null block as it was
