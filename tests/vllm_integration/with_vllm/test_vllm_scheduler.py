"""kvdefrag inside vLLM 0.33's real Scheduler and AsyncScheduler, proven by signatures.

Real rank services on unix sockets, tiny int64 KV caches; the simulated worker keeps its
rows the way vLLM's V1 runner does and translates each output as DefragWorker does (it
waits for the step stamped on it, its rows follow the moves), and every read of a computed
token (and of every block vLLM keeps in its prefix cache) must find its own signature.
The scheduler side audits its ledger against vLLM's KV cache manager after every step
(``KVDEFRAG_VLLM_AUDIT_EVERY=1``, set in conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvdefrag.common import EpochMismatch, SessionConflict
from kvdefrag.server import Engine, ServerHandle
from kvdefrag.vllm import scheduler as vllm_scheduler
from kvdefrag.vllm._scheduler import bridge as _bridge
from kvdefrag.vllm._scheduler import ledger as _ledger
from kvdefrag.vllm._scheduler.ranks import RanksDiverged
from kvdefrag.vllm._worker.translation import BlockIdTranslator
from kvdefrag.vllm.scheduler import DefragScheduler, UnsupportedByKvdefrag

from support import vllm_harness
from support.public_api import assert_public_names
from support.vllm_harness import (
    ASYNC_NUM_BLOCKS,
    NUM_BLOCKS,
    SignedWorker,
    TwoRankAsyncScheduler,
    TwoRankScheduler,
    Workload,
    harness_engine_id,
    make_scheduler,
    run_loop,
    serve_two_ranks,
    spy_preemptions,
    translating_workers,
    translator_for,
)


def _run(
    cls: type[Scheduler],
    model_dir: str,
    ranks: list[Any],
    *,
    prefix_caching: bool,
    seed: int = 1,
    num_requests: int = 80,
    translate: bool | None = None,
    zero_new_blocks: bool = False,
    **loop: Any,
) -> tuple[Scheduler, list[SignedWorker], int]:
    """Runs ``cls`` over a workload; async classes run two steps in flight.

    ``translate`` (default: whether the class is kvdefrag's) gives each worker the
    translator ``DefragWorkerMixin`` uses; False runs a worker that takes the logical ids
    as they come (a sabotage).
    """
    is_async = issubclass(cls, AsyncScheduler)
    num_blocks = ASYNC_NUM_BLOCKS if is_async and prefix_caching else NUM_BLOCKS
    with pytest.MonkeyPatch.context() as patch:
        if zero_new_blocks:
            # vLLM 0.33 zeroes new blocks only for Mamba and mixed-precision caches (which
            # kvdefrag refuses); turned on here, each zeroing must hit its own slot.
            from vllm.v1.kv_cache_interface import KVCacheConfig

            patch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda _: True))
        scheduler = make_scheduler(
            cls,
            model_dir,
            num_blocks=num_blocks,
            prefix_caching=prefix_caching,
            async_scheduling=is_async,
        )
    is_defrag = isinstance(scheduler, DefragScheduler)
    num_ranks = len(scheduler.kvdefrag.ranks.clients) if is_defrag else 1
    if translate is None:
        translate = is_defrag
    workers = [
        SignedWorker(
            kv,
            translator_for(handle, num_blocks) if translate else None,
            service=(handle, rank) if is_defrag else None,
        )
        for rank, (handle, kv) in enumerate(ranks[:num_ranks])
    ]
    resolve = ranks[0][0].resolve if is_defrag else (lambda ids: list(ids))
    steps = run_loop(
        scheduler,
        workers,
        Workload(seed=seed, num_requests=num_requests),
        resolve=resolve,
        in_flight=2 if is_async else 1,
        **loop,
    )
    if is_defrag:
        scheduler.kvdefrag.settle()  # the last step's replies, when the workers translate
        scheduler.kvdefrag.ranks.close()
    return scheduler, workers, steps


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_every_read_finds_its_signature_with_two_ranks(
    model_dir: str, ranks: list[Any], prefix_caching: bool
) -> None:
    scheduler, workers, steps = _run(
        TwoRankScheduler, model_dir, ranks, prefix_caching=prefix_caching, abort_every=37
    )
    totals = scheduler.kvdefrag.totals
    assert not scheduler.has_requests(), f"unfinished after {steps} steps"
    assert scheduler.kvdefrag.ledger.held == {}
    stats = [handle.stats() for handle, _ in ranks]
    assert stats[0].totals.num_moves > 0, "the workload never made kvdefrag move a block"
    assert stats[0] == stats[1]
    assert totals.num_audits == scheduler._kvdefrag_num_schedules > 100
    for worker in workers:
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


def test_preemption_happens_in_the_small_pool(model_dir: str, ranks: list[Any]) -> None:
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
    )
    preempted = spy_preemptions(scheduler)
    workers = translating_workers(ranks, NUM_BLOCKS)
    run_loop(
        scheduler,
        workers,
        Workload(seed=3, num_requests=80),
        resolve=ranks[0][0].resolve,
    )
    scheduler.kvdefrag.settle()
    scheduler.kvdefrag.ranks.close()
    assert len(preempted) >= 3
    assert scheduler.kvdefrag.totals.num_preempted == len(preempted)
    assert all(worker.num_corrupted == 0 for worker in workers)


def test_reset_prefix_cache_and_aborts(model_dir: str, ranks: list[Any]) -> None:
    scheduler, workers, _ = _run(
        TwoRankScheduler,
        model_dir,
        ranks,
        prefix_caching=True,
        seed=5,
        abort_every=11,
        reset_prefix_cache_every=23,
    )
    assert all(worker.num_corrupted == 0 for worker in workers)
    # every cached free block the engines keep is one vLLM still hashes
    pool = scheduler.kv_cache_manager.block_pool.blocks
    for block_id in scheduler.kvdefrag.ledger.cached_free:
        assert pool[block_id].block_hash is not None


def test_without_kvdefrag_the_harness_sees_no_corruption(model_dir: str, ranks: list[Any]) -> None:
    _, workers, _ = _run(Scheduler, model_dir, ranks, prefix_caching=True)
    assert workers[0].num_checked > 10_000
    assert workers[0].num_corrupted == 0


def test_a_worker_given_logical_ids_corrupts(model_dir: str, ranks: list[Any]) -> None:
    _, workers, _ = _run(TwoRankScheduler, model_dir, ranks, prefix_caching=True, translate=False)
    assert workers[0].num_corrupted > 0


def test_async_scheduling_needs_the_async_class(model_dir: str, ranks: list[Any]) -> None:
    with pytest.raises(UnsupportedByKvdefrag, match="DefragAsyncScheduler"):
        make_scheduler(
            TwoRankScheduler,
            model_dir,
            num_blocks=NUM_BLOCKS,
            prefix_caching=False,
            async_scheduling=True,
        )
    with pytest.raises(UnsupportedByKvdefrag, match=r"use --scheduler-cls .*\.DefragScheduler "):
        make_scheduler(
            TwoRankAsyncScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
        )


def test_without_kvdefrag_async_scheduling_sees_no_corruption(
    model_dir: str, async_ranks: list[Any]
) -> None:
    _, workers, _ = _run(
        AsyncScheduler, model_dir, async_ranks, prefix_caching=True, abort_every=37
    )
    assert workers[0].num_checked > 10_000
    assert workers[0].num_corrupted == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_async_scheduling_with_translating_workers_reads_every_signature(
    model_dir: str, request: pytest.FixtureRequest, prefix_caching: bool
) -> None:
    # NOTE: with prefix caching on, on the pool where nothing is preempted (see
    # ASYNC_NUM_BLOCKS); without it, on the small pool, with preemption.
    served: list[Any] = request.getfixturevalue("async_ranks" if prefix_caching else "ranks")
    scheduler, workers, steps = _run(
        TwoRankAsyncScheduler,
        model_dir,
        served,
        prefix_caching=prefix_caching,
        abort_every=37,
        reset_prefix_cache_every=53 if prefix_caching else 0,
    )
    assert not scheduler.has_requests(), f"unfinished after {steps} steps"
    stats = [handle.stats() for handle, _ in served]
    assert stats[0].totals.num_moves > 0, "the workload never made kvdefrag move a block"
    assert stats[0] == stats[1]
    if not prefix_caching:
        assert scheduler.kvdefrag.totals.num_preempted >= 3, "the small pool never preempted"
    for worker in workers:
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


@pytest.mark.parametrize("is_async", [False, True])
def test_workers_that_do_not_follow_moves_corrupt(
    model_dir: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, is_async: bool
) -> None:
    original = BlockIdTranslator.advance

    def advance_without_remap(self: BlockIdTranslator) -> Any:
        mapping, _ = original(self)
        return mapping, None

    monkeypatch.setattr(BlockIdTranslator, "advance", advance_without_remap)
    cls = TwoRankAsyncScheduler if is_async else TwoRankScheduler
    pool = request.getfixturevalue("ranks")  # prefix caching off: the small pool, async too
    _, workers, _ = _run(cls, model_dir, pool, prefix_caching=False)
    assert workers[0].num_corrupted > 0


def _slow_rank_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank applies each step 3 ms late: the workers run while it is in flight."""
    apply_events = Engine.apply_events

    def late(self: Engine, events: Any) -> Any:
        time.sleep(0.003)
        return apply_events(self, events)

    monkeypatch.setattr(Engine, "apply_events", late)


@pytest.mark.parametrize("carries_events", [True, False], ids=["events", "stamp-only"])
def test_translating_workers_wait_for_the_step_sent_without_waiting(
    model_dir: str, ranks: list[Any], monkeypatch: pytest.MonkeyPatch, carries_events: bool
) -> None:
    """The workers run each output while its step is still in flight (here always: a
    synchronous loop, slow services). An output that carries its step's events: the
    worker applies the step itself and the scheduler's call finds it applied; one that
    carries only the stamp: the worker waits for the call."""
    _slow_rank_services(monkeypatch)
    if not carries_events:
        attach = _bridge.attach_step_stamp
        monkeypatch.setattr(
            _bridge, "attach_step_stamp", lambda out, stamp: attach(out, stamp.without_events())
        )
    wait_applied = ServerHandle.wait_applied
    apply_planned_step = ServerHandle.apply_planned_step
    waits_for_a_step_in_flight = []
    applied_by_the_worker = []

    def counted(self: ServerHandle, epoch: int, seq: int, timeout_s: float) -> None:
        if self.stats().totals.num_steps < seq:
            waits_for_a_step_in_flight.append(seq)
        wait_applied(self, epoch, seq, timeout_s)

    def applied(self: ServerHandle, epoch: int, seq: int, events: Any) -> bool:
        is_applied_here = apply_planned_step(self, epoch, seq, events)
        if is_applied_here:
            applied_by_the_worker.append(seq)
        return is_applied_here

    monkeypatch.setattr(ServerHandle, "wait_applied", counted)
    monkeypatch.setattr(ServerHandle, "apply_planned_step", applied)
    scheduler, workers, _ = _run(TwoRankScheduler, model_dir, ranks, prefix_caching=True)
    in_flight = applied_by_the_worker if carries_events else waits_for_a_step_in_flight
    assert len(in_flight) > 100
    if not carries_events:
        assert applied_by_the_worker == []
    assert scheduler.kvdefrag.totals.num_preempted > 0
    for (handle, _), worker in zip(ranks, workers, strict=True):
        assert handle.stats().totals.num_steps == scheduler.kvdefrag.totals.num_steps
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


def test_translating_workers_that_do_not_wait_for_their_step_corrupt(
    model_dir: str, ranks: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_rank_services(monkeypatch)
    monkeypatch.setattr(vllm_harness, "wait_for_planned_step", lambda *args, **kwargs: None)
    # NOTE: without prefix caching every new block is fresh and placed (re-pointed with no
    # copy) when its step is applied: after a worker that did not wait wrote it.
    _, workers, _ = _run(TwoRankScheduler, model_dir, ranks, prefix_caching=False)
    assert workers[0].num_corrupted > 0


def test_a_forced_reset_of_one_rank_fails_its_next_pass_and_stops_the_scheduler(
    model_dir: str, ranks: list[Any]
) -> None:
    """A Reset under a running vLLM would leave the workers translating with the identity
    mapping: refused unless forced; forced, each of the rank's passes fails before it
    runs, and the scheduler stops with RanksDiverged once it settles the next step sent."""
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=True
    )
    workers = [
        SignedWorker(kv, translator_for(handle, NUM_BLOCKS), service=(handle, rank))
        for rank, (handle, kv) in enumerate(ranks)
    ]
    resolve = ranks[0][0].resolve
    try:
        workload = Workload(seed=3, num_requests=40)
        run_loop(scheduler, workers, workload, resolve=resolve, max_steps=30)
        assert scheduler.has_requests() and scheduler.kvdefrag.totals.num_steps > 0
        handle = ranks[1][0]
        old_epoch = handle.epoch
        with pytest.raises(SessionConflict, match="restart vLLM"):
            handle.reset()  # the scheduler's writer session holds the service
        assert handle.epoch == old_epoch
        handle.reset(force=True)

        num_sent = scheduler.kvdefrag.totals.num_steps
        was_sent = False
        for _ in range(50):
            if was_sent:
                with pytest.raises(RanksDiverged, match=r"rank 1: .*another epoch"):
                    scheduler.schedule()  # settles the step sent: rank 1 refused it
                break
            output = scheduler.schedule()
            was_sent = scheduler.kvdefrag.totals.num_steps > num_sent
            num_checked = workers[1].num_checked
            with pytest.raises(EpochMismatch, match=f"of epoch {old_epoch}: the server is at"):
                workers[1].execute(output)
            assert workers[1].num_checked == num_checked  # the pass did not run
            scheduler.update_from_output(output, workers[0].execute(output))
        assert was_sent, "no step was sent after the reset"
        assert workers[0].num_corrupted == workers[1].num_corrupted == 0
    finally:
        scheduler.kvdefrag.ranks.close()


@pytest.mark.parametrize("cls", ["sync", "async"])
def test_the_audit_stops_a_ledger_that_misread_a_change(
    model_dir: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cls: str
) -> None:
    """The per-step changes are read from the output and the hooks alone; the audit is
    what proves them: forget one kind of change and it names the difference."""
    if cls == "async":
        # deferred frees: blocks vLLM holds back after an aborted or finished request
        monkeypatch.setattr(_bridge.ParkedBlocks, "take", lambda self: ({}, []))
        scheduler_cls, expected = TwoRankAsyncScheduler, "deferred frees"
    else:
        # preemptions: released without a finish
        original = _bridge.changes_from_output

        def without_preemptions(output: Any, *args: Any, **kwargs: Any) -> Any:
            output.preempted_req_ids = set()
            return original(output, *args, **kwargs)

        monkeypatch.setattr(_bridge, "changes_from_output", without_preemptions)
        monkeypatch.setattr(vllm_scheduler, "changes_from_output", without_preemptions)
        scheduler_cls, expected = TwoRankScheduler, "request"
    pool = request.getfixturevalue("ranks")  # prefix caching off: the small pool, async too
    with pytest.raises(_ledger.LedgerDiverged, match=expected):
        _run(scheduler_cls, model_dir, pool, prefix_caching=False, abort_every=7)


class CountingBlocks:
    """The block pool's list, counting reads."""

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks
        self.num_reads = 0

    def __getitem__(self, block_id: int) -> Any:
        self.num_reads += 1
        return self.blocks[block_id]


class RefusedMapping(dict[str, Any]):
    """The KV cache manager's request lists, which a step must not read (audit only)."""

    def items(self) -> Any:
        raise AssertionError("a step read every request's block list")


def test_the_scheduler_side_reads_what_changed_not_the_pool(
    model_dir: str, run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same workload on two pools 8x apart: per step, the scheduler side reads a pool
    entry only for a block the step freed, never every request's list."""
    monkeypatch.setenv("KVDEFRAG_VLLM_AUDIT_EVERY", "0")
    reads: dict[int, list[int]] = {}
    for num_blocks in (ASYNC_NUM_BLOCKS, 8 * ASYNC_NUM_BLOCKS):
        with contextlib.contextmanager(serve_two_ranks)(run_dir, num_blocks) as pool_ranks:
            scheduler = make_scheduler(
                TwoRankScheduler, model_dir, num_blocks=num_blocks, prefix_caching=True
            )
            counting = CountingBlocks(scheduler._kvdefrag_pool)
            scheduler._kvdefrag_pool = counting
            scheduler._kvdefrag_blocks = RefusedMapping()
            bridge = scheduler.kvdefrag
            apply = bridge.apply
            per_step: list[int] = []

            def counted(
                output: Any,
                changes: Any,
                is_cached: Any,
                bridge: Any = bridge,
                apply: Any = apply,
                counting: Any = counting,
                per_step: list[int] = per_step,
            ) -> None:
                held = bridge.ledger.held
                let_go = {*changes.released, *changes.unparked, *changes.full_rows}
                num_freed = sum(len(held.get(request_id, ())) for request_id in let_go)
                before = counting.num_reads
                apply(output, changes, is_cached)
                per_step.append(counting.num_reads - before)
                assert per_step[-1] <= num_freed

            bridge.apply = counted
            workers = translating_workers(pool_ranks, num_blocks)
            run_loop(
                scheduler,
                workers,
                Workload(seed=4, num_requests=40),
                resolve=pool_ranks[0][0].resolve,
            )
            bridge.settle()
            bridge.ranks.close()
            reads[num_blocks] = per_step
            assert all(worker.num_corrupted == 0 for worker in workers)
    small, large = reads.values()
    assert sum(small) > 0 and sum(large) > 0  # freed blocks were looked up
    assert max(large) <= max(small) * 2  # bounded by the workload, not by the pool


def _groups(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{index}"], spec) for index, spec in enumerate(specs)
        ],
    )


def test_models_kvdefrag_cannot_serve_are_refused_at_startup_by_feature(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    from kvdefrag.vllm.scheduler import check_supported

    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    full = FullAttentionSpec(**shape)
    window = SlidingWindowSpec(**shape, sliding_window=64)
    scheduler = make_scheduler(Scheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False)
    config = scheduler.vllm_config
    check_supported(config, _groups(full))  # served
    with pytest.raises(UnsupportedByKvdefrag, match="SlidingWindowSpec: sliding-window"):
        check_supported(config, _groups(window))
    with pytest.raises(UnsupportedByKvdefrag, match="ChunkedLocalAttentionSpec"):
        chunked = ChunkedLocalAttentionSpec(**shape, attention_chunk_size=64)
        check_supported(config, _groups(chunked))
    with pytest.raises(UnsupportedByKvdefrag, match=r"has 2 \(FullAttentionSpec, SlidingWindow"):
        check_supported(config, _groups(full, window))
    for attribute, value, message in [
        ("decode_context_parallel_size", 2, "context parallelism"),
    ]:
        monkeypatch.setattr(config.parallel_config, attribute, value)
        with pytest.raises(UnsupportedByKvdefrag, match=message):
            check_supported(config, _groups(full))
        monkeypatch.setattr(config.parallel_config, attribute, 1)
    # pipeline parallelism is served (test_vllm_pipeline.py)
    monkeypatch.setattr(config.parallel_config, "pipeline_parallel_size", 2)
    check_supported(config, _groups(full))
    monkeypatch.setattr(config.parallel_config, "pipeline_parallel_size", 1)
    # the V2 model runner is served (its workers translate: test_vllm_v2_runner.py)
    monkeypatch.setattr(type(config), "use_v2_model_runner", property(lambda self: True))
    check_supported(config, _groups(full))


@pytest.mark.parametrize("scheduler_cls", ["sync", "async"])
def test_new_blocks_to_zero_are_zeroed_at_their_physical_slots(
    model_dir: str,
    scheduler_cls: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    is_sync = scheduler_cls == "sync"
    cls = TwoRankScheduler if is_sync else TwoRankAsyncScheduler
    served: list[Any] = request.getfixturevalue("ranks" if is_sync else "async_ranks")
    zeroed: list[int] = []
    original = SignedWorker.execute

    def execute(worker: SignedWorker, output: Any) -> Any:
        zeroed.extend(output.new_block_ids_to_zero or ())
        return original(worker, output)

    monkeypatch.setattr(SignedWorker, "execute", execute)
    _, workers, _ = _run(cls, model_dir, served, prefix_caching=True, zero_new_blocks=True)
    assert len(zeroed) > 100
    assert served[0][0].stats().totals.num_moves > 0
    for worker in workers:
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


# --- which services the scheduler trusts ------------------------------------------------
def _serve_without_secret(socket_path: str) -> ServerHandle:
    """A kvdefrag server on the engine's block size that no worker of this engine started."""
    import torch

    from kvdefrag.server import ServiceConfig, serve_in_process

    key = torch.zeros(NUM_BLOCKS * vllm_harness.BLOCK_SIZE, 1, dtype=torch.int64)
    return serve_in_process(
        [(key, None)],
        vllm_harness.BLOCK_SIZE,
        service_config=ServiceConfig(address=f"unix:{socket_path}"),
    )


def _write_ranks_file(path: str, addresses: list[str], engine_id: str | None = None) -> None:
    """A rank list for the engine ``make_scheduler`` builds (for ``engine_id`` when given)."""
    with open(path, "w") as file:
        engine = harness_engine_id() if engine_id is None else engine_id
        secrets = [os.urandom(32).hex() for _ in addresses]
        json.dump({"engine_id": engine, "addresses": addresses, "secrets": secrets}, file)
    os.chmod(path, 0o600)


def test_the_scheduler_refuses_an_address_this_engines_rank_does_not_serve(
    model_dir: str, run_dir: str
) -> None:
    # ranks.json names a live kvdefrag service, but not one holding the secret published
    # with it: stale, another engine's, or another process's
    impostor = _serve_without_secret(f"{run_dir}/rank0.sock")
    try:
        _write_ranks_file(f"{run_dir}/ranks.json", [impostor.address])
        with pytest.raises(Exception) as info:
            make_scheduler(DefragScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False)
        assert type(info.value).__name__ == "RankNotVerified"
        assert "is not served by this engine's rank 0" in str(info.value)
        assert impostor.stats().totals.num_steps == 0
    finally:
        impostor.stop(0)


def test_the_scheduler_refuses_the_ranks_of_another_engine_naming_both(
    model_dir: str, run_dir: str
) -> None:
    # another engine sharing the run directory wrote its ranks last: refused by its
    # engine id before any of its addresses is tried
    other = _serve_without_secret(f"{run_dir}/rank0.sock")
    try:
        _write_ranks_file(f"{run_dir}/ranks.json", [other.address], "another-engine_dp0")
        with pytest.raises(Exception) as info:
            make_scheduler(DefragScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False)
        assert type(info.value).__name__ == "RanksOfAnotherEngine"
        message = str(info.value)
        assert "holds the ranks of engine 'another-engine_dp0'" in message
        assert f"not of this engine ({harness_engine_id()!r})" in message
        assert other.stats().totals.num_steps == 0
    finally:
        other.stop(0)


def test_the_scheduler_refuses_a_ranks_file_that_is_a_link(
    model_dir: str, run_dir: str, tmp_path: Any
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    other = _serve_without_secret(f"{elsewhere}/kv.sock")
    try:
        _write_ranks_file(f"{elsewhere}/ranks.json", [other.address])
        os.symlink(f"{elsewhere}/ranks.json", f"{run_dir}/ranks.json")
        with pytest.raises(Exception) as info:
            make_scheduler(DefragScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False)
        assert type(info.value).__name__ == "UnsafeRunDir"
        assert "ranks.json is a symlink" in str(info.value)
        assert other.stats().totals.num_steps == 0
    finally:
        other.stop(0)


def test_scheduler_exports_are_pinned() -> None:
    assert_public_names(
        "kvdefrag.vllm.scheduler",
        {
            "DefragAsyncScheduler",
            "DefragScheduler",
            "StartupRefused",
            "UnsupportedByKvdefrag",
            "check_supported",
        },
    )
