"""The HPU backend's logic, run on CPU tensors with a stand-in ``habana_frameworks``.

The real backend needs a Gaudi; what can be checked anywhere is that it pads every batch
to a bucket with the null pair, never negative, calls ``mark_step`` around each swap,
pre-warms every bucket, and moves (or swaps) exactly the right blocks.
"""

import sys
import types
from collections.abc import Iterator

import pytest

from kvdefrag.server import Move

from support.kv import SignedKv


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


def test_hpu_backend_pads_swaps_and_prewarms(fake_habana: list[str]) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 40, 4
    kv = SignedKv.create(num_blocks, block_size=block_size)
    executor = HpuSwapExecutor(kv.kv_caches, block_size, pad_buckets=(4, 8), use_graphs=False)
    assert fake_habana.count("mark_step") == 2 * 2 * 2  # 2 buckets x (one-way, two-way)
    slots = list(range(num_blocks))
    assert kv.mismatched(slots, slots) == []  # warm-up: no-op

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
    assert kv.mismatched(expected, slots) == []  # every tensor: key and value of each layer
    assert report.num_bytes == executor._bytes_per_block * 4  # 3 moves, one of them two-way


def test_hpu_backend_splits_batches_over_the_largest_bucket(fake_habana: list[str]) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 64, 2
    kv = SignedKv.create(num_blocks, block_size=block_size)
    executor = HpuSwapExecutor(kv.kv_caches, block_size, pad_buckets=(4,), use_graphs=False)
    moves = [Move(50 + i, 1 + i, False) for i in range(6)]
    report = executor.execute(moves)
    assert (report.num_moves, report.num_padded) == (6, 2)  # 4 + (2 padded to 4)
    assert kv.mismatched(range(50, 56), range(1, 7)) == []
    assert kv.mismatched([0], [0]) == []  # the pad pair (0 -> 0) left the null block as it was
