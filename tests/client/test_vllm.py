"""vLLM glue: SchedulerOutput -> one step, with stand-ins that have exactly vLLM's fields.

The stand-ins are slotted dataclasses with the vLLM 0.33 names and types of the fields
the adapter reads (``vllm/v1/core/sched/output.py``), so reading anything else fails.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient, InvalidArgument
from kvdefrag.client.vllm import (
    VllmDefragAdapter,
    copy_pairs,
    events_from_scheduler_output,
)
from kvdefrag.server import ServerHandle

from support.kv import SignedKv
from support.server import Serve

BLOCK_SIZE = 4


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


@dataclasses.dataclass(slots=True)
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
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=running or cached(),
        finished_req_ids=set(finished),
        **fields,
    )


# --- the pure conversion ----------------------------------------------------------------
def test_new_requests_flatten_groups_and_prefix_hits_are_not_fresh() -> None:
    out = output(
        new=[
            NewRequestData("a", ([3, 4, 5],), num_computed_tokens=2 * BLOCK_SIZE),
            NewRequestData("b", ([6, 7], [8, 9]), num_computed_tokens=BLOCK_SIZE + 1),
        ]
    )

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.new_blocks == {"a": [3, 4, 5], "b": [6, 7, 8, 9]}
    # a: 2 computed blocks are hits; b: a block with any computed token holds data.
    assert events.fresh == [5]
    assert events.finished == ()
    assert events.resumed == {}


def test_running_requests_append_and_every_appended_block_is_fresh() -> None:
    out = output(running=cached(("a", ([11],), 40), ("b", None, 12), ("c", ([],), 3)))

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.new_blocks == {"a": [11]}
    assert events.fresh == [11]


def test_resumed_requests_replace_their_list_and_hits_are_not_fresh() -> None:
    out = output(
        running=cached(("a", ([2, 3, 12],), 2 * BLOCK_SIZE), ("b", ([13],), 0), resumed={"a"})
    )

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.resumed == {"a": [2, 3, 12]}
    assert events.new_blocks == {"b": [13]}
    assert events.fresh == [12, 13]


def test_preempted_requests_are_released_now_like_finished_ones() -> None:
    out = output(finished={"z", "a"}, preempted_req_ids={"p", "a"})

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.finished == ("a", "p", "z")  # deduplicated, in a deterministic order


def test_preempted_none_releases_nothing_extra() -> None:
    events = events_from_scheduler_output(output(finished={"a"}, preempted_req_ids=None), 4)

    assert events.finished == ("a",)


def test_a_request_finished_and_readmitted_in_one_step_is_in_both_fields() -> None:
    out = output(new=[NewRequestData("a", ([7],), 0)], finished={"a"})

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.finished == ("a",)
    assert events.new_blocks == {"a": [7]}
    assert events.fresh == [7]


def test_the_null_block_is_kept_in_lists_but_never_fresh() -> None:
    out = output(new=[NewRequestData("a", ([0, 0, 5],), 0)])

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.new_blocks == {"a": [0, 0, 5]}
    assert events.fresh == [5]


def test_new_block_ids_to_zero_replaces_the_derived_fresh_blocks() -> None:
    out = output(
        new=[NewRequestData("a", ([3, 4],), 0)],
        running=cached(("b", ([9],), 8)),
        new_block_ids_to_zero=[4, 9, 30, 0],  # 30 is not this step's: never reported fresh
    )

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.fresh == [4, 9]


def test_an_empty_new_block_ids_to_zero_means_nothing_is_fresh() -> None:
    out = output(new=[NewRequestData("a", ([3, 4],), 0)], new_block_ids_to_zero=[])

    assert events_from_scheduler_output(out, BLOCK_SIZE).fresh == []


@pytest.mark.parametrize("to_zero", [None, [5, 6]])
def test_copy_destinations_hold_data_and_are_never_fresh(to_zero: list[int] | None) -> None:
    out = output(
        running=cached(("a", ([5, 6],), 8)),
        new_block_ids_to_zero=to_zero,
        kv_cache_block_copies=[(2, 6)],
    )

    events = events_from_scheduler_output(out, BLOCK_SIZE)

    assert events.fresh == [5]
    assert copy_pairs(out) == [(2, 6)]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="block_size must be >= 1, got 0"):
        events_from_scheduler_output(output(), 0)


# --- through a real server --------------------------------------------------------------
class Worker:
    """Plays the worker: owns the KV tensor, writes fresh blocks, performs copies.

    Every write stores a new distinct value in all rows of a block; ``expected`` is what
    each block that holds data must read through the client's mapping.
    """

    def __init__(self, num_blocks: int) -> None:
        self.kv = torch.zeros(num_blocks * BLOCK_SIZE, 3)
        self.expected: dict[int, float] = {}
        self._values: Iterator[int] = itertools.count(1)

    def rows(self, physical_id: int) -> torch.Tensor:
        return self.kv[physical_id * BLOCK_SIZE : (physical_id + 1) * BLOCK_SIZE]

    def run(self, adapter: VllmDefragAdapter, out: SchedulerOutput) -> None:
        events = events_from_scheduler_output(out, BLOCK_SIZE)
        adapter.on_scheduler_output(out)
        for (src, dst), (physical_src, physical_dst) in zip(
            copy_pairs(out), adapter.resolve_copies(out), strict=True
        ):
            self.rows(physical_dst).copy_(self.rows(physical_src))
            self.expected[dst] = self.expected[src]
        assert events.fresh is not None
        for logical_id, physical_id in zip(
            events.fresh, adapter.client.resolve(events.fresh), strict=True
        ):
            value = float(next(self._values))
            self.rows(physical_id).fill_(value)
            self.expected[logical_id] = value

    def forget(self, logical_ids: list[int]) -> None:
        for logical_id in logical_ids:
            self.expected.pop(logical_id, None)

    def lost_blocks(self, adapter: VllmDefragAdapter) -> list[int]:
        logical_ids = sorted(self.expected)
        (physical_ids,) = adapter.resolve_tables([logical_ids])
        return [
            logical_id
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True)
            if not bool((self.rows(physical_id) == self.expected[logical_id]).all())
        ]


def start(worker: Worker, serve: Serve, **config: object) -> ServerHandle:
    """Serves the worker's KV tensor (the ``serve`` fixture stops the server)."""
    return serve(kv=SignedKv([(worker.kv, None)], BLOCK_SIZE), **config)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_adapter_keeps_every_block_with_its_data_through_a_real_server(
    serve: Serve, prefix_caching: bool
) -> None:
    worker = Worker(num_blocks=24)
    handle = start(worker, serve, threshold=0, prefix_caching=prefix_caching)
    with DefragClient(handle.address, prefix_caching=prefix_caching, timeout_s=5) as client:
        adapter = VllmDefragAdapter(client, BLOCK_SIZE)
        steps = [
            # a new request high in the pool; another with two groups
            output(
                new=[
                    NewRequestData("a", ([20, 21, 22],), 0),
                    NewRequestData("b", ([15], [16]), 0),
                    NewRequestData("e", ([10],), 0),
                ]
            ),
            # a grows; c shares a's first two blocks as prefix hits (computed)
            output(
                new=[NewRequestData("c", ([20, 21, 18],), 2 * BLOCK_SIZE)],
                running=cached(("a", ([23],), 12), ("b", None, 1)),
            ),
            # copy-on-write: c's new block 17 receives a copy of block 21
            output(running=cached(("c", ([17],), 12)), kv_cache_block_copies=[(21, 17)]),
            # b preempted; a finished and re-admitted with one of its blocks as a hit
            output(
                new=[NewRequestData("a", ([20, 19],), BLOCK_SIZE)],
                finished={"a"},
                preempted_req_ids={"b"},
            ),
            # b resumes: its list is replaced (its old first block is a prefix hit
            # when the cache kept it; recomputed otherwise)
            # e resumes in place (its preemption was never reported): replaced too
            output(
                running=cached(
                    ("b", ([15, 13],), BLOCK_SIZE if prefix_caching else 0),
                    ("e", ([10, 9],), BLOCK_SIZE if prefix_caching else 0),
                    resumed={"b", "e"},
                )
            ),
            # vLLM lists the blocks to zero itself this time
            output(new=[NewRequestData("d", ([12, 11],), 0)], new_block_ids_to_zero=[12, 11]),
            output(finished={"c", "d"}),
        ]
        for number, out in enumerate(steps):
            worker.run(adapter, out)
            if not prefix_caching:
                held = {i for ids in client.live_requests().values() for i in ids}
                worker.forget([i for i in list(worker.expected) if i not in held])
            assert worker.lost_blocks(adapter) == [], f"after step {number}"
            if number == 4:
                tables = client.list_requests()
                assert (tables["b"], tables["e"]) == ([15, 13], [10, 9])
        stats = client.stats().stats
        assert stats.totals.num_placements + stats.totals.num_moves > 0  # the mapping did change
        assert client.audit().is_consistent


def test_adapter_refuses_a_block_size_other_than_the_servers(serve: Serve) -> None:
    worker = Worker(num_blocks=8)
    handle = start(worker, serve)
    with (
        DefragClient(handle.address, timeout_s=5) as client,
        pytest.raises(InvalidArgument, match="block_size 8 differs from the server's 4"),
    ):
        VllmDefragAdapter(client, 8)
