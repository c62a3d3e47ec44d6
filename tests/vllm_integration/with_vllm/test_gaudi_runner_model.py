"""kvdefrag under a CPU model of vllm-gaudi's HPU runner, driven by vLLM 0.33's real
Scheduler and AsyncScheduler through DefragScheduler / DefragAsyncScheduler.

The runner model (``support.hpu_runner_model``) keeps logical rows, appends
``new_block_ids`` even to resumed rows still in its batch, and resolves every block id at
input build through ``model_runner.defragmenter``; with ``DefragHPUWorkerMixin`` that is
kvdefrag's ``DefragHPUSwitch``. Prefix caching is off (contiguous PA turns it off on
Gaudi) and the pool is small enough to preempt, sync and async. Every read must find its
own signature, and since the model samples from what it read, every request's tokens
must be those of the same workload under plain vLLM (the runner's own identity
defragmenter); the sabotages must corrupt and change the outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sys
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.vllm.errors import PassRefused
from kvdefrag.vllm.gaudi import DefragHPUSwitch
from kvdefrag.vllm.output_blocks import map_block_ids
from kvdefrag.vllm.scheduler import DefragScheduler

from support.dp_engine_loop import LoopCounts, run_dp_engine_loop
from support.hpu_subject import HPUModelWorker
from support.vllm_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TwoRankAsyncScheduler,
    TwoRankScheduler,
    Workload,
    make_scheduler,
    run_loop,
    serve_two_ranks,
    spy_preemptions,
)

EAGLE_TOKENS = 3
"""Draft tokens per step in the Eagle runs (``num_speculative_tokens``)."""


def _draft_layers() -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 1, dtype=torch.int64) for _ in range(2)]


def _workers(ranks: list[Any], num_blocks: int, *, attach: bool = True) -> list[HPUModelWorker]:
    return [
        HPUModelWorker(kv, num_blocks, handle if attach else None, rank=rank)
        for rank, (handle, kv) in enumerate(ranks)
    ]


def _outputs(scheduler: Any) -> list[tuple[str, list[int]]]:
    """Every finished request's tokens, in finishing order, as ``update_from_output``
    delivers them (the list fills as the scheduler runs)."""
    finished: list[tuple[str, list[int]]] = []
    running: dict[str, list[int]] = {}
    update = scheduler.update_from_output

    def collect(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                tokens = running.setdefault(output.request_id, [])
                tokens.extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finished.append((output.request_id, running.pop(output.request_id)))
        return outputs

    scheduler.update_from_output = collect
    return finished


@dataclasses.dataclass
class _Run:
    """What one run left: the scheduler, the workers, the preempted ids, the outputs."""

    scheduler: Any
    workers: list[HPUModelWorker]
    preempted: list[str]
    outputs: list[tuple[str, list[int]]]


def _run(
    model_dir: str,
    ranks: list[Any] | None,
    *,
    is_async: bool,
    skip_resolve: bool = False,
    skip_draft_resolve: bool = False,
    drafts: Sequence[torch.Tensor] = (),
    seed: int = 1,
    data_parallel: bool = False,
    second_warmup: bool = False,
    worker_cls: type[HPUModelWorker] = HPUModelWorker,
) -> _Run:
    """One workload on the small pool; ``ranks`` None runs plain vLLM (the runner's
    identity defragmenter, no kvdefrag; async with ``DefragAsyncScheduler``'s block-free
    fence); ``drafts`` (a draft layer per rank) turns the Eagle draft step on.
    ``data_parallel`` pads decode batches and block buckets as another DP rank's would
    (``get_dp_padding``) and runs a DP dummy batch every third step; ``second_warmup``
    calls ``compile_or_warm_up_model`` once the workers are up, as vLLM's engine core
    does after ``initialize_from_config``."""
    if ranks is None:
        cls: type[Scheduler] = AsyncScheduler if is_async else Scheduler
        ranks = [(None, torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 1, dtype=torch.int64))]
    else:
        cls = TwoRankAsyncScheduler if is_async else TwoRankScheduler
    scheduler = make_scheduler(
        cls, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False, async_scheduling=is_async
    )
    if is_async and not isinstance(scheduler, DefragScheduler):
        # NOTE: the fence DefragAsyncScheduler turns on (freed blocks return to the pool
        # once the steps in flight have run), so that plain vLLM makes the same
        # scheduling decisions (without it, it preempts other requests at other steps).
        scheduler.defer_block_free = True
    if drafts:
        # NOTE: what speculative_config sets with Eagle (it needs a draft model here):
        # every request gets lookahead slots for the draft tokens.
        scheduler.num_lookahead_tokens = EAGLE_TOKENS
    preempted = spy_preemptions(scheduler)
    outputs = _outputs(scheduler)
    workers = [
        worker_cls(
            kv,
            NUM_BLOCKS,
            handle,
            rank=rank,
            **(
                {"draft_kv": drafts[rank], "num_speculative_tokens": EAGLE_TOKENS} if drafts else {}
            ),
        )
        for rank, (handle, kv) in enumerate(ranks)
    ]
    for worker in workers:
        worker.model_runner.skip_resolve = skip_resolve
        worker.model_runner.skip_draft_resolve = skip_draft_resolve
        if data_parallel:
            worker.model_runner.dp_rng = random.Random(seed)  # the same on every TP rank
        if second_warmup:
            worker.compile_or_warm_up_model()
    is_defrag = isinstance(scheduler, DefragScheduler)
    run_loop(
        scheduler,
        workers,  # type: ignore[arg-type]
        Workload(seed=seed, num_requests=80),
        resolve=ranks[0][0].resolve if is_defrag else (lambda ids: ids),
        in_flight=2 if is_async else 1,
        abort_every=37,
        dummy_batch_every=3 if data_parallel else 0,
    )
    if is_defrag:
        scheduler.kvdefrag.settle()
        scheduler.kvdefrag.ranks.close()
    return _Run(scheduler, workers, preempted, outputs)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_outputs_are_plain_vllms_with_preemption(
    model_dir: str, ranks: list[Any], is_async: bool
) -> None:
    plain = _run(model_dir, None, is_async=is_async)
    run = _run(model_dir, ranks, is_async=is_async)
    assert not run.scheduler.has_requests()
    assert len(run.preempted) >= 3, "the small pool never preempted"
    assert run.preempted == plain.preempted
    assert ranks[0][0].stats().totals.num_moves > 0, "kvdefrag never moved a block"
    assert plain.workers[0].num_corrupted == 0
    assert len(run.outputs) >= 70  # the aborted ones deliver no finish
    assert run.outputs == plain.outputs
    for worker in run.workers:
        switch = worker.kvdefrag_switch
        assert isinstance(switch, DefragHPUSwitch) and switch.num_resolved > 1000
        assert worker.model_runner.defragmenter is switch
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_the_eagle_draft_step_in_sample_tokens_resolves_through_the_switch(
    model_dir: str, run_dir: str, is_async: bool
) -> None:
    """The draft layer is bound with the target layer, so it moves with it, and the draft
    step's ``prepare_attn_metadata``, run from ``sample_tokens``, resolves through the
    switch inside the pass."""
    plain = _run(model_dir, None, is_async=is_async, drafts=_draft_layers()[:1])
    drafts = _draft_layers()
    with contextlib.contextmanager(serve_two_ranks)(
        run_dir, NUM_BLOCKS, [[draft] for draft in drafts]
    ) as served:
        run = _run(model_dir, served, is_async=is_async, drafts=drafts)
        assert served[0][0].stats().totals.num_moves > 0, "kvdefrag never moved a block"
    assert len(run.preempted) >= 3, "the small pool never preempted"
    assert plain.workers[0].num_corrupted == 0
    assert run.outputs == plain.outputs
    for worker in run.workers:
        assert worker.model_runner.num_draft_resolved > 1000
        assert worker.model_runner.num_resolved_in_execute == 0
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


def test_execute_model_returns_none_and_sample_tokens_resolves(
    model_dir: str, ranks: list[Any]
) -> None:
    """The split: ``execute_model`` resolves nothing and returns None; every block id
    of the step is resolved in ``sample_tokens``, whose output is the step's."""
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
    )
    workers = _workers(ranks, NUM_BLOCKS)
    try:
        for request in Workload(seed=3, num_requests=4).requests(BLOCK_SIZE):
            scheduler.add_request(request)
        for _ in range(6):  # prefills, then decodes
            output = scheduler.schedule()
            switches = [worker.kvdefrag_switch for worker in workers]
            assert all(isinstance(switch, DefragHPUSwitch) for switch in switches)
            before = [switch.num_resolved for switch in switches]  # type: ignore[union-attr]
            assert [worker.execute(output) for worker in workers] == [None, None]
            assert [switch.num_resolved for switch in switches] == before  # type: ignore[union-attr]
            results = [worker.sample(None) for worker in workers]
            for switch, resolved in zip(switches, before, strict=True):
                assert switch.num_resolved > resolved  # type: ignore[union-attr]
            assert results[0].req_ids == list(output.num_scheduled_tokens)
            assert results[0].sampled_token_ids == results[1].sampled_token_ids
            scheduler.update_from_output(output, results[0])
        assert all(worker.num_corrupted == 0 and worker.num_checked > 0 for worker in workers)
    finally:
        scheduler.kvdefrag.ranks.close()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_kv_lock_is_held_through_sample_tokens(
    model_dir: str, ranks: list[Any], is_async: bool
) -> None:
    """The pass ``execute_model`` opens stays open, ``kv_lock`` held, until
    ``sample_tokens`` has run: no block moves between the two calls or during the
    forward (the runner model checks ``kv_lock.locked()`` in every ``sample_tokens``)."""
    run = _run(model_dir, ranks, is_async=is_async)
    for handle, _ in ranks:
        assert not handle.kv_lock.locked(), "a pass was left open"
    for worker in run.workers:
        assert worker.model_runner.num_sampled_steps > 100
        assert worker.model_runner.num_unlocked == 0
        assert worker.num_corrupted == 0


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_dp_dummy_batch_and_dp_padding_resolve_through_the_switch(
    model_dir: str, ranks: list[Any], is_async: bool
) -> None:
    """DP dummy batches between steps (``execute_dummy_batch``: block 0 resolved and
    written outside any scheduled step) and DP-padded decode batches (rows of
    ``_PAD_BLOCK_ID``, returned unchanged) and block buckets: every read clean, the
    outputs plain vLLM's without DP."""
    plain = _run(model_dir, None, is_async=is_async)
    run = _run(model_dir, ranks, is_async=is_async, data_parallel=True)
    assert ranks[0][0].stats().totals.num_moves > 0, "kvdefrag never moved a block"
    assert run.outputs == plain.outputs
    for worker in run.workers:
        runner = worker.model_runner
        assert runner.num_dummy_runs > 30
        assert runner.num_pad_resolved > 100
        assert runner.num_pad_changed == 0
        assert runner.defragmenter is worker.kvdefrag_switch
        assert worker.num_checked > 10_000
        assert worker.num_corrupted == 0


def test_the_second_warm_up_leaves_the_switch_in_place(model_dir: str, ranks: list[Any]) -> None:
    """vLLM's engine core calls ``compile_or_warm_up_model`` again after
    ``initialize_from_config``; in eager mode vllm-gaudi warms up again and re-creates
    its ``OnlineDefragmenter`` at the start and the end: the switch must be back after
    it, and the run as plain vLLM's."""
    plain = _run(model_dir, None, is_async=False, second_warmup=True)
    run = _run(model_dir, ranks, is_async=False, second_warmup=True)
    assert run.outputs == plain.outputs
    for worker in run.workers:
        assert worker.model_runner.num_warmups == 2
        assert worker.model_runner.defragmenter is worker.kvdefrag_switch
        assert worker.num_corrupted == 0


class _ForwardAfterThePass(HPUModelWorker):
    """A worker whose forward runs in ``sample_tokens`` after kvdefrag's pass ended
    (``kv_lock`` released): the runner's ``sample_tokens`` called around the wrapper."""

    def sample_tokens(self, grammar_output: Any) -> Any:
        runner = self.model_runner
        held, runner.scheduler_output = runner.scheduler_output, None
        super().sample_tokens(grammar_output)  # the wrapper's, with nothing to run
        runner.scheduler_output = held
        return runner.sample_tokens(grammar_output)


def test_sabotage_a_forward_in_sample_tokens_outside_the_pass_is_refused(
    model_dir: str, ranks: list[Any]
) -> None:
    with pytest.raises(PassRefused, match="outside a pass"):
        _run(model_dir, ranks, is_async=False, worker_cls=_ForwardAfterThePass)


def test_sabotage_a_draft_step_that_skips_the_resolve_corrupts(
    model_dir: str, run_dir: str
) -> None:
    drafts = _draft_layers()
    with contextlib.contextmanager(serve_two_ranks)(
        run_dir, NUM_BLOCKS, [[draft] for draft in drafts]
    ) as served:
        run = _run(model_dir, served, is_async=False, drafts=drafts, skip_draft_resolve=True)
    assert run.workers[0].num_corrupted > 0


def test_sabotage_a_draft_layer_the_service_does_not_move_corrupts(
    model_dir: str, ranks: list[Any]
) -> None:
    run = _run(model_dir, ranks, is_async=False, drafts=_draft_layers())
    assert ranks[0][0].stats().totals.num_moves > 0
    assert run.workers[0].num_corrupted > 0


def test_sabotage_a_runner_that_skips_the_resolve_corrupts(
    model_dir: str, ranks: list[Any]
) -> None:
    plain = _run(model_dir, None, is_async=False)
    run = _run(model_dir, ranks, is_async=False, skip_resolve=True)
    assert run.workers[0].num_corrupted > 0
    assert run.outputs != plain.outputs


class _SeedOrder:
    """Each step's events sent to the ranks as vllm-gaudi's runner hook orders them
    (``update_state(new | cached, finished_req_ids)``): first the blocks handed out (new,
    resumed, fresh, evicted), then, as a step of its own, the requests that let go of
    theirs. With ``reorder`` False the events go through unchanged (the control)."""

    def __init__(self, scheduler: Any, *, reorder: bool) -> None:
        self.ranks = scheduler.kvdefrag.ranks
        self.submit = self.ranks.submit
        self.reorder = reorder
        self.num_split = 0
        self.ranks.submit = self.seed_order  # what SchedulerBridge.apply calls

    def seed_order(self, events: StepEvents) -> Any:
        if not self.reorder or not events.finished:
            return self.submit(events)
        taken = StepEvents(
            new_blocks=events.new_blocks,
            resumed=events.resumed,
            fresh=events.fresh,
            evicted=events.evicted,
        )
        released = StepEvents(finished=events.finished, fresh=[])
        if taken.is_empty:
            return self.submit(released)
        self.num_split += 1
        self.submit(taken).result()  # one step in flight at a time, as the bridge keeps
        return self.submit(released)


@pytest.mark.parametrize("reorder", [False, True], ids=["kvdefrag-order", "seed-order"])
def test_sabotage_new_blocks_before_finished_ones_is_refused(
    model_dir: str, ranks: list[Any], reorder: bool
) -> None:
    """The seed's order, new blocks before finished ones, is refused by the engine.

    In vLLM's synchronous loop a request finishes in ``update_from_output`` and its blocks
    go back to the pool at once; the next ``schedule()`` may hand them to a new request,
    and the same output lists the finished one. Sent new-first, the step that hands such a
    block out names it ``fresh`` while the finished request still holds it, and the engine
    refuses that step outright (``InvalidArgument``, nothing applied) rather than move or
    overwrite live data; the error surfaces from ``schedule()``. kvdefrag's own order
    (finished, then new, in one step) runs the same workload with every read signed right.
    (Sent new-first without ``fresh``, as the seed knows no freshness, the engine counts
    the block as shared for one step and nothing is corrupted in this model: the refusal
    comes from ``fresh``, not from the order alone.)
    """
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
    )
    order = _SeedOrder(scheduler, reorder=reorder)
    workers = _workers(ranks, NUM_BLOCKS)
    try:
        if reorder:
            with pytest.raises(InvalidArgument, match=r"fresh: block id \d+ still holds data"):
                run_loop(
                    scheduler,
                    workers,  # type: ignore[arg-type]
                    Workload(seed=1, num_requests=80),
                    resolve=ranks[0][0].resolve,
                )
            assert order.num_split > 0
        else:
            run_loop(
                scheduler,
                workers,  # type: ignore[arg-type]
                Workload(seed=1, num_requests=80),
                resolve=ranks[0][0].resolve,
            )
            scheduler.kvdefrag.settle()
            assert not scheduler.has_requests()
            assert ranks[0][0].stats().totals.num_moves > 0, "kvdefrag never moved a block"
            assert workers[0].num_checked > 10_000
            assert all(worker.num_corrupted == 0 for worker in workers)
    finally:
        scheduler.kvdefrag.ranks.close()


class _RewritingPath:
    """The old scheduler rewrite path: the output turned physical on the scheduler side,
    and every cached request whose physical row changed re-sent as resumed with its whole
    physical row (so a V1 GPU runner would replace the row)."""

    def __init__(self, scheduler: Any, service: Any) -> None:
        self.scheduler = scheduler
        self.service = service  # rank 0's: every rank's mapping is the same once settled
        self.sent_rows: dict[str, list[int]] = {}
        self.num_resent = 0

    def rewrite(self, output: SchedulerOutput) -> None:
        bridge = self.scheduler.kvdefrag
        bridge.settle()  # the step planned with this output is applied on every rank
        resolve = self.service.resolve
        blocks = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        cached = output.scheduled_cached_reqs
        full_rows: dict[str, list[int]] = {}
        for request_id in cached.req_ids:
            logical = [block.block_id for block in blocks.req_to_blocks[request_id]]
            full_rows[request_id] = [int(p) for p in resolve(np.asarray(logical, np.int64))]
        map_block_ids(output, lambda ids: [int(p) for p in resolve(np.asarray(ids, np.int64))])
        for position, request_id in enumerate(cached.req_ids):
            sent = self.sent_rows.get(request_id)
            row = full_rows[request_id]
            if sent is not None and row[: len(sent)] != sent:
                cached.resumed_req_ids.add(request_id)
                cached.new_block_ids[position] = (list(row),)
                self.num_resent += 1
            self.sent_rows[request_id] = row
        for new in output.scheduled_new_reqs:
            self.sent_rows[new.req_id] = list(new.block_ids[0])


def test_sabotage_rows_resent_as_resumed_into_the_appending_runner_corrupt(
    model_dir: str, ranks: list[Any]
) -> None:
    scheduler = make_scheduler(
        TwoRankScheduler, model_dir, num_blocks=NUM_BLOCKS, prefix_caching=False
    )
    path = _RewritingPath(scheduler, ranks[0][0])
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> SchedulerOutput:
        output = original(*args, **kwargs)
        path.rewrite(output)
        return output

    scheduler.schedule = schedule  # type: ignore[method-assign]
    workers = _workers(ranks, NUM_BLOCKS, attach=False)  # ids already physical
    try:
        run_loop(
            scheduler,
            workers,  # type: ignore[arg-type]
            Workload(seed=1, num_requests=80),
            resolve=ranks[0][0].resolve,
            max_steps=400,
        )
    except ValueError as error:
        # NOTE: whole rows appended again and again overflow the runner's row at last
        # (vLLM's ``append_row`` raises then); the corruption comes first.
        assert "could not broadcast" in str(error)
    scheduler.kvdefrag.settle()
    scheduler.kvdefrag.ranks.close()
    assert path.num_resent > 0, "no row moved, so nothing was re-sent"
    assert workers[0].num_corrupted > 0


def test_the_hpu_async_scheduler_class_keeps_vllm_gaudis_fixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvdefrag.vllm import gaudi
    from kvdefrag.vllm import scheduler as vllm_scheduler_module
    from kvdefrag.vllm.scheduler import DefragAsyncScheduler

    class HPUAsyncScheduler(AsyncScheduler):  # type: ignore[misc]
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            return super().schedule(*args, **kwargs)

    names = ["vllm_gaudi", "vllm_gaudi.v1", "vllm_gaudi.v1.core", "vllm_gaudi.v1.core.sched"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("vllm_gaudi.v1.core.sched.hpu_async_scheduler")
    module.HPUAsyncScheduler = HPUAsyncScheduler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    vllm_scheduler_module.hpu_async_scheduler_class.cache_clear()
    try:
        built = gaudi.DefragHPUAsyncScheduler
        mro = built.__mro__
        assert mro.index(DefragAsyncScheduler) < mro.index(HPUAsyncScheduler)
        assert mro.index(HPUAsyncScheduler) < mro.index(AsyncScheduler)
        gaudi.check_gaudi_scheduler(object.__new__(built))
        with pytest.raises(gaudi.GaudiSchedulerMismatch, match="DefragHPUAsyncScheduler"):
            gaudi.check_gaudi_scheduler(object.__new__(DefragAsyncScheduler))
    finally:
        vllm_scheduler_module.hpu_async_scheduler_class.cache_clear()


DP_NUM_BLOCKS = 48
"""A pool small enough that, under async scheduling with the block-free fence, vLLM
schedules steps with nothing in them while requests run (the fence holds the blocks of
the step in flight, and the preemption loop stops at a victim whose blocks it holds)."""

DP_SEEDS = range(1, 11)


@dataclasses.dataclass
class _DPRun:
    """What one run of the DP engine loop left."""

    counts: LoopCounts
    workers: list[HPUModelWorker]
    num_moves: int = 0

    @property
    def num_corrupted(self) -> int:
        return sum(worker.num_corrupted for worker in self.workers)


def _run_dp(
    model_dir: str,
    run_dir: str | None,
    seed: int,
    *,
    worker_cls: type[HPUModelWorker] = HPUModelWorker,
) -> _DPRun:
    """One workload through vLLM's DP engine loop (``support.dp_engine_loop``: an idle
    rank's dummy batch for every step that executes nothing, the workers on their own
    threads), async scheduling, DP padding drawn as another rank's would be. With
    ``run_dir`` kvdefrag serves two ranks; without, plain vLLM's ``AsyncScheduler``
    (no block-free fence) on the runner's identity defragmenter."""
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            cls: type[Scheduler] = AsyncScheduler
            ranks: list[Any] = [
                (None, torch.zeros(DP_NUM_BLOCKS * BLOCK_SIZE, 1, dtype=torch.int64))
            ]
        else:
            cls = TwoRankAsyncScheduler
            ranks = stack.enter_context(
                contextlib.contextmanager(serve_two_ranks)(run_dir, DP_NUM_BLOCKS)
            )
        scheduler = make_scheduler(
            cls, model_dir, num_blocks=DP_NUM_BLOCKS, prefix_caching=False, async_scheduling=True
        )
        workers = [
            worker_cls(kv, DP_NUM_BLOCKS, handle, rank=rank)
            for rank, (handle, kv) in enumerate(ranks)
        ]
        for worker in workers:
            worker.model_runner.dp_rng = random.Random(seed)  # the same on every TP rank
        counts = run_dp_engine_loop(
            scheduler, workers, Workload(seed=seed, num_requests=40), is_async=True, abort_every=37
        )
        assert not scheduler.has_requests()
        if run_dir is None:
            return _DPRun(counts, workers)
        scheduler.kvdefrag.settle()
        scheduler.kvdefrag.ranks.close()
        for handle, _ in ranks:
            assert handle.resolve(np.asarray([0], np.int64)).tolist() == [0]
        return _DPRun(counts, workers, ranks[0][0].stats().totals.num_moves)


def test_dp_dummy_batches_on_fenced_empty_steps_overwrite_no_live_block(
    model_dir: str, run_dir: str
) -> None:
    """Gaudi, data parallel, async scheduling, kvdefrag on: the fence makes vLLM schedule
    steps with nothing in them while requests run, and the DP loop runs an idle-rank dummy
    batch for each. vllm-gaudi's dummy decode reads its row one entry past the block it
    names; the worker clears the rows first, so that entry is block 0 and no live block
    is written: every read clean over every seed. Block 0 stays where it is (vllm-gaudi's
    DP prefill padding writes into physical block 0 without resolving it) and no block
    is ever resolved onto it."""
    num_empty_steps = 0
    for seed in DP_SEEDS:
        run = _run_dp(model_dir, run_dir, seed)
        num_empty_steps += run.counts.num_empty_steps
        assert run.num_corrupted == 0, f"seed {seed}"
        assert run.num_moves > 0, f"seed {seed}: kvdefrag never moved a block"
        for worker in run.workers:
            runner = worker.model_runner
            assert runner.num_dummy_runs == run.counts.num_dummy_batches > 0
            assert runner.num_dummy_stray_writes == 0, f"seed {seed}"
            assert runner.num_dummy_prefill_pads > 0
            assert runner.num_null_block_moved == runner.num_live_on_null_block == 0
            assert worker.num_checked > 10_000
    assert num_empty_steps >= len(DP_SEEDS), "the fence never emptied a step"


class _DummyOnStaleRows(HPUModelWorker):
    """Today's worker before the fix: the dummy batch runs on the rows as they are."""

    def kvdefrag_clear_rows(self) -> None:
        pass


def test_sabotage_dp_dummy_batches_on_stale_rows_overwrite_live_blocks(
    model_dir: str, run_dir: str
) -> None:
    """Without the rows cleared, the dummy decode's slot comes from the stale second entry
    of the row it reuses: the block of a request left unscheduled by the empty step,
    whose first slot it overwrites (seeds 1-3 all corrupt)."""
    runs = [_run_dp(model_dir, run_dir, seed, worker_cls=_DummyOnStaleRows) for seed in (1, 2, 3)]
    assert all(run.num_corrupted > 0 for run in runs)
    assert all(run.workers[0].model_runner.num_dummy_stray_writes > 0 for run in runs)


def test_plain_vllm_dp_without_the_fence_reads_clean_on_the_same_pool(model_dir: str) -> None:
    """Plain vLLM (vllm-gaudi's own scheduler has no block-free fence) on the same pool:
    every read clean, as with kvdefrag."""
    for seed in (1, 2, 3):
        run = _run_dp(model_dir, None, seed)
        assert run.num_corrupted == 0
