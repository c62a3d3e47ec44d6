"""The vLLM scheduler's lockstep group of rank clients, on real servers."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvdefrag.client import DefragClient, StepEvents
from kvdefrag.client.vllm._ranks import RankGroup
from kvdefrag.common import EpochMismatch, ServiceUnavailable
from kvdefrag.server import Move, make_executor

from support.kv import SignedKv
from support.server import Serve


class StallOnceExecutor:
    """The real CPU executor; its first batch takes ``stall_s`` longer."""

    def __init__(self, kv: SignedKv, stall_s: float) -> None:
        self._inner = make_executor(kv.kv_caches, kv.block_size)
        self.num_blocks = self._inner.num_blocks
        self.stall_s = stall_s

    def execute(self, moves: Sequence[Move]) -> Any:
        if self.stall_s:
            time.sleep(self.stall_s)
            self.stall_s = 0.0
        return self._inner.execute(moves)


def test_a_rank_that_answers_late_is_completed_not_stepped_twice(serve: Serve) -> None:
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    slow = StallOnceExecutor(kvs[1], stall_s=1.5)
    handles = [serve(kv=kvs[0], threshold=0), serve(kv=kvs[1], threshold=0, executor=slow)]
    clients = [DefragClient(handle.address, timeout_s=0.5) for handle in handles]
    group = RankGroup(clients)
    try:
        group.step(StepEvents.build(new_blocks={"a": [40, 41]}, fresh=[]))  # moves: slow
        reply = group.step(StepEvents.build(new_blocks={"b": [50]}))
        assert reply.seq == 2
        for handle in handles:
            assert handle.stats().totals.num_steps == 2
            assert handle._engine.list_requests() == {"a": [40, 41], "b": [50]}
        assert handles[0]._engine.digest == handles[1]._engine.digest == clients[1].digest
    finally:
        group.close()


def test_a_submitted_step_is_waited_for_on_each_rank_by_its_stamp(serve: Serve) -> None:
    kvs = [SignedKv.create(64), SignedKv.create(64)]
    slow = StallOnceExecutor(kvs[1], stall_s=0.3)
    handles = [serve(kv=kvs[0], threshold=0), serve(kv=kvs[1], threshold=0, executor=slow)]
    group = RankGroup([DefragClient(handle.address) for handle in handles])
    try:
        in_flight = group.submit(StepEvents.build(new_blocks={"a": [40, 41]}, fresh=[]))
        assert [seq for _, seq in in_flight.stamps] == [1, 1]
        assert [epoch for epoch, _ in in_flight.stamps] == group.epochs
        for handle, (epoch, seq) in zip(handles, in_flight.stamps, strict=True):
            handle.wait_applied(epoch, seq, timeout_s=10.0)
            assert handle._engine.list_requests() == {"a": [40, 41]}  # applied, moves done
        assert in_flight.result().seq == 1
        assert group.submit(StepEvents.build(finished=["a"])).result().seq == 2
    finally:
        group.close()


def test_waiting_for_a_step_that_never_comes_names_it(serve: Serve) -> None:
    handle = serve(kv=SignedKv.create(64))
    with DefragClient(handle.address) as client:
        client.step(new_blocks={"a": [3]})
        handle.wait_applied(client.epoch, 1, timeout_s=0.0)  # applied: no wait at all
        with pytest.raises(ServiceUnavailable, match=r"step seq 2 of epoch .* was not applied"):
            handle.wait_applied(client.epoch, 2, timeout_s=0.05)
        epoch = client.epoch
        client.reset()
        with pytest.raises(EpochMismatch, match=f"seq 1 of epoch {epoch}: the server is at"):
            handle.wait_applied(epoch, 1, timeout_s=5.0)
