"""The worker side of kvdefrag in vLLM: each rank serves its KV caches on a unix socket.

Select it with ``--worker-cls kvdefrag.server.vllm_worker.DefragWorker`` (or
``LLM(worker_cls=...)``), next to ``--scheduler-cls
kvdefrag.client.vllm.scheduler.DefragScheduler``. ``DefragWorker`` is vLLM's worker for the
current platform (``CPUWorker`` on CPU, the GPU ``Worker`` otherwise) with
``DefragWorkerMixin`` in front; put the mixin in front of any other ``Worker`` subclass
yourself.

Once vLLM has allocated the KV caches (``initialize_from_config``), the worker binds them
as per-layer views whose first dimension is ``num_blocks * block_size`` and starts
``serve_in_process`` on ``unix:$KVDEFRAG_VLLM_RUN_DIR/rank<N>.sock``, ``N`` the worker's
global rank: the address ``DefragScheduler`` connects to. It holds the engine's
``kv_lock`` during every ``execute_model`` (the engine moves KV data only while holding
it) and stops the service in ``shutdown``.

This is the only module of the package that imports vLLM, and only when a worker class is
looked up (``DefragWorker``, ``DefragCPUWorker``, ``DefragGPUWorker``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from kvdefrag.client.vllm.topology import rank_address, run_dir_from_env
from kvdefrag.server._server import ServerHandle, serve_in_process

__all__ = ["DefragWorkerMixin", "bind_vllm_kv_caches"]

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 1.0


def bind_vllm_kv_caches(
    kv_caches: Sequence[torch.Tensor], num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Views vLLM's per-layer KV tensors as kvdefrag's flat ``(key, value)`` pairs.

    A block moves as a whole, so a layout binds when each block is one contiguous run of
    memory; the order inside a block (tokens, heads) does not matter::

        [2, num_blocks, ...]  (key/value first: FlashAttention, CPU)  -> (kv[0], kv[1])
        [num_blocks, ...]     (block first: FlashInfer, MLA)           -> (kv, None)
        each viewed as [num_blocks * block_size, -1]

    A tensor two layers share (KV sharing) is bound once.

    Args:
        kv_caches: ``model_runner.kv_caches``, one tensor per attention layer.
        num_blocks: ``KVCacheConfig.num_blocks``.
        block_size: Token slots per block.

    Returns:
        One ``(key, value)`` pair per distinct tensor; ``value`` is None when a block holds
        both (or MLA's single latent).

    Raises:
        ValueError: A tensor with another layout, or one that is not contiguous (a block is
            then not one run of memory, so it cannot be bound as a view).
    """
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    seen: set[int] = set()
    for index, kv in enumerate(kv_caches):
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        shape = tuple(kv.shape)
        if not kv.is_contiguous():
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} (shape {shape}, stride {kv.stride()}) "
                "is not contiguous, so a block is not one run of memory; this attention "
                "backend's layout cannot be bound"
            )
        per_block = kv.numel() // max(num_blocks, 1)
        if kv.dim() >= 3 and shape[0] == 2 and shape[1] == num_blocks:
            pairs.append(
                (_flat(kv[0], num_blocks, block_size), _flat(kv[1], num_blocks, block_size))
            )
        elif kv.dim() >= 2 and shape[0] == num_blocks and per_block % block_size == 0:
            pairs.append((_flat(kv, num_blocks, block_size), None))
        else:
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} has shape {shape}; expected "
                f"[2, {num_blocks}, ...] or [{num_blocks}, ...] with {block_size}-token blocks"
            )
    return pairs


def _flat(tensor: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    per_block = tensor.numel() // num_blocks
    if per_block % block_size != 0:
        raise ValueError(
            f"kvdefrag: a block of shape {tuple(tensor.shape[1:])} does not split into "
            f"{block_size} token slots"
        )
    return tensor.view(num_blocks * block_size, per_block // block_size)


class DefragWorkerMixin:
    """Serves one rank's KV caches to ``DefragScheduler``; put it before a vLLM Worker.

    Invariants: ``kvdefrag_handle`` is None until ``initialize_from_config`` has bound the
    caches and the service listens; while it is set, every ``execute_model`` runs holding
    ``kvdefrag_handle.engine.kv_lock``, so no block moves during a forward pass.
    """

    kvdefrag_handle: ServerHandle | None = None

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Lets vLLM allocate the KV caches, then binds them and starts the service."""
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        self.kvdefrag_handle = self._start_kvdefrag(kv_cache_config)

    def execute_model(self, scheduler_output: Any) -> Any:
        """vLLM's forward pass, holding ``kv_lock`` so no block moves meanwhile."""
        handle = self.kvdefrag_handle
        if handle is None:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        with handle.engine.kv_lock:
            return super().execute_model(scheduler_output)  # type: ignore[misc]

    def shutdown(self) -> None:
        """Stops the service, then shuts the worker down."""
        handle, self.kvdefrag_handle = self.kvdefrag_handle, None
        try:
            if handle is not None:
                handle.stop(grace_s=_STOP_GRACE_S)
        finally:
            parent_shutdown = getattr(super(), "shutdown", None)
            if parent_shutdown is not None:
                parent_shutdown()

    def kvdefrag_address(self) -> str:
        """Where this rank serves: ``unix:$KVDEFRAG_VLLM_RUN_DIR/rank<N>.sock``.

        Override it (with ``DefragScheduler.kvdefrag_addresses``) to serve on TCP across
        hosts; TLS comes from the ``KVDEFRAG_TLS_*`` variables.
        """
        run_dir = run_dir_from_env()
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        rank: int = self.rank  # type: ignore[attr-defined]
        return rank_address(run_dir, rank)

    def _start_kvdefrag(self, kv_cache_config: Any) -> ServerHandle:
        worker: Any = self
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"kvdefrag: {len(groups)} KV cache groups (a hybrid model); kvdefrag serves "
                "models with one"
            )
        block_size = int(worker.cache_config.block_size)
        num_blocks = int(kv_cache_config.num_blocks)
        kv_caches = bind_vllm_kv_caches(worker.model_runner.kv_caches, num_blocks, block_size)
        address = self.kvdefrag_address()
        device = kv_caches[0][0].device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        handle = serve_in_process(kv_caches, block_size, address=address, stream=stream)
        logger.info(
            "kvdefrag: rank %d serves %d blocks of %d tokens (%d layers) on %s",
            worker.rank,
            num_blocks,
            block_size,
            len(kv_caches),
            address,
        )
        return handle


@functools.cache
def _worker_class(name: str) -> type:
    """Builds ``name`` (``DefragCPUWorker``/``DefragGPUWorker``) on first use: imports vLLM."""
    if name == "DefragCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        base: type = CPUWorker
    else:
        from vllm.v1.worker.gpu_worker import Worker

        base = Worker
    return type(
        name,
        (DefragWorkerMixin, base),
        {"__module__": __name__, "__qualname__": name, "__doc__": DefragWorkerMixin.__doc__},
    )


def __getattr__(name: str) -> type:
    """``DefragWorker`` (for the current platform), ``DefragCPUWorker``, ``DefragGPUWorker``."""
    if name == "DefragWorker":
        from vllm.platforms import current_platform

        return _worker_class("DefragCPUWorker" if current_platform.is_cpu() else "DefragGPUWorker")
    if name in ("DefragCPUWorker", "DefragGPUWorker"):
        return _worker_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
