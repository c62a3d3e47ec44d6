"""The swap executor for a device: the backend table and its factory.

The backends (``_executor_cpu``, ``_executor_cuda``, ``_executor_hpu``) import the shared
interface from ``_executor``; this module is the only one that imports them, each when a
device of its kind is bound (the HPU one must not be imported where ``habana_frameworks``
is absent).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvdefrag.common import InvalidArgument
from kvdefrag.server._executor import KvCaches, SwapExecutor, bind_kv_caches

__all__ = ["make_executor"]


def _cpu_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    from kvdefrag.server._executor_cpu import CpuSwapExecutor

    return CpuSwapExecutor(kv_caches, block_size)


def _cuda_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    from kvdefrag.server._executor_cuda import CudaSwapExecutor

    return CudaSwapExecutor(kv_caches, block_size, stream=options.get("stream"))


def _hpu_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    module = importlib.import_module("kvdefrag.server._executor_hpu")
    executor: SwapExecutor = module.HpuSwapExecutor(kv_caches, block_size, **options)
    return executor


_BACKENDS = {"cpu": _cpu_executor, "cuda": _cuda_executor, "hpu": _hpu_executor}


def make_executor(kv_caches: KvCaches, block_size: int, **options: Any) -> SwapExecutor:
    """Builds the executor for the caches' device (cpu, cuda or hpu).

    Args:
        kv_caches: The worker's per-layer ``(key, value)`` tensors.
        block_size: Token slots per block.
        **options: Backend options: ``stream`` (CUDA/HPU: the forward pass's stream),
            ``pad_buckets`` (HPU: static batch sizes).
    """
    tensors, _ = bind_kv_caches(kv_caches, block_size)
    device_type = tensors[0].device.type
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise InvalidArgument(
            f"no swap executor for device {device_type!r}; supported: {sorted(_BACKENDS)}"
        )
    return backend(kv_caches, block_size, **options)
