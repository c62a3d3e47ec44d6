"""tests/vllm run vLLM's own scheduler: only in .venv-vllm (``make test-vllm``)."""

import importlib.metadata
import json
import os
import sys

import pytest

# NOTE: importlib mode puts no test folder on sys.path; the test module imports its
# harness (vllm_harness.py, next to this file) by name.
sys.path.insert(0, os.path.dirname(__file__))

# kvdefrag serves vLLM's V1 model runner (the scheduler refuses V2 by name).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def _has_vllm() -> bool:
    # NOTE: not find_spec("vllm"): with tests/ on pytest's pythonpath, this very folder
    # is a namespace package named vllm.
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _has_vllm():
    collect_ignore_glob = ["test_*.py"]

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
