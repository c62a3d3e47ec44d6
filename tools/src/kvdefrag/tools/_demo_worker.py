"""The demo's worker: it fills KV blocks as a forward pass would and checks them later.

Pure test equipment for ``kvdefrag demo`` / ``replay``: an embedded CPU KV cache, a
distinct signature per written block, and the live set rebuilt from the step events.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common import NULL_BLOCK_ID, StepEvents

# Signature values: base (< 2**23) + pattern (< 2**22) < 2**24, exact in float32.
_BASE_MASK = (1 << 23) - 1
_PATTERN_MASK = (1 << 22) - 1
_STAMP_MULTIPLIER = 2_654_435_761  # odd: distinct stamps give distinct signatures
_TENSOR_MULTIPLIER = 40_503
_ELEMENT_MULTIPLIER = 97


def make_kv_caches(
    num_blocks: int,
    block_size: int,
    *,
    num_layers: int = 2,
    num_kv_heads: int = 2,
    head_size: int = 8,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An embedded CPU KV cache in vLLM's layout (float32: every signature is exact)."""
    shape = (num_blocks * block_size, num_kv_heads, head_size)
    return [
        (torch.zeros(shape, dtype=torch.float32), torch.zeros(shape, dtype=torch.float32))
        for _ in range(num_layers)
    ]


class KvSignatures:
    """The worker's side of the KV cache: it fills blocks and checks what it reads back.

    Each write gives a logical block a new *stamp* (unique over the run). Element ``e``
    of the block in tensor ``t`` then holds ``base(stamp) + pattern_t[e]``, where ``base``
    is distinct for distinct stamps (over the first 2**23 writes) and ``pattern_t``
    differs per tensor and element: a block copied to the wrong slot, tensor or offset
    reads back wrong. Every value is an integer below 2**24, exact in float32.

    Invariants: ``stamps[l] >= 0`` iff logical block ``l`` was written and not forgotten.
    All tensor access happens under ``lock`` (the engine's ``kv_lock``).
    """

    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        lock: threading.Lock,
    ) -> None:
        tensors = [tensor for pair in kv_caches for tensor in pair]
        self.num_blocks = tensors[0].shape[0] // block_size
        self._views = [tensor.view(self.num_blocks, -1) for tensor in tensors]
        elements = torch.arange(self._views[0].shape[1], dtype=torch.int64)
        self._patterns = [
            ((elements * _ELEMENT_MULTIPLIER + index * _TENSOR_MULTIPLIER) & _PATTERN_MASK).to(
                torch.float32
            )[None, :]
            for index in range(len(self._views))
        ]
        self._lock = lock
        self.stamps: npt.NDArray[np.int64] = np.full(self.num_blocks, -1, dtype=np.int64)
        self._next_stamp = 0

    @staticmethod
    def _bases(stamps: npt.NDArray[np.int64]) -> torch.Tensor:
        bases = (torch.from_numpy(stamps) * _STAMP_MULTIPLIER) & _BASE_MASK
        return bases.to(torch.float32)[:, None]

    def write(self, logical_ids: Sequence[int], physical_ids: Sequence[int]) -> None:
        """Fills each logical block (new stamp) at its physical slot: the forward pass."""
        if not logical_ids:
            return
        stamps = np.arange(self._next_stamp, self._next_stamp + len(logical_ids), dtype=np.int64)
        self._next_stamp += len(logical_ids)
        self.stamps[np.asarray(logical_ids, dtype=np.int64)] = stamps
        index = torch.as_tensor(physical_ids, dtype=torch.int64)
        bases = self._bases(stamps)
        with self._lock:
            for view, pattern in zip(self._views, self._patterns, strict=True):
                view.index_copy_(0, index, (bases + pattern).to(view.dtype))

    def forget(self, logical_ids: Iterable[int]) -> None:
        """Marks blocks whose content no longer matters."""
        self.stamps[np.fromiter(logical_ids, dtype=np.int64)] = -1

    def corrupted(
        self, logical_ids: Sequence[int], physical_ids: Sequence[int]
    ) -> list[tuple[int, int]]:
        """Returns the (logical, physical) pairs whose slot does not hold the block's data."""
        if not logical_ids:
            return []
        logical = np.asarray(logical_ids, dtype=np.int64)
        stamps = self.stamps[logical]
        bad = torch.from_numpy(stamps < 0)  # never written: nothing to find there
        index = torch.as_tensor(physical_ids, dtype=torch.int64)
        bases = self._bases(stamps)
        with self._lock:
            for view, pattern in zip(self._views, self._patterns, strict=True):
                actual = view.index_select(0, index).to(torch.float32)
                bad |= (actual != bases + pattern).any(dim=1)
        return [
            (int(logical[i]), int(physical_ids[i])) for i in torch.nonzero(bad).flatten().tolist()
        ]


class LogicalPool:
    """The live set as the engine sees it, rebuilt from the step events alone.

    Invariants: ``refs[l]`` is the number of references running requests hold on logical
    block ``l`` (block 0 is never counted), ``tables`` every running request's blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        self.refs: npt.NDArray[np.int32] = np.zeros(num_blocks, dtype=np.int32)
        self.tables: dict[str, list[int]] = {}

    @staticmethod
    def _counted(block_ids: Iterable[int]) -> npt.NDArray[np.int64]:
        ids = np.fromiter(block_ids, dtype=np.int64)
        counted: npt.NDArray[np.int64] = ids[ids != NULL_BLOCK_ID]
        return counted

    def apply(self, events: StepEvents) -> tuple[list[int], list[int]]:
        """Applies one step's references in the engine's order.

        Returns:
            The logical ids that became live, and those that became free.
        """
        before = self.refs.copy()
        for request_id in [*events.finished, *events.resumed]:
            np.subtract.at(self.refs, self._counted(self.tables.pop(request_id, ())), 1)
        for lists in (events.resumed, events.new_blocks):
            for request_id, block_ids in lists.items():
                self.tables.setdefault(request_id, []).extend(block_ids)
                np.add.at(self.refs, self._counted(block_ids), 1)
        changed = np.flatnonzero(before != self.refs)
        became_live = changed[(before[changed] == 0) & (self.refs[changed] > 0)]
        became_free = changed[(before[changed] > 0) & (self.refs[changed] == 0)]
        return became_live.tolist(), became_free.tolist()

    @property
    def num_live(self) -> int:
        return int(np.count_nonzero(self.refs))

    def max_live(self) -> int:
        """Highest live logical id (0 when nothing is live)."""
        live = np.flatnonzero(self.refs)
        return int(live[-1]) if live.size else 0

    def live_ids(self) -> list[int]:
        return np.flatnonzero(self.refs).tolist()
