"""The defragmentation engine: the one owner of kvdefrag's mutable state.

A step applies the scheduler's events in docs/design/step.md order, all-or-nothing up to the KV
moves::

    validate -> finished -> resumed -> evicted -> new blocks -> unpins -> pins
             -> placement -> compaction -> execute moves -> commit mapping -> result

(A block fresh this step is pinned where placement puts it.)

Validation reads only; nothing changes until every field has passed. If the executor
fails, the compaction is not committed (the mapping still matches the data of every
live block), the step counts as applied without its compaction (its events stand) and
the engine refuses further steps until ``reset()``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvdefrag.common import (
    NULL_BLOCK_ID,
    EngineUnhealthy,
    InvalidArgument,
    NotFound,
    PoolStats,
    StalePageToken,
    StepEvents,
    Totals,
)
from kvdefrag.common.errors import quote
from kvdefrag.common.events import require_step_events
from kvdefrag.server import _policy
from kvdefrag.server._backends import make_executor
from kvdefrag.server._executor import (
    KvCaches,
    SwapExecutor,
    check_same_geometry,
    kv_geometry,
    warm_up,
)
from kvdefrag.server._move_log import MoveLog, moves_of_blocks_live_before
from kvdefrag.server._moves import Move, MoveBatch, MoveReport
from kvdefrag.server._snapshot import MappingSnapshots
from kvdefrag.server._tracker import BlockTracker
from kvdefrag.server._validate import validate_step
from kvdefrag.server.config import EngineConfig

_LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step did. Every figure here is this step's; ``stats`` is the pool after it
    (with the engine's cumulative ``stats.totals``).

    Attributes:
        block_mapping: Physical id of every logical id newly referenced or moved this
            step (moved includes free blocks whose slot changed).
        moves: Compaction moves executed, in physical space (columns, and a sequence
            of ``Move``).
        num_placed: Fresh blocks re-pointed to a lower slot (no copy).
        num_unknown_finished: Finished ids the engine did not know (tolerated).
        num_padded: Pad pairs the executor added (static-shape backends).
        num_bytes_moved: Bytes written to the KV tensors.
        transfer_runs: For each block list this step pinned (a KV transfer), its runs of
            consecutive physical ids, in list order (the null block skipped).
        swap_duration_s: Time spent in the executor (0.0 when nothing moved).
        digest: Digest of the live mapping after the step (see ``kvdefrag.common``).
        stats: Pool statistics after the step.
    """

    block_mapping: dict[int, int]
    moves: MoveBatch
    num_placed: int
    num_unknown_finished: int
    num_padded: int
    num_bytes_moved: int
    swap_duration_s: float
    digest: int
    stats: PoolStats
    transfer_runs: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestPage:
    """A slice of the running requests, in the engine's order (``list_requests_page``).

    Attributes:
        requests: Request id -> logical block ids, for the requests of this page.
        generation: The state the page was read from (see ``list_requests_page``).
        next_start: The position of the next page, None after the last one.
    """

    requests: dict[str, list[int]]
    generation: int
    next_start: int | None


class StepObserver(Protocol):
    """Told about every step, failure and reset (metrics and health implement it).

    Called outside the engine lock, after the change is committed; an observer that
    raises is logged and otherwise ignored.
    """

    def on_step(self, result: StepResult, duration_s: float) -> None: ...

    def on_move_failure(self) -> None: ...

    def on_reset(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Published:
    """What lock-free readers see besides the mapping (``MappingSnapshots``): replaced
    whole at the end of each step or reset."""

    digest: int
    stats: PoolStats


class Engine:
    """Tracks live KV blocks, keeps the logical->physical mapping and compacts the pool.

    Invariants (between calls): the mapping is a permutation of ``[0, num_blocks)`` with
    ``resolve(0) == 0``; the KV data of every live block (and, with prefix caching, of
    every cached free block) sits at ``resolve(logical_id)``, except after
    ``rebind_kv_caches`` (new memory: its caller vouches that no old content is read
    again, and each block is written there anew); every running request holds a block
    other than the null block. A new or resumed request whose list holds
    none (``[]``, ``[0]``) is not kept: it is not counted in ``num_requests``, and
    finishing it later counts as an unknown finished id.

    Locks, always taken in this order (see docs/design/kv-access-and-locks.md)::

        servicer lock  ->  engine lock (_lock)  ->  kv_lock

    ``_lock`` serialises steps, resets and the request reads (which hold it only to copy
    what they return). ``kv_lock`` is the worker's:
    it holds it during its forward pass, and the engine takes it (inside ``_lock``) to
    move KV data and publish the new mapping. ``resolve``, ``resolve_tables``, ``stats``
    and ``digest`` take no lock: they read the mapping published by the last step, so a
    worker may call them while it holds ``kv_lock``.

    Example:
        >>> import torch
        >>> from kvdefrag.server import Engine, EngineConfig, StepEvents
        >>> kv = [(torch.zeros(64 * 16, 8), torch.zeros(64 * 16, 8))]
        >>> engine = Engine(kv, block_size=16, config=EngineConfig(threshold=0))
        >>> result = engine.step(StepEvents(new_blocks={"req-a": [5, 9]}))
        >>> result.block_mapping  # fresh blocks placed at the bottom, free ones swapped up
        {5: 1, 9: 2, 1: 5, 2: 9}
        >>> engine.resolve([5, 9]).tolist()
        [1, 2]
    """

    def __init__(
        self,
        kv_caches: KvCaches,
        block_size: int = 16,
        config: EngineConfig | None = None,
        *,
        executor: SwapExecutor | None = None,
        stream: Any = None,
        observer: StepObserver | None = None,
        kv_lock: threading.Lock | None = None,
    ) -> None:
        self.config = config if config is not None else EngineConfig()
        if not isinstance(self.config, EngineConfig):
            raise InvalidArgument(
                f"config must be an EngineConfig, got {type(self.config).__name__}"
            )
        self.block_size = block_size
        self._stream = stream
        self._executor = executor or self._bind_executor(kv_caches)
        self.num_blocks = self._executor.num_blocks
        # NOTE: the layout, never the tensors: a worker that frees its KV caches
        # (``release_kv_caches``) must not find the engine still holding them. An
        # executor given with no caches (one that only counts moves) binds no layout.
        self._kv_geometry = (
            kv_geometry(kv_caches, block_size) if kv_caches or executor is None else ()
        )
        self.kv_lock = kv_lock or threading.Lock()
        self._observers: list[StepObserver] = [] if observer is None else [observer]
        self._lock = threading.Lock()
        self._tracker = BlockTracker(self.num_blocks, self.config.prefix_caching)
        # Pin key -> its logical ids (StepEvents.pins), until a step unpins the key.
        self._pins: dict[str, list[int]] = {}
        self._totals = Totals()
        self._unhealthy_reason: str | None = None
        self._force_defrag = False
        # Counts the steps applied (failed ones included) and resets: a request page
        # token names the generation its first page saw.
        self._generation = 0
        self._snapshots = MappingSnapshots(self.num_blocks)
        self._published = self._publish_locked()
        # Compactions committed, for readers that follow moved data (``moves_since``).
        self._move_log = MoveLog()

    def add_observer(self, observer: StepObserver) -> None:
        """Adds an observer told about every later step, move failure and reset."""
        with self._lock:
            self._observers = [*self._observers, observer]

    # --- the step ---------------------------------------------------------------------
    def step(self, events: StepEvents, /) -> StepResult:
        """Applies one scheduling iteration's block events, then compacts if needed.

        ``events`` was type-checked when it was made (``StepEvents``) and is applied as it
        is (leave it unchanged).

        Args:
            events: The step's events.

        Returns:
            The new or changed mapping entries, the moves executed and statistics.

        Raises:
            InvalidArgument: ``events`` is not a ``StepEvents``, or names blocks or
                requests the pool refuses; nothing changed.
            EngineUnhealthy: A previous KV move failed (nothing changed), or this one
                did: the step is applied without its compaction and counted in
                ``stats().totals.num_steps``.
        """
        return self.apply_events(require_step_events(events))

    def apply_events(self, events: StepEvents) -> StepResult:
        """``step`` for a caller that knows it holds a ``StepEvents`` (the servicer's path).

        Nothing is copied: the caller must not change ``events`` afterwards. The pool
        checks (ranges, duplicates, fresh blocks) run as in ``step``.

        Raises:
            InvalidArgument, EngineUnhealthy: As ``step``.
        """
        started = time.perf_counter()
        with self._lock:
            if self._unhealthy_reason is not None:
                raise EngineUnhealthy(self._unhealthy_reason)
            validate_step(self._tracker, events, self._pins)
            self._generation += 1
            move_failed = False
            result: StepResult | None = None
            try:
                result = self._apply(events)
            except EngineUnhealthy:
                move_failed = True
                raise
            finally:
                self._published = self._publish_locked(
                    stats=None if result is None else result.stats
                )
                if move_failed:
                    self._notify("on_move_failure")
        self._notify("on_step", result, time.perf_counter() - started)
        return result

    def _notify(self, event: str, *args: Any) -> None:
        """Tells the observers; their failures are logged, never raised."""
        for observer in self._observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                # NOTE: the change is committed by now; raising would make the client
                # resend a step the engine already applied.
                _LOGGER.exception("step observer failed in %s", event)

    def schedule_defragment(self) -> None:
        """Makes the next step compact the pool whatever the threshold (or, with decode
        buckets, whether or not the bucket drops): a full pass, as the threshold policy's.

        NOTE: a forced pass runs inside the next step, never on its own: KV data may
        only move between forward passes, and the scheduler must learn the new mapping
        in the same reply that its next block tables depend on.
        """
        with self._lock:
            self._force_defrag = True

    def _apply(self, events: StepEvents) -> StepResult:
        tracker = self._tracker
        released: list[int] = []  # blocks freed by this step (some may be taken again)
        num_unknown = len(events.finished) - tracker.drop_requests(events.finished, released)
        tracker.drop_requests(events.resumed, released)
        for logical_id in events.evicted:
            tracker.evict(logical_id)
        touched: list[int] = []
        newly_live: list[int] = []
        # NOTE: the blocks that become live are mixed into the digest once, after
        # placement (validation made every fresh block one of them): most are placed.
        for lists in (events.resumed, events.new_blocks):
            newly_live += tracker.append_requests(lists, mix_digests=False)
            for logical_ids in lists.values():
                touched += logical_ids
        fresh = events.fresh
        if fresh is None:
            fresh = [] if tracker.prefix_caching else newly_live
        num_unknown_unpins = self._unpin(events.unpinned)
        pinned_later: list[int] = []
        if events.pins or tracker.num_pinned:
            fresh, pinned_later = self._pin(events.pins, fresh)
        num_placed = (
            self._place(fresh, touched, (events.resumed, events.new_blocks))
            if self.config.enable_placement
            else 0
        )
        tracker.pin(pinned_later)
        transfer_runs = _runs_of(tracker.fwd, events.pins.values()) if events.pins else ()
        tracker.mix_live_digests(newly_live)
        try:
            moves, report, swap_s = self._compact(touched, newly_live, released, fresh)
        except EngineUnhealthy:
            # NOTE: the events stand: the step is applied without its compaction, and
            # counted, so that num_steps (and the service's seq) say what the state is.
            self._count_step(
                num_placed, num_unknown, num_unknown_unpins, MoveBatch([], []), MoveReport(0, 0, 0)
            )
            raise
        self._count_step(num_placed, num_unknown, num_unknown_unpins, moves, report)
        fwd = tracker.fwd
        block_mapping = {logical_id: fwd[logical_id] for logical_id in touched}
        block_mapping.pop(NULL_BLOCK_ID, None)
        return StepResult(
            block_mapping=block_mapping,
            moves=moves,
            num_placed=num_placed,
            num_unknown_finished=num_unknown,
            num_padded=report.num_padded,
            num_bytes_moved=report.num_bytes,
            swap_duration_s=swap_s,
            digest=tracker.digest,
            stats=self._stats_locked(),
            transfer_runs=transfer_runs,
        )

    def _unpin(self, keys: Sequence[str]) -> int:
        """Ends the pins of ``keys``; returns how many named no pin (tolerated: a
        connector may report a transfer done twice, or one pinned before a reset)."""
        pins = self._pins
        num_unknown = 0
        for key in keys:
            logical_ids = pins.pop(key, None)
            if logical_ids is None:
                num_unknown += 1
            else:
                self._tracker.unpin(logical_ids)
        return num_unknown

    def _pin(self, pins: Mapping[str, list[int]], fresh: list[int]) -> tuple[list[int], list[int]]:
        """Records the step's pins and pins the blocks that are not fresh this step.

        Returns:
            The fresh blocks placement may re-point (those not pinned), and the fresh
            blocks to pin once placed.
        """
        if not pins:
            pin_counts = self._tracker.pin_counts
            return [i for i in fresh if not pin_counts[i]], []
        self._pins.update(pins)
        fresh_set = set(fresh)
        pinned_now = [i for ids in pins.values() for i in ids if i not in fresh_set]
        pinned_later = [i for ids in pins.values() for i in ids if i in fresh_set]
        self._tracker.pin(pinned_now)
        pin_counts = self._tracker.pin_counts
        # NOTE: a fresh block pinned before this step (its slot still read by a transfer
        # that outlives its last request) is not re-pointed either.
        placeable = [i for i in fresh if not pin_counts[i]]
        return placeable, pinned_later

    def _count_step(
        self,
        num_placed: int,
        num_unknown: int,
        num_unknown_unpins: int,
        moves: MoveBatch,
        report: MoveReport,
    ) -> None:
        totals = self._totals
        self._totals = Totals(
            num_steps=totals.num_steps + 1,
            num_moves=totals.num_moves + len(moves),
            num_two_way_moves=totals.num_two_way_moves + moves.num_two_way,
            num_placements=totals.num_placements + num_placed,
            num_defrag_runs=totals.num_defrag_runs + bool(moves),
            num_bytes_moved=totals.num_bytes_moved + report.num_bytes,
            num_unknown_finished=totals.num_unknown_finished + num_unknown,
            num_unknown_unpins=totals.num_unknown_unpins + num_unknown_unpins,
        )

    def _place(
        self,
        fresh: list[int],
        touched: list[int],
        lists: Sequence[Mapping[str, Sequence[int]]],
    ) -> int:
        """Re-points each fresh block to the slot the policy picks (no copy); ``lists``
        are the step's resumed and appended lists, whose runs placement extends."""
        tracker = self._tracker
        config = self.config
        logical_ids, physical_ids = _policy.plan_placement(
            tracker,
            fresh,
            lists,
            decode_buckets=config.decode_buckets,
            max_holes=None if config.decode_buckets else config.threshold,
        )
        touched += tracker.place_blocks(logical_ids, physical_ids, mix_digests=False)
        return len(logical_ids)

    def _compact(
        self, touched: list[int], newly_live: list[int], released: list[int], fresh: list[int]
    ) -> tuple[MoveBatch, MoveReport, float]:
        """Plans, executes and commits this step's compaction, if any.

        Returns:
            The KV copies executed (``_policy.plan_copies``), their report, the time
            they took.
        """
        tracker = self._tracker
        is_forced = self._force_defrag
        if not _policy.should_compact(tracker, self.config, is_forced=is_forced):
            return MoveBatch([], []), MoveReport(0, 0, 0), 0.0
        self._force_defrag = False
        moves = _policy.plan_compaction(tracker, self.config, is_forced=is_forced, placed_ids=fresh)
        if not moves:
            return MoveBatch([], []), MoveReport(0, 0, 0), 0.0
        copies = _policy.plan_copies(tracker, moves, fresh)
        if tracker.num_pinned:
            self._check_no_pinned_move(copies)
        started = time.perf_counter()
        with self.kv_lock:
            try:
                report = self._executor.execute(copies)
            except Exception as err:
                self._unhealthy_reason = (
                    f"the events of step {self._totals.num_steps + 1} (counted since the "
                    "last reset, like seq) were applied without its compaction: the KV "
                    f"move of {len(moves)} blocks failed ({type(err).__name__}: {err}). "
                    "The compaction's mapping was not committed, so live blocks resolve to "
                    "their old, intact slots; cached free blocks in the batch may be lost. "
                    "reset() is required."
                )
                raise EngineUnhealthy(self._unhealthy_reason) from err
            swap_s = time.perf_counter() - started
            followed = moves_of_blocks_live_before(tracker.fwd, moves, newly_live, released)
            touched += tracker.move_live_blocks(moves.src_ids, moves.dst_ids)
            # NOTE: published before kv_lock is released: a worker that takes kv_lock
            # next must resolve to where the data now is.
            self._published = self._publish_locked()
            self._move_log.record(followed)
        return copies, report, swap_s

    def _check_no_pinned_move(self, copies: MoveBatch) -> None:
        """The second line behind the policy: a batch that would move a pinned block or
        write a pinned slot is not executed, and the engine stops (a transfer reads or
        writes that slot: moving it would corrupt data silently)."""
        slots = np.asarray([*copies.src_ids, *copies.dst_ids], dtype=np.intp)
        pinned = slots[self._tracker.are_pinned_slots(slots)]
        if len(pinned):
            self._unhealthy_reason = (
                f"step {self._totals.num_steps + 1} planned a move of pinned physical block "
                f"{int(pinned[0])} (a KV transfer in flight reads or writes it); nothing was "
                "moved, the step stands without its compaction, and reset() is required"
            )
            raise EngineUnhealthy(self._unhealthy_reason)

    def _publish_locked(self, *, stats: PoolStats | None = None) -> _Published:
        """Publishes the mapping's changes for lock-free readers (O(changes)) and returns
        the digest and ``stats`` (the pool statistics of now, computed if None)."""
        tracker = self._tracker
        self._snapshots.publish(tracker.fwd, tracker.take_remapped())
        if stats is None:
            stats = self._stats_locked()
        return _Published(digest=tracker.digest, stats=stats)

    # --- reads ------------------------------------------------------------------------
    def moves_since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None:
        """The moves of live blocks committed after number ``version``, one batch per
        compaction, oldest first (``MoveLog.since``; what is logged, and why that is
        enough for a reader, is in ``kvdefrag.server._move_log``).

        For a reader whose own records name physical ids: it follows the data that moved
        since it last looked in O(blocks moved). Call it holding ``kv_lock``
        (compactions commit under it). A reset starts the log over: nothing from before
        it is reported.

        Returns:
            ``(version now, the batches)``; None when the log no longer reaches back to
            ``version``.
        """
        return self._move_log.since(version)

    def resolve(self, logical_ids: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Maps logical ids to physical ids (vectorised, lock-free).

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
        return self._snapshots.read(ids)

    def resolve_tables(self, tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """Maps every block table (one list of logical ids per request) to physical ids."""
        lengths = [len(table) for table in tables]
        flat = self.resolve([block_id for table in tables for block_id in table]).tolist()
        resolved, start = [], 0
        for length in lengths:
            resolved.append(flat[start : start + length])
            start += length
        return resolved

    def mapping(self) -> npt.NDArray[np.int64]:
        """The whole logical->physical mapping (index: logical id), lock-free: a copy of
        what the last step published, cheaper than resolving every id."""
        return self._snapshots.read_all()

    def stats(self) -> PoolStats:
        """The pool as of the last step or reset (lock-free)."""
        return self._published.stats

    def digest_and_stats(self) -> tuple[int, PoolStats]:
        """``digest`` and ``stats()`` of one and the same step (lock-free)."""
        published = self._published
        return published.digest, published.stats

    def _stats_locked(self) -> PoolStats:
        tracker = self._tracker
        max_live = tracker.max_live
        num_live = tracker.num_live
        return PoolStats(
            num_blocks=self.num_blocks,
            num_live=num_live,
            max_live=max_live,
            holes=max_live - num_live,
            num_requests=len(tracker.requests),
            fragmentation_ratio=max_live / num_live if num_live else 1.0,
            is_healthy=self._unhealthy_reason is None,
            num_pinned=tracker.num_pinned,
            totals=self._totals,
        )

    @property
    def digest(self) -> int:
        """Digest of the live mapping as of the last step or reset (lock-free)."""
        return self._published.digest

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the engine refuses steps, or None when it is healthy."""
        return self._unhealthy_reason

    @property
    def is_pristine(self) -> bool:
        """Healthy, and no step applied since the start or the last reset: the mapping is
        the identity and no block is live or cached, so a change of mode
        (``change_mode``) loses nothing."""
        with self._lock:
            return self._is_pristine_locked()

    def _is_pristine_locked(self) -> bool:
        return self._unhealthy_reason is None and self._totals.num_steps == 0

    def change_mode(self, *, prefix_caching: bool) -> None:
        """Runs with ``prefix_caching`` from now on (a reset into the new mode).

        Raises:
            InvalidArgument: The engine is not pristine (``is_pristine``): its live and
                cached blocks were tracked in the other mode; nothing changed. Reset it
                first.
        """
        if prefix_caching == self.config.prefix_caching:
            return
        with self._lock, self.kv_lock:
            if not self._is_pristine_locked():
                raise InvalidArgument(
                    f"prefix_caching={prefix_caching}: the engine runs with "
                    f"prefix_caching={self.config.prefix_caching} and has applied "
                    f"{self._totals.num_steps} steps since its last reset; reset to change "
                    "the mode"
                )
            self._reset_locked(prefix_caching)
        self._notify("on_reset")

    def request_blocks(self, request_id: str) -> list[int]:
        """Returns a running request's logical block ids.

        Raises:
            NotFound: The engine holds no request with that id.
        """
        with self._lock:
            return list(self._request_blocks_locked(request_id))

    def _request_blocks_locked(self, request_id: str) -> list[int]:
        blocks = self._tracker.requests.get(request_id)
        if blocks is None:
            raise NotFound(f"request_id {quote(request_id)} is not running")
        return blocks

    def resolve_request(self, request_id: str) -> tuple[list[int], list[int]]:
        """Returns a running request's logical block ids and their physical ids.

        Raises:
            NotFound: The engine holds no request with that id.
        """
        with self._lock:
            blocks = self._request_blocks_locked(request_id)
            # NOTE: under the lock no step is half done, so the published mapping is
            # the one of the tracker's request table.
            physical_ids: list[int] = self._snapshots.read(
                np.asarray(blocks, dtype=np.int64)
            ).tolist()
            return list(blocks), physical_ids

    def list_requests(self) -> dict[str, list[int]]:
        """Returns every running request's logical block ids (an O(pool) audit call)."""
        with self._lock:
            return {rid: list(ids) for rid, ids in self._tracker.requests.items()}

    def list_requests_page(
        self, start: int, max_requests: int, generation: int | None = None
    ) -> RequestPage:
        """Returns up to ``max_requests`` running requests from position ``start``.

        Pages of one generation are slices of one request table, so reading them all
        gives every request exactly once. The lock is held only to copy the slice.

        Args:
            start: Position of the page's first request (0 for the first page).
            max_requests: At most this many requests (>= 1).
            generation: The ``generation`` of the first page; None for a first page.

        Raises:
            StalePageToken: A step or a reset was applied since that generation.
            InvalidArgument: ``start`` is past the last request (no page of this
                generation ever started there: a forged or corrupted token).
        """
        assert max_requests >= 1, f"a page holds at least one request, got {max_requests}"
        with self._lock:
            if generation is not None and generation != self._generation:
                raise StalePageToken(
                    "the running requests changed since the first page (a step or a reset "
                    "was applied); list again from the first page"
                )
            requests = self._tracker.requests
            if not 0 <= start <= len(requests):
                raise InvalidArgument(
                    f"its position {start} is past the {len(requests)} running requests"
                )
            page = {
                request_id: list(logical_ids)
                for request_id, logical_ids in itertools.islice(
                    requests.items(), start, start + max_requests
                )
            }
            end = start + len(page)
            return RequestPage(page, self._generation, end if end < len(requests) else None)

    # --- the KV tensors ---------------------------------------------------------------
    def _bind_executor(self, kv_caches: KvCaches) -> SwapExecutor:
        """The executor for ``kv_caches``' device, built (and warmed) as at start."""
        return make_executor(
            kv_caches, self.block_size, stream=self._stream, pad_buckets=self.config.pad_buckets
        )

    def warmup(self) -> int:
        """Runs the executor's warm-up again, holding ``kv_lock``.

        The HPU executor runs every pad bucket, one-way and two-way, with pad-only
        batches (they move nothing), so no graph is compiled inside a later step; the
        CPU and CUDA executors compile nothing and run no batch.

        Returns:
            The batches run: 0 for executors without graphs, one without a warm-up, or
            while the KV caches are released.
        """
        with self.kv_lock:
            return warm_up(self._executor)

    def release_kv_caches(self) -> None:
        """Lets go of the KV tensors (the worker freed its caches, e.g. to sleep).

        The mapping, the requests and the totals stay. Until ``rebind_kv_caches`` binds
        new tensors, a step that needs to move blocks fails (``EngineUnhealthy``, naming
        the release; a reset is then required), as no memory is there to move; steps
        that move nothing still apply.
        """
        with self._lock, self.kv_lock:
            self._executor = _ReleasedKvCaches(self.num_blocks)
        _LOGGER.info("kvdefrag: the KV caches are released; steps may not move blocks")

    def rebind_kv_caches(self, kv_caches: KvCaches, executor: SwapExecutor | None = None) -> None:
        """Moves blocks in ``kv_caches`` from now on, in place of the bound tensors.

        For a worker that re-allocated its KV caches (vllm-gaudi's ``wake_up`` after a
        sleep that discarded them). The new tensors must be laid out as the bound ones:
        the same layers, and per tensor the same shape, dtype and device kind. Their
        executor is built as at start (the HPU one warms every pad bucket as it binds)
        before it is swapped in, holding the engine lock and ``kv_lock``: no step moves
        blocks half in the old memory, half in the new.

        The mapping, the requests, the totals and the health stay as they are, and no new
        epoch starts: the open session goes on. That is right only when nothing reads the
        old content again: whatever the new tensors hold, the mapping names where each
        block's data goes from now on (any permutation is as good as another for memory
        no request reads). The caller vouches for it: every running request recomputes
        from its first token and no cached block is reused (the vLLM integration rebinds
        only after a sleep that discarded the caches, which vLLM precedes by preempting
        every request and emptying its prefix cache). A caller whose requests would read
        their old KV data after the rebind must restart the engine instead.

        Args:
            kv_caches: The worker's new per-layer ``(key, value)`` KV tensors.
            executor: A swap executor for them, instead of the one built for them.

        Raises:
            InvalidArgument: ``kv_caches`` is malformed, or two of its tensors share
                memory (both named), or not laid out as the bound caches (the message
                names the first difference), or ``executor`` moves another number of
                blocks; nothing changed: the bound caches stay.
        """
        check_same_geometry(self._kv_geometry, kv_caches, self.block_size)
        bound = executor or self._bind_executor(kv_caches)
        if bound.num_blocks != self.num_blocks:
            raise InvalidArgument(
                f"rebind_kv_caches: the executor moves {bound.num_blocks} blocks, the pool "
                f"has {self.num_blocks}"
            )
        with self._lock, self.kv_lock:
            self._executor = bound
        _LOGGER.info("kvdefrag: the service now moves blocks in the re-allocated KV caches")

    def reset(self, *, prefix_caching: bool | None = None) -> None:
        """Forgets every request, restores the identity mapping and zeroes the totals;
        healthy again.

        Args:
            prefix_caching: The mode to run in from now on; None keeps the current one.

        NOTE: the KV data stays where it is. Reset only when it no longer matters: the
        scheduler dropped its requests and its prefix cache (or restarted). The identity
        is published holding ``kv_lock``: a worker's pass running meanwhile reads one
        mapping from its start to its end, and the next pass reads the new one.
        """
        with self._lock, self.kv_lock:
            self._reset_locked(prefix_caching)
        self._notify("on_reset")

    def _reset_locked(self, prefix_caching: bool | None) -> None:
        if prefix_caching is not None:
            self.config = dataclasses.replace(self.config, prefix_caching=prefix_caching)
        self._tracker = BlockTracker(self.num_blocks, self.config.prefix_caching)
        self._pins = {}
        self._totals = Totals()
        self._unhealthy_reason = None
        self._force_defrag = False
        self._generation += 1
        self._snapshots = MappingSnapshots(self.num_blocks)
        self._published = self._publish_locked()
        self._move_log.restart()


class _ReleasedKvCaches:
    """The executor while the worker's KV caches are released: there is nothing to move."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def warmup(self) -> int:
        return 0

    def execute(self, moves: Sequence[Move]) -> MoveReport:
        raise RuntimeError(
            "the KV caches are released (the worker freed them: it sleeps); no block can "
            "move until rebind_kv_caches binds new ones"
        )


def _runs_of(fwd: list[int], block_lists: Iterable[list[int]]) -> tuple[int, ...]:
    """The runs of consecutive physical ids of each non-empty list (null block skipped):
    where a transfer of it needs a new descriptor or copy (pinned blocks never move, so
    this holds until the transfer ends)."""
    runs = []
    for logical_ids in block_lists:
        slots = [fwd[logical_id] for logical_id in logical_ids if logical_id != NULL_BLOCK_ID]
        if slots:
            runs.append(1 + sum(b != a + 1 for a, b in itertools.pairwise(slots)))
    return tuple(runs)
