"""Distributed layouts on vLLM 0.33's real configuration objects: the refusals the
workers make before the model loads, and each data-parallel engine's own ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm.config import DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig

from kvdefrag.vllm import refusals as _engine_checks
from kvdefrag.vllm._discovery import PublishedRank, ensure_run_dir, publish_ranks, rank_address
from kvdefrag.vllm.contract import data_parallel_rank, engine_run_dir, rank_port_offset
from kvdefrag.vllm.errors import UnsupportedByKvdefrag
from kvdefrag.vllm.refusals import RAY_V2_ENV, check_engine_config
from kvdefrag.vllm.scheduler import DefragScheduler, check_supported
from kvdefrag.vllm.worker import DefragWorkerMixin

from support.vllm_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    V2VllmConfig,
    Workload,
    harness_engine_id,
    make_scheduler,
    model_config,
    serve_rank,
)


def _config(model_dir: str, **kwargs: Any) -> VllmConfig:
    """A real ``VllmConfig``: ``ParallelConfig(**kwargs)``, ``kv_transfer_config`` apart
    (prefill context parallelism on the V2 runner: vLLM refuses it on V1)."""
    kv_transfer_config = kwargs.pop("kv_transfer_config", None)
    config_cls = V2VllmConfig if kwargs.get("prefill_context_parallel_size", 1) > 1 else VllmConfig
    return config_cls(
        model_config=model_config(model_dir),
        parallel_config=ParallelConfig(**kwargs),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )


def _as_dp_engine(config: VllmConfig, dp_rank: int, *, is_moe: bool) -> VllmConfig:
    """What ``EngineCoreProc.run_engine_core`` does to an engine's config before it
    builds the engine core, its executor and its scheduler (vLLM 0.33
    ``v1/engine/core.py:1477-1556``)."""
    parallel = config.parallel_config
    parallel.data_parallel_rank_local = dp_rank
    parallel.data_parallel_index = dp_rank
    if is_moe:
        parallel.data_parallel_rank = dp_rank
    else:
        parallel.reconfigure_for_independent_dp_rank()
    return config


class _VllmWorker:
    """vLLM's Worker as far as the mixin's start goes: the config, and the two calls
    every executor makes first (a real CPU or GPU worker needs vLLM's kernels)."""

    def __init__(self, vllm_config: VllmConfig, rank: int) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.rank = rank
        self.local_rank = rank
        self.calls: list[str] = []

    def init_device(self) -> None:
        self.calls.append("init_device")

    def load_model(self) -> None:
        self.calls.append("load_model")


class _Worker(DefragWorkerMixin, _VllmWorker):
    pass


REFUSED = {
    "decode context parallel 2": (
        {"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
        "--decode-context-parallel-size",
    ),
    "prefill context parallel 2": (
        {"prefill_context_parallel_size": 2},
        "--prefill-context-parallel-size",
    ),
    "KV connector not served": (
        {
            "kv_transfer_config": KVTransferConfig(
                kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both"
            )
        },
        "'SimpleCPUOffloadConnector'.*drop --kv-transfer-config",
    ),
}


@pytest.mark.parametrize("layout", sorted(REFUSED))
def test_a_real_config_kvdefrag_refuses_stops_the_worker_before_the_model_loads(
    model_dir: str, run_dir: str, layout: str
) -> None:
    settings, fix = REFUSED[layout]
    config = _config(model_dir, **dict(settings))
    worker = _Worker(config, rank=0)
    with pytest.raises(UnsupportedByKvdefrag, match=fix):
        worker.init_device()
    assert worker.calls == []  # vLLM's init_device, and so load_model, never ran
    assert os.listdir(run_dir) == []
    # the scheduler side refuses it with the same check
    with pytest.raises(UnsupportedByKvdefrag, match=fix):
        check_supported(config, make_scheduler_kv_cache_config())


def make_scheduler_kv_cache_config() -> Any:
    """One full-attention group, as a Llama's (the refusals above are not about it)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )


def test_tensor_data_and_pipeline_parallel_configs_are_served(model_dir: str, run_dir: str) -> None:
    for settings in (
        {"data_parallel_size": 2},
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 4, "tensor_parallel_size": 2},
    ):
        worker = _Worker(_config(model_dir, **settings), rank=0)
        worker.init_device()
        assert worker.calls == ["init_device"]


def test_vllm_033_has_no_legacy_ray_executor_to_refuse(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not _engine_checks.has_legacy_ray_executor()
    config = _config(model_dir)
    monkeypatch.setattr(config.parallel_config, "distributed_executor_backend", "ray")
    monkeypatch.setenv(RAY_V2_ENV, "0")  # only vLLM 0.32 reads it
    check_engine_config(config)


@pytest.mark.parametrize("is_moe", [False, True], ids=["dense", "moe"])
def test_each_dp_engine_of_a_real_config_has_its_own_run_dir_and_ports(
    model_dir: str, run_dir: str, is_moe: bool
) -> None:
    configs = [
        _as_dp_engine(
            _config(model_dir, data_parallel_size=2, tensor_parallel_size=2), k, is_moe=is_moe
        )
        for k in range(2)
    ]
    assert [data_parallel_rank(config.parallel_config) for config in configs] == [0, 1]
    assert [engine_run_dir(config.parallel_config, run_dir) for config in configs] == [
        run_dir,
        os.path.join(run_dir, "dp1"),
    ]
    offsets = [
        rank_port_offset(config.parallel_config, local_rank)
        for config in configs
        for local_rank in range(2)
    ]
    assert offsets == [0, 1, 2, 3]


def test_each_dp_engines_scheduler_steps_only_its_own_ranks(model_dir: str, run_dir: str) -> None:
    """``vllm serve --data-parallel-size 2`` of a dense model: two engines of one rank,
    rank 0 both; each engine's scheduler finds its rank in its own run directory."""
    served = []
    schedulers: list[Any] = []
    try:
        for dp_rank in range(2):
            parallel = _as_dp_engine(
                _config(model_dir, data_parallel_size=2), dp_rank, is_moe=False
            ).parallel_config
            engine_dir = engine_run_dir(parallel, run_dir)
            ensure_run_dir(engine_dir)
            secret = os.urandom(32)
            handle, _ = serve_rank(f"{engine_dir}/rank0.sock", NUM_BLOCKS, secret)
            served.append(handle)
            publish_ranks(
                engine_dir,
                [PublishedRank(rank_address(engine_dir, 0), secret)],
                engine_id=harness_engine_id(parallel),
            )
            schedulers.append(
                make_scheduler(
                    DefragScheduler,
                    model_dir,
                    num_blocks=NUM_BLOCKS,
                    prefix_caching=False,
                    parallel_config=parallel,
                )
            )
        # requests only to DP engine 1
        for request in Workload(seed=5, num_requests=4, reuse_ids=False).requests(BLOCK_SIZE):
            schedulers[1].add_request(request)
        schedulers[1].schedule()
        schedulers[1].kvdefrag.settle()
        live = [
            scheduler.kvdefrag.ranks.clients[0].stats().stats.max_live for scheduler in schedulers
        ]
        assert live[0] == 0 and live[1] > 0, live
    finally:
        for scheduler in schedulers:
            scheduler.shutdown()
        for handle in served:
            handle.stop(grace_s=0.5)
