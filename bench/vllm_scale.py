"""``make bench-vllm``: what kvdefrag adds to vLLM 0.33's own scheduler at production scale.

For each size (64 requests on 16,384 blocks, 256 on 65,536, 512 on 131,072), prefix
caching off and on, synchronous and asynchronous scheduling, it builds vLLM's real
scheduler twice in one process: vLLM alone (``Scheduler`` / ``AsyncScheduler``) and with
kvdefrag (``DefragScheduler`` / ``DefragAsyncScheduler``, stepping one in-process service
on a unix socket whose KV cache is one byte per token slot, so the bookkeeping is timed,
not the copying). Both are driven in lockstep through the same steady decode workload and
their iterations are timed interleaved, so that load on the machine hits both alike::

    iteration = schedule() + update_from_output()      (the engine core's thread)

    vLLM alone:  schedule N | pickle N,                       worker rows N | update N
    kvdefrag:    schedule N | pickle N, wait for N's replies, worker pass N | update N
                            (not timed: the executor, the forward pass, the workers)

Asynchronous classes keep one output in flight, as vLLM's engine core does with a batch
queue of two: step ``N + 1`` is scheduled before step ``N``'s output is applied.

Each iteration is timed by the wall clock and by the thread's CPU clock (what it costs
on a core of its own: another process taking the core does not count). kvdefrag's own
code inside ``schedule()`` (read the changes, plan, send, stamp) is timed apart: a class
between ``DefragScheduler`` and vLLM's ``Scheduler`` times vLLM's part of the call.

The workload: every one of the ``N`` requests runs (``max_num_seqs = N``); prompts of
1.5-3k tokens, half of them behind one of four shared 512-token system prompts (prefix
caching hits); each request generates 4N-6N tokens, so about two finish (and are replaced)
every ten steps. To start at steady occupancy, the first ``N`` requests are admitted at a
random point of their life (what they generated so far is part of their prompt), after
short "filler" requests have passed through the pool's free part (with prefix caching its
free blocks then hold cached content, so allocations evict, as in a server that has run a
while). The timed window starts once every request has prefilled.

The bench waits for each step's replies before ``update_from_output()``: in vLLM the
forward pass lies between the two, and the rank threads take the replies meanwhile (the
time from ``schedule()``'s return to the checked replies is reported as the round trip).
Then each scheduler's worker stand-in runs its pass on a pickled copy of the output, as
vLLM's executor sends it: for vLLM alone, the V1 runner's row bookkeeping; with kvdefrag,
what ``DefragWorkerMixin.execute_model`` does without a model:
``wait_for_planned_step`` (the step is applied by then, as under async scheduling), then
under ``kv_lock`` ``BlockIdTranslator.advance``, ``remap_v1_runner_rows`` on a stand-in
V1 runner (whose ``requests`` and ``input_batch.block_table`` rows it keeps from the
outputs as vLLM's ``_update_states`` does) and ``translate_scheduler_output``: that is
the worker's per-pass overhead. Both schedulers thus meet ``update_from_output()`` after
a gap that leaves the caches cold, as a forward pass does (a gap on one side only made
vLLM alone's ``update_from_output()`` look ~0.08 ms faster at 64 requests). The service
and the worker run in this process (in vLLM, in the workers'): ``added`` (kvdefrag's
iteration minus vLLM's) includes what their work does to the caches, ``own`` does not.

Checks, printed under the table: both schedulers did the same scheduling (steps,
preemptions, and what each step scheduled), the service's digest equals its client's,
the ledger matches vLLM's KV cache manager (``kvdefrag_audit``), and the stand-in
runner's rows are the physical ids of vLLM's block lists.

Run: ``make bench-vllm`` (``.venv-vllm``); ``--quick`` times fewer iterations,
``--sizes 256`` runs one size, ``--profile`` prints cProfile's view of the kvdefrag
scheduler's iterations.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import heapq
import json
import os
import pickle
import platform
import pstats
import secrets
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.pop("KVDEFRAG_VLLM_AUDIT_EVERY", None)  # audits are O(pool): once, at the end

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm_engineless import build_scheduler

from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.server import ServerHandle, ServiceConfig, serve_in_process
from kvdefrag.vllm._discovery import PublishedRank
from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm._worker.translation import (
    BlockIdTranslator,
    remap_v1_runner_rows,
    translate_scheduler_output,
)
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
MAX_NUM_BATCHED_TOKENS = 16_384
SIZES = ((64, 16_384), (256, 65_536), (512, 131_072))
GOAL_SIZE = 256
PROMPT_TOKENS = (1_536, 3_072)
SYSTEM_PROMPT_TOKENS = 512
NUM_SYSTEM_PROMPTS = 4
FILLER_TOKENS = 2_048
SAMPLED_TOKEN = 7
STEP_WAIT_S = 60.0
WARM_DECODE_STEPS = 20

GOAL_RATIO = 1.15
GOAL_RATIO_P99 = 1.3
GOAL_FLAT = 1.3
GOAL_WORKER_MS = 0.2

_STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"  .. {time.perf_counter() - _STARTED:5.0f} s  {message}", file=sys.stderr, flush=True)


# --- the workload ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    max_tokens: int


class Workload:
    """A seeded stream of requests for ``num_requests`` running at once.

    Each request generates 4N-6N tokens (N = ``num_requests``): with all N decoding one
    token a step, about 0.2 finish per step. ``population`` admits the first N at a
    uniform point of their life; ``arrival(k)`` is the k-th replacement.
    """

    def __init__(self, num_requests: int, num_blocks: int, seed: int = 1) -> None:
        self.num_requests = num_requests
        self.num_blocks = num_blocks
        self.seed = seed
        rng = np.random.default_rng([seed, 0])
        self.system_prompts = [
            rng.integers(3, 30_000, SYSTEM_PROMPT_TOKENS).tolist()
            for _ in range(NUM_SYSTEM_PROMPTS)
        ]

    def _spec(self, kind: int, index: int, *, aged: bool) -> RequestSpec:
        rng = np.random.default_rng([self.seed, kind, index])
        length = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        prompt: list[int] = []
        if rng.random() < 0.5:
            prompt += self.system_prompts[int(rng.integers(NUM_SYSTEM_PROMPTS))]
        prompt += rng.integers(3, 30_000, length - len(prompt)).tolist()
        n = self.num_requests
        lifetime = int(rng.integers(4 * n, 6 * n + 1))
        max_tokens = lifetime
        if aged:  # generated so far: part of the prompt, as if it had run that long
            age = int(rng.integers(0, lifetime))
            prompt += rng.integers(3, 30_000, age).tolist()
            max_tokens = lifetime - age
        name = ("pop", "new")[kind - 1]
        return RequestSpec(f"{name}-{index}", prompt, max_tokens)

    def population(self) -> list[RequestSpec]:
        return [self._spec(1, index, aged=True) for index in range(self.num_requests)]

    def arrival(self, index: int) -> RequestSpec:
        return self._spec(2, index, aged=False)

    def fillers(self, population: Sequence[RequestSpec]) -> list[RequestSpec]:
        """One-token requests that pass through the pool's part the population leaves free."""
        live = sum(-(-len(spec.prompt) // BLOCK_SIZE) for spec in population)
        free = max(0, self.num_blocks - 1 - live)
        count = free * BLOCK_SIZE // FILLER_TOKENS
        rng = np.random.default_rng([self.seed, 3])
        return [
            RequestSpec(f"fill-{index}", rng.integers(3, 30_000, FILLER_TOKENS).tolist(), 1)
            for index in range(count)
        ]


# --- vLLM's scheduler, built as EngineCore builds it ----------------------------------------
def make_scheduler(
    cls: type[Scheduler], *, num_requests: int, num_blocks: int, prefix_caching: bool
) -> Scheduler:
    return build_scheduler(
        cls,
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        max_num_seqs=num_requests,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=prefix_caching,
        async_scheduling=issubclass(cls, AsyncScheduler),
    )


class VllmScheduleTimer(Scheduler):
    """Times vLLM's own ``schedule()`` inside ``DefragScheduler.schedule`` (it comes right
    before vLLM's ``Scheduler`` in the bench class's MRO): the rest of that call is
    kvdefrag's own code on the engine core's thread."""

    inner_s: tuple[float, float] = (0.0, 0.0)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        output = super().schedule(*args, **kwargs)
        self.inner_s = (time.perf_counter() - wall, time.thread_time() - cpu)
        return output


def one_service_class(base: type[DefragScheduler], rank: PublishedRank) -> type[DefragScheduler]:
    """``base`` stepping the one service ``rank`` names (the bench's only rank), with
    vLLM's part of ``schedule()`` timed (``VllmScheduleTimer``)."""

    def kvdefrag_ranks(self: DefragScheduler) -> list[PublishedRank]:
        return [rank]

    cls = type(
        f"Bench{base.__name__}",
        (base, VllmScheduleTimer),
        {"kvdefrag_ranks": kvdefrag_ranks},
    )
    mro = cls.__mro__
    assert mro.index(VllmScheduleTimer) + 1 == mro.index(Scheduler), mro
    return cls


class GcClock:
    """Seconds the garbage collector has run in this process (``gc.callbacks``), so an
    iteration's share of it is the difference across the iteration's timed calls."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started


GC_CLOCK = GcClock()


@dataclasses.dataclass
class Samples:
    """Durations, in seconds, by the wall clock and by the thread's CPU clock."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    def summary(self) -> dict[str, dict[str, float]]:
        return {"wall": _summary_ms(self.wall), "cpu": _summary_ms(self.cpu)}


def _summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    if not samples_s:
        return {"p50": 0.0, "mean": 0.0, "p99": 0.0}
    ordered = sorted(samples_s)
    last = len(ordered) - 1
    return {
        "p50": ordered[round(0.50 * last)] * 1e3,
        "mean": statistics.fmean(ordered) * 1e3,
        "p99": ordered[round(0.99 * last)] * 1e3,
    }


def _tail(side: Side) -> dict[str, float]:
    """What the slowest iterations (at or above the wall clock's p99) are made of: their
    mean wall and CPU time, and the collector's share; the collector over every iteration."""
    wall, cpu, gc_s = side.iteration.wall, side.iteration.cpu, side.gc_s
    cutoff = sorted(wall)[round(0.99 * (len(wall) - 1))]
    slow = [i for i, value in enumerate(wall) if value >= cutoff]
    return {
        "slow_wall_ms": statistics.fmean(wall[i] for i in slow) * 1e3,
        "slow_cpu_ms": statistics.fmean(cpu[i] for i in slow) * 1e3,
        "slow_gc_ms": statistics.fmean(gc_s[i] for i in slow) * 1e3,
        "gc_ms_mean": statistics.fmean(gc_s) * 1e3,
        "gc_iterations": sum(1 for value in gc_s if value > 0),
    }


def _paired_ms(kvdefrag: Sequence[float], vllm: Sequence[float]) -> dict[str, float]:
    """What kvdefrag adds, iteration by iteration (the two run the same step, back to
    back): median and mean of the differences."""
    differences = [a - b for a, b in zip(kvdefrag, vllm, strict=True)]
    return {
        "median": statistics.median(differences) * 1e3,
        "mean": statistics.fmean(differences) * 1e3,
    }


# --- the worker stand-in ---------------------------------------------------------------------
class V1RunnerRows:
    """vLLM 0.33's V1 runner as far as its rows go (``gpu_model_runner._update_states`` and
    ``InputBatch``): ``requests[id].block_ids`` and the persistent batch's block table
    (``input_batch.block_table.block_tables[0]``: ``block_table.np``, ``num_blocks_per_row``,
    ``req_ids``, ``req_id_to_index``), rows added at the lowest free index and condensed
    after each step."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int) -> None:
        self.requests: dict[str, SimpleNamespace] = {}
        self.table = np.zeros((max_num_reqs, max_num_blocks), dtype=np.int32)
        self.lengths = np.zeros(max_num_reqs, dtype=np.int32)
        block_table = SimpleNamespace(
            block_table=SimpleNamespace(np=self.table), num_blocks_per_row=self.lengths
        )
        self.input_batch = SimpleNamespace(
            block_table=SimpleNamespace(block_tables=[block_table]),
            req_ids=[],
            req_id_to_index={},
        )
        self._removed: list[int] = []

    def update_states(self, output: Any) -> None:
        batch = self.input_batch
        for request_id in output.finished_req_ids:
            self.requests.pop(request_id, None)
            self._remove(request_id)
        cached = output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        scheduled = output.num_scheduled_tokens.keys()
        for request_id in batch.req_id_to_index.keys() - (scheduled - resumed):
            self._remove(request_id)
        to_add: list[str] = []
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(
                block_ids=tuple(list(group) for group in new.block_ids)
            )
            to_add.append(new.req_id)
        for position, request_id in enumerate(cached.req_ids):
            state = self.requests[request_id]
            new_ids = cached.new_block_ids[position]
            if request_id in resumed:
                state.block_ids = tuple(list(group) for group in new_ids)
            elif new_ids is not None:
                for held, appended in zip(state.block_ids, new_ids, strict=True):
                    held.extend(appended)
            index = batch.req_id_to_index.get(request_id)
            if index is None:
                to_add.append(request_id)
            elif new_ids is not None and new_ids[0]:
                start = int(self.lengths[index])
                self.table[index, start : start + len(new_ids[0])] = new_ids[0]
                self.lengths[index] = start + len(new_ids[0])
        for request_id in to_add:
            self._add(request_id)
        self._condense()

    def _remove(self, request_id: str) -> None:
        index = self.input_batch.req_id_to_index.pop(request_id, None)
        if index is None:
            return
        self.input_batch.req_ids[index] = None
        self.lengths[index] = 0
        heapq.heappush(self._removed, index)

    def _add(self, request_id: str) -> None:
        req_ids = self.input_batch.req_ids
        if self._removed:
            index = heapq.heappop(self._removed)
        else:
            index = len(req_ids)
            req_ids.append(None)
        req_ids[index] = request_id
        self.input_batch.req_id_to_index[request_id] = index
        row = self.requests[request_id].block_ids[0]
        self.table[index, : len(row)] = row
        self.lengths[index] = len(row)

    def _condense(self) -> None:
        """Slides the last rows into the empty ones below them (``InputBatch.condense``)."""
        req_ids = self.input_batch.req_ids
        index_of = self.input_batch.req_id_to_index
        empty = sorted(self._removed)
        self._removed.clear()
        last = len(req_ids) - 1
        for hole in empty:
            while last >= 0 and req_ids[last] is None:
                last -= 1
            if hole >= last:
                break
            request_id = req_ids[last]
            length = int(self.lengths[last])
            self.table[hole, :length] = self.table[last, :length]
            self.lengths[hole] = length
            self.lengths[last] = 0
            req_ids[hole], req_ids[last] = request_id, None
            index_of[request_id] = hole
            last -= 1
        del req_ids[len(index_of) :]


class WorkerStandIn:
    """One rank's worker without the model: with its rank's service (``handle``),
    ``DefragWorkerMixin.execute_model``; without, vLLM's own row bookkeeping alone."""

    def __init__(self, handle: ServerHandle | None, num_blocks: int, max_num_reqs: int) -> None:
        self.handle = handle
        self.translator = None if handle is None else BlockIdTranslator(handle, num_blocks)
        self.runner = V1RunnerRows(max_num_reqs, MAX_MODEL_LEN // BLOCK_SIZE)
        self.wait_s: list[float] = []
        self.pass_s = Samples()
        self.num_remaps = 0
        self.num_rewritten = 0  # row entries remap_v1_runner_rows rewrote

    def execute(self, sent: Any, *, timed: bool) -> None:
        """One pass over ``sent``, the worker's copy of an output, once its step's reply
        is in (as under async scheduling, where the forward pass before covers it)."""
        if self.handle is None or self.translator is None:
            self.runner.update_states(sent)
            return
        clock, cpu_clock = time.perf_counter, time.thread_time
        started, started_cpu = clock(), cpu_clock()
        wait_for_planned_step(self.handle, 0, sent, STEP_WAIT_S)
        waited = clock()
        with self.handle.kv_lock:
            mapping, remap = self.translator.advance()
            num_rewritten = 0 if remap is None else remap_v1_runner_rows(self.runner, remap)
            translate_scheduler_output(sent, mapping)
            done, done_cpu = clock(), cpu_clock()
            self.runner.update_states(sent)  # vLLM's own part of the pass
        if timed:
            self.wait_s.append(waited - started)
            self.pass_s.add(done - started, done_cpu - started_cpu)
            self.num_remaps += remap is not None
            self.num_rewritten += num_rewritten

    def rows_mismatching(self, scheduler: Scheduler) -> int:
        """Requests whose rows (either copy) are not the physical ids of vLLM's list."""
        assert self.handle is not None
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        batch = self.runner.input_batch
        bad = 0
        with self.handle.kv_lock:
            for request_id, index in batch.req_id_to_index.items():
                blocks = manager.req_to_blocks.get(request_id)
                if not blocks:
                    continue
                logical = np.array([block.block_id for block in blocks], dtype=np.int64)
                physical = self.handle.resolve(logical).tolist()
                row = self.runner.table[index, : int(self.runner.lengths[index])].tolist()
                state = self.runner.requests[request_id].block_ids[0]
                bad += not (row == physical == list(state))
        return bad


# --- one scheduler driven through the workload ---------------------------------------------
class Side:
    """One scheduler (vLLM alone or with kvdefrag) in the loop, and what it measured."""

    def __init__(
        self,
        name: str,
        scheduler: Scheduler,
        workload: Workload,
        *,
        prefix_caching: bool,
        worker: WorkerStandIn,
    ) -> None:
        self.name = name
        self.scheduler = scheduler
        self.workload = workload
        self.worker = worker
        self.in_flight = 2 if isinstance(scheduler, AsyncScheduler) else 1
        self.queue: deque[tuple[Any, ModelRunnerOutput]] = deque()
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256) if prefix_caching else None
        self.num_arrivals = 0
        self.num_steps = 0
        self.num_preempted = 0
        self.num_finished = 0
        self.records: list[int] = []
        self.num_with_blocks: list[int] = []  # requests that got blocks, per step
        self.iteration = Samples()
        self.parts = {name: Samples() for name in ("schedule", "vllm_schedule", "update")}
        self.own = Samples()  # kvdefrag's own code in schedule()
        self.gc_s: list[float] = []  # the collector's time inside each timed iteration
        self.reply_s: list[float] = []
        self.profiler: cProfile.Profile | None = None
        self.rows_mismatching = -1

    def add(self, spec: RequestSpec) -> None:
        self.scheduler.add_request(
            Request(
                request_id=spec.request_id,
                prompt_token_ids=list(spec.prompt),
                sampling_params=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )

    def top_up(self) -> None:
        """Replaces the requests that finished: ``num_requests`` stay in the scheduler."""
        running, waiting = self.scheduler.get_request_counts()
        for _ in range(self.workload.num_requests - running - waiting):
            self.add(self.workload.arrival(self.num_arrivals))
            self.num_arrivals += 1

    @property
    def is_prefilling(self) -> bool:
        scheduler = self.scheduler
        return bool(scheduler.waiting) or any(
            request.is_prefill_chunk or request.num_computed_tokens < request.num_prompt_tokens
            for request in scheduler.running
        )

    def step(self, *, timed: bool, check: bool = False) -> None:
        """One engine-core iteration; times ``schedule()`` + ``update_from_output()``.

        ``check``: right after ``schedule()`` (where the ledger and vLLM agree; a request
        that stops in ``update_from_output`` is released at the next ``schedule()``), audit
        the ledger and compare the worker's rows with vLLM's lists.
        """
        scheduler = self.scheduler
        clock, cpu_clock = time.perf_counter, time.thread_time
        profiler = self.profiler if timed else None
        if profiler is not None:
            profiler.enable()
        gc_before = GC_CLOCK.total_s
        started, started_cpu = clock(), cpu_clock()
        output = scheduler.schedule()
        scheduled, scheduled_cpu = clock(), cpu_clock()
        gc_s = GC_CLOCK.total_s - gc_before
        if profiler is not None:
            profiler.disable()
        schedule_wall, schedule_cpu = scheduled - started, scheduled_cpu - started_cpu
        runner_output = self._sample(output)
        self._record(output)
        # NOTE: what vLLM does between the two calls, not timed, for both schedulers:
        # the executor hands each worker its copy and the forward pass runs, meanwhile
        # the rank threads take kvdefrag's replies (waited for here, so that neither the
        # service nor the replies run inside a timed call). The worker's pass runs here
        # too, so that both schedulers meet update_from_output() after a gap that leaves
        # the caches alike; in vLLM it runs in another process.
        sent = pickle.loads(pickle.dumps(output))
        if isinstance(scheduler, DefragScheduler):
            scheduler.kvdefrag.settle()
            if timed:
                self.reply_s.append(clock() - scheduled)
                inner_wall, inner_cpu = scheduler.inner_s
                self.own.add(schedule_wall - inner_wall, schedule_cpu - inner_cpu)
            if check:
                scheduler.kvdefrag_audit()  # raises LedgerDiverged on any difference
        self.worker.execute(sent, timed=timed)
        if check and isinstance(scheduler, DefragScheduler):
            self.rows_mismatching = self.worker.rows_mismatching(scheduler)
        self.queue.append((output, runner_output))
        update_wall = update_cpu = 0.0
        if len(self.queue) >= self.in_flight:
            done, done_output = self.queue.popleft()
            if profiler is not None:
                profiler.enable()
            gc_before = GC_CLOCK.total_s
            begun, begun_cpu = clock(), cpu_clock()
            scheduler.update_from_output(done, done_output)
            update_wall, update_cpu = clock() - begun, cpu_clock() - begun_cpu
            gc_s += GC_CLOCK.total_s - gc_before
            if profiler is not None:
                profiler.disable()
        self.num_steps += 1
        if timed:
            self.iteration.add(schedule_wall + update_wall, schedule_cpu + update_cpu)
            self.gc_s.append(gc_s)
            self.parts["schedule"].add(schedule_wall, schedule_cpu)
            self.parts["update"].add(update_wall, update_cpu)
            inner = getattr(scheduler, "inner_s", None)
            self.parts["vllm_schedule"].add(*(inner or (schedule_wall, schedule_cpu)))

    def _sample(self, output: Any) -> ModelRunnerOutput:
        """One token for every scheduled request that is past its prompt."""
        requests = self.scheduler.requests
        request_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=[
                [] if requests[request_id].is_prefill_chunk else [SAMPLED_TOKEN]
                for request_id in request_ids
            ],
        )

    def _record(self, output: Any) -> None:
        new_block_ids = output.scheduled_cached_reqs.new_block_ids
        self.num_with_blocks.append(
            len(output.scheduled_new_reqs) + len(new_block_ids) - new_block_ids.count(None)
        )
        preempted = len(output.preempted_req_ids or ())
        self.num_preempted += preempted
        self.num_finished += len(output.finished_req_ids)
        self.records.append(
            hash(
                (
                    frozenset(output.num_scheduled_tokens.items()),
                    preempted,
                    frozenset(output.finished_req_ids),
                )
            )
        )

    def live_blocks(self) -> int:
        manager = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        return len(
            {block.block_id for blocks in manager.req_to_blocks.values() for block in blocks}
        )


# --- one configuration ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    num_requests: int
    num_blocks: int
    prefix_caching: bool
    is_async: bool

    @property
    def label(self) -> str:
        mode = "async" if self.is_async else "sync"
        return (
            f"{self.num_requests}/{self.num_blocks // 1024}k {mode} APC "
            f"{'on' if self.prefix_caching else 'off'}"
        )


def run_config(
    config: Config, iterations: int, run_dir: str, profile: bool = False
) -> dict[str, Any]:
    """Warms both schedulers up in lockstep, then times ``iterations`` interleaved."""
    progress(f"{config.label}: building")
    workload = Workload(config.num_requests, config.num_blocks)
    key = torch.zeros(config.num_blocks * BLOCK_SIZE, 1, dtype=torch.uint8)
    socket_path = os.path.join(run_dir, f"rank0-{config.num_blocks}.sock")
    secret = secrets.token_bytes(IDENTITY_SECRET_BYTES)
    handle = serve_in_process(
        [(key, None)],
        BLOCK_SIZE,
        service_config=ServiceConfig(address=f"unix:{socket_path}"),
        identity_secret=secret,
    )
    try:
        rank = PublishedRank(handle.address, secret)
        return _run_config(config, workload, handle, rank, iterations, profile)
    finally:
        handle.stop(grace_s=0.5)


def _run_config(
    config: Config,
    workload: Workload,
    handle: ServerHandle,
    rank: PublishedRank,
    iterations: int,
    profile: bool,
) -> dict[str, Any]:
    vllm_cls: type[Scheduler] = AsyncScheduler if config.is_async else Scheduler
    defrag_base = DefragAsyncScheduler if config.is_async else DefragScheduler
    defrag_cls = one_service_class(defrag_base, rank)
    sizes = {
        "num_requests": config.num_requests,
        "num_blocks": config.num_blocks,
        "prefix_caching": config.prefix_caching,
    }
    base = Side(
        "vllm",
        make_scheduler(vllm_cls, **sizes),
        workload,
        prefix_caching=config.prefix_caching,
        worker=WorkerStandIn(None, config.num_blocks, config.num_requests),
    )
    defrag_scheduler = make_scheduler(defrag_cls, **sizes)
    defrag = Side(
        "kvdefrag",
        defrag_scheduler,
        workload,
        prefix_caching=config.prefix_caching,
        worker=WorkerStandIn(handle, config.num_blocks, config.num_requests),
    )
    sides = (base, defrag)
    population = workload.population()
    fillers = workload.fillers(population)
    progress(f"{config.label}: warming up ({len(fillers)} fillers, then {len(population)})")
    for side in sides:
        for spec in fillers:
            side.add(spec)
    while any(side.scheduler.has_requests() or side.queue for side in sides):
        for side in sides:
            if side.scheduler.has_requests():
                side.step(timed=False)
            elif side.queue:  # the last output in flight
                done, done_output = side.queue.popleft()
                side.scheduler.update_from_output(done, done_output)
    for side in sides:
        for spec in population:
            side.add(spec)
    warm = 0
    while warm < WARM_DECODE_STEPS:
        for side in sides:
            side.top_up()
            side.step(timed=False)
        warm = 0 if any(side.is_prefilling for side in sides) else warm + 1
    warm_steps = [side.num_steps for side in sides]
    live_before = defrag.live_blocks()
    totals_before = handle.stats().totals
    steps_before = defrag_scheduler.kvdefrag.totals.num_steps
    if profile:
        base.profiler, defrag.profiler = cProfile.Profile(), cProfile.Profile()
    progress(f"{config.label}: timing {iterations} iterations")
    # NOTE: as vLLM's engine core does once it has started (freeze_gc_heap).
    gc.collect()
    gc.freeze()
    try:
        for index in range(iterations):
            for side in sides if index % 2 == 0 else sides[::-1]:
                side.top_up()
                side.step(timed=True)
    finally:
        gc.unfreeze()
    live_after = defrag.live_blocks()
    for side in sides:  # not timed: the checks
        side.top_up()
        side.step(timed=False, check=True)
    defrag_scheduler.kvdefrag.settle()
    client = defrag_scheduler.kvdefrag.ranks.clients[0]
    service_digest = client.stats().digest
    worker = defrag.worker
    assert worker is not None
    stats = handle.stats()
    bridge = defrag_scheduler.kvdefrag.totals
    result: dict[str, Any] = {
        "label": config.label,
        **dataclasses.asdict(config),
        "iterations": iterations,
        "warm_steps": warm_steps,
        "live_blocks": [live_before, live_after],
        "vllm": base.iteration.summary(),
        "kvdefrag": defrag.iteration.summary(),
        "added": {
            "wall": _paired_ms(defrag.iteration.wall, base.iteration.wall),
            "cpu": _paired_ms(defrag.iteration.cpu, base.iteration.cpu),
        },
        "own": defrag.own.summary(),
        "parts": {
            side.name: {name: samples.summary() for name, samples in side.parts.items()}
            for side in sides
        },
        "with_blocks_per_step": statistics.fmean(defrag.num_with_blocks[-iterations - 1 :]),
        "tail": {side.name: _tail(side) for side in sides},
        "worker_pass": worker.pass_s.summary(),
        "worker_wait": _summary_ms(worker.wait_s),
        "reply": _summary_ms(defrag.reply_s),
        "worker_remaps": worker.num_remaps,
        "worker_rewritten": worker.num_rewritten,
        "steps": [base.num_steps, defrag.num_steps],
        "preempted": [base.num_preempted, defrag.num_preempted],
        "finished": [base.num_finished, defrag.num_finished],
        "steps_differing": sum(a != b for a, b in zip(base.records, defrag.records, strict=False))
        + abs(len(base.records) - len(defrag.records)),
        "digest_matches": service_digest == client.digest,
        "audit_ok": True,
        "rows_mismatching": defrag.rows_mismatching,
        "kvdefrag_steps_sent": bridge.num_steps - steps_before,
        "moves": stats.totals.num_moves - totals_before.num_moves,
        "two_way_moves": stats.totals.num_two_way_moves - totals_before.num_two_way_moves,
        "placements": stats.totals.num_placements - totals_before.num_placements,
        "defrag_runs": stats.totals.num_defrag_runs - totals_before.num_defrag_runs,
    }
    if profile:
        result["profiles"] = {side.name: side.profiler for side in sides}
    for side in sides:
        side.scheduler.shutdown()
    return result


# --- the report ------------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def _mode(run: dict[str, Any]) -> str:
    return (
        f"{'async' if run['is_async'] else 'sync'} APC {'on' if run['prefix_caching'] else 'off'}"
    )


def _three(summary: dict[str, float]) -> str:
    return f"{summary['p50']:.2f}/{summary['mean']:.2f}/{summary['p99']:.2f}"


def _two(summary: dict[str, float], first: str = "p50", second: str = "mean") -> str:
    return f"{summary[first]:.2f}/{summary[second]:.2f}"


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _size(run: dict[str, Any]) -> str:
    return f"{run['num_requests']}/{run['num_blocks'] // 1024}k"


CLOCKS = (("wall", "wall clock"), ("cpu", "the engine core thread's CPU time"))


def report(runs: list[dict[str, Any]], iterations: int) -> str:
    lines = [
        "== kvdefrag in vLLM 0.33's scheduler at scale: one iteration = schedule() + "
        "update_from_output()",
        f"   {iterations} timed iterations per row; vLLM alone and with kvdefrag in one "
        "process, in lockstep, interleaved",
    ]
    for clock, title in CLOCKS:
        lines.append(f"   {title}, ms:")
        rows = []
        for run in runs:
            vllm, kvd = run["vllm"][clock], run["kvdefrag"][clock]
            rows.append(
                [
                    _size(run),
                    _mode(run),
                    f"{run['live_blocks'][1] / run['num_blocks']:.0%}",
                    _three(vllm),
                    _three(kvd),
                    "/".join(f"{kvd[name] / vllm[name]:.2f}" for name in ("p50", "mean", "p99")),
                    f"{run['added'][clock]['median']:+.3f}/{run['added'][clock]['mean']:+.3f}",
                    f"{run['own'][clock]['p50']:.3f}/{run['own'][clock]['mean']:.3f}",
                    _three(run["worker_pass"][clock]),
                    _two(run["reply"], "p50", "p99") if clock == "wall" else "",
                ]
            )
        lines.append(
            _table(
                [
                    "size",
                    "mode",
                    "live",
                    "vLLM p50/mean/p99",
                    "kvdefrag p50/mean/p99",
                    "ratio p50/mean/p99",
                    "added med/mean",
                    "own p50/mean",
                    "worker p50/mean/p99",
                    "round trip p50/p99",
                ],
                rows,
            )
        )
    rows = []
    for run in runs:
        tails = run["tail"]
        rows.append(
            [
                _size(run),
                _mode(run),
                *(
                    f"{tail['slow_wall_ms']:.2f}/{tail['slow_cpu_ms']:.2f}/{tail['slow_gc_ms']:.2f}"
                    for tail in (tails["vllm"], tails["kvdefrag"])
                ),
                *(
                    f"{tail['gc_ms_mean']:.3f} ({tail['gc_iterations']})"
                    for tail in (tails["vllm"], tails["kvdefrag"])
                ),
            ]
        )
    lines.append("   the slowest iterations (wall >= p99), mean ms: wall/CPU/garbage collector")
    lines.append(
        _table(
            [
                "size",
                "mode",
                "vLLM wall/CPU/GC",
                "kvdefrag wall/CPU/GC",
                "vLLM GC mean (iterations)",
                "kvdefrag GC mean (iterations)",
            ],
            rows,
        )
    )
    lines += [
        "   live: blocks held by requests at the end, of the pool; added: kvdefrag's "
        "iteration minus vLLM's, paired",
        "   (the same step, back to back); own: kvdefrag's code inside schedule() (read the "
        "changes, plan, send, stamp);",
        "   worker: its pass (wait_for_planned_step on an applied step; under kv_lock advance, "
        "remap_v1_runner_rows,",
        "   translate); round trip: from schedule()'s return to the step's replies checked "
        "(in vLLM the forward pass covers it)",
        "",
        "== flat: what kvdefrag adds per iteration, mean (ms), by size",
    ]
    rows = []
    for clock, _ in CLOCKS:
        for mode_runs in _by_mode(runs).values():
            first, last = mode_runs[0], mode_runs[-1]
            added = [run["added"][clock]["mean"] for run in mode_runs]
            own = [run["own"][clock]["mean"] for run in mode_runs]
            changed = [run["with_blocks_per_step"] for run in mode_runs]
            rows.append(
                [
                    clock,
                    _mode(first),
                    " ".join(f"{value:.1f}" for value in changed),
                    " ".join(f"{value:+.3f}" for value in added),
                    _ratio(last["added"][clock]["mean"], first["added"][clock]["mean"]),
                    " ".join(f"{value:.3f}" for value in own),
                    _ratio(last["own"][clock]["mean"], first["own"][clock]["mean"]),
                ]
            )
    sizes = " ".join(_size(run) for run in next(iter(_by_mode(runs).values())))
    lines.append(
        _table(
            [
                "clock",
                "mode",
                "requests given blocks/step",
                f"added ({sizes})",
                "last/first",
                f"own ({sizes})",
                "last/first",
            ],
            rows,
        )
    )
    lines.append("")
    lines.append("== checks (vLLM alone / with kvdefrag; the service against its client)")
    rows = []
    for run in runs:
        rows.append(
            [
                _size(run),
                _mode(run),
                "{}/{}".format(*run["steps"]),
                "{}/{}".format(*run["preempted"]),
                "{}/{}".format(*run["finished"]),
                str(run["steps_differing"]),
                _yes(run["digest_matches"]),
                _yes(run["audit_ok"]),
                str(run["rows_mismatching"]),
                str(run["kvdefrag_steps_sent"]),
                str(run["moves"]),
                str(run["two_way_moves"]),
                str(run["worker_remaps"]),
                str(run["worker_rewritten"]),
            ]
        )
    lines.append(
        _table(
            [
                "size",
                "mode",
                "steps",
                "preempted",
                "finished",
                "steps differing",
                "digest",
                "audit",
                "rows off",
                "kvd steps",
                "moves",
                "swaps",
                "remaps",
                "rewritten",
            ],
            rows,
        )
    )
    lines.append(
        "   steps etc. since the start; kvd steps, moves (swaps: two-way), remaps (worker "
        "passes whose rows follow moves) and rewritten"
    )
    lines.append("   (row entries those remaps rewrote) in the timed window")
    lines.append("")
    lines.append("== goals (ratios of measurements taken in this run)")
    lines.append(_table(["what", "wall", "CPU", "goal", "met wall/CPU"], goals(runs)))
    return "\n".join(lines)


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x" if baseline > 0 else "n/a"


def _by_mode(runs: list[dict[str, Any]]) -> dict[tuple[bool, bool], list[dict[str, Any]]]:
    modes: dict[tuple[bool, bool], list[dict[str, Any]]] = {}
    for run in runs:
        modes.setdefault((run["is_async"], run["prefix_caching"]), []).append(run)
    return modes


def goals(runs: list[dict[str, Any]]) -> list[list[str]]:
    rows: list[list[str]] = []

    def row(what: str, cells: dict[str, tuple[str, bool]], goal: str) -> None:
        rows.append(
            [
                what,
                cells["wall"][0],
                cells["cpu"][0],
                goal,
                "/".join(_yes(cells[clock][1]) for clock, _ in CLOCKS),
            ]
        )

    at_goal = [run for run in runs if run["num_requests"] == GOAL_SIZE]
    for run in at_goal:
        for name, goal in (("p50", GOAL_RATIO), ("mean", GOAL_RATIO), ("p99", GOAL_RATIO_P99)):
            cells = {}
            for clock, _ in CLOCKS:
                kvd, vllm = run["kvdefrag"][clock][name], run["vllm"][clock][name]
                cells[clock] = (f"{kvd:.2f}/{vllm:.2f} = {kvd / vllm:.2f}x", kvd / vllm <= goal)
            row(f"iteration {_size(run)} {_mode(run)}, {name}", cells, f"<= {goal}x")
    for mode_runs in _by_mode(runs).values():
        first, last = mode_runs[0], mode_runs[-1]
        if (first["num_requests"], last["num_requests"]) != (SIZES[0][0], SIZES[-1][0]):
            continue
        cells = {}
        for clock, _ in CLOCKS:
            big, small = last["added"][clock]["mean"], first["added"][clock]["mean"]
            ratio = big / small if small > 0 else float("inf")
            cells[clock] = (f"{big:.3f}/{small:.3f} = {ratio:.2f}x", ratio <= GOAL_FLAT)
        row(
            f"added {_size(last)} over {_size(first)} {_mode(last)}, mean",
            cells,
            f"<= {GOAL_FLAT}x",
        )
    for run in at_goal:
        cells = {}
        for clock, _ in CLOCKS:
            worker = run["worker_pass"][clock]
            cells[clock] = (
                f"{worker['p50']:.3f}/{worker['mean']:.3f} ms",
                worker["mean"] <= GOAL_WORKER_MS,
            )
        row(
            f"worker pass {_size(run)} {_mode(run)}, p50/mean",
            cells,
            f"mean <= {GOAL_WORKER_MS} ms",
        )
    return rows


def print_profiles(runs: list[dict[str, Any]], limit: int) -> None:
    """cProfile's view of the timed iterations (its own overhead inflates every figure)."""
    for run in runs:
        for name, profiler in run.pop("profiles", {}).items():
            print(f"\n== cProfile, {run['label']}, {name}: timed iterations, by own time")
            stats = pstats.Stats(profiler, stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(limit)
            if name == "kvdefrag":
                print(f"-- {name}: kvdefrag's functions, by cumulative time")
                stats.sort_stats("cumulative").print_stats(r"kvdefrag/|vllm_scale", limit)
                print(f"-- {name}: kvdefrag's functions, by own time")
                stats.sort_stats("tottime").print_stats(r"kvdefrag/", limit)
                stats.print_callers(r"isinstance|builtins.all|builtins.len", 12)


# --- main --------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations per row")
    parser.add_argument("--iterations", type=int, default=0, help="iterations per row")
    parser.add_argument(
        "--sizes", default="", help="request counts to run, comma-separated (64,256,512)"
    )
    parser.add_argument("--modes", default="", help="sync,async (default both)")
    parser.add_argument("--apc", default="", help="off,on (default both)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed iterations")
    parser.add_argument("--profile-limit", type=int, default=30)
    parser.add_argument("--out", default="out/bench-vllm.json", help="where to write the JSON")
    args = parser.parse_args(argv)
    iterations = args.iterations or (60 if args.quick else 200)
    wanted_sizes = {int(s) for s in args.sizes.split(",") if s}
    wanted_modes = set(args.modes.split(",")) if args.modes else {"sync", "async"}
    wanted_apc = set(args.apc.split(",")) if args.apc else {"off", "on"}
    configs = [
        Config(num_requests, num_blocks, prefix_caching, is_async)
        for num_requests, num_blocks in SIZES
        if not wanted_sizes or num_requests in wanted_sizes
        for prefix_caching in (False, True)
        if ("on" if prefix_caching else "off") in wanted_apc
        for is_async in (False, True)
        if ("async" if is_async else "sync") in wanted_modes
    ]
    print(
        f"kvdefrag in vLLM's scheduler at scale on {platform.machine()}, python "
        f"{platform.python_version()}, torch {torch.__version__}"
        + (" [--quick]" if args.quick else ""),
        flush=True,
    )
    init_none_hash(sha256)
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvdefrag-bench-") as run_dir:
        # NOTE: the schedulers read their settings at start, the run directory included,
        # though the bench hands them its in-process rank itself.
        os.environ.setdefault(RUN_DIR_ENV, run_dir)
        for config in configs:
            runs.append(run_config(config, iterations, run_dir, profile=args.profile))
    if args.profile:
        print_profiles(runs, args.profile_limit)
    print(report(runs, iterations))
    elapsed = time.perf_counter() - started
    print(f"(took {elapsed:.0f} s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"quick": args.quick, "runs": runs, "elapsed_s": elapsed}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
