"""A synthetic vLLM scheduler: realistic block events for demos, tests and benchmarks.

Pure Python (no numpy, no torch). Requests arrive as a Poisson process with heavy-tailed
prompt and output lengths; a simplified vLLM v1 scheduler (token budget, chunked prefill,
preemption of the newest running request) asks a block pool for KV blocks, and the pool
hands out block ids exactly the way vLLM 0.33's ``BlockPool`` does::

    free queue (front is allocated first)
    front                                                                   tail
      | freed, never cached | untouched: 1, 2, 3, ...  | freed, cached (LRU) |
        ^ prepended on free                               ^ appended on free

    * the queue starts as 1, 2, 3, ... (block 0 is the null block, never handed out);
    * allocation pops from the front; a popped block that still has a prefix-cache
      entry loses it (it is *evicted*);
    * a request frees its blocks last-block-first: blocks without a cache entry go to
      the front, cached ones to the tail, so they are evicted last-block-first;
    * a prefix-cache hit on a free block takes it out of the queue (ref count 0 -> 1).

``WorkloadConfig.free_order="fifo"`` flips where freed blocks go to what earlier vLLM v1
releases did (the ones vllm-gaudi pinned): every freed block is appended at the tail, so
a freed id is reused only after every other free block (``kvdefrag.tools._block_pool``).

Each scheduling iteration yields a ``WorkloadStep`` whose ``events`` are what
``Engine.step`` / ``DefragClient.step`` take. The generator is deterministic for a
given configuration (seed included), and the request stream (arrivals and lengths) does
not depend on the pool size, so the same configuration with ``background_blocks`` set
to ``num_blocks - C`` gives the same events, shifted by a constant id offset, for every
pool size with ``C`` blocks of dynamic capacity.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Hashable, Iterable, Iterator

from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.tools._block_pool import FREE_ORDERS, BlockPool, FreeBlockQueue

__all__ = [
    "FREE_ORDERS",
    "BlockPool",
    "FreeBlockQueue",
    "SyntheticWorkload",
    "WorkloadConfig",
    "WorkloadStep",
    "generate_steps",
]


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the synthetic workload.

    Attributes:
        num_blocks: Blocks in the pool, null block included.
        block_size: Tokens per block.
        num_steps: Scheduling iterations that iterating the workload yields.
        arrival_rate: Mean request arrivals per step (Poisson process).
        initial_requests: Requests already waiting before the first step (warm start).
        prompt_len_median: Median length, in tokens, of a prompt's own part (lognormal).
        prompt_len_sigma: Sigma of the lognormal prompt length (heavier tail when larger).
        prompt_len_min: Shortest prompt, system prompt included.
        prompt_len_max: Longest prompt, system prompt included.
        output_len_scale: Shortest output; lengths are ``scale * Pareto(alpha)``.
        output_len_alpha: Pareto shape of output lengths (heavier tail when smaller).
        output_len_max: Longest output.
        enable_prefix_caching: Cache full blocks and share common prefixes (vLLM APC).
        num_system_prompts: Distinct system prompts shared by requests (popularity 1/k).
        system_prompt_len: Mean length of a system prompt, in tokens.
        system_prompt_fraction: Share of requests that start with a system prompt.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget of one step (chunked prefill).
        background_blocks: Blocks held, from the first step on, by parked long-context
            requests that never finish (they take ids 1..background_blocks).
        background_request_blocks: Blocks per background request.
        seed: Seed of the random stream.
        free_order: Where the pool puts freed blocks: ``"lifo"`` (vLLM 0.33: uncached
            ones at the front, reused first) or ``"fifo"`` (earlier vLLM v1: all at the
            tail, reused last).
    """

    num_blocks: int = 10_000
    block_size: int = 16
    num_steps: int = 3_000
    arrival_rate: float = 0.08
    initial_requests: int = 64
    prompt_len_median: int = 600
    prompt_len_sigma: float = 1.0
    prompt_len_min: int = 8
    prompt_len_max: int = 8_192
    output_len_scale: int = 260
    output_len_alpha: float = 1.4
    output_len_max: int = 4_096
    enable_prefix_caching: bool = False
    num_system_prompts: int = 4
    system_prompt_len: int = 400
    system_prompt_fraction: float = 0.6
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2_048
    background_blocks: int = 0
    background_request_blocks: int = 1_024
    seed: int = 0
    free_order: str = "lifo"

    def __post_init__(self) -> None:
        positive = ("num_blocks", "block_size", "prompt_len_min", "output_len_scale")
        for name in (*positive, "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_steps", "initial_requests", "background_blocks", "num_system_prompts"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.arrival_rate < 0:
            raise InvalidArgument(f"arrival_rate must be >= 0, got {self.arrival_rate}")
        if not 0.0 <= self.system_prompt_fraction <= 1.0:
            raise InvalidArgument(
                f"system_prompt_fraction must be in [0, 1], got {self.system_prompt_fraction}"
            )
        if self.prompt_len_max < self.prompt_len_min or self.output_len_max < 1:
            raise InvalidArgument(
                f"length bounds are empty: prompt [{self.prompt_len_min}, "
                f"{self.prompt_len_max}], output_len_max {self.output_len_max}"
            )
        if self.free_order not in FREE_ORDERS:
            raise InvalidArgument(
                f"free_order must be one of {', '.join(FREE_ORDERS)}, got {self.free_order!r}"
            )
        if self.background_request_blocks < 1:
            raise InvalidArgument(
                f"background_request_blocks must be >= 1, got {self.background_request_blocks}"
            )
        # NOTE: a request must fit in the pool on its own, or preempting everybody else
        # cannot make room for it and the scheduler would preempt forever.
        longest = _cdiv(self.prompt_len_max + self.output_len_max, self.block_size)
        if longest > self.dynamic_capacity:
            raise InvalidArgument(
                f"prompt_len_max + output_len_max ({self.prompt_len_max} + "
                f"{self.output_len_max} tokens) need {longest} blocks but only "
                f"{self.dynamic_capacity} are left for requests (num_blocks={self.num_blocks}, "
                f"background_blocks={self.background_blocks})"
            )

    @property
    def dynamic_capacity(self) -> int:
        """Blocks that requests other than the background ones can use."""
        return self.num_blocks - 1 - self.background_blocks


@dataclasses.dataclass(frozen=True)
class WorkloadStep:
    """One scheduling iteration's block events, plus bookkeeping for callers.

    Attributes:
        index: Step number, from 0.
        events: The step for kvdefrag. ``finished``: requests that finished in the
            previous iteration or were preempted in this one; ``new_blocks``: appended
            blocks (new requests included); ``resumed``: full block lists of requests
            resumed after preemption; ``fresh``: every newly allocated block (prefix-cache
            hits are not fresh, so it is never None); ``evicted`` (prefix caching):
            blocks whose prefix-cache entry was dropped to reuse them this step, and
            blocks freed without one (never full) that are still free, as the vLLM
            integration reports them.
        num_scheduled_tokens: Request id -> tokens computed this step.
        num_live_blocks: Blocks referenced once this step's events are applied (what a
            defragmenter counts as live; see ``SyntheticWorkload.block_tables``).
        max_live_block_id: Highest such block id (0 when none): without defragmentation,
            the number of blocks a contiguous-PA kernel reads is this plus one.
        num_running: Requests still running after this iteration (background excluded).
        num_waiting: Requests waiting after this iteration (preempted ones included).
        num_preempted: Requests preempted in this step.
        num_prefix_hit_blocks: Blocks reused from the prefix cache in this step.
    """

    index: int
    events: StepEvents
    num_scheduled_tokens: dict[str, int]
    num_live_blocks: int
    max_live_block_id: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_prefix_hit_blocks: int

    @property
    def fragmentation_ratio(self) -> float:
        """``max_live_block_id / num_live_blocks`` without defragmentation (1.0 = packed)."""
        return self.max_live_block_id / self.num_live_blocks if self.num_live_blocks else 1.0


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt_len: int
    output_len: int
    system_prompt: int | None
    system_prompt_len: int
    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    num_generated: int = 0
    num_cached_blocks: int = 0
    is_resuming: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    def block_key(self, index: int, block_size: int) -> Hashable:
        """Content key of the request's block ``index``: shared inside a system prompt.

        Keys stand for vLLM's chained block hashes: a block fully inside a system prompt
        has the same content in every request with that prompt; any later block depends
        on the request's own tokens.
        """
        if self.system_prompt is not None and (index + 1) * block_size <= self.system_prompt_len:
            return ("system", self.system_prompt, index)
        return ("request", self.request_id, index)


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class SyntheticWorkload:
    """A simplified vLLM v1 scheduler over a ``BlockPool``; iterate it for the steps.

    Per step: requests that finished in the previous iteration are reported; running
    requests (oldest first) get their next prefill chunk or one decode token, and when
    the pool runs out the newest running request is preempted (its blocks freed; it
    waits at the front of the queue and is later recomputed: its resumed list holds the
    prefix-cache hits followed by fresh blocks); waiting requests are admitted while the
    token budget, ``max_num_seqs`` and the pool allow, unless somebody was preempted.

    Example:
        >>> workload = SyntheticWorkload(WorkloadConfig(num_blocks=2_000, num_steps=5))
        >>> steps = list(workload)
        >>> sorted(steps[0].events.new_blocks["req-0"])[:3]
        [1, 2, 3]
    """

    def __init__(self, config: WorkloadConfig | None = None) -> None:
        self.config = config or WorkloadConfig()
        cfg = self.config
        self.pool = BlockPool(cfg.num_blocks, cfg.enable_prefix_caching, cfg.free_order)
        self._rng = random.Random(cfg.seed)
        self._system_prompt_lens = [
            max(cfg.block_size, round(cfg.system_prompt_len * self._rng.uniform(0.5, 1.5)))
            for _ in range(cfg.num_system_prompts)
        ]
        self._system_prompt_weights = [1.0 / (k + 1) for k in range(cfg.num_system_prompts)]
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
        self._background: dict[str, list[int]] = {}
        self._finished_pending: dict[str, list[int]] = {}
        # Blocks freed without a prefix-cache entry since the last step's events: their
        # content is worthless, so (prefix caching on) the step reports them evicted.
        self._freed_uncached: list[int] = []
        self._num_arrived = 0
        self._next_arrival = 0.0
        self._index = 0
        self._live_heap: list[int] = []
        self._in_heap = bytearray(cfg.num_blocks)
        for _ in range(cfg.initial_requests):
            self._waiting.append(self._new_request())
        self._draw_next_arrival()

    def __iter__(self) -> Iterator[WorkloadStep]:
        """Yields the remaining steps up to ``config.num_steps``."""
        while self._index < self.config.num_steps:
            yield self.step()

    @property
    def num_steps_done(self) -> int:
        return self._index

    def block_tables(self) -> dict[str, list[int]]:
        """Block ids of every request live after the last step's events, a copy.

        Background requests are included, and so are requests that finished in the last
        iteration: the pool has freed their blocks already, but the scheduler reports
        them only in the next step, so a defragmenter still counts them as live.
        """
        tables = {rid: list(ids) for rid, ids in self._background.items()}
        tables.update((req.request_id, list(req.block_ids)) for req in self._running)
        tables.update((rid, list(ids)) for rid, ids in self._finished_pending.items())
        return tables

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that keep a prefix-cache entry (their content must survive)."""
        pool = self.pool
        return [block_id for block_id in pool.free_queue if pool.block_key(block_id) is not None]

    # --- the step ---------------------------------------------------------------------
    def step(self) -> WorkloadStep:
        """Runs one scheduling iteration and returns its events."""
        cfg = self.config
        pool = self.pool
        index = self._index
        self._index += 1
        events = _StepBuilder(finished=list(self._finished_pending))
        self._finished_pending = {}
        if index == 0:
            self._allocate_background(events)
        self._admit_arrivals(index)
        scheduled: dict[_Request, int] = {}
        budget = cfg.max_num_batched_tokens
        num_preempted = 0
        position = 0
        while position < len(self._running) and budget > 0:
            request = self._running[position]
            num_new = min(request.num_tokens - request.num_computed, budget)
            needed = _cdiv(request.num_computed + num_new, cfg.block_size)
            needed -= len(request.block_ids)
            while needed > pool.num_free:
                victim = self._running.pop()
                self._preempt(victim)
                events.finished.append(victim.request_id)
                num_preempted += 1
                if victim is request:
                    break
            if request.is_resuming:  # preempted just now: it holds no blocks
                break
            if needed > 0:
                new_ids = self._allocate(needed, events)
                request.block_ids += new_ids
                events.new_blocks[request.request_id] = new_ids
            scheduled[request] = num_new
            budget -= num_new
            position += 1
        if not num_preempted:
            budget = self._admit_waiting(budget, scheduled, events)
        if cfg.enable_prefix_caching:
            # NOTE: exact knowledge, as the vLLM integration has it (a freed block that was
            # never full has no hash): evicted once free, unless allocated again already.
            events.evicted += sorted(
                block_id
                for block_id in set(self._freed_uncached)
                if pool.ref_counts[block_id] == 0 and pool.block_key(block_id) is None
            )
        self._freed_uncached = []
        # What a defragmenter sees after this step's events, before the forward pass.
        num_live_blocks = pool.num_live
        max_live_block_id = self._max_live_block_id()
        self._finish_iteration(scheduled)
        events.num_scheduled_tokens = {req.request_id: n for req, n in scheduled.items()}
        return WorkloadStep(
            index=index,
            events=StepEvents(
                finished=tuple(events.finished),
                new_blocks=events.new_blocks,
                resumed=events.resumed,
                fresh=events.fresh,
                evicted=events.evicted,
            ),
            num_scheduled_tokens=events.num_scheduled_tokens,
            num_live_blocks=num_live_blocks,
            max_live_block_id=max_live_block_id,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preempted=num_preempted,
            num_prefix_hit_blocks=events.num_prefix_hits,
        )

    def _admit_waiting(
        self, budget: int, scheduled: dict[_Request, int], events: _StepBuilder
    ) -> int:
        cfg = self.config
        pool = self.pool
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            request = self._waiting[0]
            hits = self._cached_prefix(request)
            num_computed = len(hits) * cfg.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            needed = _cdiv(num_computed + num_new, cfg.block_size) - len(hits)
            num_free_hits = sum(1 for block_id in hits if pool.ref_counts[block_id] == 0)
            if needed + num_free_hits > pool.num_free:
                break
            self._waiting.popleft()
            pool.touch(hits)  # before allocating, so the hits cannot be evicted
            self._note_live(hits)
            new_ids = self._allocate(needed, events)
            request.block_ids = hits + new_ids
            request.num_computed = num_computed
            request.num_cached_blocks = len(hits)
            events.num_prefix_hits += len(hits)
            if request.is_resuming:
                events.resumed[request.request_id] = list(request.block_ids)
                request.is_resuming = False
            else:
                events.new_blocks[request.request_id] = list(request.block_ids)
            self._running.append(request)
            scheduled[request] = num_new
            budget -= num_new
        return budget

    def _finish_iteration(self, scheduled: dict[_Request, int]) -> None:
        """The forward pass ran: tokens are computed, full blocks cached, requests done."""
        cfg = self.config
        pool = self.pool
        done: list[_Request] = []
        for request, num_new in scheduled.items():
            request.num_computed += num_new
            if cfg.enable_prefix_caching:
                num_full = request.num_computed // cfg.block_size
                for block_index in range(request.num_cached_blocks, num_full):
                    key = request.block_key(block_index, cfg.block_size)
                    pool.cache(request.block_ids[block_index], key)
                request.num_cached_blocks = max(num_full, request.num_cached_blocks)
            if request.num_computed == request.num_tokens:
                request.num_generated += 1
                if request.num_generated >= request.output_len:
                    done.append(request)
        if done:
            finished = set(done)
            self._running = [req for req in self._running if req not in finished]
            for request in done:
                self._note_freed(pool.free(reversed(request.block_ids)))
                self._finished_pending[request.request_id] = request.block_ids

    def _note_freed(self, block_ids: list[int]) -> None:
        block_key = self.pool.block_key
        self._freed_uncached += [block_id for block_id in block_ids if block_key(block_id) is None]

    def _preempt(self, request: _Request) -> None:
        self._note_freed(self.pool.free(reversed(request.block_ids)))
        request.block_ids = []
        request.num_computed = 0
        request.num_cached_blocks = 0
        request.is_resuming = True
        self._waiting.appendleft(request)

    def _cached_prefix(self, request: _Request) -> list[int]:
        """The longest run of cached blocks at the start of the request (vLLM's rule:
        at least one token is always recomputed)."""
        if not self.config.enable_prefix_caching:
            return []
        block_size = self.config.block_size
        hits: list[int] = []
        for block_index in range((request.num_tokens - 1) // block_size):
            block_id = self.pool.lookup(request.block_key(block_index, block_size))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _allocate(self, count: int, events: _StepBuilder) -> list[int]:
        new_ids, evicted = self.pool.allocate(count)
        events.fresh += new_ids
        events.evicted += evicted
        self._note_live(new_ids)
        return new_ids

    # --- arrivals and background ------------------------------------------------------
    def _new_request(self) -> _Request:
        cfg = self.config
        rng = self._rng
        system_prompt: int | None = None
        system_len = 0
        if cfg.num_system_prompts and rng.random() < cfg.system_prompt_fraction:
            system_prompt = rng.choices(
                range(cfg.num_system_prompts), weights=self._system_prompt_weights
            )[0]
            system_len = self._system_prompt_lens[system_prompt]
        own_len = rng.lognormvariate(math.log(cfg.prompt_len_median), cfg.prompt_len_sigma)
        prompt_len = min(max(system_len + round(own_len), cfg.prompt_len_min), cfg.prompt_len_max)
        output_len = cfg.output_len_scale * rng.paretovariate(cfg.output_len_alpha)
        request = _Request(
            request_id=f"req-{self._num_arrived}",
            prompt_len=prompt_len,
            output_len=min(round(output_len), cfg.output_len_max),
            system_prompt=system_prompt,
            system_prompt_len=min(system_len, prompt_len),
        )
        self._num_arrived += 1
        return request

    def _draw_next_arrival(self) -> None:
        rate = self.config.arrival_rate
        self._next_arrival += self._rng.expovariate(rate) if rate > 0 else math.inf

    def _admit_arrivals(self, index: int) -> None:
        while self._next_arrival < index + 1:
            self._waiting.append(self._new_request())
            self._draw_next_arrival()

    def _allocate_background(self, events: _StepBuilder) -> None:
        cfg = self.config
        remaining = cfg.background_blocks
        while remaining:
            count = min(remaining, cfg.background_request_blocks)
            request_id = f"background-{len(self._background)}"
            block_ids = self._allocate(count, events)
            self._background[request_id] = block_ids
            events.new_blocks[request_id] = list(block_ids)
            remaining -= count

    # --- highest live id (a lazy max-heap) ---------------------------------------------
    def _note_live(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if not self._in_heap[block_id]:
                self._in_heap[block_id] = 1
                heapq.heappush(self._live_heap, -block_id)

    def _max_live_block_id(self) -> int:
        heap = self._live_heap
        while heap and self.pool.ref_counts[-heap[0]] == 0:
            self._in_heap[-heapq.heappop(heap)] = 0
        return -heap[0] if heap else 0


@dataclasses.dataclass
class _StepBuilder:
    """The mutable accumulator of one iteration; frozen into ``StepEvents`` at its end."""

    finished: list[str]
    new_blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    resumed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    fresh: list[int] = dataclasses.field(default_factory=list)
    evicted: list[int] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    num_prefix_hits: int = 0


def generate_steps(config: WorkloadConfig | None = None) -> Iterator[WorkloadStep]:
    """Yields the ``config.num_steps`` steps of a fresh ``SyntheticWorkload``."""
    return iter(SyntheticWorkload(config))
