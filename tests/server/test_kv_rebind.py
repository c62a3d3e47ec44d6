"""The worker's KV tensors change under a running service: ``ServerHandle.warmup``,
``release_kv_caches`` (vLLM's sleep frees them) and ``rebind_kv_caches`` (its wake-up
allocates new ones), on real services and signed CPU caches.

The HPU executor's warm-up, at bind, on request and after a rebind, is in
``test_executor_hpu.py`` (it needs the stand-in ``habana_frameworks``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient, EngineUnhealthy
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import ServerHandle

from support.doubles import ScriptedExecutor
from support.kv import SignedKv, kv_tensors, make_kv_caches
from support.server import Serve

NUM_BLOCKS = 64
BLOCK_SIZE = 4
A_BLOCKS = list(range(1, 11))
B_BLOCKS = [40, 41, 42]


@pytest.fixture
def served(serve: Serve) -> Iterator[tuple[ServerHandle, SignedKv, DefragClient]]:
    """A service on signed caches, compacting at once, and its scheduler's client; two
    requests are live (``a`` placed below ``b``), each block written where it lives."""
    kv = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    handle = serve(kv=kv, threshold=0)
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": A_BLOCKS, "b": B_BLOCKS}))
        kv.write(A_BLOCKS + B_BLOCKS, client.resolve(A_BLOCKS + B_BLOCKS))
        yield handle, kv, client


def snapshot(kv: SignedKv) -> list[torch.Tensor]:
    return [tensor.clone() for tensor in kv_tensors(kv.kv_caches)]


def unchanged(kv: SignedKv, before: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(tensor, old)
        for tensor, old in zip(kv_tensors(kv.kv_caches), before, strict=True)
    )


def test_warmup_is_defined_on_cpu_and_runs_no_batch(
    served: tuple[ServerHandle, SignedKv, DefragClient],
) -> None:
    handle, kv, _ = served
    before = snapshot(kv)
    assert handle.warmup() == 0  # the CPU executor compiles nothing
    assert unchanged(kv, before)


def test_after_a_rebind_blocks_move_in_the_new_tensors_and_the_old_ones_stay(
    served: tuple[ServerHandle, SignedKv, DefragClient],
) -> None:
    handle, old, client = served
    epoch, mapping = handle.epoch, handle.resolve()
    handle.release_kv_caches()  # the worker sleeps: its caches are discarded
    old_before = snapshot(old)
    new = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)  # its wake-up allocates these

    handle.rebind_kv_caches(new.kv_caches)

    # Nothing the scheduler sees changed: the same epoch, mapping and requests.
    assert handle.epoch == epoch
    assert handle.resolve().tolist() == mapping.tolist()
    assert handle.stats().num_requests == 2
    new.write(B_BLOCKS, handle.resolve(B_BLOCKS).tolist())  # b recomputed after the wake-up
    reply = client.step(
        StepEvents(finished=["a"])
    )  # the session goes on; holes below b: b moves down
    assert reply.num_moves == len(B_BLOCKS)
    assert new.lost_blocks(handle, B_BLOCKS) == []
    assert unchanged(old, old_before)


def test_released_caches_are_let_go_and_a_step_that_moves_fails_naming_it(
    served: tuple[ServerHandle, SignedKv, DefragClient],
) -> None:
    handle, _, client = served
    engine: Any = handle._engine  # what the handle does not offer: the bound executor
    bound = weakref.ref(engine._executor)
    handle.release_kv_caches()
    gc.collect()
    assert bound() is None  # nothing holds the freed caches' executor (and views) any more
    assert handle.warmup() == 0  # nothing to warm

    client.step(StepEvents(new_blocks={"c": [50]}))  # placed, nothing moved: applied
    with pytest.raises(EngineUnhealthy, match="KV caches are released"):
        client.step(StepEvents(finished=["a"]))  # a compaction with no memory to move in


def other_layout(**options: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return make_kv_caches(options.pop("num_blocks", NUM_BLOCKS), block_size=BLOCK_SIZE, **options)


@pytest.mark.parametrize(
    ("kv_caches", "named"),
    [
        (other_layout(num_layers=3), r"kv_caches has 3 layers, the bound caches 2"),
        (
            other_layout(num_blocks=32),
            r"kv_caches\[0\]\.key is a float32 cpu tensor of shape \(128, 2, 4\), the bound "
            r"one a float32 cpu tensor of shape \(256, 2, 4\)",
        ),
        (other_layout(num_heads=4), r"kv_caches\[0\]\.key is .* shape \(256, 4, 4\)"),
        (other_layout(dtype=torch.float16), r"kv_caches\[0\]\.key is a float16 cpu tensor"),
        (other_layout(mla=True), r"kv_caches\[0\]\.value is None, the bound one a float32"),
        ([torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 8)], r"kv_caches\[0\] must be a \(key, value\)"),
    ],
    ids=["layers", "num_blocks", "shape", "dtype", "mla", "not_pairs"],
)
def test_a_rebind_to_another_layout_is_refused_by_name_and_changes_nothing(
    served: tuple[ServerHandle, SignedKv, DefragClient], kv_caches: Any, named: str
) -> None:
    handle, old, client = served
    epoch, mapping = handle.epoch, handle.resolve()
    with pytest.raises(InvalidArgument, match=named):
        handle.rebind_kv_caches(kv_caches)
    assert handle.epoch == epoch and handle.resolve().tolist() == mapping.tolist()
    reply = client.step(StepEvents(finished=["a"]))  # still moving in the bound tensors
    assert reply.num_moves == len(B_BLOCKS)
    assert old.lost_blocks(handle, B_BLOCKS) == []


def test_a_rebind_with_an_executor_of_another_pool_is_refused(
    served: tuple[ServerHandle, SignedKv, DefragClient],
) -> None:
    handle, old, client = served
    new = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match="the executor moves 32 blocks, the pool has 64"):
        handle.rebind_kv_caches(new.kv_caches, executor=ScriptedExecutor.without_kv(32))
    client.step(StepEvents(finished=["a"]))
    assert old.lost_blocks(handle, B_BLOCKS) == []
