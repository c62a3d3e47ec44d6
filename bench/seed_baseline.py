"""SEED-EQUIVALENT BASELINE for ``make bench`` -- not part of kvdefrag.

This module re-states, in our own words and for measurement only, the algorithm of the
project's seed: vllm-gaudi's ``OnlineDefragmenter`` and ``CacheSwapUtils``
(``vllm_gaudi/extension/defragmentation.py`` in the vllm-gaudi repository). It keeps the
seed's data structures and costs on purpose, so the benchmark compares like with like:

* reference counts in a dict keyed by *physical* id; a list of logical ids per request;
* forward/backward mapping tables as Python lists, grown on demand;
* resolve one element at a time in Python;
* every step takes ``max()`` over the used blocks; when ``max - threshold > num_used``
  it sorts all used blocks (descending), walks a generator of free slots (which sorts
  them again, ascending), pairs the highest used with the lowest free (at most 512),
  swaps reference counts and mapping entries, and hands the pairs to the KV swap;
* the KV swap expands block ids to token-slot ids and does ``index_select`` +
  ``index_copy_`` per tensor (one way, or both ways with prefix caching).

Deliberate deviations, so that it can run the benchmark's event stream at all:

* FIXED: finished requests are released *before* new blocks are added (the seed adds
  first, so an id finished and re-admitted in one step would lose its blocks, and a block
  freed and reallocated in one step would be counted twice).
* FIXED: an unknown finished id is ignored (the seed raises ``KeyError``), because a
  request can finish before it ever got a block.
* resumed lists are appended like new blocks, as in the seed; the stream always reports
  a preempted request as finished first, so appending to nothing equals replacing.
* the KV swap is injected (the benchmark counts moves instead of copying), and padding
  is only counted (the seed pads with -1, which only HPU accepts).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

PAD_BUCKETS = (8, 16, 32, 64, 128, 256, 512)

SwapFn = Callable[[list[tuple[int, int]], int], None]


class SeedEquivalentDefragmenter:
    """The seed's online defragmenter, restated (see the module docstring).

    Attributes:
        threshold: Defragment when ``max_used - threshold > num_used``.
        num_moves: Blocks moved so far.
        num_runs: Defragmentation passes that moved at least one block.
    """

    def __init__(self, swap: SwapFn, threshold: int = 32) -> None:
        self.threshold = threshold
        self.num_moves = 0
        self.num_runs = 0
        self._swap = swap
        self._refs: dict[int, int] = {}  # physical id -> reference count
        self._request_blocks: dict[str, list[int]] = {}  # logical ids per request
        self._to_physical: list[int] = []
        self._to_logical: list[int] = []

    # --- bookkeeping, as in the seed ----------------------------------------------------
    def _grow_tables(self, block_id: int) -> None:
        size = len(self._to_physical)
        if size <= block_id:
            self._to_physical.extend(range(size, block_id + 1))
            self._to_logical.extend(range(size, block_id + 1))

    def _add_ref(self, physical_id: int, delta: int) -> None:
        refs = self._refs.get(physical_id, 0) + delta
        if refs <= 0:
            del self._refs[physical_id]
        else:
            self._refs[physical_id] = refs

    def _exchange_refs(self, slot_a: int, slot_b: int) -> None:
        refs_a = self._refs.pop(slot_a, 0)
        refs_b = self._refs.pop(slot_b, 0)
        if refs_b:
            self._refs[slot_a] = refs_b
        if refs_a:
            self._refs[slot_b] = refs_a

    def resolve(self, block_id: int) -> int:
        """Logical -> physical for one id (Python, per element, like the seed)."""
        if block_id >= len(self._to_physical):
            return block_id
        return self._to_physical[block_id]

    def update(self, new_blocks: Mapping[str, Sequence[int]], finished: Iterable[str]) -> None:
        """Releases finished requests, then references new blocks (order FIXED, see top)."""
        for request_id in finished:
            for block_id in self._request_blocks.pop(request_id, ()):  # FIXED: unknown ok
                self._add_ref(self.resolve(block_id), -1)
        for request_id, block_ids in new_blocks.items():
            if not block_ids:
                continue
            self._request_blocks.setdefault(request_id, []).extend(block_ids)
            self._grow_tables(max(block_ids))
            for block_id in block_ids:
                self._add_ref(self.resolve(block_id), +1)

    # --- the defragmentation pass -------------------------------------------------------
    def _free_slots(self) -> Iterator[int]:
        """Free physical slots, lowest first: gaps between the sorted used slots, then up."""
        start = 1
        for used in sorted(self._refs):
            yield from range(start, used)
            start = used + 1
        yield from itertools.count(start)

    def defragment(self) -> int:
        """Moves up to 512 of the highest used blocks into the lowest free slots."""
        if not self._refs:
            return 0
        max_used = max(self._refs)
        if max_used - self.threshold <= len(self._refs):
            return 0
        pairs: list[tuple[int, int]] = []
        free_slots = self._free_slots()  # endless: zip stops with the used blocks
        for used, free in zip(sorted(self._refs, reverse=True), free_slots, strict=False):
            if len(pairs) == PAD_BUCKETS[-1] or free > used:
                break
            pairs.append((used, free))
        for used, free in pairs:
            self._exchange_refs(used, free)
            logical_used = self._to_logical[used]
            logical_free = self._to_logical[free]
            self._to_physical[logical_used], self._to_logical[free] = free, logical_used
            self._to_physical[logical_free], self._to_logical[used] = used, logical_free
        if pairs:
            bucket = next((size for size in PAD_BUCKETS if size >= len(pairs)), PAD_BUCKETS[-1])
            self._swap(pairs, bucket)
            self.num_moves += len(pairs)
            self.num_runs += 1
        return len(pairs)

    # --- one step of the benchmark's stream ---------------------------------------------
    def step(
        self,
        *,
        finished: Iterable[str] = (),
        new_blocks: Mapping[str, Sequence[int]] | None = None,
        resumed: Mapping[str, Sequence[int]] | None = None,
        fresh: Iterable[int] | None = None,
        evicted: Iterable[int] = (),
    ) -> dict[int, int]:
        """Applies one step the way the seed's worker would; returns new ids' physical ids.

        ``fresh`` and ``evicted`` are accepted and ignored: the seed has no such notion.
        """
        lists = {**(resumed or {}), **(new_blocks or {})}
        self.update(lists, finished)
        self.defragment()
        return {block_id: self.resolve(block_id) for ids in lists.values() for block_id in ids}

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def max_used(self) -> int:
        return max(self._refs, default=0)


class SeedEquivalentSwap:
    """The seed's KV swap, restated: slot-expanded ``index_select`` + ``index_copy_``.

    A fresh buffer is allocated by every ``index_select`` (that is the point: the seed
    reaches a fraction of memcpy bandwidth). Pads nothing (see the module docstring).
    """

    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
        block_size: int,
        two_way: bool = False,
    ) -> None:
        self._tensors = [t for pair in kv_caches for t in pair if t is not None]
        self._block_size = block_size
        self._two_way = two_way
        self._slots = torch.arange(block_size, dtype=torch.long)

    def __call__(self, pairs: list[tuple[int, int]], bucket: int) -> None:
        used_ids, free_ids = zip(*pairs, strict=True)
        used = torch.tensor(used_ids, dtype=torch.long)
        free = torch.tensor(free_ids, dtype=torch.long)
        used_slots = ((used * self._block_size).unsqueeze(-1) + self._slots).flatten()
        free_slots = ((free * self._block_size).unsqueeze(-1) + self._slots).flatten()
        for tensor in self._tensors:
            from_used = tensor.index_select(0, used_slots)
            if self._two_way:
                tensor.index_copy_(0, used_slots, tensor.index_select(0, free_slots))
            tensor.index_copy_(0, free_slots, from_used)
