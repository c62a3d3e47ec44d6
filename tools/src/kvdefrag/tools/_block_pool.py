"""vLLM 0.33's KV block pool, modelled for the synthetic workload (pure Python).

The order blocks are handed out in is what makes vLLM's pool fragment; the free-queue
diagram and its rules are in ``kvdefrag.tools.workload``'s docstring.

Two orders for blocks that become free (``FREE_ORDERS``):

* ``"lifo"`` (vLLM 0.33, the default): a block freed without a prefix-cache entry goes to
  the *front* of the free queue, so it is the next one handed out; cached ones go to the
  tail.
* ``"fifo"`` (earlier vLLM v1 releases, e.g. the ones vllm-gaudi pinned): every freed
  block goes to the *tail*, so the pool hands out every other free block before it reuses
  one.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, Sequence

from kvdefrag.common import NULL_BLOCK_ID, InvalidArgument

FREE_ORDERS = ("lifo", "fifo")


class FreeBlockQueue:
    """Free block ids in eviction order, as a doubly linked list over the ids.

    Like vLLM's ``FreeKVCacheBlockQueue``: starts as ``1, 2, ..., num_blocks - 1``; O(1)
    pop from the front, removal from the middle, batch prepend and append.

    Invariants: every id in ``[1, num_blocks)`` is either in the queue once or out of it;
    block 0 is never in it.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, f"a pool needs the null block and one more, got {num_blocks}"
        self._head = num_blocks
        self._tail = num_blocks + 1
        # Node i links to its neighbours; the two sentinels sit after the block ids.
        self._next = [-1] * (num_blocks + 2)
        self._prev = [-1] * (num_blocks + 2)
        order = [self._head, *range(1, num_blocks), self._tail]
        for node, next_node in itertools.pairwise(order):
            self._next[node] = next_node
            self._prev[next_node] = node
        self._queued = bytearray(b"\x01") * num_blocks
        self._queued[NULL_BLOCK_ID] = 0
        self._size = num_blocks - 1

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_id: object) -> bool:
        return (
            isinstance(block_id, int)
            and 0 <= block_id < len(self._queued)
            and bool(self._queued[block_id])
        )

    def __iter__(self) -> Iterator[int]:
        """Yields the queued ids front to back (O(len); for tests and audits)."""
        node = self._next[self._head]
        while node != self._tail:
            yield node
            node = self._next[node]

    def popleft(self) -> int:
        """Removes and returns the front id.

        Raises:
            IndexError: The queue is empty.
        """
        block_id = self._next[self._head]
        if block_id == self._tail:
            raise IndexError("the free block queue is empty")
        self.remove(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        """Takes a queued id out of the queue, wherever it is."""
        assert self._queued[block_id], f"block {block_id} is not in the free queue"
        prev_id, next_id = self._prev[block_id], self._next[block_id]
        self._next[prev_id] = next_id
        self._prev[next_id] = prev_id
        self._queued[block_id] = 0
        self._size -= 1

    def prepend(self, block_ids: Sequence[int]) -> None:
        """Puts ids at the front, keeping their order (``block_ids[0]`` pops first)."""
        for block_id in reversed(block_ids):
            self._link_after(self._head, block_id)

    def append(self, block_ids: Iterable[int]) -> None:
        """Puts ids at the tail, in order (the last one is evicted last)."""
        for block_id in block_ids:
            self._link_after(self._prev[self._tail], block_id)

    def _link_after(self, node: int, block_id: int) -> None:
        assert block_id != NULL_BLOCK_ID, "the null block is never free"
        assert not self._queued[block_id], f"block {block_id} is already in the free queue"
        next_id = self._next[node]
        self._next[node] = block_id
        self._prev[block_id] = node
        self._next[block_id] = next_id
        self._prev[next_id] = block_id
        self._queued[block_id] = 1
        self._size += 1


class BlockPool:
    """Reference counts, the free queue and the prefix cache of one KV pool (vLLM's rules).

    Invariants: a block with a reference count above 0 is not in the free queue, every
    other block but the null block is; a block has a cache key iff it is listed under that
    key in the cache; cached blocks are never deduplicated (two copies of one prefix may
    be cached, lookups return the first one cached).

    Args:
        num_blocks: Blocks in the pool, null block included.
        enable_caching: Keep prefix-cache entries of freed full blocks.
        free_order: Where freed blocks go, one of ``FREE_ORDERS`` (module docstring).

    Raises:
        InvalidArgument: ``free_order`` is not one of ``FREE_ORDERS``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, free_order: str = "lifo") -> None:
        if free_order not in FREE_ORDERS:
            raise InvalidArgument(
                f"free_order must be one of {', '.join(FREE_ORDERS)}, got {free_order!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_order = free_order
        self.free_queue = FreeBlockQueue(num_blocks)
        self.ref_counts = [0] * num_blocks
        self.num_live = 0
        self._keys: list[Hashable | None] = [None] * num_blocks
        self._cache: dict[Hashable, dict[int, None]] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated (cached free blocks included)."""
        return len(self.free_queue)

    def block_key(self, block_id: int) -> Hashable | None:
        """The prefix-cache key of a block, None when it is not cached."""
        return self._keys[block_id]

    def lookup(self, key: Hashable) -> int | None:
        """The first cached block with this key, None on a miss."""
        cached = self._cache.get(key)
        return next(iter(cached)) if cached else None

    def allocate(self, count: int) -> tuple[list[int], list[int]]:
        """Pops ``count`` blocks from the front of the free queue.

        Returns:
            The allocated ids, and those among them whose cache entry was evicted.
        """
        assert count <= self.num_free, f"allocate({count}) with {self.num_free} free blocks"
        allocated: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            block_id = self.free_queue.popleft()
            if self._keys[block_id] is not None:
                self._uncache(block_id)
                evicted.append(block_id)
            self.ref_counts[block_id] = 1
            self.num_live += 1
            allocated.append(block_id)
        return allocated, evicted

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each (prefix-cache hits); a free block leaves the queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                self.free_queue.remove(block_id)
                self.num_live += 1
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drops one reference from each block, given in eviction order (first goes first).

        ``"lifo"``: blocks that become free without a cache entry go to the front of the
        queue, cached ones to the tail. ``"fifo"``: all of them go to the tail, in order.

        Returns:
            The blocks that became free.
        """
        freed: list[int] = []
        for block_id in block_ids:
            refs = self.ref_counts[block_id] - 1
            assert refs >= 0, f"block {block_id} freed with no references"
            self.ref_counts[block_id] = refs
            if refs == 0:
                freed.append(block_id)
        self.num_live -= len(freed)
        if self.free_order == "fifo":
            self.free_queue.append(freed)
            return freed
        keys = self._keys
        uncached = [block_id for block_id in freed if keys[block_id] is None]
        cached = [block_id for block_id in freed if keys[block_id] is not None]
        self.free_queue.prepend(uncached)
        self.free_queue.append(cached)
        return uncached + cached

    def cache(self, block_id: int, key: Hashable) -> None:
        """Registers a full block under its content key."""
        assert self._keys[block_id] is None, f"block {block_id} is already cached"
        self._keys[block_id] = key
        self._cache.setdefault(key, {})[block_id] = None

    def _uncache(self, block_id: int) -> None:
        key = self._keys[block_id]
        cached = self._cache[key]
        del cached[block_id]
        if not cached:
            del self._cache[key]
        self._keys[block_id] = None
