"""The HPU backend's logic, run on CPU tensors with a stand-in ``habana_frameworks``.

The real backend needs a Gaudi; what can be checked anywhere is that it pads every batch
to a bucket with the null pair, never negative, calls ``mark_step`` around each swap,
warms every bucket (at bind, and again when asked: ``warmup``, ``ServerHandle.warmup``,
and for caches bound anew, ``ServerHandle.rebind_kv_caches``), and moves (or swaps)
exactly the right blocks.
"""

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import StepEvents
from kvdefrag.server import Move, _backends

from support.kv import SignedKv, kv_tensors
from support.server import Serve


class StandInHabana:
    """What the stand-in ``habana_frameworks.torch`` saw.

    Attributes:
        marks: One ``"mark_step"`` per call.
        swaps: ``(batch size, two_way)`` of every swap run through an HPU graph (lazy
            mode's ``wrap_in_hpu_graph``; the stand-in runs the module eagerly).
    """

    def __init__(self) -> None:
        self.marks: list[str] = []
        self.swaps: list[tuple[int, bool]] = []

    def wrap_in_hpu_graph(self, module: Any, **_: Any) -> Any:
        def graph(src: torch.Tensor, dst: torch.Tensor, caches: Any, two_way: bool) -> None:
            self.swaps.append((len(src), two_way))
            module(src, dst, caches, two_way)

        return graph


@pytest.fixture
def fake_habana(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInHabana]:
    """Installs a stand-in ``habana_frameworks.torch`` (lazy mode) that records what ran."""
    seen = StandInHabana()
    package = types.ModuleType("habana_frameworks")
    module = types.ModuleType("habana_frameworks.torch")
    module.core = types.SimpleNamespace(mark_step=lambda: seen.marks.append("mark_step"))  # type: ignore[attr-defined]
    module.utils = types.SimpleNamespace(internal=types.SimpleNamespace(is_lazy=lambda: True))  # type: ignore[attr-defined]
    module.hpu = types.SimpleNamespace(wrap_in_hpu_graph=seen.wrap_in_hpu_graph)  # type: ignore[attr-defined]
    package.torch = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "habana_frameworks", package)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch", module)
    monkeypatch.delitem(sys.modules, "kvdefrag.server._executor_hpu", raising=False)
    yield seen
    sys.modules.pop("kvdefrag.server._executor_hpu", None)  # imported against the stand-in


EVERY_BUCKET_BOTH_WAYS = [(4, False), (4, True), (8, False), (8, True)]


def test_hpu_backend_pads_swaps_and_prewarms(fake_habana: StandInHabana) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 40, 4
    kv = SignedKv.create(num_blocks, block_size=block_size)
    executor = HpuSwapExecutor(kv.kv_caches, block_size, pad_buckets=(4, 8), use_graphs=False)
    assert fake_habana.marks.count("mark_step") == 2 * 2 * 2  # 2 buckets x (one-way, two-way)
    slots = list(range(num_blocks))
    assert kv.mismatched(slots, slots) == []  # warm-up: no-op

    fake_habana.marks.clear()
    moves = [Move(30, 1, False), Move(31, 2, False), Move(32, 3, True)]
    report = executor.execute(moves)
    assert (report.num_moves, report.num_padded) == (3, 1)
    assert fake_habana.marks == ["mark_step", "mark_step"]
    expected = list(range(num_blocks))
    # A batch with a two-way move runs as swaps: a swap is also a correct one-way move.
    for move in moves:
        src, dst = move.src_physical_id, move.dst_physical_id
        expected[src], expected[dst] = expected[dst], expected[src]
    assert kv.mismatched(expected, slots) == []  # every tensor: key and value of each layer
    assert report.num_bytes == executor._bytes_per_block * 4  # 3 moves, one of them two-way


def test_hpu_backend_splits_batches_over_the_largest_bucket(fake_habana: StandInHabana) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 64, 2
    kv = SignedKv.create(num_blocks, block_size=block_size)
    executor = HpuSwapExecutor(kv.kv_caches, block_size, pad_buckets=(4,), use_graphs=False)
    moves = [Move(50 + i, 1 + i, False) for i in range(6)]
    report = executor.execute(moves)
    assert (report.num_moves, report.num_padded) == (6, 2)  # 4 + (2 padded to 4)
    assert kv.mismatched(range(50, 56), range(1, 7)) == []
    assert kv.mismatched([0], [0]) == []  # the pad pair (0 -> 0) left the null block as it was


def test_hpu_warmup_runs_every_bucket_again_and_moves_nothing(fake_habana: StandInHabana) -> None:
    from kvdefrag.server._executor_hpu import HpuSwapExecutor

    num_blocks, block_size = 40, 4
    kv = SignedKv.create(num_blocks, block_size=block_size)
    executor = HpuSwapExecutor(kv.kv_caches, block_size, pad_buckets=(4, 8))
    assert fake_habana.swaps == EVERY_BUCKET_BOTH_WAYS  # at bind, through the graphs
    executor.execute([Move(30, 1, False), Move(31, 2, True)])
    expected = list(range(num_blocks))
    expected[1], expected[30] = 30, 1  # run as swaps: the batch has a two-way move
    expected[2], expected[31] = 31, 2
    slots = list(range(num_blocks))
    assert kv.mismatched(expected, slots) == []

    fake_habana.swaps.clear()
    assert executor.warmup() == 4
    assert fake_habana.swaps == EVERY_BUCKET_BOTH_WAYS
    assert kv.mismatched(expected, slots) == []  # pad-only batches: nothing moved


def test_a_service_on_hpu_warms_at_bind_on_request_and_after_a_rebind(
    serve: Serve, fake_habana: StandInHabana, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPU tensors get the HPU backend here, built by serve_in_process's own path.
    monkeypatch.setitem(_backends._BACKENDS, "cpu", _backends._hpu_executor)
    old = SignedKv.create(64, block_size=4)
    handle = serve(kv=old, pad_buckets=(4, 8), threshold=0)
    assert fake_habana.swaps == EVERY_BUCKET_BOTH_WAYS

    fake_habana.swaps.clear()
    assert handle.warmup() == 4
    assert fake_habana.swaps == EVERY_BUCKET_BOTH_WAYS
    assert old.mismatched(range(64), range(64)) == []  # nothing moved

    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": list(range(1, 11)), "b": [40, 41, 42]}))
        old_before = [tensor.clone() for tensor in kv_tensors(old.kv_caches)]
        new = SignedKv.create(64, block_size=4)
        fake_habana.swaps.clear()
        handle.rebind_kv_caches(new.kv_caches)
        assert fake_habana.swaps == EVERY_BUCKET_BOTH_WAYS  # the new executor, warmed

        live = [40, 41, 42]
        new.write(live, handle.resolve(live).tolist())  # b's data, written after the wake-up
        fake_habana.swaps.clear()
        reply = client.step(StepEvents(finished=["a"]))  # holes below b: it moves down
        assert reply.num_moves == 3 and fake_habana.swaps == [(4, False)]
        assert new.lost_blocks(handle, live) == []
    for tensor, before in zip(kv_tensors(old.kv_caches), old_before, strict=True):
        assert torch.equal(tensor, before)  # the old tensors were not written
