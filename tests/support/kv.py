"""Factories for real torch KV caches whose blocks carry a distinct signature.

A KV cache is laid out as kvdefrag binds it: one ``(key, value)`` pair per layer, each
tensor ``[num_blocks * block_size, num_heads, head_size]`` (flat token slots), ``value``
None for MLA models (vllm-gaudi's own layout: ``support.gaudi_kv``).

Every block of every tensor can be filled with a *signature* derived from
``(logical_id, version, tensor_index)``: a pseudo-random pattern of small integers, exact
in every dtype used here (int8, float8, float16, bfloat16, float32), so a lost, stale or
misplaced block reads back as a mismatch instead of passing by accident::

    physical slot:   0        1        2        3   ...
    rows:          | null   | L7 v2  | L3 v0  | L9 v1 | ...   (L = logical id, v = version)

``SignedKv`` keeps the expected version of every logical id; tests write a new version
into ``engine.resolve(logical_id)`` when a block becomes fresh and check that every
block whose content must survive still reads its own signature.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common.digest import (
    DIGEST_INCREMENT,
    DIGEST_MULTIPLIER_1,
    DIGEST_MULTIPLIER_2,
    MASK64,
)

KvCaches = list[tuple[torch.Tensor, torch.Tensor | None]]

_MASK64 = np.uint64(MASK64)
SIGNATURE_RANGE = 201  # values in [-100, 100]: exact in int8, float16, bfloat16, float32
FP8_SIGNATURE_RANGE = 17  # values in [-8, 8]: exact in float8_e4m3fn and float8_e5m2


class Resolver(Protocol):
    """Anything that maps logical block ids to physical ones (the engine)."""

    def resolve(self, logical_ids: Sequence[int]) -> npt.NDArray[np.int64]: ...


def make_kv_caches(
    num_blocks: int,
    *,
    block_size: int = 4,
    num_layers: int = 2,
    num_heads: int = 2,
    head_size: int = 4,
    dtype: torch.dtype = torch.float32,
    mla: bool = False,
) -> KvCaches:
    """Builds zero-filled per-layer ``(key, value)`` caches on the CPU.

    Args:
        num_blocks: Blocks in the pool, the null block included.
        block_size: Token slots per block.
        num_layers: Number of ``(key, value)`` pairs.
        num_heads: Second dimension of every tensor.
        head_size: Third dimension of every tensor.
        dtype: Element type of every tensor.
        mla: When True every ``value`` is None (MLA models keep one latent cache).

    Returns:
        The caches, each tensor ``[num_blocks * block_size, num_heads, head_size]``.
    """
    shape = (num_blocks * block_size, num_heads, head_size)
    return [
        (
            torch.zeros(shape, dtype=dtype),
            None if mla else torch.zeros(shape, dtype=dtype),
        )
        for _ in range(num_layers)
    ]


def kv_tensors(kv_caches: KvCaches) -> list[torch.Tensor]:
    """Returns the caches' tensors in binding order (key, value per layer; None skipped)."""
    return [tensor for pair in kv_caches for tensor in pair if tensor is not None]


def _mix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64 finaliser, vectorised (uint64 arithmetic wraps silently in arrays)."""
    z = values ^ (values >> np.uint64(30))
    z = (z * np.uint64(DIGEST_MULTIPLIER_1)) & _MASK64
    z = z ^ (z >> np.uint64(27))
    z = (z * np.uint64(DIGEST_MULTIPLIER_2)) & _MASK64
    return z ^ (z >> np.uint64(31))


def block_signature(
    logical_ids: Sequence[int] | npt.NDArray[np.int64],
    versions: Sequence[int] | npt.NDArray[np.int64],
    tensor_index: int,
    elements_per_block: int,
    value_range: int = SIGNATURE_RANGE,
) -> npt.NDArray[np.int64]:
    """Returns the signature rows of blocks: one row of small integers per block.

    Args:
        logical_ids: The blocks' logical ids.
        versions: The version of each block's content (bumped on every rewrite).
        tensor_index: Which KV tensor (binding order), so key/value/layers differ.
        elements_per_block: Elements of one block in that tensor.
        value_range: How many distinct values an element takes (centred on 0).

    Returns:
        An int64 array ``[len(logical_ids), elements_per_block]``.
    """
    logical = np.asarray(logical_ids, dtype=np.uint64)[:, None]
    version = np.asarray(versions, dtype=np.uint64)[:, None]
    element = np.arange(elements_per_block, dtype=np.uint64)[None, :]
    seed = _mix64(
        (logical << np.uint64(40)) ^ (version << np.uint64(16)) ^ np.uint64(tensor_index + 1)
    )
    mixed = _mix64(seed ^ (element * np.uint64(DIGEST_INCREMENT) & _MASK64))
    return (mixed % np.uint64(value_range)).astype(np.int64) - value_range // 2


def signature_range(dtype: torch.dtype) -> int:
    """Returns how many distinct small integers ``dtype`` holds exactly (see above)."""
    if dtype.is_floating_point and torch.finfo(dtype).bits == 8:
        return FP8_SIGNATURE_RANGE
    return SIGNATURE_RANGE


class SignedKv:
    """KV caches plus the signature version every logical block is expected to hold.

    At construction every block ``l`` gets version 0 of logical ``l`` at physical ``l``
    (the identity mapping an engine starts with), the null block included.

    Attributes:
        kv_caches: The caches (bind them to an engine).
        block_size: Token slots per block.
        num_blocks: Blocks in the pool.
        versions: Expected version per logical id.
    """

    def __init__(self, kv_caches: KvCaches, block_size: int) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        tensors = kv_tensors(kv_caches)
        self.num_blocks = tensors[0].shape[0] // block_size
        self._views = [tensor.view(self.num_blocks, -1) for tensor in tensors]
        self.versions = np.zeros(self.num_blocks, dtype=np.int64)
        all_ids = np.arange(self.num_blocks, dtype=np.int64)
        self._write_rows(all_ids, all_ids)

    @classmethod
    def create(cls, num_blocks: int, *, block_size: int = 4, **options: object) -> SignedKv:
        """Builds fresh caches (see ``make_kv_caches`` for options) and signs them."""
        caches = make_kv_caches(num_blocks, block_size=block_size, **options)  # type: ignore[arg-type]
        return cls(caches, block_size)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across every tensor (what a move of it writes)."""
        return sum(view[0].numel() * view.element_size() for view in self._views)

    def _write_rows(
        self, logical_ids: npt.NDArray[np.int64], physical_ids: npt.NDArray[np.int64]
    ) -> None:
        versions = self.versions[logical_ids]
        index = torch.from_numpy(np.ascontiguousarray(physical_ids, dtype=np.int64))
        for tensor_index, view in enumerate(self._views):
            rows = block_signature(
                logical_ids, versions, tensor_index, view.shape[1], signature_range(view.dtype)
            )
            view[index] = torch.from_numpy(rows).to(view.dtype)

    def write(self, logical_ids: Iterable[int], physical_ids: Iterable[int]) -> None:
        """Gives each logical block a new version and writes it at the physical slot."""
        logical = np.asarray(list(logical_ids), dtype=np.int64)
        physical = np.asarray(list(physical_ids), dtype=np.int64)
        assert logical.shape == physical.shape, "one physical slot per logical block"
        if not logical.size:
            return
        assert len(set(logical.tolist())) == logical.size, "write each block once"
        self.versions[logical] += 1
        self._write_rows(logical, physical)

    def write_fresh(self, engine: Resolver, logical_ids: Iterable[int]) -> None:
        """Writes a new version of each block where the engine says it lives now.

        This is what the worker's forward pass does with a fresh block's KV.
        """
        logical = sorted(set(logical_ids))
        self.write(logical, engine.resolve(logical).tolist())

    def mismatched(self, logical_ids: Iterable[int], physical_ids: Iterable[int]) -> list[int]:
        """Returns the logical ids whose physical slot does not hold their signature."""
        logical = np.asarray(list(logical_ids), dtype=np.int64)
        physical = np.asarray(list(physical_ids), dtype=np.int64)
        if not logical.size:
            return []
        index = torch.from_numpy(physical)
        bad = np.zeros(logical.size, dtype=np.bool_)
        versions = self.versions[logical]
        for tensor_index, view in enumerate(self._views):
            expected = block_signature(
                logical, versions, tensor_index, view.shape[1], signature_range(view.dtype)
            )
            actual = view[index].to(torch.float64).numpy()
            bad |= (actual != expected).any(axis=1)
        return sorted(logical[bad].tolist())

    def lost_blocks(self, engine: Resolver, logical_ids: Iterable[int]) -> list[int]:
        """Returns the logical ids that do not read their own signature via the engine."""
        logical = sorted(set(logical_ids))
        return self.mismatched(logical, engine.resolve(logical).tolist())
