"""Stand-ins for vLLM 0.33's ``SchedulerOutput``, for tests that run without vLLM.

They have exactly the fields, names and types kvdefrag reads and writes
(``vllm/v1/core/sched/output.py``): the request data classes are slotted, so touching any
other field fails. ``SchedulerOutput`` is not, as vLLM's is not: the step stamp is an
attribute set on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(slots=True)
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclasses.dataclass(slots=True)
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def cached(
    *entries: tuple[str, tuple[list[int], ...] | None, int], resumed: Iterable[str] = ()
) -> CachedRequestData:
    """Builds CachedRequestData from (req_id, new_block_ids, num_computed_tokens) entries."""
    return CachedRequestData(
        req_ids=[entry[0] for entry in entries],
        resumed_req_ids=set(resumed),
        new_block_ids=[entry[1] for entry in entries],
        num_computed_tokens=[entry[2] for entry in entries],
    )


def output(
    new: Iterable[NewRequestData] = (),
    running: CachedRequestData | None = None,
    finished: Iterable[str] = (),
    **fields: Any,
) -> SchedulerOutput:
    """One ``SchedulerOutput``; ``fields`` sets the optional ones."""
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=running or cached(),
        finished_req_ids=set(finished),
        **fields,
    )
