"""The one swap executor double: a real executor that a test scripts faults into.

``ScriptedExecutor`` implements the engine's ``SwapExecutor`` protocol around a real
executor, so KV data really moves, and records every batch it is asked to move. A test
scripts what goes wrong, per call or from now on::

    executor = ScriptedExecutor.for_kv(kv)
    executor.fail_next()               # the next batch raises, nothing moved
    executor.moves_before_failing = lambda moves: moves[:2]  # ... after two moves ran
    executor.is_failing = True         # every batch raises until set back
    executor.stall_next(1.5)           # the next batch takes 1.5 s longer
    executor.hold(); executor.entered.wait(); executor.release()  # a batch that hangs
    executor.fail_mid_write(2, at_write=1)  # tensor 2's first write fails halfway
    executor.drops_moves = True        # batches claim success and copy nothing
    executor.calls                     # every batch, in order

Each fault raises ``RuntimeError(INJECTED_FAILURE)`` (the engine wraps it in
``EngineUnhealthy``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvdefrag.server import Move, MoveReport, SwapExecutor
from kvdefrag.server._executor import pad_to_bucket
from kvdefrag.server._executor_cpu import CpuSwapExecutor

from support.kv import SignedKv

INJECTED_FAILURE = "injected KV copy failure"
# How long a held batch waits for release() before the double gives up (and fails).
HOLD_LIMIT_S = 60.0


class _WriteFault:
    """A failure inside one tensor's writes: the n-th write, or the write of the n-th row,
    of ``tensor_index`` (both counted from 1, over every thread) fails partway."""

    def __init__(self, tensor_index: int, at_write: int | None, at_row: int | None) -> None:
        self.tensor_index = tensor_index
        self.at_write = at_write
        self.at_row = at_row
        self.num_writes = 0
        self.num_rows = 0

    def rows_before_failing(self, indices: Any) -> int | None:
        """Counts one write; returns how many of its rows go through before it fails, or
        None when this write does not fail."""
        num_rows = int(np.size(indices))
        first_row = self.num_rows + 1
        self.num_writes += 1
        self.num_rows += num_rows
        if self.at_write is not None and self.num_writes == self.at_write:
            return num_rows // 2 if np.ndim(indices) else 0
        if self.at_row is not None and first_row <= self.at_row <= self.num_rows:
            return self.at_row - first_row if np.ndim(indices) else 0
        return None


class _FaultableCpuSwapExecutor(CpuSwapExecutor):
    """The real CPU executor, whose writes a ``_WriteFault`` can break partway."""

    def __init__(self, kv_caches: Any, block_size: int, num_threads: int = 0) -> None:
        super().__init__(kv_caches, block_size, num_threads=num_threads)
        self.write_fault: _WriteFault | None = None
        self.failed_writes: list[int] = []
        self._fault_lock = threading.Lock()

    def write_rows(self, rows: Any, indices: Any, data: Any) -> None:
        fault = self.write_fault
        if fault is not None and rows is self._rows[fault.tensor_index]:
            with self._fault_lock:
                num_before = fault.rows_before_failing(indices)
                if num_before is not None:
                    self.write_fault = None  # once
                    at = fault.at_write if fault.at_write is not None else fault.at_row
                    assert at is not None
                    self.failed_writes.append(at)
            if num_before is not None:
                if num_before:
                    super().write_rows(rows, indices[:num_before], data[:num_before])
                raise RuntimeError(INJECTED_FAILURE)
        super().write_rows(rows, indices, data)


class ScriptedExecutor:
    """A real swap executor with scripted faults, recording every batch.

    Build it with ``for_kv`` (the real CPU executor of signed caches; every fault
    available), ``around`` (any real executor) or ``without_kv`` (nothing to move: only
    failing or dropping batches make sense).

    Attributes:
        calls: Every batch asked for, in order (faulty ones too).
        entered: Set when a batch starts (before a hold).
        is_failing: While True, every batch fails.
        moves_before_failing: Picks the moves of a failing batch that really run before
            it fails (a device lost partway); None: none run.
        drops_moves: While True, batches that do not fail report success and copy
            nothing (the data stays behind).
    """

    def __init__(self, inner: SwapExecutor | None, num_blocks: int) -> None:
        self._inner: Any = inner
        self.num_blocks = num_blocks
        self.calls: list[list[Move]] = []
        self.entered = threading.Event()
        self.is_failing = False
        self.moves_before_failing: Callable[[list[Move]], list[Move]] | None = None
        self.drops_moves = False
        self._pad_buckets: Sequence[int] = ()
        self._failing_calls: set[int] = set()
        self._stall_next_s = 0.0
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()

    @classmethod
    def for_kv(cls, kv: SignedKv, *, num_threads: int = 0) -> ScriptedExecutor:
        """Wraps the real CPU executor of ``kv`` (``num_threads`` 0: torch's count)."""
        inner = _FaultableCpuSwapExecutor(kv.kv_caches, kv.block_size, num_threads)
        return cls(inner, inner.num_blocks)

    @classmethod
    def around(cls, inner: SwapExecutor) -> ScriptedExecutor:
        """Wraps ``inner`` (any real executor; mid-write faults need ``for_kv``)."""
        return cls(inner, inner.num_blocks)

    @classmethod
    def without_kv(cls, num_blocks: int) -> ScriptedExecutor:
        """A double with no KV data behind it: a batch that should move fails the test."""
        return cls(None, num_blocks)

    # --- the script -------------------------------------------------------------------
    def fail_next(self) -> None:
        """The next batch fails (once)."""
        self.fail_on_call(self.num_calls + 1)

    def fail_on_call(self, number: int) -> None:
        """The ``number``-th batch (counting every batch since creation, from 1) fails."""
        self._failing_calls.add(number)

    def stall_next(self, seconds: float) -> None:
        """The next batch sleeps ``seconds`` before it runs (or fails)."""
        self._stall_next_s = seconds

    def hold(self) -> None:
        """Batches from now on block until ``release()`` (``entered`` tells one came)."""
        self.entered.clear()
        self._gate.clear()

    def release(self) -> None:
        """Lets held and later batches run."""
        self._gate.set()

    def pad_to(self, buckets: Sequence[int]) -> None:
        """Pads every batch to the smallest bucket with null pairs, as static-shape
        backends do, and reports the padding."""
        self._pad_buckets = tuple(buckets)

    def fail_mid_write(
        self, tensor_index: int, *, at_write: int | None = None, at_row: int | None = None
    ) -> None:
        """A write into the ``tensor_index``-th KV tensor fails partway, once.

        Args:
            tensor_index: Position among the caches' tensors (k0, v0, k1, v1, ...).
            at_write: The n-th write into that tensor fails after half its rows.
            at_row: The write of the n-th row written into that tensor fails after the
                rows before that one.
        """
        assert (at_write is None) != (at_row is None), "give at_write or at_row"
        inner = self._inner
        assert isinstance(inner, _FaultableCpuSwapExecutor), "mid-write faults need for_kv"
        inner.write_fault = _WriteFault(tensor_index, at_write, at_row)

    # --- what happened ----------------------------------------------------------------
    @property
    def num_calls(self) -> int:
        """How many batches were asked for."""
        return len(self.calls)

    @property
    def failed_writes(self) -> list[int]:
        """The ``at_write`` or ``at_row`` of every mid-write fault that fired."""
        inner = self._inner
        return list(inner.failed_writes) if isinstance(inner, _FaultableCpuSwapExecutor) else []

    @property
    def bytes_per_block(self) -> int:
        """The real executor's bytes per block, over every tensor."""
        assert self._inner is not None, "without_kv: no KV tensors"
        return int(self._inner.bytes_per_block)

    # --- the protocol -----------------------------------------------------------------
    def execute(self, moves: Sequence[Move]) -> MoveReport:
        batch = list(moves)
        with self._lock:
            self.calls.append(batch)
            number = len(self.calls)
        self.entered.set()
        assert self._gate.wait(HOLD_LIMIT_S), "the test never released the held batch"
        stall_s, self._stall_next_s = self._stall_next_s, 0.0
        if stall_s:
            time.sleep(stall_s)
        if self.is_failing or number in self._failing_calls:
            self._failing_calls.discard(number)
            if self.moves_before_failing is not None:
                self._move(self.moves_before_failing(batch))
            raise RuntimeError(INJECTED_FAILURE)
        if self.drops_moves:
            return MoveReport(num_moves=len(batch), num_padded=0, num_bytes=0)
        return self._move(batch)

    def _move(self, batch: list[Move]) -> MoveReport:
        inner = self._inner
        assert inner is not None, "without_kv: a batch that should move reached the double"
        if not self._pad_buckets or not batch:
            return inner.execute(batch)
        src_ids, dst_ids, num_padded = pad_to_bucket(
            [move.src_physical_id for move in batch],
            [move.dst_physical_id for move in batch],
            self._pad_buckets,
        )
        is_two_way = [move.is_two_way for move in batch] + [False] * num_padded
        report = inner.execute(
            [Move(*move) for move in zip(src_ids, dst_ids, is_two_way, strict=True)]
        )
        num_bytes = report.num_bytes - num_padded * self.bytes_per_block
        return MoveReport(len(batch), num_padded, num_bytes)
