"""The scheduler side of kvdefrag in vLLM: a vLLM 0.33 ``Scheduler`` that defragments.

Turn it on with ``vllm serve ... --scheduler-cls
kvdefrag.vllm.scheduler.DefragAsyncScheduler`` (async scheduling, vLLM's default) or
``--scheduler-cls kvdefrag.vllm.scheduler.DefragScheduler --no-async-scheduling`` (or
``LLM(..., scheduler_cls=...)``), with ``KVDEFRAG_VLLM_RUN_DIR`` set and the workers
running ``kvdefrag.vllm.worker.DefragWorker`` (see docs/operator/vllm.md).

The output leaves here in logical ids, as vLLM built it, stamped with the step planned
with it (``contract.attach_step_stamp``, the step's events included); every worker, under
every scheduling mode and runner, makes sure that step is applied (applying it itself when
the scheduler's call has not arrived) and translates the output when it runs it.

Facts about vLLM 0.33 this relies on:

* ``EngineCore.__init__`` (v1/engine/core.py) allocates the KV caches on every worker
  (``_initialize_kv_caches``) before it builds the scheduler from
  ``SchedulerConfig.get_scheduler_cls()``: the rank services exist when ``__init__``
  connects.
* ``Scheduler.schedule()`` returns the output the executor hands, unchanged, to every
  TP/PP rank (pickled for worker processes: the stamp travels as an attribute).
* Per step (``_scheduler.bridge`` lists the fields): the output's finished, preempted, new and
  cached requests; ``Scheduler.deferred_frees``, a deque vLLM only appends to and pops
  from the left (replaced by ``ParkedBlocks``); ``Scheduler.reset_prefix_cache``;
  ``kv_cache_manager.block_pool.blocks[i]`` (``ref_cnt``, ``block_hash``, kept on free
  blocks while they stay in the prefix cache) for the blocks a step freed.
* For the audit only: ``kv_cache_manager.coordinator.single_type_managers[0]
  .req_to_blocks``, every request's blocks.

Importing this module imports vLLM; ``kvdefrag.vllm.contract``, the configuration checks the
workers share (``refusals``) and the scheduler side's bookkeeping (``_scheduler.ledger``,
``_scheduler.bridge``, ``_scheduler.ranks``) do not.
"""

from __future__ import annotations

import functools
from typing import Any

from kvdefrag.vllm._discovery import PublishedRank, rank_directory
from kvdefrag.vllm._scheduler.bridge import ParkedBlocks, SchedulerBridge, changes_from_output
from kvdefrag.vllm._scheduler.gaudi import (
    HPU_ASYNC_SCHEDULER,
    check_gaudi_scheduler,
    hpu_async_scheduler_base,
)
from kvdefrag.vllm._scheduler.ranks import RankGroup, client_tls, connect_ranks
from kvdefrag.vllm._scheduler.transfers import TransferWatch
from kvdefrag.vllm.config import IntegrationConfig, load_integration_config
from kvdefrag.vllm.contract import engine_run_dir
from kvdefrag.vllm.errors import StartupRefused, UnsupportedByKvdefrag
from kvdefrag.vllm.refusals import check_supported
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

__all__ = [
    "DefragAsyncScheduler",
    "DefragScheduler",
    "StartupRefused",
    "UnsupportedByKvdefrag",
    "check_supported",
]


class DefragScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler, plus one kvdefrag step per ``schedule()`` for every rank.

    The output it returns names logical blocks, as vLLM built it, stamped with the step
    planned with it; each worker gets that step applied and translates. Everything else
    (queues, the KV cache manager, prefix caching, preemption) is vLLM's own, in logical
    ids. Per step it reads only what changed (``_scheduler.bridge``); with
    ``KVDEFRAG_VLLM_AUDIT_EVERY=N`` it also compares its ledger with the KV cache manager
    every ``N`` steps and stops with ``LedgerDiverged`` on any difference.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_supported(self.vllm_config, self.kv_cache_config)
        parallel_config = self.vllm_config.parallel_config
        self.kvdefrag_config: IntegrationConfig = load_integration_config(
            executor_backend=parallel_config.distributed_executor_backend
        )
        is_async = bool(self.vllm_config.scheduler_config.async_scheduling)
        if is_async != isinstance(self, AsyncScheduler):
            wanted = "DefragAsyncScheduler" if is_async else "DefragScheduler"
            raise UnsupportedByKvdefrag(
                f"async scheduling is {'on' if is_async else 'off'}: use "
                f"--scheduler-cls kvdefrag.vllm.scheduler.{wanted} (vLLM runs a "
                "custom scheduler class as it is, so the class must match the mode)"
            )
        if is_async:
            check_gaudi_scheduler(self)  # on Gaudi: must inherit HPUAsyncScheduler
        if int(self.vllm_config.max_concurrent_batches) > 1:
            # NOTE: pipeline parallelism keeps one batch in flight per stage (the engine
            # core's batch queue), under sync scheduling too: see ``DefragAsyncScheduler``
            # for why freed blocks must wait for every batch in flight.
            self.defer_block_free = True
        manager = self.kv_cache_manager
        self._kvdefrag_blocks = manager.coordinator.single_type_managers[0].req_to_blocks
        self._kvdefrag_pool = manager.block_pool.blocks
        # NOTE: vLLM appends the block lists it holds back to this deque and pops them
        # when they return to the pool; the subclass records both (no scan per step).
        self._kvdefrag_parked = ParkedBlocks(getattr(self, "deferred_frees", ()))
        self.deferred_frees = self._kvdefrag_parked
        # NOTE: vLLM's pool reset refuses while any block is held; parked blocks are held
        # only for the fence (``DefragAsyncScheduler``), so they are lent back for it.
        self._kvdefrag_reset_pool = manager.reset_prefix_cache
        manager.reset_prefix_cache = self._kvdefrag_reset_pool_with_parked_blocks
        self._kvdefrag_cache_reset = False
        self._kvdefrag_audit_every = self.kvdefrag_config.audit_every
        self._kvdefrag_transfers: TransferWatch | None = None
        self._kvdefrag_watched: tuple[Any, ...] = ()  # the connector and the wrappers set
        if self.connector is not None:
            blocks = self._kvdefrag_blocks
            self._kvdefrag_transfers = TransferWatch(
                self.requests,
                lambda request_id: [block.block_id for block in blocks.get(request_id, ())],
                waiting_for_remote_kvs=RequestStatus.WAITING_FOR_REMOTE_KVS,
                deferred_loads=getattr(self, "deferred_loads", None),
            )
            self._kvdefrag_watch_connector()
        self._kvdefrag_num_schedules = 0
        block_size = int(self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
        prefix_caching = bool(self.cache_config.enable_prefix_caching)
        # NOTE: each rank proves the secret it published before its address is trusted.
        clients = connect_ranks(
            self.kvdefrag_ranks(),
            prefix_caching=prefix_caching,
            tls=client_tls(self.kvdefrag_config),
        )
        for rank, client in enumerate(clients):
            if client.block_size != block_size:
                raise UnsupportedByKvdefrag(
                    f"rank {rank}'s service has block_size {client.block_size}, the "
                    f"scheduler {block_size}: one block size for every rank and group"
                )
        self.kvdefrag = SchedulerBridge(
            RankGroup(clients),
            num_blocks=int(self.kv_cache_config.num_blocks),
            block_size=block_size,
            prefix_caching=prefix_caching,
        )

    def kvdefrag_ranks(self) -> list[PublishedRank]:
        """Every rank's address and identity secret, as rank 0's worker published them for
        this engine (``_rank_directory.rank_directory``: ``ranks.json`` in its run
        directory, or Ray's key-value store under Ray, wherever Ray placed rank 0; under
        the engine's id, so a data-parallel engine reads its own and steps only its own
        ranks; override to find them elsewhere); each is verified before use.

        Raises:
            UnsafeRunDir: The run directory or ``ranks.json`` is not private.
            RanksOfAnotherEngine: The record found names another engine.
            StartupRefused: No record of this engine's ranks (within a bounded wait under
                Ray), or one not for this engine's ranks.
        """
        parallel_config = self.vllm_config.parallel_config
        run_dir = engine_run_dir(parallel_config, self.kvdefrag_config.run_dir)
        return rank_directory(self.vllm_config, run_dir).ranks(parallel_config.world_size)

    def _kvdefrag_watch_connector(self) -> None:
        """Follows the KV connector's transfers (``_scheduler.transfers``): its
        ``update_state_after_alloc`` and ``update_connector_output`` are wrapped on the
        instance to learn of loads and of offload jobs done, its ``request_finished`` to
        publish physical ids (the scheduler calls them as attributes; the wrappers only
        record and translate). Checked at every ``schedule()``: a connector replaced,
        or a method patched, after construction (vLLM's own tests do both) is wrapped
        again."""
        connector = self.connector
        if self._kvdefrag_watched and self._kvdefrag_watched[0] is connector:
            names = ("update_state_after_alloc", "update_connector_output")
            if all(
                getattr(connector, name) is wrapper
                for name, wrapper in zip(names, self._kvdefrag_watched[1:3], strict=True)
            ):
                return
        if connector is None:
            self._kvdefrag_watched = ()
            return
        watch = self._kvdefrag_transfers
        assert watch is not None, "made in __init__ when a connector is configured"
        update_state_after_alloc = connector.update_state_after_alloc

        @functools.wraps(update_state_after_alloc)
        def recording(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            result = update_state_after_alloc(request, blocks, num_external_tokens)
            watch.on_alloc(request, num_external_tokens)
            return result

        connector.update_state_after_alloc = recording
        update_connector_output = connector.update_connector_output
        num_workers = int(self.vllm_config.parallel_config.world_size)

        @functools.wraps(update_connector_output)
        def reading(connector_output: Any) -> Any:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            completed = getattr(meta, "completed_jobs", None)
            if completed:
                watch.on_jobs_completed(completed, num_workers)
            return update_connector_output(connector_output)

        connector.update_connector_output = reading
        self._kvdefrag_publish_depth = 0
        for name in ("request_finished", "request_finished_all_groups"):
            finished = getattr(connector, name, None)
            if finished is not None and not getattr(finished, "_kvdefrag_publishes", False):
                setattr(connector, name, self._kvdefrag_publishing(finished))
        self._kvdefrag_watched = (connector, recording, reading)

    def _kvdefrag_publishing(self, request_finished: Any) -> Any:
        """Wraps the connector's ``request_finished``: block ids it publishes for another
        instance to read (NIXL's ``remote_block_ids``) name where the data is, physical.

        NOTE: called from ``update_from_output``, where a step planned later may still be
        in flight (async scheduling) and may move these blocks: every step in flight is
        settled first, and the request's pin (``TransferWatch``: ``send/<id>``) goes into
        the next step, before any later move. Costs one step's application per publish.
        Only the outermost call translates: one of the two methods may call the other
        through the instance (MultiConnector's ``request_finished_all_groups`` does).
        """

        @functools.wraps(request_finished)
        def publishing(request: Any, block_ids: Any) -> Any:
            self._kvdefrag_publish_depth += 1
            try:
                delay_free, params = request_finished(request, block_ids)
            finally:
                self._kvdefrag_publish_depth -= 1
            remote = params.get("remote_block_ids") if isinstance(params, dict) else None
            if delay_free and remote and not self._kvdefrag_publish_depth:
                resolve = self.kvdefrag.resolve_settled
                params["remote_block_ids"] = (
                    resolve(remote)
                    if isinstance(remote[0], int)
                    else [resolve(group) for group in remote]
                )
            return delay_free, params

        publishing._kvdefrag_publishes = True  # type: ignore[attr-defined]
        return publishing

    def _kvdefrag_is_cached(self, block_id: int) -> bool:
        block = self._kvdefrag_pool[block_id]
        return block.ref_cnt == 0 and block.block_hash is not None

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        """vLLM's ``schedule()``, then the kvdefrag step; the output stays logical."""
        if self._kvdefrag_transfers is not None:
            self._kvdefrag_watch_connector()
        output = super().schedule(*args, **kwargs)
        changes = changes_from_output(
            output, self._kvdefrag_parked, is_cache_reset=self._kvdefrag_cache_reset
        )
        self._kvdefrag_cache_reset = False
        if self._kvdefrag_transfers is not None:
            changes = self._kvdefrag_transfers.adjust(
                changes, output.finished_req_ids, output.kv_connector_metadata
            )
        self.kvdefrag.apply(output, changes, self._kvdefrag_is_cached)
        self._kvdefrag_num_schedules += 1
        every = self._kvdefrag_audit_every
        if every and self._kvdefrag_num_schedules % every == 0:
            self.kvdefrag_audit()
        return output

    def kvdefrag_audit(self) -> None:
        """Compares kvdefrag's ledger with the KV cache manager over the whole pool.

        Raises:
            LedgerDiverged: Naming every difference.
        """
        truth = {
            request_id: [block.block_id for block in blocks]
            for request_id, blocks in self._kvdefrag_blocks.items()
            if blocks
        }
        self.kvdefrag.ledger.audit(
            truth, self._kvdefrag_parked.block_lists(), self._kvdefrag_is_cached
        )
        self.kvdefrag.totals.num_audits += 1

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM's reset; once it succeeds, the next step tells the engines that no free
        block keeps its content.

        It succeeds where vLLM's own scheduler does: the blocks parked for the block-free
        fence (freed by requests whose last step is still in flight, preempted ones
        included when ``reset_running_requests`` preempts every running request) count as
        free for the reset, as they are free in vLLM without the fence
        (``_kvdefrag_reset_pool_with_parked_blocks``)."""
        is_reset = bool(super().reset_prefix_cache(*args, **kwargs))
        self._kvdefrag_cache_reset |= is_reset
        return is_reset

    def _kvdefrag_reset_pool_with_parked_blocks(self) -> bool:
        """The KV cache manager's ``reset_prefix_cache`` with the parked blocks lent back.

        vLLM's block pool resets only when every block but the null block is free
        (``BlockPool.reset_prefix_cache``, vLLM 0.33 ``v1/core/block_pool.py``). The
        parked blocks are free as far as vLLM's requests go; the fence holds them back
        only so that nothing is moved into or placed on them while a step in flight
        still reads them. So for the reset they are returned to the pool
        (``free_blocks``, one reference per parked list) and taken back right after
        (``touch``): the hashes are gone, the references and the parked lists are as
        they were, and kvdefrag keeps them live until the fence passes. Nothing is
        allocated in between.
        """
        parked = [blocks for _, blocks in self._kvdefrag_parked]
        pool = self.kv_cache_manager.block_pool
        for blocks in parked:
            pool.free_blocks(blocks)
        try:
            return bool(self._kvdefrag_reset_pool())
        finally:
            for blocks in parked:
                pool.touch(blocks)

    def shutdown(self) -> None:
        """Checks the steps in flight and closes the rank clients within one timeout, then
        shuts vLLM's scheduler down.

        vLLM's ``EngineCore.shutdown`` stops the executor, and so the workers' services,
        before it shuts the scheduler down: a rank whose service is gone is named in a
        warning and not waited for (``SchedulerBridge.close``).
        """
        try:
            self.kvdefrag.close()
        finally:
            super().shutdown()


class DefragAsyncScheduler(DefragScheduler, AsyncScheduler):  # type: ignore[misc]
    """``DefragScheduler`` on vLLM's ``AsyncScheduler``: plans step ``N + 1`` while ``N`` runs.

    It sends the output unchanged (logical ids); each worker translates it when it runs
    it, holding ``kv_lock``, and keeps its persistent rows physical across moves
    (``kvdefrag.vllm.worker``).

    A request that finishes, is aborted or is preempted while its last step is still in
    flight frees blocks that step reads and writes (and a preempted request's in-flight
    token is delivered). Moving other data into them, or placing fresh blocks on them,
    would change what that step computes, so this class turns on vLLM's own fence for
    KV connectors (``defer_block_free``): freed blocks return to the pool only once the
    steps that were in flight have run, and until then kvdefrag keeps them live.

    Under pipeline parallelism (``DefragScheduler`` too) several batches are in flight
    and each stage's rank runs them later than the one before it, while every rank
    applies each step as soon as it arrives. vLLM's fence covers them all: a freed list
    is parked with the sequence number of the last batch scheduled
    (``Scheduler._free_request_blocks``) and returned only once the engine core has
    processed that batch's output, which the last stage returns after every stage ran it.
    Each rank translates a batch's ids with its mapping at pass time, which holds every
    block that batch names: live ones where their data moved, freed ones still parked.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.defer_block_free = True


@functools.cache
def hpu_async_scheduler_class() -> type:
    """Builds ``DefragHPUAsyncScheduler`` (``DefragAsyncScheduler`` on vllm-gaudi's
    ``HPUAsyncScheduler``) on first use: imports vLLM and vllm-gaudi.

    Raises:
        ImportError: vllm-gaudi is not installed.
    """
    base = hpu_async_scheduler_base()
    if base is None:
        raise ImportError(
            f"kvdefrag: DefragHPUAsyncScheduler needs vllm-gaudi ({HPU_ASYNC_SCHEDULER}), "
            "which is not installed; off Gaudi use "
            "kvdefrag.vllm.scheduler.DefragAsyncScheduler"
        )
    return type(
        "DefragHPUAsyncScheduler",
        (DefragAsyncScheduler, base),
        {
            "__module__": "kvdefrag.vllm.gaudi",
            "__qualname__": "DefragHPUAsyncScheduler",
            "__doc__": DefragAsyncScheduler.__doc__,
        },
    )
