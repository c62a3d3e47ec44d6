"""``TransferWatch`` and the ledger: a KV connector's windows as steps (no vLLM).

Fake requests stand in for vLLM's (``request_id``, ``status``, ``num_computed_tokens``,
``is_finished``); the scheduler's ``requests`` and the KV cache manager's lists are plain
dicts the test changes as vLLM would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdefrag.vllm._scheduler.ledger import BlockLedger, StepChanges
from kvdefrag.vllm._scheduler.transfers import TransferWatch

WAITING_FOR_REMOTE_KVS = "waiting-for-remote-kvs"
BLOCK_SIZE = 4


@dataclasses.dataclass
class FakeRequest:
    request_id: str
    status: str = "running"
    num_computed_tokens: int = 0

    def is_finished(self) -> bool:
        return self.status.startswith("finished")


class Instance:
    """A scheduler's requests and block lists, a watch and a ledger over them."""

    def __init__(self) -> None:
        self.requests: dict[str, FakeRequest] = {}
        self.blocks: dict[str, list[int]] = {}
        self.watch = TransferWatch(
            self.requests,
            lambda request_id: list(self.blocks.get(request_id, [])),
            waiting_for_remote_kvs=WAITING_FOR_REMOTE_KVS,
        )
        self.ledger = BlockLedger(num_blocks=32, block_size=BLOCK_SIZE, prefix_caching=False)

    def step(self, changes: StepChanges | None = None, finished: tuple[str, ...] = ()) -> Any:
        changes = changes or StepChanges()
        changes = dataclasses.replace(changes, released=[*changes.released, *finished])
        return self.ledger.plan(self.watch.adjust(changes, finished), lambda _: False)


def test_a_finish_whose_free_waits_for_the_send_keeps_the_list_pinned_until_vllm_frees_it() -> None:
    prefill = Instance()
    prefill.requests["a"] = FakeRequest("a")
    prefill.blocks["a"] = [3, 4, 5]
    events = prefill.step(StepChanges(full_rows={"a": [3, 4, 5]}, num_computed_tokens={"a": 0}))
    assert events.new_blocks == {"a": [3, 4, 5]} and not events.pins

    prefill.requests["a"].status = "finished-length-capped"  # delay_free_blocks: still there
    events = prefill.step(finished=("a",))
    assert events.finished == () and events.pins == {"send/a": [3, 4, 5]}
    assert prefill.ledger.held["a"] == [3, 4, 5]

    assert prefill.step().is_empty  # still sending
    del prefill.requests["a"], prefill.blocks["a"]  # finished_sending: _free_blocks
    events = prefill.step()
    assert events.finished == ("a",) and events.unpinned == ("send/a",)
    assert "a" not in prefill.ledger.held and not prefill.watch.sending


def test_a_finish_freed_at_once_is_released_unpinned() -> None:
    prefill = Instance()
    prefill.requests["a"] = FakeRequest("a")
    prefill.step(StepChanges(full_rows={"a": [3]}, num_computed_tokens={"a": 0}))
    del prefill.requests["a"]
    events = prefill.step(finished=("a",))
    assert events.finished == ("a",) and not events.pins and not events.unpinned


def test_a_load_is_held_from_allocation_fresh_past_the_local_hits_and_pinned() -> None:
    decode = Instance()
    request = decode.requests["d"] = FakeRequest("d", WAITING_FOR_REMOTE_KVS, 4)
    decode.blocks["d"] = [7, 8, 9]
    decode.watch.on_alloc(request, num_external_tokens=8)
    events = decode.step()
    assert events.new_blocks == {"d": [7, 8, 9]} and events.fresh == [8, 9]
    assert events.pins == {"load/d": [7, 8, 9]}

    assert decode.step().is_empty  # still loading
    request.status = "waiting"  # finished_recving: promoted
    events = decode.step()
    assert events.unpinned == ("load/d",) and events.resumed == {}  # the same list
    # Scheduled in a later step with its whole list: a resume of the same blocks.
    request.status = "running"
    events = decode.step(StepChanges(full_rows={"d": [7, 8, 9]}, num_computed_tokens={"d": 11}))
    assert events.resumed == {"d": [7, 8, 9]} and events.fresh == [] and not events.unpinned


def test_a_failed_load_that_cut_or_freed_the_list_is_read_again() -> None:
    decode = Instance()
    for request_id, ids in (("cut", [1, 2, 3]), ("freed", [4, 5])):
        request = decode.requests[request_id] = FakeRequest(request_id, WAITING_FOR_REMOTE_KVS)
        decode.blocks[request_id] = ids
        decode.watch.on_alloc(request, num_external_tokens=8)
    decode.step()
    decode.requests["cut"].status = decode.requests["freed"].status = "waiting"
    decode.blocks["cut"] = [1]
    del decode.blocks["freed"]
    events = decode.step()
    assert events.resumed == {"cut": [1]} and events.finished == ("freed",)
    assert sorted(events.unpinned) == ["load/cut", "load/freed"]
    assert decode.ledger.held == {"cut": [1]}


def test_a_load_aborted_while_loading_stays_pinned_until_the_receive_ends() -> None:
    decode = Instance()
    request = decode.requests["d"] = FakeRequest("d", WAITING_FOR_REMOTE_KVS)
    decode.blocks["d"] = [6, 7]
    decode.watch.on_alloc(request, num_external_tokens=8)
    decode.step()
    request.status = "finished-aborted"  # finish_requests: free delayed to finished_recving
    events = decode.step(finished=("d",))
    assert events.finished == () and not events.unpinned and not events.pins
    assert decode.watch.sending == {"d": "load/d"}
    del decode.requests["d"], decode.blocks["d"]
    events = decode.step()
    assert events.finished == ("d",) and events.unpinned == ("load/d",)


def test_an_allocation_without_an_external_load_is_not_a_load() -> None:
    decode = Instance()
    request = decode.requests["d"] = FakeRequest("d", "running")
    decode.blocks["d"] = [2]
    decode.watch.on_alloc(request, num_external_tokens=0)
    decode.watch.on_alloc(FakeRequest("sync", "running"), num_external_tokens=4)  # synchronous
    assert decode.step().is_empty and not decode.watch.loading
