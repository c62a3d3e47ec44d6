"""The defragmentation engine: the one owner of kvdefrag's mutable state.

A step applies the scheduler's events in docs/design.md §4 order, all-or-nothing up to the KV
moves::

    validate -> finished -> resumed -> evicted -> new blocks -> placement -> compaction
             -> execute moves -> commit mapping -> result

Validation reads only; nothing changes until every field has passed. If the executor
fails, the compaction is not committed (the mapping still matches the data of every
live block) and the engine refuses further steps until ``reset()``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvdefrag.common import EngineUnhealthy, InvalidArgument, NotFound
from kvdefrag.server._executor import KvCaches, MoveReport, SwapExecutor, make_executor
from kvdefrag.server._planner import Move, plan_compaction
from kvdefrag.server._tracker import NULL_BLOCK_ID, BlockTracker
from kvdefrag.server._validate import StepInput, validate_step
from kvdefrag.server.config import DEFAULT_PAD_BUCKETS, Config

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the pool and of what the engine has done since it started.

    Attributes:
        num_blocks: Blocks in the pool, null block included.
        num_live: Blocks referenced by at least one request.
        max_live: Highest live physical id (0 when nothing is live).
        holes: ``max_live - num_live``: free slots below the highest live one.
        num_requests: Requests holding blocks.
        fragmentation_ratio: ``max_live / num_live``; 1.0 is packed (and when empty).
        is_healthy: False after a failed KV move, until ``reset()``.
        num_steps: Steps applied.
        num_moves: Blocks moved by compaction (one-way and two-way).
        num_two_way_moves: Moves that swapped contents with a cached free block.
        num_placements: Fresh blocks re-pointed to a lower slot without a copy.
        num_defrag_runs: Compaction passes that moved at least one block.
        num_bytes_moved: Bytes written to the KV tensors by moves.
        num_unknown_finished: Finished request ids the engine did not know.
    """

    num_blocks: int
    num_live: int
    max_live: int
    holes: int
    num_requests: int
    fragmentation_ratio: float
    is_healthy: bool
    num_steps: int = 0
    num_moves: int = 0
    num_two_way_moves: int = 0
    num_placements: int = 0
    num_defrag_runs: int = 0
    num_bytes_moved: int = 0
    num_unknown_finished: int = 0


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step did.

    Attributes:
        block_mapping: Physical id of every logical id newly referenced or moved this
            step (moved includes free blocks whose slot changed).
        moves: Compaction moves executed, in physical space.
        num_placed: Fresh blocks re-pointed to a lower slot (no copy).
        num_unknown_finished: Finished ids the engine did not know (tolerated).
        num_padded: Pad pairs the executor added (static-shape backends).
        num_bytes_moved: Bytes written to the KV tensors.
        swap_duration_s: Time spent in the executor (0.0 when nothing moved).
        digest: Digest of the live mapping after the step (see ``kvdefrag.common``).
        stats: Pool statistics after the step.
    """

    block_mapping: dict[int, int]
    moves: tuple[Move, ...]
    num_placed: int
    num_unknown_finished: int
    num_padded: int
    num_bytes_moved: int
    swap_duration_s: float
    digest: int
    stats: EngineStats


class StepObserver(Protocol):
    """Told about every step and failure (the metrics layer implements it)."""

    def on_step(self, result: StepResult, duration_s: float) -> None: ...

    def on_move_failure(self) -> None: ...


@dataclasses.dataclass
class _Counters:
    num_steps: int = 0
    num_moves: int = 0
    num_two_way_moves: int = 0
    num_placements: int = 0
    num_defrag_runs: int = 0
    num_bytes_moved: int = 0
    num_unknown_finished: int = 0


class Engine:
    """Tracks live KV blocks, keeps the logical->physical mapping and compacts the pool.

    Invariants (between calls): the mapping is a permutation of ``[0, num_blocks)`` with
    ``resolve(0) == 0``; the KV data of every live block (and, with prefix caching, of
    every cached free block) sits at ``resolve(logical_id)``.

    Thread-safe: one lock serialises steps, resets and reads. On CPU the executor also
    takes ``kv_lock``, which the worker must hold during its forward pass.

    Example:
        >>> import torch
        >>> from kvdefrag.server import Engine
        >>> kv = [(torch.zeros(64 * 16, 8), torch.zeros(64 * 16, 8))]
        >>> engine = Engine(kv, block_size=16, threshold=0)
        >>> result = engine.step(new_blocks={"req-a": [5, 9]})
        >>> result.block_mapping  # fresh blocks placed at the bottom, free ones swapped up
        {5: 1, 9: 2, 1: 5, 2: 9}
        >>> engine.resolve([5, 9]).tolist()
        [1, 2]
    """

    def __init__(
        self,
        kv_caches: KvCaches,
        block_size: int = 16,
        threshold: int = 32,
        prefix_caching: bool = False,
        *,
        max_moves_per_step: int = 512,
        pad_buckets: Sequence[int] = DEFAULT_PAD_BUCKETS,
        enable_placement: bool = True,
        executor: SwapExecutor | None = None,
        stream: Any = None,
        observer: StepObserver | None = None,
        kv_lock: threading.Lock | None = None,
    ) -> None:
        self.config = Config(
            threshold=threshold,
            max_moves_per_step=max_moves_per_step,
            pad_buckets=tuple(pad_buckets),
            enable_placement=enable_placement,
            prefix_caching=prefix_caching,
        )
        self.block_size = block_size
        self._executor = executor or make_executor(
            kv_caches, block_size, stream=stream, pad_buckets=self.config.pad_buckets
        )
        self.num_blocks = self._executor.num_blocks
        self.kv_lock = kv_lock or threading.Lock()
        self._observer = observer
        self._lock = threading.Lock()
        self._tracker = BlockTracker(self.num_blocks, prefix_caching)
        self._counters = _Counters()
        self._unhealthy_reason: str | None = None
        self._force_defrag = False

    @classmethod
    def from_config(
        cls, kv_caches: KvCaches, block_size: int, config: Config, **options: Any
    ) -> Engine:
        """Builds an engine with the engine fields of a service Config."""
        return cls(
            kv_caches,
            block_size,
            config.threshold,
            config.prefix_caching,
            max_moves_per_step=config.max_moves_per_step,
            pad_buckets=config.pad_buckets,
            enable_placement=config.enable_placement,
            **options,
        )

    # --- the step ---------------------------------------------------------------------
    def step(
        self,
        *,
        finished: Iterable[str] = (),
        new_blocks: Mapping[str, Sequence[int]] | None = None,
        resumed: Mapping[str, Sequence[int]] | None = None,
        fresh: Iterable[int] | None = None,
        evicted: Iterable[int] = (),
    ) -> StepResult:
        """Applies one scheduling iteration's block events, then compacts if needed.

        Args:
            finished: Request ids that finished (or were preempted): their blocks are
                released. Unknown ids are tolerated and counted.
            new_blocks: Request id -> logical ids appended this step.
            resumed: Request id -> the request's full new block list (replaces the old).
            fresh: Logical ids among the new/resumed ones that hold no data yet. None:
                every newly live block without prefix caching, none with it.
            evicted: Logical ids dropped from the prefix cache (content no longer needed).

        Returns:
            The new or changed mapping entries, the moves executed and statistics.

        Raises:
            InvalidArgument: A field is malformed; nothing changed.
            EngineUnhealthy: A previous KV move failed, or this one did.
        """
        started = time.perf_counter()
        with self._lock:
            if self._unhealthy_reason is not None:
                raise EngineUnhealthy(self._unhealthy_reason)
            step_input = validate_step(self._tracker, finished, new_blocks, resumed, fresh, evicted)
            try:
                result = self._apply(step_input)
            finally:
                self._tracker.flush()
        self._notify("on_step", result, time.perf_counter() - started)
        return result

    def _notify(self, event: str, *args: Any) -> None:
        """Tells the observer; its failure is logged, never raised."""
        if self._observer is None:
            return
        try:
            getattr(self._observer, event)(*args)
        except Exception:
            # NOTE: the step is committed by now; raising would make the client resend
            # a step the engine already applied.
            _LOGGER.exception("step observer failed in %s", event)

    def schedule_defragment(self) -> None:
        """Makes the next step compact the pool whatever the threshold.

        NOTE: a forced pass runs inside the next step, never on its own: KV data may
        only move between forward passes, and the scheduler must learn the new mapping
        in the same reply that its next block tables depend on.
        """
        with self._lock:
            self._force_defrag = True

    def _apply(self, step: StepInput) -> StepResult:
        tracker = self._tracker
        counters = self._counters
        num_unknown = sum(not tracker.drop_request(rid) for rid in step.finished)
        for request_id in step.resumed:
            tracker.drop_request(request_id)
        for logical_id in step.evicted:
            tracker.evict(logical_id)
        touched: list[int] = []
        newly_live: list[int] = []
        for lists in (step.resumed, step.new_blocks):
            for request_id, logical_ids in lists.items():
                newly_live += tracker.append_blocks(request_id, logical_ids)
                touched += logical_ids
        fresh = step.fresh
        if fresh is None:
            fresh = [] if tracker.prefix_caching else newly_live
        num_placed = self._place(fresh, touched) if self.config.enable_placement else 0
        moves, report, swap_s = self._compact(touched)
        counters.num_steps += 1
        counters.num_placements += num_placed
        counters.num_unknown_finished += num_unknown
        stats = self._stats_locked()
        fwd = tracker.fwd
        return StepResult(
            block_mapping={i: fwd[i] for i in touched if i != NULL_BLOCK_ID},
            moves=tuple(moves),
            num_placed=num_placed,
            num_unknown_finished=num_unknown,
            num_padded=report.num_padded,
            num_bytes_moved=report.num_bytes,
            swap_duration_s=swap_s,
            digest=tracker.digest,
            stats=stats,
        )

    def _place(self, fresh: list[int], touched: list[int]) -> int:
        """Re-points each fresh block to the lowest expendable free slot below it."""
        tracker = self._tracker
        num_placed = 0
        for logical_id in dict.fromkeys(fresh):
            physical_id = tracker.fwd[logical_id]
            target = tracker.lowest_expendable()
            if target is None or target > physical_id:
                continue
            touched += tracker.swap_slots(physical_id, target)
            num_placed += 1
        return num_placed

    def _compact(self, touched: list[int]) -> tuple[list[Move], MoveReport, float]:
        tracker = self._tracker
        holes = tracker.max_live - tracker.num_live
        if holes <= self.config.threshold and not self._force_defrag:
            return [], MoveReport(0, 0, 0), 0.0
        self._force_defrag = False
        moves = plan_compaction(tracker, self.config.max_moves_per_step)
        if not moves:
            return [], MoveReport(0, 0, 0), 0.0
        started = time.perf_counter()
        try:
            with self.kv_lock:
                report = self._executor.execute(moves)
        except Exception as err:
            tracker.restore_slots([slot for move in moves for slot in move[:2]])
            self._unhealthy_reason = (
                f"KV move of {len(moves)} blocks failed ({type(err).__name__}: {err}); "
                "the mapping was not changed, so live blocks resolve to their old slots; "
                "cached free blocks in the batch may be lost. reset() is required."
            )
            self._notify("on_move_failure")
            raise EngineUnhealthy(self._unhealthy_reason) from err
        swap_s = time.perf_counter() - started
        touched += tracker.move_live_blocks(
            [move.src_physical_id for move in moves], [move.dst_physical_id for move in moves]
        )
        counters = self._counters
        counters.num_defrag_runs += 1
        counters.num_moves += len(moves)
        counters.num_two_way_moves += sum(move.is_two_way for move in moves)
        counters.num_bytes_moved += report.num_bytes
        return moves, report, swap_s

    # --- reads ------------------------------------------------------------------------
    def resolve(self, logical_ids: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Maps logical ids to physical ids (vectorised).

        Raises:
            InvalidArgument: An id is not an integer or is outside ``[0, num_blocks)``.
        """
        ids = np.asarray(logical_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise InvalidArgument(f"resolve: block ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise InvalidArgument(f"resolve: block id {bad} is outside [0, {self.num_blocks})")
        with self._lock:
            physical_ids: npt.NDArray[np.int64] = self._tracker.fwd_array[ids]
        return physical_ids

    def resolve_tables(self, tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """Maps every block table (one list of logical ids per request) to physical ids."""
        lengths = [len(table) for table in tables]
        flat = self.resolve([block_id for table in tables for block_id in table]).tolist()
        resolved, start = [], 0
        for length in lengths:
            resolved.append(flat[start : start + length])
            start += length
        return resolved

    def stats(self) -> EngineStats:
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> EngineStats:
        tracker = self._tracker
        max_live = tracker.max_live
        num_live = tracker.num_live
        return EngineStats(
            num_blocks=self.num_blocks,
            num_live=num_live,
            max_live=max_live,
            holes=max_live - num_live,
            num_requests=len(tracker.requests),
            fragmentation_ratio=max_live / num_live if num_live else 1.0,
            is_healthy=self._unhealthy_reason is None,
            **vars(self._counters),
        )

    @property
    def digest(self) -> int:
        with self._lock:
            return self._tracker.digest

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine refuses steps, or None when it is healthy."""
        return self._unhealthy_reason

    def request_blocks(self, request_id: str) -> list[int]:
        """Returns a running request's logical block ids.

        Raises:
            NotFound: The engine holds no request with that id.
        """
        with self._lock:
            blocks = self._tracker.requests.get(request_id)
            if blocks is None:
                raise NotFound(f"request_id {request_id!r} is not running")
            return list(blocks)

    def list_requests(self) -> dict[str, list[int]]:
        """Returns every running request's logical block ids (an O(pool) audit call)."""
        with self._lock:
            return {rid: list(ids) for rid, ids in self._tracker.requests.items()}

    def reset(self, *, prefix_caching: bool | None = None) -> None:
        """Forgets every request and restores the identity mapping; healthy again.

        Args:
            prefix_caching: The mode to run in from now on; None keeps the current one.

        NOTE: the KV data stays where it is. Reset only when it no longer matters: the
        scheduler dropped its requests and its prefix cache (or restarted).
        """
        with self._lock:
            if prefix_caching is not None:
                self.config = dataclasses.replace(self.config, prefix_caching=prefix_caching)
            self._tracker = BlockTracker(self.num_blocks, self.config.prefix_caching)
            self._unhealthy_reason = None
            self._force_defrag = False
