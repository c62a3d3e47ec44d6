"""vLLM 0.33's scheduler built the way ``EngineCore`` builds it, without an engine.

Shared by the benches that drive vLLM's real ``Scheduler`` / ``AsyncScheduler`` (and
kvdefrag's subclasses) with no model: a tiny Llama's ``config.json`` (no weights, no
tokenizer) and one full-attention KV-cache group on CPU. Runs in ``.venv-vllm``.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

SAMPLED_TOKEN = 7
"""The token every stand-in step samples."""


@cache
def tiny_model_config(max_model_len: int) -> ModelConfig:
    """A tiny Llama's config in a temporary folder, ``max_model_len`` tokens long."""
    folder = tempfile.mkdtemp(prefix="kvdefrag-bench-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 32_000,
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    Path(folder, "config.json").write_text(json.dumps(config))
    return ModelConfig(
        model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len
    )


def build_scheduler(
    cls: type[Scheduler],
    *,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    prefix_caching: bool,
    async_scheduling: bool = False,
) -> Scheduler:
    """``cls`` as ``EngineCore`` builds it, on one full-attention group of ``num_blocks``."""
    vllm_config = VllmConfig(
        model_config=tiny_model_config(max_model_len),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


def poisson_count(rng: random.Random, rate: float) -> int:
    """A Poisson draw with mean ``rate`` (Knuth's product of uniforms)."""
    count, threshold, product = 0, math.exp(-rate), rng.random()
    while product > threshold:
        count += 1
        product *= rng.random()
    return count


def sample_finished(scheduler: Scheduler, output: Any) -> ModelRunnerOutput:
    """One token for every request whose scheduled tokens reach its end."""
    request_ids = list(output.num_scheduled_tokens)
    sampled = []
    for request_id in request_ids:
        request = scheduler.requests[request_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([SAMPLED_TOKEN] if done else [])
    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
        sampled_token_ids=sampled,
    )
