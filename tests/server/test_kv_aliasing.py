"""KV tensors that share memory are refused when they are bound, by name, changing nothing.

A move is applied to every bound tensor in turn, so memory bound twice (a layer's key
given as its value too, one tensor in two layers, two views of one storage that share
bytes) is moved twice: a two-way swap undoes itself while the mapping says the blocks
moved. ``Engine``, ``serve_in_process`` and ``rebind_kv_caches`` refuse such caches;
vLLM's real layouts (``[2, num_blocks, ...]`` halves, vllm-gaudi's caches with their
scales) share no bytes and still bind and move every block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import Engine, load_config, serve_in_process
from kvdefrag.server.config import EngineConfig
from kvdefrag.vllm._worker.kv_binding import bind_vllm_kv_caches

from support.kv import KvCaches, SignedKv, make_kv_caches
from support.server import Serve

NUM_BLOCKS = 32
BLOCK_SIZE = 4
SLOTS = NUM_BLOCKS * BLOCK_SIZE


def _shifted_views() -> KvCaches:
    """One storage, key its first slots and value the slots one block further: both
    contiguous, overlapping in all but a block."""
    storage = torch.zeros(SLOTS + BLOCK_SIZE, 2, 4)
    return [(storage[:SLOTS], storage[BLOCK_SIZE:])]


def _interleaved_views() -> KvCaches:
    """One ``[slots, 2, ...]`` storage, key and value its two interleaved halves."""
    storage = torch.zeros(SLOTS, 2, 2, 4)
    return [(storage[:, 0], storage[:, 1])]


def _same_key_and_value() -> KvCaches:
    key, _ = make_kv_caches(NUM_BLOCKS, block_size=BLOCK_SIZE, num_layers=1)[0]
    return [(key, key)]


def _one_tensor_in_two_layers() -> KvCaches:
    (key0, value0), (key1, _) = make_kv_caches(NUM_BLOCKS, block_size=BLOCK_SIZE)
    return [(key0, value0), (key1, key0)]


def _a_view_of_another_layer() -> KvCaches:
    (key0, value0), (key1, _) = make_kv_caches(NUM_BLOCKS, block_size=BLOCK_SIZE)
    return [(key0, value0), (key1, value0.view(SLOTS, -1))]


ALIASED: dict[str, tuple[Callable[[], KvCaches], str]] = {
    "key is value": (_same_key_and_value, r"kv_caches\[0\]\.value overlaps kv_caches\[0\]\.key"),
    "two layers": (
        _one_tensor_in_two_layers,
        r"kv_caches\[1\]\.value overlaps kv_caches\[0\]\.key",
    ),
    "a reshaped view": (
        _a_view_of_another_layer,
        r"kv_caches\[1\]\.value overlaps kv_caches\[0\]\.value",
    ),
    "shifted views": (_shifted_views, r"kv_caches\[0\]\.value overlaps kv_caches\[0\]\.key"),
    "interleaved views": (
        _interleaved_views,
        r"kv_caches\[0\]\.value overlaps kv_caches\[0\]\.key",
    ),
}


@pytest.mark.parametrize("case", sorted(ALIASED))
def test_the_engine_refuses_tensors_that_share_memory_naming_both(case: str) -> None:
    make, message = ALIASED[case]
    with pytest.raises(InvalidArgument, match=message):
        Engine(make(), BLOCK_SIZE)


def test_serve_in_process_refuses_shared_memory_and_leaves_no_socket(tmp_path: Path) -> None:
    engine_config, service_config = load_config({"address": f"unix:{tmp_path}/s.sock"}, {})
    with pytest.raises(InvalidArgument, match=r"kv_caches\[1\]\.value overlaps"):
        serve_in_process(
            _one_tensor_in_two_layers(),
            BLOCK_SIZE,
            engine_config=engine_config,
            service_config=service_config,
        )
    assert list(tmp_path.iterdir()) == []


def compacting_steps(kv: SignedKv, engine: Engine) -> list[int]:
    """Fills the pool, finishes the low request so the live ones move down (two-way
    swaps with the freed blocks), writing every fresh block where it lands; returns the
    live logical ids."""
    live = [20, 21, 22, 23, 24, 25]
    engine.step(StepEvents(new_blocks={"low": list(range(1, 10)), "high": live}))
    kv.write_fresh(engine, list(range(1, 10)) + live)
    result = engine.step(StepEvents(finished=["low"]))
    assert len(result.moves) == len(live)
    return live


def test_a_rebind_to_shared_memory_is_refused_and_the_old_tensors_still_move() -> None:
    kv = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine = Engine(kv.kv_caches, BLOCK_SIZE, EngineConfig(threshold=0))

    with pytest.raises(InvalidArgument, match=r"kv_caches\[1\]\.value overlaps"):
        engine.rebind_kv_caches(_one_tensor_in_two_layers())

    live = compacting_steps(kv, engine)
    assert kv.lost_blocks(engine, live) == []


def test_vllms_key_value_halves_of_one_tensor_bind_and_move_every_block(
    serve: Serve,
) -> None:
    # FlashAttention's / the CPU backend's layout: [2, num_blocks, block_size, heads, size].
    layer = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 4)
    shared = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 4)
    layers = [layer, shared, shared]  # the last two layers share one tensor
    kv = SignedKv(bind_vllm_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
    assert len(kv.kv_caches) == 2
    handle = serve(kv=kv, num_blocks=NUM_BLOCKS, threshold=0)
    with DefragClient(handle.address, timeout_s=10) as client:
        live = [20, 21, 22, 23, 24, 25]
        client.step(StepEvents(new_blocks={"low": list(range(1, 10)), "high": live}))
        kv.write_fresh(handle, list(range(1, 10)) + live)
        assert client.step(StepEvents(finished=["low"])).num_moves == len(live)
    assert kv.lost_blocks(handle, live) == []
