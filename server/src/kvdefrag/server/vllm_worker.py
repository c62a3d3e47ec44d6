"""The worker side of kvdefrag in vLLM: each rank serves its own KV caches.

Select it with ``--worker-cls kvdefrag.server.vllm_worker.DefragWorker`` (or
``LLM(worker_cls=...)``), next to ``--scheduler-cls
kvdefrag.client.vllm.scheduler.DefragScheduler``. ``DefragWorker`` is vLLM's worker for the
current platform (``CPUWorker`` on CPU, the GPU ``Worker`` otherwise) with
``DefragWorkerMixin`` in front; put the mixin in front of any other ``Worker`` subclass
yourself.

Once vLLM has allocated the KV caches (``initialize_from_config``), the worker binds them
as per-layer views whose first dimension is ``num_blocks * block_size`` and starts
``serve_in_process`` on ``unix:$KVDEFRAG_VLLM_RUN_DIR/rank<N>.sock``, ``N`` the worker's
global rank (or on TCP, see ``kvdefrag.client.vllm.topology``). The ranks then gather
their addresses over vLLM's world group and rank 0 publishes them in the run directory,
where ``DefragScheduler`` reads them. It holds the engine's
``kv_lock`` during every ``execute_model`` (the engine moves KV data only while holding
it) and stops the service in ``shutdown``. When the workers translate block ids
(``topology.workers_translate``: async scheduling, or vLLM's V2 model runner), it also
keeps the runner's persistent block tables physical: vLLM's V1 runner
(``remap_v1_runner_rows``) or its V2 runner (``remap_v2_runner_rows``).

This is the only module of the package that imports vLLM, and only when a worker class is
looked up (``DefragWorker``, ``DefragCPUWorker``, ``DefragGPUWorker``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.client.vllm.topology import (
    STEP_STAMP,
    STEP_WAIT_ENV,
    TCP_PORT_ENV,
    publish_rank_addresses,
    rank_address,
    run_dir_from_env,
    tcp_address,
    uses_v2_model_runner,
    workers_translate,
)
from kvdefrag.server._server import ServerHandle, serve_in_process
from kvdefrag.server.config import load_config

__all__ = [
    "BlockIdTranslator",
    "DefragWorkerMixin",
    "bind_vllm_kv_caches",
    "check_v2_runner",
    "remap_v1_runner_rows",
    "remap_v2_runner_rows",
    "step_wait_s",
    "translate_scheduler_output",
    "wait_for_planned_step",
]

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 1.0
_DEFAULT_STEP_WAIT_S = 60.0
_NULL_BLOCK_ID = 0


def bind_vllm_kv_caches(
    kv_caches: Sequence[Any], num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Views vLLM's per-layer KV tensors as kvdefrag's flat ``(key, value)`` pairs.

    A block moves as a whole, so a layout binds when each block is one contiguous run of
    memory; the order inside a block (tokens, heads) does not matter::

        [2, num_blocks, ...]  (key/value first: FlashAttention, CPU)  -> (kv[0], kv[1])
        [num_blocks, ...]     (block first: FlashInfer, MLA)           -> (kv, None)
        each viewed as [num_blocks * block_size, -1]
        (key, value) pairs    (vllm-gaudi: [num_blocks * block_size, heads, head_size]
                               each, value None for MLA)               -> viewed the same

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
        if isinstance(kv, (tuple, list)):
            pair = _bind_pair(index, kv, num_blocks, block_size)
            if pair[0].data_ptr() not in seen:
                seen.add(pair[0].data_ptr())
                pairs.append(pair)
            continue
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


def _bind_pair(
    index: int, pair: Sequence[torch.Tensor | None], num_blocks: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer given as a ``(key, value)`` pair whose first dimension counts token slots."""
    if len(pair) != 2 or pair[0] is None:
        raise ValueError(
            f"kvdefrag: KV cache of layer {index} is a sequence of {len(pair)} items; "
            "expected (key, value) with value None only for MLA"
        )
    flat: list[torch.Tensor | None] = []
    for tensor in pair:
        if tensor is None:
            flat.append(None)
            continue
        if not tensor.is_contiguous() or tensor.shape[0] != num_blocks * block_size:
            raise ValueError(
                f"kvdefrag: KV cache of layer {index} holds a tensor of shape "
                f"{tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()}); expected a "
                f"contiguous [{num_blocks * block_size}, ...] (num_blocks * block_size)"
            )
        flat.append(tensor.view(num_blocks * block_size, -1))
    key = flat[0]
    assert key is not None
    return key, flat[1]


def _flat(tensor: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    per_block = tensor.numel() // num_blocks
    if per_block % block_size != 0:
        raise ValueError(
            f"kvdefrag: a block of shape {tuple(tensor.shape[1:])} does not split into "
            f"{block_size} token slots"
        )
    return tensor.view(num_blocks * block_size, per_block // block_size)


def translate_scheduler_output(output: Any, mapping: npt.NDArray[np.int64]) -> None:
    """Rewrites, in place, every block id a ``SchedulerOutput`` names from logical to physical.

    Covers what vLLM 0.33's V1 and V2 runners read: new requests' rows (under the V2
    runner resumed requests come as new ones, with their whole row), ``new_block_ids``
    of cached requests, ``new_block_ids_to_zero`` and ``kv_cache_block_copies``.
    """

    def physical(block_ids: Sequence[int]) -> list[int]:
        if not block_ids:
            return []
        translated: list[int] = mapping[np.asarray(block_ids, dtype=np.int64)].tolist()
        return translated

    for request in output.scheduled_new_reqs:
        request.block_ids = tuple(physical(group) for group in request.block_ids)
    cached = output.scheduled_cached_reqs
    cached.new_block_ids = [
        None if groups is None else tuple(physical(group) for group in groups)
        for groups in cached.new_block_ids
    ]
    if output.new_block_ids_to_zero:
        output.new_block_ids_to_zero = physical(output.new_block_ids_to_zero)
    copies = getattr(output, "kv_cache_block_copies", None)
    if copies:
        pairs = [physical([int(copy[0]), int(copy[1])]) for copy in copies]
        output.kv_cache_block_copies = [
            (src, dst) if type(copy) is tuple else type(copy)(src, dst)
            for copy, (src, dst) in zip(copies, pairs, strict=True)
        ]


def remap_v1_runner_rows(model_runner: Any, remap: npt.NDArray[np.int64]) -> None:
    """Rewrites the V1 runner's persistent rows after blocks moved: ``remap[old] = new``.

    Both copies vLLM 0.33's ``GPUModelRunner`` (and the CPU runner built on it) keeps: each
    request's ``block_ids`` lists (rows of requests outside the batch come back from
    these) and the block tables of the persistent batch, committed to the device at
    every step.
    """
    for state in model_runner.requests.values():
        for group in state.block_ids:
            if group:
                group[:] = remap[np.asarray(group, dtype=np.int64)].tolist()
    for table in model_runner.input_batch.block_table.block_tables:
        in_use = np.flatnonzero(table.num_blocks_per_row)
        if in_use.size == 0:
            continue
        rows = table.block_table.np[: int(in_use[-1]) + 1]
        rows[...] = remap[rows]


def remap_v2_runner_rows(model_runner: Any, remap: npt.NDArray[np.int64]) -> None:
    """Rewrites the V2 runner's persistent block table after blocks moved: ``remap[old] = new``.

    vLLM 0.33's V2 runner (``vllm/v1/worker/gpu/model_runner.py``) keeps one row per
    request slot in ``block_tables.block_tables[0].gpu``, an int32
    ``[max_num_reqs, max_num_blocks]`` tensor on the runner's device; new requests
    overwrite their row, cached requests only append to it. The whole table is rewritten
    on its own device, in stream order before the forward pass: entries past a row's
    length, and rows of free slots, hold stale ids or the null block, and since ``remap``
    is a permutation of every block id they stay harmless (the null block 0 never moves,
    so zeros stay zeros). Staged writes are applied inside ``execute_model``, so none is
    pending when this runs (before it).

    Args:
        model_runner: A runner ``check_v2_runner`` accepts.
        remap: ``remap[old_physical] = new_physical`` for every block id.
    """
    assert remap[_NULL_BLOCK_ID] == _NULL_BLOCK_ID, (
        f"kvdefrag moved the null block to {int(remap[_NULL_BLOCK_ID])}"
    )
    for staged in model_runner.block_tables.block_tables:
        table: torch.Tensor = staged.gpu
        lookup = torch.as_tensor(remap, dtype=torch.int64, device=table.device)
        table.copy_(lookup[table.long()].to(table.dtype))


def check_v2_runner(model_runner: Any) -> None:
    """Refuses, at startup, a V2 runner whose block table is not where kvdefrag follows it.

    ``remap_v2_runner_rows`` relies on ``model_runner.block_tables.block_tables`` holding
    exactly one table (one KV-cache group) whose ``.gpu`` is a 2-D integer tensor.

    Raises:
        ValueError: Naming the part of that structure the runner lacks.
    """
    runner_name = type(model_runner).__name__
    tables = getattr(getattr(model_runner, "block_tables", None), "block_tables", None)
    if not isinstance(tables, (list, tuple)):
        raise ValueError(
            f"kvdefrag: the V2 model runner ({runner_name}) has no list "
            "model_runner.block_tables.block_tables, where kvdefrag follows the blocks it "
            "moves; this vLLM's V2 runner is not the one kvdefrag supports (vLLM 0.33)"
        )
    if len(tables) != 1:
        raise ValueError(
            f"kvdefrag: the V2 model runner ({runner_name}) has {len(tables)} block tables "
            "in model_runner.block_tables.block_tables; kvdefrag serves exactly one "
            "(one KV-cache group)"
        )
    table = getattr(tables[0], "gpu", None)
    if (
        not isinstance(table, torch.Tensor)
        or table.dim() != 2
        or table.dtype not in (torch.int32, torch.int64)
    ):
        found = (
            f"a {table.dtype} tensor of shape {tuple(table.shape)}"
            if isinstance(table, torch.Tensor)
            else type(table).__name__
        )
        raise ValueError(
            f"kvdefrag: model_runner.block_tables.block_tables[0].gpu of the V2 model runner "
            f"({runner_name}) is {found}; expected a 2-D int32 or int64 tensor "
            "[max_num_reqs, max_num_blocks]"
        )


class BlockIdTranslator:
    """Keeps a worker's block ids physical when the worker, not the scheduler, translates.

    Each ``advance`` (called holding ``kv_lock``, before a forward pass) returns the
    mapping the KV data is in now and how physical ids moved since the previous call, so
    the persistent rows can follow and the incoming output be translated with one mapping.
    """

    def __init__(self, mapping: Any) -> None:
        self._mapping = mapping
        self._last: npt.NDArray[np.int64] = mapping()

    def advance(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
        """Returns ``(mapping, remap)``; ``remap`` is None when nothing moved since last time."""
        current: npt.NDArray[np.int64] = self._mapping()
        last, self._last = self._last, current
        if np.array_equal(last, current):
            return current, None
        remap = np.empty_like(current)
        remap[last] = current
        return current, remap


def wait_for_planned_step(handle: ServerHandle, rank: int, output: Any, timeout_s: float) -> None:
    """Waits until this rank's service has applied the step planned with ``output``.

    When the workers translate, the scheduler sends each step without waiting for its
    reply and marks the output with every rank's ``(epoch, seq)`` of it (``STEP_STAMP``);
    an output translated before its step is applied would name the blocks' old places.
    Call it before taking ``kv_lock`` (the step may need the lock to move KV data).

    Raises:
        EpochMismatch, EngineUnhealthy, ServiceUnavailable: As
            ``ServerHandle.wait_applied`` (the step will not be applied here).
    """
    stamps = getattr(output, STEP_STAMP, None)
    if stamps is None:
        return
    epoch, seq = stamps[rank]
    handle.wait_applied(epoch, seq, timeout_s)


def step_wait_s() -> float:
    """How long a worker waits for its step: ``KVDEFRAG_VLLM_STEP_WAIT_S``, 60 s if unset.

    Raises:
        ValueError: The variable is not a positive number.
    """
    text = os.environ.get(STEP_WAIT_ENV, "").strip()
    try:
        wait_s = float(text) if text else _DEFAULT_STEP_WAIT_S
    except ValueError:
        wait_s = -1.0
    if not wait_s > 0:
        raise ValueError(f"kvdefrag: {STEP_WAIT_ENV} must be a positive number, got {text!r}")
    return wait_s


class DefragWorkerMixin:
    """Serves one rank's KV caches to ``DefragScheduler``; put it before a vLLM Worker.

    Invariants: ``kvdefrag_handle`` is None until ``initialize_from_config`` has bound the
    caches and the service listens; while it is set, every ``execute_model`` runs holding
    ``kvdefrag_handle.kv_lock``, so no block moves during a forward pass.
    ``kvdefrag_translator`` is set exactly when the workers translate, and
    ``kvdefrag_is_v2_runner`` says which runner's rows follow the moves then.
    """

    kvdefrag_handle: ServerHandle | None = None
    kvdefrag_translator: BlockIdTranslator | None = None
    kvdefrag_is_v2_runner: bool = False
    kvdefrag_step_wait_s: float = 0.0

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Lets vLLM allocate the KV caches, then binds them and starts the service."""
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        handle = self._start_kvdefrag(kv_cache_config)
        self.kvdefrag_attach(handle, int(kv_cache_config.num_blocks))

    def kvdefrag_attach(self, handle: ServerHandle, num_blocks: int) -> None:
        """Puts a serving rank's engine in front of ``execute_model``.

        ``initialize_from_config`` calls it once the service listens; when the workers
        translate, it sets up the translator and picks the runner whose rows follow moves.
        """
        vllm_config = getattr(self, "vllm_config", None)
        if workers_translate(vllm_config):
            self.kvdefrag_step_wait_s = step_wait_s()
            self.kvdefrag_is_v2_runner = uses_v2_model_runner(vllm_config)
            self.kvdefrag_translator = BlockIdTranslator(handle.resolve)
        self.kvdefrag_handle = handle

    def execute_model(self, scheduler_output: Any) -> Any:
        """vLLM's forward pass, holding ``kv_lock`` so no block moves meanwhile.

        When the workers translate (async scheduling, or the V2 runner), it first waits
        for the step planned with this output to be applied (``wait_for_planned_step``);
        then the persistent rows follow the blocks that moved since the last pass and the
        output turns physical, both with the mapping the KV data is in while the lock is
        held.
        """
        handle = self.kvdefrag_handle
        if handle is None:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        translator = self.kvdefrag_translator
        if translator is not None:
            wait_for_planned_step(
                handle,
                self.rank,  # type: ignore[attr-defined]
                scheduler_output,
                self.kvdefrag_step_wait_s,
            )
        with handle.kv_lock:
            if translator is not None:
                mapping, remap = translator.advance()
                if remap is not None:
                    remap_rows = (
                        remap_v2_runner_rows if self.kvdefrag_is_v2_runner else remap_v1_runner_rows
                    )
                    remap_rows(self.model_runner, remap)  # type: ignore[attr-defined]
                translate_scheduler_output(scheduler_output, mapping)
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
        """Where this rank serves: ``unix:$KVDEFRAG_VLLM_RUN_DIR/rank<N>.sock``, or
        ``HOST:PORT+local rank`` when ``KVDEFRAG_VLLM_TCP_PORT`` is set (ranks on several
        hosts; TLS from the ``KVDEFRAG_TLS_*`` variables).
        """
        run_dir = run_dir_from_env()
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        worker: Any = self
        tcp = tcp_address(int(worker.local_rank), _host_ip)
        return tcp if tcp is not None else rank_address(run_dir, int(worker.rank))

    def _start_kvdefrag(self, kv_cache_config: Any) -> ServerHandle:
        worker: Any = self
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(
                f"kvdefrag: {len(groups)} KV cache groups (a hybrid model); kvdefrag serves "
                "models with one"
            )
        if uses_v2_model_runner(getattr(worker, "vllm_config", None)):
            check_v2_runner(worker.model_runner)
        block_size = int(worker.cache_config.block_size)
        num_blocks = int(kv_cache_config.num_blocks)
        kv_caches = bind_vllm_kv_caches(worker.model_runner.kv_caches, num_blocks, block_size)
        address = self.kvdefrag_address()
        device = kv_caches[0][0].device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        engine_config, service_config = load_config({"address": address})
        handle = serve_in_process(
            kv_caches,
            block_size,
            engine_config=engine_config,
            service_config=service_config,
            stream=stream,
        )
        try:
            addresses = _gather_addresses(address, int(worker.parallel_config.world_size))
            if worker.rank == 0:
                publish_rank_addresses(run_dir_from_env(), addresses)
        except BaseException:
            handle.stop(grace_s=0)
            raise
        logger.info(
            "kvdefrag: rank %d serves %d blocks of %d tokens (%d layers) on %s",
            worker.rank,
            num_blocks,
            block_size,
            len(kv_caches),
            address,
        )
        return handle


def _host_ip() -> str:
    """The IP vLLM itself uses for this host (``VLLM_HOST_IP`` or its guess)."""
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def _gather_addresses(address: str, world_size: int) -> list[str]:
    """Every rank's address, rank 0 first, gathered over vLLM's world process group.

    Every rank calls this once its service listens (a collective).

    Raises:
        RuntimeError: The ranks span hosts but some serve on a unix socket.
    """
    if world_size == 1:
        return [address]
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    mine = (socket.gethostname(), address)
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, mine, group=group.cpu_group)
    hosts = sorted({host for host, _ in gathered})
    if len(hosts) > 1 and any(addr.startswith("unix:") for _, addr in gathered):
        raise RuntimeError(
            f"kvdefrag: the ranks span hosts {hosts} but serve on unix sockets: set "
            f"{TCP_PORT_ENV} (and the KVDEFRAG_TLS_* files) on every host"
        )
    return [str(addr) for _, addr in gathered]


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
