"""The vLLM worker side without vLLM: binding vLLM's KV layouts, and the mixin's lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.server import Move, make_executor
from kvdefrag.server.vllm_worker import DefragWorkerMixin, bind_vllm_kv_caches

NUM_BLOCKS = 8
BLOCK_SIZE = 4
HEADS = 2
HEAD_SIZE = 3

LAYOUTS = {
    # CPU attention: [2, num_blocks, heads, block_size, head_size]
    "cpu": (2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE),
    # FlashAttention: [2, num_blocks, block_size, heads, head_size]
    "flash": (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE),
    # FlashInfer: [num_blocks, 2, block_size, heads, head_size]
    "flashinfer": (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE),
    # MLA: [num_blocks, block_size, head_size]
    "mla": (NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE),
}


def _block(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Everything of block ``block_id`` in a vLLM layout (key and value)."""
    return kv[:, block_id].clone() if kv.shape[0] == 2 else kv[block_id].clone()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_move_on_the_bound_views_moves_the_whole_vllm_block(layout: str) -> None:
    kv = torch.randn(LAYOUTS[layout])
    before = [_block(kv, block_id) for block_id in range(NUM_BLOCKS)]
    pairs = bind_vllm_kv_caches([kv], NUM_BLOCKS, BLOCK_SIZE)
    assert pairs[0][0].shape[0] == NUM_BLOCKS * BLOCK_SIZE
    assert pairs[0][0].data_ptr() == kv.data_ptr()  # a view, not a copy
    make_executor(pairs, BLOCK_SIZE).execute(
        [Move(6, 1, is_two_way=True), Move(7, 2, is_two_way=False)]
    )
    assert torch.equal(_block(kv, 1), before[6])
    assert torch.equal(_block(kv, 6), before[1])
    assert torch.equal(_block(kv, 2), before[7])
    for block_id in (0, 3, 4, 5):
        assert torch.equal(_block(kv, block_id), before[block_id])


def test_a_tensor_two_layers_share_is_bound_once() -> None:
    shared = torch.zeros(LAYOUTS["cpu"])
    other = torch.zeros(LAYOUTS["cpu"])
    assert len(bind_vllm_kv_caches([shared, other, shared], NUM_BLOCKS, BLOCK_SIZE)) == 2


def test_a_layout_that_is_not_a_view_is_refused_by_name() -> None:
    permuted = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE).transpose(0, 1)
    with pytest.raises(ValueError, match="not contiguous"):
        bind_vllm_kv_caches([permuted], NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(ValueError, match="has shape"):
        bind_vllm_kv_caches([torch.zeros(5, NUM_BLOCKS + 1, 4)], NUM_BLOCKS, BLOCK_SIZE)


class _FakeRunner:
    def __init__(self) -> None:
        self.kv_caches: list[torch.Tensor] = []


class _FakeVllmWorker:
    """What the mixin uses of vLLM's Worker: rank, cache_config, model_runner, hooks."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.cache_config = type("CacheConfig", (), {"block_size": BLOCK_SIZE})()
        self.model_runner = _FakeRunner()
        self.calls: list[str] = []

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.model_runner.kv_caches = [torch.zeros(LAYOUTS["cpu"]) for _ in range(2)]
        self.calls.append("initialize_from_config")

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append("execute_model")
        return scheduler_output

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class _Worker(DefragWorkerMixin, _FakeVllmWorker):
    pass


def _kv_cache_config(num_groups: int = 1) -> Any:
    return type(
        "KVCacheConfig", (), {"num_blocks": NUM_BLOCKS, "kv_cache_groups": [None] * num_groups}
    )()


def test_the_mixin_serves_the_rank_holds_kv_lock_and_stops_on_shutdown(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "engine0"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=1)
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    with DefragClient(f"unix:{run_dir}/rank1.sock", prefix_caching=False) as client:
        client.step(new_blocks={"req-0": [5, 6]})
        assert client.stats().stats.max_live == 2

    held: list[bool] = []

    def execute(scheduler_output: Any) -> Any:
        lock: threading.Lock = handle.engine.kv_lock
        held.append(lock.locked())
        return scheduler_output

    monkeypatch.setattr(_FakeVllmWorker, "execute_model", lambda self, out: execute(out))
    assert worker.execute_model("output") == "output"
    assert held == [True]
    assert not handle.engine.kv_lock.locked()

    worker.shutdown()
    assert worker.kvdefrag_handle is None
    assert worker.calls[-1] == "shutdown"
    assert not (run_dir / "rank1.sock").exists()


def test_the_mixin_refuses_a_hybrid_model_and_an_unset_run_dir(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="2 KV cache groups"):
        _Worker(rank=0).initialize_from_config(_kv_cache_config(num_groups=2))
    monkeypatch.delenv("KVDEFRAG_VLLM_RUN_DIR")
    with pytest.raises(RuntimeError, match="KVDEFRAG_VLLM_RUN_DIR"):
        _Worker(rank=0).initialize_from_config(_kv_cache_config())


def test_importing_the_module_imports_no_vllm() -> None:
    code = (
        "import sys, kvdefrag.server.vllm_worker as module\n"
        "assert not [name for name in sys.modules if name.split('.')[0] == 'vllm']\n"
        "assert not hasattr(module, 'NoSuchWorker')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
