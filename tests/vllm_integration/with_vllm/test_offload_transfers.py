"""vLLM 0.33's real scheduler with OffloadingConnector's real scheduler side, behind
kvdefrag, and a fake offload worker that copies blocks to and from CPU memory late.

The pool is small and prefix caching on, so cached blocks are evicted from the KV cache
and later requests load them back from CPU memory. The worker runs as ``DefragWorker``
does (it waits for its step, its rows follow the moves, the output and the connector's
metadata turn physical) and does what vLLM 0.33's offloading worker does
(``distributed/kv_transfer/kv_connector/v1/offloading/worker.py``): a store job queued in
one pass (``prepare_store_kv``, ``:272-284``) is submitted at the start of the next, and
at once when ``jobs_to_flush`` names it, waited for before the forward pass
(``handle_preemptions``, ``:219-244``); a load job is submitted in its pass, waited for
there when ``sync`` (``start_kv_transfers``, ``:246-270``); each job copies its blocks
when it completes, zero to two passes after it was submitted (the latest it may read or
write them), and is reported in ``completed_jobs``, a load's request in
``finished_recving`` (``get_finished``, ``:286-321``).

Every token a request reads, loaded ones included, must find its signature, and every
block vLLM keeps in its prefix cache must still hold its tokens.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvdefrag.vllm._discovery import PublishedRank, publish_ranks, published_ranks, rank_address
from kvdefrag.vllm._scheduler import ledger as _ledger
from kvdefrag.vllm._worker.connectors import connector_adapter
from kvdefrag.vllm._worker.translation import BlockIdTranslator
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.contract import engine_id
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

from support.vllm_harness import (
    BLOCK_SIZE,
    SignedWorker,
    Workload,
    harness_engine_id,
    make_scheduler,
    run_loop,
    serve_rank,
)

NUM_BLOCKS = 48
OFFLOAD_CONFIG = KVTransferConfig(
    kv_connector="OffloadingConnector",
    kv_role="kv_both",
    kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24},
)


@dataclasses.dataclass
class _Job:
    job_id: int
    request_id: str | None  # an asynchronous load's request
    src: list[int]
    dst: list[int]
    is_store: bool
    due: int


class OffloadWorker(SignedWorker):
    """A ``SignedWorker`` with a fake offloading worker and a CPU tier of its own."""

    def __init__(self, handle: Any, kv: torch.Tensor, seed: int, *, translates: bool = True):
        super().__init__(kv, BlockIdTranslator(handle, NUM_BLOCKS), service=(handle, 0))
        self.adapter = connector_adapter(OFFLOAD_CONFIG)
        self.translates = translates
        self.cpu: dict[int, torch.Tensor] = {}
        self.rng = random.Random(seed)
        self.num_passes = 0
        self.queued_stores: list[_Job] = []
        self.in_flight: list[_Job] = []
        self.completed: dict[int, int] = {}
        self.finished_recving: set[str] = set()
        self.num_stored = 0
        self.num_loaded = 0

    def _job(self, job_id: int, entry: Any, is_store: bool, request_id: str | None) -> _Job:
        src = [int(block_id) for block_id in entry.src_spec.block_ids]
        dst = [int(block_id) for block_id in entry.dst_spec.block_ids]
        return _Job(job_id, request_id, src, dst, is_store, 0)

    def _submit(self, job: _Job) -> None:
        job.due = self.num_passes + self.rng.randint(0, 2)
        self.in_flight.append(job)

    def _complete(self, job: _Job) -> None:
        """Copies the job's blocks now (as late as it may), and reports it."""
        for src, dst in zip(job.src, job.dst, strict=True):
            if job.is_store:
                self.cpu[dst] = self.kv[src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE].clone()
                self.num_stored += 1
            else:
                self.kv[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = self.cpu[src]
                self.num_loaded += 1
        self.completed[job.job_id] = 1
        if job.request_id is not None:
            self.finished_recving.add(job.request_id)

    def _wait(self, job_ids: set[int]) -> None:
        for job in [job for job in self.in_flight if job.job_id in job_ids]:
            self.in_flight.remove(job)
            self._complete(job)

    def _update_rows(self, output: Any) -> None:
        """The connector's part of the pass before the forward pass, on its metadata made
        physical: flushes, the stores queued in the previous pass, this pass's loads."""
        self.num_passes += 1
        metadata = output.kv_connector_metadata
        if self.translates:
            metadata = self.adapter.translate(metadata, self.pass_mapping, BLOCK_SIZE)
        store_jobs = dict(metadata.store_jobs)
        flushed = set(metadata.jobs_to_flush or ())
        for job_id in flushed:
            entry = store_jobs.pop(job_id, None)
            if entry is not None:
                self.queued_stores.append(self._job(job_id, entry, True, None))
        for job in self.queued_stores:
            self._submit(job)
        self.queued_stores = []
        self._wait(flushed)
        sync_loads = set()
        for job_id, entry in metadata.load_jobs.items():
            self._submit(self._job(job_id, entry, False, None if entry.sync else entry.req_id))
            if entry.sync:
                sync_loads.add(job_id)
        self._wait(sync_loads)
        self._stores_of_this_pass = [
            self._job(job_id, entry, True, None) for job_id, entry in store_jobs.items()
        ]
        super()._update_rows(output)

    def _forward(self, output: Any) -> ModelRunnerOutput:
        result = super()._forward(output)
        self.queued_stores += self._stores_of_this_pass  # submitted next pass
        self._wait({job.job_id for job in self.in_flight if job.due <= self.num_passes})
        completed, self.completed = self.completed, {}
        recving, self.finished_recving = self.finished_recving, set()
        result.kv_connector_output = KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=(
                OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
            ),
        )
        return result


@pytest.fixture
def offload_service(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """One kvdefrag rank (threshold 0), published in its own run directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, os.fspath(run_dir))
    secret = os.urandom(32)
    handle, kv = serve_rank(f"{run_dir}/rank0.sock", NUM_BLOCKS, secret, threshold=0)
    publish_ranks(
        os.fspath(run_dir),
        [PublishedRank(rank_address(os.fspath(run_dir), 0), secret)],
        engine_id=harness_engine_id(),
    )
    yield handle, kv
    handle.stop(grace_s=0.5)


def _run(model_dir: str, service: tuple[Any, Any], is_async: bool, **worker: Any) -> Any:
    handle, kv = service
    base = DefragAsyncScheduler if is_async else DefragScheduler

    class OneRankScheduler(base):  # type: ignore[misc, valid-type]
        def kvdefrag_ranks(self) -> list[PublishedRank]:
            run_dir = os.environ[RUN_DIR_ENV]
            return published_ranks(run_dir, 1, engine_id=engine_id(self.vllm_config))

    scheduler = make_scheduler(
        OneRankScheduler,
        model_dir,
        num_blocks=NUM_BLOCKS,
        prefix_caching=True,
        async_scheduling=is_async,
        kv_transfer_config=OFFLOAD_CONFIG,
    )
    offload = OffloadWorker(handle, kv, seed=5, **worker)
    run_loop(
        scheduler,
        [offload],
        Workload(seed=3, num_requests=80, reuse_ids=False),
        resolve=handle.resolve,
        in_flight=2 if is_async else 1,
    )
    scheduler.kvdefrag.settle()
    scheduler.kvdefrag.ranks.close()
    return offload


def _run_plain(model_dir: str, tmp_path: Any, is_async: bool) -> OffloadWorker:
    """The same run on vLLM's own scheduler, the worker taking the ids as they come."""
    cls = AsyncScheduler if is_async else Scheduler
    scheduler = make_scheduler(
        cls,
        model_dir,
        num_blocks=NUM_BLOCKS,
        prefix_caching=True,
        async_scheduling=is_async,
        kv_transfer_config=OFFLOAD_CONFIG,
    )
    handle, kv = serve_rank(f"{tmp_path}/plain.sock", NUM_BLOCKS)
    try:
        offload = OffloadWorker(handle, kv, seed=5, translates=False)
        offload.translator = offload.service = None
        run_loop(
            scheduler,
            [offload],
            Workload(seed=3, num_requests=80, reuse_ids=False),
            resolve=lambda logical_ids: list(logical_ids),
            in_flight=2 if is_async else 1,
        )
    finally:
        handle.stop(grace_s=0.5)
    return offload


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_every_block_stored_and_loaded_back_reads_its_signature(
    model_dir: str, offload_service: Any, is_async: bool, tmp_path: Any
) -> None:
    """Every token a request reads finds its signature. So does every block vLLM keeps in
    its prefix cache, except under async scheduling, where the harness cannot tell which
    in-flight writes a cached block of a request preempted mid-step still receives
    (``support.vllm_harness``): there kvdefrag may add no failure of that check to those
    vLLM's own scheduler shows on the same run."""
    plain = _run_plain(model_dir, tmp_path, is_async)
    offload = _run(model_dir, offload_service, is_async)
    handle = offload_service[0]

    assert offload.num_corrupted == offload.num_cached_corrupted  # every row read is right
    assert offload.num_cached_corrupted == plain.num_cached_corrupted == plain.num_corrupted
    if not is_async:
        assert plain.num_corrupted == 0
    assert offload.num_stored > 50 and offload.num_loaded > 20, (
        offload.num_stored,
        offload.num_loaded,
    )
    totals = handle.stats().totals
    assert totals.num_moves > 0 and totals.num_placements > 0
    assert handle.stats().num_pinned == 0  # every job ended, and its pin with it


def test_without_the_job_pins_stores_copy_moved_blocks(
    model_dir: str, offload_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sabotage: the ledger sends no pin, so compaction moves a block between the pass
    that queued its store and the copy."""
    plan = _ledger.BlockLedger.plan

    def without_pins(self: Any, changes: Any, is_cached: Any) -> Any:
        return dataclasses.replace(plan(self, changes, is_cached), pins={}, unpinned=())

    monkeypatch.setattr(_ledger.BlockLedger, "plan", without_pins)
    offload = _run(model_dir, offload_service, is_async=False)

    assert offload.num_corrupted > 0


def test_job_ids_left_logical_corrupt(model_dir: str, offload_service: Any) -> None:
    """The sabotage: the worker hands the offloading worker the scheduler's ids."""
    offload = _run(model_dir, offload_service, is_async=False, translates=False)

    assert offload.num_corrupted > 0
