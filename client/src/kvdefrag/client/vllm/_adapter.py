"""vLLM glue, duck-typed: one ``SchedulerOutput`` becomes one kvdefrag step.

Duck-typed against vLLM 0.33 ``vllm/v1/core/sched/output.py`` (no vLLM import). The
fields read, and what each becomes::

    finished_req_ids                     set          -> finished
    preempted_req_ids                    set | None   -> finished (blocks released now)
    scheduled_new_reqs[i].req_id, .block_ids (tuple of lists, one per KV-cache group),
        .num_computed_tokens                          -> new_blocks (groups flattened)
    scheduled_cached_reqs.req_ids, .new_block_ids (list of tuple-or-None),
        .resumed_req_ids (set), .num_computed_tokens  -> resumed (replace) / new_blocks
    new_block_ids_to_zero                list | None  -> fresh (derived when None)
    kv_cache_block_copies                list of (src_block_id, dst_block_id)
                                                      -> destinations are never fresh

Fresh blocks, when vLLM does not list them (``new_block_ids_to_zero`` is None, as for
most models): for new and resumed requests the blocks past
``num_computed_tokens // block_size`` (earlier ones are prefix-cache hits holding
data), for running requests every newly appended block. The null block 0 is never
fresh.

NOTE: with ``preempted_req_ids`` None (older vLLM) a preempted request's blocks are only
released when it resumes, so a block freed by preemption and handed to another request
in between still counts as live and cannot be reported fresh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvdefrag.client._client import DefragClient
from kvdefrag.client._types import StepReply
from kvdefrag.common import NULL_BLOCK_ID, InvalidArgument, StepEvents

__all__ = [
    "StepEvents",
    "VllmDefragAdapter",
    "copy_pairs",
    "events_from_scheduler_output",
]


def _flatten(block_ids: Iterable[Sequence[int]] | None) -> list[int]:
    """Flattens vLLM's per-KV-cache-group block lists into one list of ids."""
    return [block_id for group in block_ids or () for block_id in group]


def _past_computed(
    block_ids: Iterable[Sequence[int]] | None, num_computed_tokens: int, block_size: int
) -> list[int]:
    """The blocks of each group past the computed prefix: they hold no data yet.

    NOTE: a block with any computed token holds data (ceil, not floor): after a full
    prefix-cache hit vLLM recomputes the last token, so ``num_computed_tokens`` stops one
    short of a block boundary while the last hit block holds its cached KV.
    """
    first_fresh = -(-num_computed_tokens // block_size)
    return [block_id for group in block_ids or () for block_id in list(group)[first_fresh:]]


def copy_pairs(output: Any) -> list[tuple[int, int]]:
    """Returns the output's copy-on-write copies as logical ``(src, dst)`` pairs."""
    copies = getattr(output, "kv_cache_block_copies", None) or ()
    return [(int(src), int(dst)) for src, dst in copies]


def events_from_scheduler_output(output: Any, block_size: int) -> StepEvents:
    """Turns one vLLM ``SchedulerOutput`` into the events of one step (a pure function).

    Args:
        output: A vLLM 0.33 ``SchedulerOutput`` (or anything with its fields).
        block_size: Tokens per KV block.

    Returns:
        The step's events; ``fresh`` is always explicit.

    Raises:
        InvalidArgument: ``block_size`` is not positive.
    """
    if block_size < 1:
        raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
    preempted = getattr(output, "preempted_req_ids", None) or ()
    finished = sorted({*output.finished_req_ids, *preempted})
    new_blocks: dict[str, list[int]] = {}
    resumed: dict[str, list[int]] = {}
    derived_fresh: list[int] = []
    for request in output.scheduled_new_reqs:
        new_blocks[request.req_id] = _flatten(request.block_ids)
        derived_fresh += _past_computed(request.block_ids, request.num_computed_tokens, block_size)
    cached = output.scheduled_cached_reqs
    resumed_ids = set(getattr(cached, "resumed_req_ids", None) or ())
    for position, request_id in enumerate(cached.req_ids):
        block_ids = cached.new_block_ids[position]
        if request_id in resumed_ids:
            resumed[request_id] = _flatten(block_ids)
            derived_fresh += _past_computed(
                block_ids, cached.num_computed_tokens[position], block_size
            )
        elif block_ids:
            appended = _flatten(block_ids)
            if appended:
                new_blocks[request_id] = appended
                derived_fresh += appended
    to_zero = getattr(output, "new_block_ids_to_zero", None)
    candidates = derived_fresh if to_zero is None else [int(block_id) for block_id in to_zero]
    # NOTE: a copy destination holds data once the worker copied into it; and fresh
    # must name this step's blocks only (the server refuses anything else).
    holds_data = {dst for _, dst in copy_pairs(output)}
    allocated = {block_id for ids in (*new_blocks.values(), *resumed.values()) for block_id in ids}
    fresh = [
        block_id
        for block_id in dict.fromkeys(candidates)
        if block_id != NULL_BLOCK_ID and block_id not in holds_data and block_id in allocated
    ]
    return StepEvents(finished=tuple(finished), new_blocks=new_blocks, resumed=resumed, fresh=fresh)


class VllmDefragAdapter:
    """Feeds a vLLM scheduler's outputs to a ``DefragClient``, one step per output.

    ``on_scheduler_output`` runs before the forward pass that uses the output.

    Example:
        >>> adapter = VllmDefragAdapter(client, block_size=16)  # doctest: +SKIP
        >>> adapter.on_scheduler_output(scheduler_output)  # doctest: +SKIP
        >>> physical_tables = adapter.resolve_tables(block_tables)  # doctest: +SKIP
        >>> physical_copies = adapter.resolve_copies(scheduler_output)  # doctest: +SKIP
    """

    def __init__(self, client: DefragClient, block_size: int) -> None:
        """Binds the adapter to a connected client.

        Raises:
            InvalidArgument: ``block_size`` differs from the server's.
        """
        if client.block_size and client.block_size != block_size:
            raise InvalidArgument(
                f"block_size {block_size} differs from the server's {client.block_size}"
            )
        self.client = client
        self.block_size = block_size

    def on_scheduler_output(self, output: Any) -> StepReply:
        """Sends the output's block events as one step; returns the reply."""
        return self.client.step(**events_from_scheduler_output(output, self.block_size).as_kwargs())

    def resolve_tables(self, tables: Iterable[Iterable[int]]) -> list[list[int]]:
        """Maps the scheduler's block tables to physical ids (locally)."""
        return self.client.resolve_tables(tables)

    def resolve_copies(self, output: Any) -> list[tuple[int, int]]:
        """Returns the output's copy-on-write copies as physical ``(src, dst)`` pairs."""
        pairs = copy_pairs(output)
        physical_ids = self.client.resolve([block_id for pair in pairs for block_id in pair])
        return list(zip(physical_ids[::2], physical_ids[1::2], strict=True))
