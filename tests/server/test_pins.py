"""Pinned blocks keep their slot: a KV transfer in flight reads or writes them.

A random scheduler (``RandomWorkload``) drives an engine that compacts at every step, while
the test pins blocks the way KV connectors need them: a request's blocks while a prefill
instance sends them (live, then finished and still pinned), a fresh block while a decode
instance receives into it (pinned in the step that allocates it, written "by the
transfer" after the step), freed blocks while an offload job stores them. Every pinned
block must stay at the slot it had when pinned and keep its signed data until its key is
unpinned; every block that holds data must read its own signature.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from kvdefrag.common import EngineUnhealthy, InvalidArgument, StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server._tracker import BlockTracker

from support.kv import SignedKv
from support.random_workload import RandomWorkload

NUM_BLOCKS = 64
BLOCK_SIZE = 4


@dataclasses.dataclass
class _Pin:
    logical_ids: list[int]
    slots: list[int]  # where the transfer reads or writes: fixed when pinned
    ends_at: int  # the step that unpins it


class PinnedRun:
    """An engine, its signed KV and the pins a connector would hold over random steps."""

    def __init__(
        self, seed: int, prefix_caching: bool, *, send_pins: bool = True, **config: object
    ) -> None:
        self.rng = random.Random(seed)
        self.workload = RandomWorkload(NUM_BLOCKS, prefix_caching, seed)
        self.kv = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
        engine_config = EngineConfig(threshold=0, prefix_caching=prefix_caching, **config)  # type: ignore[arg-type]
        self.engine = Engine(self.kv.kv_caches, BLOCK_SIZE, config=engine_config)
        self.send_pins = send_pins
        self.pins: dict[str, _Pin] = {}
        self.step_index = 0
        self.totals: Counter[str] = Counter()

    def step(self) -> list[int]:
        """Runs one step; returns the pinned blocks that lost their slot or their data."""
        self.step_index += 1
        rng, engine = self.rng, self.engine
        events, outcome = self.workload.next_step()
        unpinned = [key for key, pin in self.pins.items() if pin.ends_at <= self.step_index]
        new_pins: dict[str, list[int]] = {}
        before = self.workload.model  # after the step (the workload applied it)
        fresh = set(outcome.fresh)
        # P side: a request's blocks that hold data, pinned while "sent"; some finish
        # while pinned (their free is delayed, as a prefill instance's).
        for request_id in list(events.new_blocks)[:2]:
            held = [i for i in before.requests.get(request_id, []) if i and i not in fresh]
            if held and rng.random() < 0.5:
                new_pins[f"send/{self.step_index}/{request_id}"] = held
        # D side: fresh blocks pinned in the step that allocates them (received later).
        loads = [i for i in outcome.fresh if rng.random() < 0.3]
        if loads:
            new_pins[f"load/{self.step_index}"] = loads
        # Offload: blocks of requests this step finished, stored after their free.
        freed = [i for i in self._released_by(events) if i not in fresh and rng.random() < 0.5]
        if freed:
            new_pins[f"store/{self.step_index}"] = freed
        if rng.random() < 0.2:
            engine.schedule_defragment()
            self.totals["forced"] += 1
        pinned_before = {key: list(pin.slots) for key, pin in self.pins.items()}
        sent = (
            dataclasses.replace(events, unpinned=tuple(unpinned), pins=new_pins)
            if self.send_pins
            else events
        )
        result = engine.step(sent)
        self.totals["moves"] += len(result.moves)
        self.totals["placed"] += result.num_placed
        for key in unpinned:
            del self.pins[key]
        # The pass writes the fresh blocks (the step's loads land in theirs), where the
        # step placed them.
        self.kv.write_fresh(engine, outcome.fresh)
        for key, logical_ids in new_pins.items():
            slots = engine.resolve(logical_ids).tolist()
            self.pins[key] = _Pin(logical_ids, slots, self.step_index + rng.randint(1, 5))
        self.totals["pinned"] += len(new_pins)
        if self.send_pins:
            assert engine.stats().num_pinned == len(
                {i for pin in self.pins.values() for i in pin.logical_ids}
            )
        # The data of blocks the scheduler's model says hold it (pinned or not).
        lost = self.kv.lost_blocks(engine, self.workload.model.holds_data())
        assert not lost, f"step {self.step_index}: blocks {lost} lost their data"
        # The pinned blocks: at their slot, with their data (freed ones too).
        broken = []
        for key, slots in pinned_before.items():
            if key in self.pins:
                pin = self.pins[key]
                if engine.resolve(pin.logical_ids).tolist() != slots:
                    broken += pin.logical_ids
                broken += self.kv.mismatched(pin.logical_ids, slots)
        return sorted(set(broken))

    def _released_by(self, events: StepEvents) -> list[int]:
        """Blocks that no request holds after the step and some request held before it."""
        live = self.workload.model.live()
        return sorted(
            {i for rid in events.finished for i in self._held_before.get(rid, ()) if i} - live
        )

    def remember_lists(self) -> None:
        self._held_before = {rid: list(ids) for rid, ids in self.workload.model.requests.items()}


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
@pytest.mark.parametrize("seed", range(4))
def test_pinned_blocks_keep_their_slot_and_data_under_compaction(
    prefix_caching: bool, seed: int
) -> None:
    run = PinnedRun(seed, prefix_caching)
    for _ in range(250):
        run.remember_lists()
        assert run.step() == []
    assert run.totals["pinned"] > 50 and run.totals["moves"] > 50 and run.totals["forced"]
    # Once every pin ends, the pool packs again.
    run.engine.step(StepEvents(unpinned=tuple(run.pins)))
    assert run.engine.stats().num_pinned == 0
    run.engine.schedule_defragment()
    run.engine.step(StepEvents())
    stats = run.engine.stats()
    assert stats.max_live == stats.num_live


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
def test_with_decode_buckets_pinned_blocks_stay_too(prefix_caching: bool) -> None:
    run = PinnedRun(7, prefix_caching, decode_buckets=(8, 16, 32, 48, 64))
    for _ in range(250):
        run.remember_lists()
        assert run.step() == []
    assert run.totals["moves"] > 20


def test_without_the_pins_the_same_transfers_read_moved_data() -> None:
    """The sabotage: the scheduler forgets to send the pins; the checks above catch it."""
    run = PinnedRun(0, prefix_caching=False, send_pins=False)
    broken: list[int] = []
    for _ in range(250):
        run.remember_lists()
        broken += run.step()
    assert broken, "moving pinned blocks went unnoticed: the check cannot fail"


def test_a_policy_that_ignores_pins_is_stopped_before_it_moves_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE)
    engine = Engine(kv.kv_caches, BLOCK_SIZE, config=EngineConfig(threshold=0))
    engine.step(
        StepEvents(new_blocks={"a": [1, 2], "b": [9, 10]}, fresh=[], pins={"send/b": [9, 10]})
    )
    engine.step(StepEvents(finished=("a",)))
    assert engine.resolve([9, 10]).tolist() == [9, 10]  # would have moved down
    monkeypatch.setattr(BlockTracker, "highest_movable_slots", BlockTracker.highest_live_slots)
    engine.schedule_defragment()
    with pytest.raises(EngineUnhealthy, match=r"move of pinned physical block (9|10) "):
        engine.step(StepEvents())
    assert engine.resolve([9, 10]).tolist() == [9, 10]
    assert kv.lost_blocks(engine, [9, 10]) == []


def test_pins_are_checked_and_counted() -> None:
    engine = _engine(16)
    engine.step(StepEvents(new_blocks={"a": [3, 4]}, pins={"send/a": [3, 4]}))
    assert engine.stats().num_pinned == 2
    digest = engine.digest
    for events, message in [
        (StepEvents(pins={"send/a": [5]}), "key 'send/a' is pinned already"),
        (StepEvents(pins={"k": [16]}), r"pins\['k'\]: block id 16 is outside \[0, 16\)"),
        (StepEvents(pins={"": [1]}), "pins: request id must be a non-empty str"),
        (StepEvents(unpinned=("x" * 257,)), r"unpinned: request id 'x+'\.\.\. \(257 char"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            engine.step(events)
    assert engine.digest == digest and engine.stats().totals.num_steps == 1
    # Unpin and pin the same key in one step: the unpin comes first.
    engine.step(StepEvents(unpinned=("send/a",), pins={"send/a": [4, 0]}))
    assert engine.stats().num_pinned == 1  # the null block is never pinned
    result = engine.step(StepEvents(unpinned=("send/a", "never-pinned")))
    assert result.stats.num_pinned == 0
    assert result.stats.totals.num_unknown_unpins == 1
    engine.step(StepEvents(pins={"k": [7]}))
    engine.reset()
    assert engine.stats().num_pinned == 0
    engine.step(StepEvents(pins={"k": [7]}))  # a reset forgets the keys


def test_a_block_pinned_twice_stays_until_both_pins_end() -> None:
    engine = _engine(16)
    engine.step(
        StepEvents(
            new_blocks={"a": [1], "b": [12]}, fresh=[], pins={"send/b": [12], "store/b": [12]}
        )
    )
    engine.step(StepEvents(finished=("a",), unpinned=("send/b",)))
    engine.schedule_defragment()
    engine.step(StepEvents())
    assert engine.resolve([12]).tolist() == [12]
    engine.step(StepEvents(unpinned=("store/b",)))
    engine.schedule_defragment()
    engine.step(StepEvents())
    assert engine.resolve([12]).tolist() == [1]


def test_a_fresh_block_pinned_in_its_step_is_placed_first() -> None:
    engine = _engine(32)
    result = engine.step(StepEvents(new_blocks={"d": [20, 21, 22]}, pins={"load/d": [20, 21, 22]}))
    slots = engine.resolve([20, 21, 22]).tolist()
    assert slots == [1, 2, 3] and result.num_placed == 3
    # A freed, pinned block is not handed to the next request's fresh blocks.
    engine.step(StepEvents(finished=("d",)))
    engine.step(StepEvents(new_blocks={"e": [5, 6]}))
    assert set(engine.resolve([5, 6]).tolist()).isdisjoint(slots)
    assert engine.resolve([20, 21, 22]).tolist() == slots


def _engine(num_blocks: int) -> Engine:
    kv = SignedKv.create(num_blocks, block_size=BLOCK_SIZE)
    return Engine(kv.kv_caches, BLOCK_SIZE, config=EngineConfig(threshold=0))


def test_pinned_slots_are_never_expendable() -> None:
    tracker = BlockTracker(8, prefix_caching=False)
    tracker.append_blocks("a", [3])
    tracker.pin([3, 5])
    tracker.drop_request("a")
    expendable = tracker.lowest_expendable_slots(8, 8).tolist()
    assert 3 not in expendable and 5 not in expendable
    assert 3 not in tracker.lowest_free_slots(8, 8).tolist()
    tracker.unpin([3, 5])
    assert {3, 5} <= set(tracker.lowest_expendable_slots(8, 8).tolist())
    assert np.array_equal(tracker.are_pinned_slots(np.arange(8)), np.zeros(8, dtype=bool))
