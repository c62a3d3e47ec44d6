"""The scheduler side without vLLM: changes read from outputs, stamped, checked by a worker.

The stand-in outputs have vLLM 0.33's fields (``support.vllm_output``); the test plays
vLLM's scheduler (outputs, the KV cache manager's truth for the audit, deferred frees)
and a V1 model runner that translates as ``DefragWorker`` does (``RowWorker``: persistent
physical rows it only replaces for new and resumed requests and remaps when blocks move,
KV data written through them), against real services on real KV tensors.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import DefragError, InvalidArgument
from kvdefrag.server import ServerHandle
from kvdefrag.vllm._scheduler.bridge import ParkedBlocks, SchedulerBridge, changes_from_output
from kvdefrag.vllm._scheduler.ranks import RankGroup
from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm._worker.translation import BlockIdTranslator, translate_scheduler_output
from kvdefrag.vllm.contract import StepStamp, read_step_stamp
from kvdefrag.vllm.output_blocks import first_fresh_block_index

from support.kv import SignedKv
from support.server import Serve
from support.vllm_output import NewRequestData, SchedulerOutput, cached, output

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class RowWorker:
    """Plays vLLM's V1 runner under ``DefragWorkerMixin``: persistent physical rows that
    follow moves, each output translated after its step, KV written through the rows.

    A new or resumed request's row is replaced; a running request's row is only appended
    to. Every block a step computes into gets a new distinct value in all its rows;
    ``expected`` is what each logical block must read.
    """

    def __init__(self) -> None:
        self.kv = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 3)
        self.rows: dict[str, list[int]] = {}
        self.expected: dict[int, float] = {}
        self._values: Iterator[int] = itertools.count(1)
        self.service: tuple[ServerHandle, BlockIdTranslator] | None = None

    def attach(self, handle: ServerHandle) -> None:
        self.service = (handle, BlockIdTranslator(handle, NUM_BLOCKS))

    def data(self, physical_id: int) -> torch.Tensor:
        return self.kv[physical_id * BLOCK_SIZE : (physical_id + 1) * BLOCK_SIZE]

    def execute(self, out: SchedulerOutput, truth: Mapping[str, Sequence[int]]) -> None:
        """As ``DefragWorkerMixin.execute_model``: wait, then under ``kv_lock`` rows follow
        the moves, the output turns physical and the "forward pass" runs."""
        assert self.service is not None
        handle, translator = self.service
        wait_for_planned_step(handle, 0, out, timeout_s=10)
        with handle.kv_lock:
            mapping, remap = translator.advance()
            if remap is not None:
                self.rows = {rid: remap[row].tolist() for rid, row in self.rows.items()}
            physical = copy.deepcopy(out)
            translate_scheduler_output(physical, mapping)
            self.run(physical, truth)

    def run(self, out: SchedulerOutput, truth: Mapping[str, Sequence[int]]) -> None:
        """Runs one (physical) output; ``truth`` names the logical ids it computes into."""
        for request_id in sorted(out.finished_req_ids | (out.preempted_req_ids or set())):
            self.rows.pop(request_id, None)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            (self.rows[new.req_id],) = (list(group) for group in new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        running = out.scheduled_cached_reqs
        for request_id, groups, num_computed in zip(
            running.req_ids, running.new_block_ids, running.num_computed_tokens, strict=True
        ):
            if request_id in running.resumed_req_ids:
                assert groups is not None
                self.rows[request_id] = list(groups[0])
            elif groups is not None:
                self.rows[request_id].extend(groups[0])
            computed[request_id] = num_computed
        for src, dst in out.kv_cache_block_copies:
            self.data(dst).copy_(self.data(src))
        for request_id, num_computed in computed.items():
            first = first_fresh_block_index(num_computed, BLOCK_SIZE)
            for logical_id, physical_id in list(
                zip(truth[request_id], self.rows[request_id], strict=True)
            )[first:]:
                value = float(next(self._values))
                self.data(physical_id).fill_(value)
                self.expected[logical_id] = value

    def wrong_blocks(
        self, truth: Mapping[str, Sequence[int]], scheduled: set[str]
    ) -> list[tuple[str, int]]:
        """(request, position) of every block of a scheduled request whose row entry does
        not read its data (a row is read only when its request is scheduled)."""
        return [
            (request_id, position)
            for request_id, logical_ids in truth.items()
            if request_id in scheduled
            for position, (logical_id, physical_id) in enumerate(
                zip(logical_ids, self.rows[request_id], strict=True)
            )
            if not bool((self.data(physical_id) == self.expected[logical_id]).all())
        ]


def steps(prefix_caching: bool) -> list[tuple[SchedulerOutput, dict[str, list[int]]]]:
    """(output, the KV cache manager's truth after it), in logical ids."""
    hit = BLOCK_SIZE if prefix_caching else 0
    return [
        # new requests high in the pool
        (
            output(
                new=[
                    NewRequestData("a", ([20, 21, 22],), 0),
                    NewRequestData("b", ([15],), 0),
                    NewRequestData("e", ([10],), 0),
                ]
            ),
            {"a": [20, 21, 22], "b": [15], "e": [10]},
        ),
        # a grows; c shares a's first two blocks as prefix hits (computed); b computes on
        (
            output(
                new=[NewRequestData("c", ([20, 21, 18],), 2 * BLOCK_SIZE)],
                running=cached(("a", ([23],), 12), ("b", None, 1)),
            ),
            {"a": [20, 21, 22, 23], "b": [15], "c": [20, 21, 18], "e": [10]},
        ),
        # copy-on-write: c's new block 17 receives a copy of block 21, then decodes on it
        (
            output(running=cached(("c", ([17],), 13)), kv_cache_block_copies=[(21, 17)]),
            {"a": [20, 21, 22, 23], "b": [15], "c": [20, 21, 18, 17], "e": [10]},
        ),
        # b preempted; a finished and re-admitted with one of its blocks as a hit
        (
            output(
                new=[NewRequestData("a", ([20, 19],), BLOCK_SIZE)],
                finished={"a"},
                preempted_req_ids={"b"},
            ),
            {"a": [20, 19], "c": [20, 21, 18, 17], "e": [10]},
        ),
        # b resumes (its old block a hit when the cache kept it); e is resumed in place
        (
            output(
                running=cached(("b", ([15, 13],), hit), ("e", ([10, 9],), hit), resumed={"b", "e"})
            ),
            {"a": [20, 19], "b": [15, 13], "c": [20, 21, 18, 17], "e": [10, 9]},
        ),
        # vLLM lists the blocks to zero itself; everyone decodes one block on
        (
            output(
                new=[NewRequestData("d", ([12, 11],), 0)],
                running=cached(("a", ([8],), 8), ("c", ([7],), 16), ("e", ([6],), 8)),
                new_block_ids_to_zero=[12, 11],
            ),
            {
                "a": [20, 19, 8],
                "b": [15, 13],
                "c": [20, 21, 18, 17, 7],
                "d": [12, 11],
                "e": [10, 9, 6],
            },
        ),
        (
            output(finished={"c", "d"}, running=cached(("a", ([5],), 12), ("b", ([4],), 8))),
            {"a": [20, 19, 8, 5], "b": [15, 13, 4], "e": [10, 9, 6]},
        ),
    ]


def serve_ranks(serve: Serve, worker: RowWorker, num_ranks: int, **options: Any) -> list[Any]:
    """Rank 0 serves the worker's tensor; the others serve tensors of their own."""
    kvs = [SignedKv([(worker.kv, None)], BLOCK_SIZE)] + [
        SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE) for _ in range(num_ranks - 1)
    ]
    handles = [serve(kv=kv, num_blocks=NUM_BLOCKS, **options) for kv in kvs]
    worker.attach(handles[0])
    return handles


def bridge_for(handles: list[Any], *, prefix_caching: bool = False) -> SchedulerBridge:
    clients = [DefragClient(h.address, prefix_caching=prefix_caching) for h in handles]
    return SchedulerBridge(
        RankGroup(clients),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        prefix_caching=prefix_caching,
    )


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_translating_workers_keep_every_row_reading_its_own_data(
    serve: Serve, prefix_caching: bool, num_ranks: int
) -> None:
    worker = RowWorker()
    handles = serve_ranks(serve, worker, num_ranks, threshold=0, prefix_caching=prefix_caching)
    bridge = bridge_for(handles, prefix_caching=prefix_caching)
    clients = bridge.ranks.clients
    ever_live: set[int] = set()
    try:
        for number, (out, truth) in enumerate(steps(prefix_caching)):
            is_cache_reset = number == 5  # reset_prefix_cache ran before this schedule()
            if is_cache_reset:
                ever_live = set()  # only blocks computed from now on carry a hash
            ever_live |= {i for ids in truth.values() for i in ids}
            hashed = set(ever_live)

            def is_cached(block_id: int, hashed: set[int] = hashed) -> bool:
                return prefix_caching and block_id in hashed

            changes = changes_from_output(out, None, is_cache_reset=is_cache_reset)
            bridge.apply(out, changes, is_cached)
            bridge.ledger.audit(truth, [], is_cached)
            worker.execute(out, truth)
            for src, dst in out.kv_cache_block_copies:
                worker.expected[dst] = worker.expected[src]
            scheduled = {new.req_id for new in out.scheduled_new_reqs}
            scheduled |= set(out.scheduled_cached_reqs.req_ids)
            assert worker.wrong_blocks(truth, scheduled) == [], f"after step {number}"
            # the rows of every running request follow the moves, scheduled or not
            assert worker.rows == {
                rid: handles[0].resolve(ids).tolist() for rid, ids in truth.items()
            }, f"after step {number}"
        bridge.settle()
        assert bridge.totals.num_steps == 7
        moves = handles[0].stats().totals.num_moves
        assert moves > 0  # blocks did move under the rows
        assert {c.digest for c in clients} == {clients[0].digest}
        for client in clients:
            assert client.audit().is_consistent
    finally:
        bridge.settle()
        bridge.ranks.close()


def test_every_output_carries_the_last_step_planned_and_stays_logical(serve: Serve) -> None:
    worker = RowWorker()
    handles = serve_ranks(serve, worker, 2, threshold=0)
    bridge = bridge_for(handles)
    clients = bridge.ranks.clients
    try:
        first = output()
        bridge.apply(first, changes_from_output(first, None), lambda i: False)
        # nothing sent yet: the stamp names the step before each session's first
        assert read_step_stamp(first) == StepStamp(tuple((c.epoch, 0) for c in clients))

        (out, _), *_ = steps(prefix_caching=False)
        bridge.apply(out, changes_from_output(out, None), lambda i: False)

        assert out.scheduled_new_reqs[0].block_ids == ([20, 21, 22],)
        stamp = read_step_stamp(out)
        assert stamp is not None
        assert stamp.by_rank == tuple((client.epoch, 1) for client in clients)
        for rank, handle in enumerate(handles):
            handle.wait_applied(*stamp.for_rank(rank), timeout_s=10)

        empty = output()
        bridge.apply(empty, changes_from_output(empty, None), lambda i: False)
        assert read_step_stamp(empty) == stamp  # no events, no step: the last one's stamp
        assert bridge.totals.num_steps == 1
        bridge.settle()
        assert bridge.totals.last_reply is not None
        assert bridge.totals.last_reply.seq == 1
    finally:
        bridge.settle()
        bridge.ranks.close()


# --- reading the changes --------------------------------------------------------------
def test_changes_come_from_the_output_fields_that_changed() -> None:
    out = output(
        new=[NewRequestData("a", ([3, 4],), 4)],
        running=cached(
            ("b", ([6],), 8), ("c", None, 4), ("d", ([],), 0), ("e", ([7, 8],), 0), resumed={"e"}
        ),
        finished={"z"},
        preempted_req_ids={"p"},
        kv_cache_block_copies=[(4, 6)],
    )

    changes = changes_from_output(out, None, is_cache_reset=True)

    assert sorted(changes.released) == ["p", "z"]
    assert changes.full_rows == {"a": [3, 4], "e": [7, 8]}
    assert changes.appended == {"b": [6]}
    # only the requests that got blocks: "c" and "d" got none
    assert changes.num_computed_tokens == {"a": 4, "b": 8, "e": 0}
    assert changes.not_fresh == frozenset({6})
    assert changes.is_cache_reset


class Block(NamedTuple):
    block_id: int


def test_parked_blocks_record_what_vllm_holds_back_and_returns() -> None:
    parked = ParkedBlocks()
    first = (1, [Block(3), Block(4)])
    parked.append(first)
    parked.append((2, [Block(5)]))

    lists, returned = parked.take()
    assert list(lists.values()) == [[3, 4], [5]]
    assert returned == []
    first_name = next(iter(lists))

    assert parked[0] is first  # still vLLM's deque
    assert parked.popleft() is first
    parked.append((3, [Block(6)]))
    parked.append((3, [Block(7)]))
    parked.popleft()  # (2, [5]): parked in an earlier step
    assert parked.block_lists() == [[6], [7]]

    lists, returned = parked.take()
    assert list(lists.values()) == [[6], [7]]
    assert len(returned) == 2 and returned[0] == first_name
    assert parked.take() == ({}, [])


def test_a_list_parked_and_returned_between_two_steps_is_in_neither() -> None:
    parked = ParkedBlocks([(0, [Block(9)])])
    parked.take()
    parked.append((1, [Block(3)]))
    parked.popleft()  # the older one
    parked.popleft()  # the new one, within the same step

    lists, returned = parked.take()
    assert lists == {}
    assert len(returned) == 1


# --- a step that fails while the next one is planned --------------------------------------
def test_a_step_that_fails_between_the_settle_and_the_next_submit_lends_it_no_seq(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``apply`` checks the step before the last, plans, then submits: a step that fails
    in between must not lend its seq to the next, else the output planned with the failed
    step would find its seq applied (with the next step's events) and run."""
    handle = serve(num_blocks=NUM_BLOCKS // 2)  # the ledger's ids past 11 are refused
    bridge = bridge_for([handle])
    client = bridge.ranks.clients[0]
    refusal_may_land = threading.Event()
    client_step = client.step

    def step_held(events: Any) -> Any:
        if events.new_blocks.get("b"):  # the refused one: after ``apply``'s settle
            assert refusal_may_land.wait(10)
        return client_step(events)

    monkeypatch.setattr(client, "step", step_held)
    submit = bridge.ranks.submit

    def submit_once_it_failed(events: Any) -> Any:
        refusal_may_land.set()
        previous = bridge._in_flight[-1]
        while not previous.done():
            time.sleep(0.01)
        return submit(events)

    try:
        first = output(new=[NewRequestData("a", ([3],), 0)])
        bridge.apply(first, changes_from_output(first, None), lambda i: False)
        refused = output(new=[NewRequestData("b", ([20],), 0)])
        bridge.apply(refused, changes_from_output(refused, None), lambda i: False)
        monkeypatch.setattr(bridge.ranks, "submit", submit_once_it_failed)
        following = output(new=[NewRequestData("c", ([5],), 0)])
        bridge.apply(following, changes_from_output(following, None), lambda i: False)

        refused_stamp, following_stamp = read_step_stamp(refused), read_step_stamp(following)
        assert refused_stamp is not None and following_stamp is not None
        assert following_stamp.for_rank(0)[1] == refused_stamp.for_rank(0)[1] + 1
        # The refused step's output must not run: its seq is never applied, so the
        # worker's wait for it ends in an error (it found seq 2 applied, with "c").
        with pytest.raises(DefragError, match="seq 2"):
            wait_for_planned_step(handle, 0, refused, timeout_s=0.5)
        with pytest.raises(InvalidArgument, match="20"):
            bridge.settle()
        with pytest.raises(DefragError, match="step seq 3 was not sent"):
            bridge.close()
        assert handle._engine.list_requests() == {"a": [3]}
    finally:
        bridge.close()
