"""Where a ``SchedulerOutput`` names blocks, written once for both sides.

The scheduler side reads the output's block ids to learn what changed
(``_scheduler.bridge``); a worker rewrites them to physical ids before its runner reads
them (``_worker``). Duck-typed against vLLM 0.33's ``SchedulerOutput``: this module imports
neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["copy_destinations", "first_fresh_block_index", "map_block_ids"]


def map_block_ids(output: Any, to_physical: Callable[[Sequence[int]], list[int]]) -> None:
    """Rewrites, in place, every block id ``output`` names, through ``to_physical``.

    The one list of the ``SchedulerOutput`` fields that name blocks, for both sides (the
    scheduler when it rewrites, a worker when it translates); what vLLM 0.33's V1 and V2
    runners read::

        scheduled_new_reqs[i].block_ids           one list per KV-cache group
        scheduled_cached_reqs.new_block_ids[i]    None, or one list per group (appended
                                                  ids; a whole row for resumed requests)
        new_block_ids_to_zero                     None or a list
        kv_cache_block_copies                     (src, dst) pairs (absent before 0.33)

    Args:
        output: The ``SchedulerOutput``.
        to_physical: Maps a list of logical ids to their physical ids, in order.
    """
    for request in output.scheduled_new_reqs:
        request.block_ids = tuple(to_physical(group) for group in request.block_ids)
    cached = output.scheduled_cached_reqs
    cached.new_block_ids = [
        None if groups is None else tuple(to_physical(group) for group in groups)
        for groups in cached.new_block_ids
    ]
    if output.new_block_ids_to_zero:
        output.new_block_ids_to_zero = to_physical(output.new_block_ids_to_zero)
    copies = getattr(output, "kv_cache_block_copies", None)
    if copies:
        pairs = [to_physical([int(copy[0]), int(copy[1])]) for copy in copies]
        output.kv_cache_block_copies = [
            (src, dst) if type(copy) is tuple else type(copy)(src, dst)
            for copy, (src, dst) in zip(copies, pairs, strict=True)
        ]


def copy_destinations(output: Any) -> frozenset[int]:
    """Logical ids ``output`` copies into (copy-on-write targets): they must keep the data
    the copy writes, so they are never fresh."""
    copies = getattr(output, "kv_cache_block_copies", None) or ()
    return frozenset(int(copy[1]) for copy in copies)


def first_fresh_block_index(num_computed_tokens: int, block_size: int) -> int:
    """The index of a scheduled request's first block that holds no computed token.

    Blocks from there on hold no data yet (fresh): the engine may place them anywhere
    without a copy.

    NOTE: a block holding some computed tokens is not fresh: after a full prefix-cache hit
    vLLM recomputes only the last token, so ``num_computed_tokens`` stops one short of a
    block boundary and the last hit block must keep its data (hence ceil, not floor).
    """
    return -(-num_computed_tokens // block_size)
