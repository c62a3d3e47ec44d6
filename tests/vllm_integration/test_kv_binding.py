"""Binding vllm-gaudi's KV layout: ``(key_cache, value_cache, key_scales, value_scales)``
per layer over ``num_blocks + 1`` blocks (the last its pad block), served and compacted.

Every block of every tensor, scales included, is signed in the runner's own layout
(``SignedKv`` over the raw tensors, not kvdefrag's views), so a block whose data moved
without its scales, or a pad block that was written, reads back wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import StepEvents
from kvdefrag.server import load_config, serve_in_process
from kvdefrag.vllm._worker.kv_binding import bind_vllm_kv_caches
from kvdefrag.vllm.errors import UnsupportedByKvdefrag

from support.gaudi_kv import gaudi_tensors, make_gaudi_kv_caches
from support.kv import SignedKv

NUM_BLOCKS = 64
BLOCK_SIZE = 4
EXTRA_BLOCKS = 2  # this rank's tensors hold 2 blocks past KVCacheConfig.num_blocks
HEADS = 2
HEAD_SIZE = 4
SLOTS = (NUM_BLOCKS + EXTRA_BLOCKS + 1) * BLOCK_SIZE
PAD_BLOCK_IDS = list(range(NUM_BLOCKS, NUM_BLOCKS + EXTRA_BLOCKS + 1))  # the pad block last

LAYOUTS: dict[str, dict[str, Any]] = {
    "fp8 with scales": {"dtype": torch.float8_e4m3fn, "scales": True},
    "bf16": {"dtype": torch.bfloat16},
    "mla": {"dtype": torch.bfloat16, "mla": True},
}


def gaudi_layers(**options: Any) -> list[Any]:
    """Three layers of vllm-gaudi's layout, the third sharing the first's KV."""
    layers = make_gaudi_kv_caches(
        NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=HEADS,
        head_size=HEAD_SIZE,
        extra_blocks=EXTRA_BLOCKS,
        **options,
    )
    return [*layers, layers[0]]


def signed_raw(layers: list[Any]) -> SignedKv:
    """Every block of every distinct tensor signed where the runner keeps it."""
    return SignedKv([(tensor, None) for tensor in gaudi_tensors(layers)], BLOCK_SIZE)


def test_each_layer_binds_its_pool_with_its_scales_and_not_the_pad_block() -> None:
    layers = gaudi_layers(scales=True)
    key, value, key_scales, (value_scales_on_t, value_scales_on_hidden) = layers[0]
    pairs = bind_vllm_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE)
    pool = NUM_BLOCKS * BLOCK_SIZE
    layer_0 = [
        ((pool, HEADS * HEAD_SIZE), (pool, HEADS * HEAD_SIZE)),
        ((pool, HEADS), None),  # key_scales: a row per token slot and head
        ((pool, HEADS), None),  # value_scales on T: the same
        ((pool, HEADS * HEAD_SIZE // BLOCK_SIZE), None),  # on hidden: a block's row, split
    ]
    shapes = [(tuple(k.shape), None if v is None else tuple(v.shape)) for k, v in pairs]
    assert shapes == layer_0 * 2  # the third layer shares the first's tensors: bound once
    bound = [pairs[0][0], pairs[0][1], pairs[1][0], pairs[2][0], pairs[3][0]]
    runner = [key, value, key_scales, value_scales_on_t, value_scales_on_hidden]
    assert [view.data_ptr() for view in bound if view is not None] == [
        tensor.data_ptr() for tensor in runner
    ]  # views of the runner's tensors, not copies


def test_mla_and_scaleless_layers_bind_one_pair_each() -> None:
    mla = bind_vllm_kv_caches(gaudi_layers(mla=True), NUM_BLOCKS, BLOCK_SIZE)
    assert [(tuple(k.shape), v) for k, v in mla] == [
        ((NUM_BLOCKS * BLOCK_SIZE, HEAD_SIZE), None)
    ] * 2
    plain = bind_vllm_kv_caches(gaudi_layers(), NUM_BLOCKS, BLOCK_SIZE)
    assert len(plain) == 2 and all(v is not None for _, v in plain)
    key, value, _, _ = gaudi_layers()[0]
    assert len(bind_vllm_kv_caches([(key, value)], NUM_BLOCKS, BLOCK_SIZE)) == 1  # 2-tuple form


def test_a_per_tensor_scale_is_not_bound() -> None:
    key, value, _, _ = gaudi_layers()[0]
    layer = (key, value, torch.tensor(0.5), (torch.tensor([0.25]), None))
    assert len(bind_vllm_kv_caches([layer], NUM_BLOCKS, BLOCK_SIZE)) == 1  # same for every block


def compact(layers: list[Any], pairs: Any, tmp_path: Path) -> tuple[SignedKv, list[int], list[int]]:
    """Serves ``pairs`` and runs steps that compact, writing each fresh block (data and
    scales) where the service places it, as the forward pass does; returns the signed raw
    tensors, the live logical ids, every one moved, and their physical ids now."""
    raw = signed_raw(layers)
    engine_config, service_config = load_config(
        {"address": f"unix:{tmp_path}/gaudi.sock", "threshold": 0}, {}
    )
    handle = serve_in_process(
        pairs, BLOCK_SIZE, engine_config=engine_config, service_config=service_config
    )
    live = [40, 41, 42, 50, 51]
    try:
        with DefragClient(handle.address, timeout_s=10) as client:
            fill = {"a": list(range(1, 16)), "b": live[:3]}
            for new_blocks in (fill, {"c": live[3:]}):
                client.step(StepEvents(new_blocks=new_blocks))
                new_ids = sorted({i for ids in new_blocks.values() for i in ids})
                raw.write(new_ids, client.resolve(new_ids))
            placed = handle.resolve(live).tolist()
            reply = client.step(StepEvents(finished=["a"]))  # b and c move down into a's blocks
            moved = handle.resolve(live).tolist()
    finally:
        handle.stop(1.0)
    assert reply.num_moves == len(live)
    assert max(moved) < min(placed)
    return raw, live, moved


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compaction_moves_every_live_blocks_data_and_scales_and_never_the_pad_block(
    layout: str, tmp_path: Path
) -> None:
    layers = gaudi_layers(**LAYOUTS[layout])
    raw, live, moved = compact(
        layers, bind_vllm_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE), tmp_path
    )
    assert raw.mismatched(live, moved) == []  # every tensor: data and scales
    assert raw.mismatched(PAD_BLOCK_IDS, PAD_BLOCK_IDS) == []  # never read, never written


def test_data_moved_without_its_scales_is_seen(tmp_path: Path) -> None:
    """What binding (key_cache, value_cache) alone would do to dynamic fp8 KV."""
    layers = gaudi_layers(**LAYOUTS["fp8 with scales"])
    pairs = bind_vllm_kv_caches([layer[:2] for layer in layers], NUM_BLOCKS, BLOCK_SIZE)
    raw, live, moved = compact(layers, pairs, tmp_path)
    assert raw.mismatched(live, moved) == live


def _as_layer_1(layer: Any) -> list[Any]:
    return [gaudi_layers()[0], layer]


def _bad_layers() -> list[tuple[list[Any], str]]:
    key, value, key_scales, (on_t, _) = gaudi_layers(scales=True)[0]
    scales = (key_scales, (on_t, torch.ones(NUM_BLOCKS + EXTRA_BLOCKS + 1, 1, 3)))
    short = key[: NUM_BLOCKS * BLOCK_SIZE - BLOCK_SIZE]
    return [
        (
            _as_layer_1((key[:-1], value[:-1], None, None)),
            r"key_cache of layer 1 has shape \(267, 2, 4\)",
        ),
        (
            _as_layer_1((short, short.clone(), None, None)),
            r"key_cache of layer 1 has shape \(252, 2, 4\)",
        ),
        (
            _as_layer_1((key, value[:-4], None, None)),
            r"value_cache of layer 1 is of shape \(264, 2, 4\)",
        ),
        (
            _as_layer_1((key.transpose(1, 2), value, None, None)),
            r"key_cache of layer 1 .* not contiguous",
        ),
        (
            _as_layer_1((key, value, torch.ones(HEADS), None)),
            r"key_scales of layer 1 has shape \(2,\)",
        ),
        (
            _as_layer_1((key, value, *scales)),
            r"value_scales\[1\] of layer 1 has shape \(67, 1, 3\): a row of 3",
        ),
        (_as_layer_1((key, value, key_scales, "fp8")), r"value_scales of layer 1 is a str"),
        (_as_layer_1((key, value, key_scales)), r"layer 1 is a sequence of 3 items"),
    ]


@pytest.mark.parametrize(("layers", "named"), _bad_layers())
def test_a_layout_that_cannot_move_with_its_blocks_is_refused_by_name(
    layers: list[Any], named: str
) -> None:
    with pytest.raises(UnsupportedByKvdefrag, match=named):
        bind_vllm_kv_caches(layers, NUM_BLOCKS, BLOCK_SIZE)
