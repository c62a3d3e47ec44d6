"""The scheduler side without vLLM: outputs rewritten or stamped, checked by a model worker.

The stand-in outputs have vLLM 0.33's fields (``support.vllm_output``); the test plays
vLLM's KV cache manager (the truth after each ``schedule()``) and a V1 model runner
(``RowWorker``: persistent rows it only replaces for new and resumed requests, KV data
written through them), against real services on real KV tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.vllm._bridge import SchedulerBridge
from kvdefrag.vllm._ranks import RankGroup
from kvdefrag.vllm.common import first_fresh_block_index, read_step_stamp

from support.kv import SignedKv
from support.server import Serve
from support.vllm_output import NewRequestData, SchedulerOutput, cached, output

BLOCK_SIZE = 4
NUM_BLOCKS = 24


class RowWorker:
    """Plays vLLM's V1 runner: persistent physical rows, KV written through them.

    A new or resumed request's row is replaced; a running request's row is only appended
    to. Every block a step computes into gets a new distinct value in all its rows;
    ``expected`` is what each logical block must read.
    """

    def __init__(self) -> None:
        self.kv = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 3)
        self.rows: dict[str, list[int]] = {}
        self.expected: dict[int, float] = {}
        self._values: Iterator[int] = itertools.count(1)

    def data(self, physical_id: int) -> torch.Tensor:
        return self.kv[physical_id * BLOCK_SIZE : (physical_id + 1) * BLOCK_SIZE]

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
    return [serve(kv=kv, num_blocks=NUM_BLOCKS, **options) for kv in kvs]


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_rewritten_outputs_keep_every_row_reading_its_own_data(
    serve: Serve, prefix_caching: bool, num_ranks: int
) -> None:
    worker = RowWorker()
    handles = serve_ranks(serve, worker, num_ranks, threshold=0, prefix_caching=prefix_caching)
    clients = [DefragClient(h.address, prefix_caching=prefix_caching) for h in handles]
    bridge = SchedulerBridge(
        RankGroup(clients), block_size=BLOCK_SIZE, prefix_caching=prefix_caching
    )
    ever_live: set[int] = set()
    try:
        for number, (out, truth) in enumerate(steps(prefix_caching)):
            ever_live |= {i for ids in truth.values() for i in ids}
            hashed = ever_live - {22} if number >= 5 else ever_live  # 22 loses its hash
            bridge.apply(out, truth, lambda i, hashed=hashed: prefix_caching and i in hashed)
            worker.run(out, truth)
            for src, dst in steps(prefix_caching)[number][0].kv_cache_block_copies:
                worker.expected[dst] = worker.expected[src]
            scheduled = {new.req_id for new in out.scheduled_new_reqs}
            scheduled |= set(out.scheduled_cached_reqs.req_ids)
            assert worker.wrong_blocks(truth, scheduled) == [], f"after step {number}"
            resolve = clients[0].resolve
            assert {rid: worker.rows[rid] for rid in scheduled} == {
                rid: resolve(truth[rid]) for rid in scheduled
            }, f"after step {number}"
        assert bridge.totals.num_steps == 7
        assert bridge.totals.num_rows_resent > 0  # moved rows were re-sent, and read right
        assert {c.digest for c in clients} == {clients[0].digest}
        for client in clients:
            assert client.audit().is_consistent
    finally:
        bridge.ranks.close()


def test_when_the_workers_translate_the_output_stays_logical_and_carries_its_step(
    serve: Serve,
) -> None:
    worker = RowWorker()
    handles = serve_ranks(serve, worker, 2, threshold=0)
    clients = [DefragClient(h.address) for h in handles]
    bridge = SchedulerBridge(RankGroup(clients), block_size=BLOCK_SIZE, prefix_caching=False)
    try:
        (out, truth), *_ = steps(prefix_caching=False)
        bridge.apply(out, truth, lambda block_id: False, rewrite=False)

        assert out.scheduled_new_reqs[0].block_ids == ([20, 21, 22],)
        stamp = read_step_stamp(out)
        assert stamp is not None
        assert stamp.by_rank == tuple((client.epoch, 1) for client in clients)
        for rank, handle in enumerate(handles):
            handle.wait_applied(*stamp.for_rank(rank), timeout_s=10)
        bridge.settle()
        assert bridge.totals.last_reply is not None
        assert bridge.totals.last_reply.seq == 1

        empty = output()
        bridge.apply(
            empty, {"a": [20, 21, 22], "b": [15], "e": [10]}, lambda i: False, rewrite=False
        )
        assert read_step_stamp(empty) is None  # nothing changed: no step sent
    finally:
        bridge.settle()
        bridge.ranks.close()
