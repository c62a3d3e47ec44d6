"""``Engine.apply_events`` (the servicer's path: events converted from the wire, not
checked for types or copied again) against ``Engine.step`` on the same random workloads.

Each step goes to one engine through ``step(events)`` and to another as the
servicer hands it on: a StepRequest serialised by the client, parsed and converted by the
server. Both must give the same results, digests and mappings, and refuse the same
invalid steps with the same message, changing nothing.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from kvdefrag.client import _convert as client_convert
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import Engine, EngineConfig, StepResult
from kvdefrag.server import _convert as server_convert
from kvdefrag.v1 import defrag_pb2 as pb

from support.kv import make_kv_caches
from support.random_workload import RandomWorkload
from support.reference_model import assert_engine_agrees, physical_layout

NUM_BLOCKS = 96
BLOCK_SIZE = 2


def through_the_wire(events: StepEvents) -> StepEvents:
    """The events as the servicer sees them: serialised, parsed and converted."""
    data = client_convert.step_request(1, 1, events).SerializeToString()
    request = pb.StepRequest()
    request.ParseFromString(data)
    return server_convert.step_events(request)


def comparable(result: StepResult) -> tuple[Any, ...]:
    return (
        result.block_mapping,
        result.moves,
        result.num_placed,
        result.num_unknown_finished,
        result.num_bytes_moved,
        result.digest,
        result.stats,
    )


def make_engines(prefix_caching: bool) -> tuple[Engine, Engine]:
    config = EngineConfig(threshold=4, max_moves_per_step=6, prefix_caching=prefix_caching)
    return (
        Engine(make_kv_caches(NUM_BLOCKS, block_size=BLOCK_SIZE), BLOCK_SIZE, config),
        Engine(make_kv_caches(NUM_BLOCKS, block_size=BLOCK_SIZE), BLOCK_SIZE, config),
    )


def spoiled(events: StepEvents, rng: random.Random) -> StepEvents:
    """An invalid variant of a step: an id out of range, or listed twice."""
    new_blocks = {rid: list(ids) for rid, ids in events.new_blocks.items()}
    request_id = "spoiled"
    if rng.random() < 0.5:
        new_blocks[request_id] = [NUM_BLOCKS + rng.randrange(3)]
    else:
        block_id = rng.randrange(1, NUM_BLOCKS)
        new_blocks[request_id] = [block_id, block_id]
    return dataclasses.replace(events, new_blocks=new_blocks)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_apply_events_gives_what_step_gives(prefix_caching: bool, seed: int) -> None:
    by_step, by_events = make_engines(prefix_caching)
    workload = RandomWorkload(NUM_BLOCKS, prefix_caching, seed)
    rng = random.Random(seed)
    num_moves = num_refused = 0
    for _ in range(120):
        if rng.random() < 0.1:
            bad = spoiled(workload.next_step()[0], rng)
            # NOTE: next_step applied the unspoiled events to the model; apply them to
            # the engines too after checking that the spoiled ones change nothing.
            with pytest.raises(InvalidArgument) as from_step:
                by_step.step(bad)
            with pytest.raises(InvalidArgument) as from_events:
                by_events.apply_events(through_the_wire(bad))
            assert str(from_step.value) == str(from_events.value)
            num_refused += 1
            events = dataclasses.replace(
                bad,
                new_blocks={rid: ids for rid, ids in bad.new_blocks.items() if rid != "spoiled"},
            )
        else:
            events, _ = workload.next_step()
        expected = by_step.step(events)
        wired = through_the_wire(events)
        got = by_events.apply_events(wired)
        assert comparable(got) == comparable(expected)
        num_moves += len(got.moves)
        assert_engine_agrees(by_events, workload.model)
    assert physical_layout(by_step).tolist() == physical_layout(by_events).tolist()
    assert by_step.list_requests() == by_events.list_requests()
    assert num_refused > 0
    assert num_moves > 0 or prefix_caching
