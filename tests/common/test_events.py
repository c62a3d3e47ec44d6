"""StepEvents: the step every layer speaks, type-checked once, when it is made."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.common.events import require_step_events


def test_other_collections_are_copied_into_plain_lists() -> None:
    events = StepEvents(
        finished=iter(["done"]),
        new_blocks={"a": (5, 9)},
        resumed={"b": (3,)},
        fresh=np.array([5]),
        evicted=range(7, 9),
    )
    assert events == StepEvents(
        finished=("done",), new_blocks={"a": [5, 9]}, resumed={"b": [3]}, fresh=[5], evicted=[7, 8]
    )
    assert all(type(block_id) is int for block_id in events.fresh or ())
    assert type(events.new_blocks["a"]) is list


def test_lists_of_ints_are_checked_and_kept_as_they_are() -> None:
    new_blocks = {"a": [5, 9], "b": [1]}
    fresh = [5, 9]
    events = StepEvents(finished=("x",), new_blocks=new_blocks, fresh=fresh)
    assert events.new_blocks is new_blocks and events.fresh is fresh  # no copy
    # numpy ids, bools, or an id past int64 among ints: the slow path, which names them.
    mixed = StepEvents(new_blocks={"a": [np.int64(5), 9]})
    assert mixed.new_blocks == {"a": [5, 9]} and type(mixed.new_blocks["a"][0]) is int
    with pytest.raises(InvalidArgument, match=r"new_blocks\['b'\]\[1\]: block id .* not an int64"):
        StepEvents(new_blocks={"a": [1], "b": [2, 1 << 63]})


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ({"finished": "req-a"}, "finished: expected a collection of request ids, got a str"),
        ({"finished": [7]}, "finished: request id must be a str, got 7"),
        ({"new_blocks": [1, 2]}, "new_blocks: expected a mapping"),
        ({"new_blocks": {1: [2]}}, "new_blocks: request id must be a str, got 1"),
        ({"resumed": {"a": "12"}}, r"resumed\['a'\]: expected a sequence of block ids"),
        ({"fresh": [1.5]}, "fresh: block id 1.5 is not an integer"),
        ({"evicted": [1 << 63]}, r"evicted\[0\]: block id 9223372036854775808 is not an int64"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(events: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StepEvents(**events)


def test_as_kwargs_are_the_fields_and_a_copy() -> None:
    events = StepEvents(finished=["x"], new_blocks={"a": [1]}, fresh=[1])
    kwargs = events.as_kwargs()

    assert tuple(kwargs) == StepEvents.field_names()[:5]  # no pins: no pin keys
    assert kwargs == {
        "finished": ["x"],
        "new_blocks": {"a": [1]},
        "resumed": {},
        "fresh": [1],
        "evicted": [],
    }
    kwargs["new_blocks"]["a"].append(2)
    kwargs["finished"].append("y")
    assert events.new_blocks == {"a": [1]} and events.finished == ("x",)
    assert StepEvents(**kwargs).new_blocks == {"a": [1, 2]}


def test_as_kwargs_carry_pins_when_set_and_copy_them() -> None:
    events = StepEvents(unpinned=["send/a"], pins={"send/b": (3, 4)})
    kwargs = events.as_kwargs()

    assert tuple(kwargs) == StepEvents.field_names()
    assert kwargs["unpinned"] == ["send/a"] and kwargs["pins"] == {"send/b": [3, 4]}
    kwargs["pins"]["send/b"].append(5)
    assert events.pins == {"send/b": [3, 4]}
    assert StepEvents(**kwargs) == StepEvents(unpinned=("send/a",), pins={"send/b": [3, 4, 5]})
    assert not events.is_empty and not StepEvents(unpinned=["k"]).is_empty


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ({"pins": {"k": ["x"]}}, "pins\\['k'\\]: block id 'x' is not an integer"),
        ({"pins": {3: [1]}}, "pins: request id must be a str"),
        ({"unpinned": "key"}, "unpinned: expected a collection"),
    ],
)
def test_malformed_pins_are_refused_naming_the_field(events: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StepEvents(**events)


def test_fresh_none_stays_none_and_only_an_event_free_step_is_empty() -> None:
    assert StepEvents().fresh is None
    assert StepEvents().as_kwargs()["fresh"] is None
    assert StepEvents().is_empty
    assert not StepEvents(evicted=[3]).is_empty
    assert not StepEvents(finished=["a"]).is_empty


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"finished": ("a", 7)}, "finished: request id must be a str, got 7"),
        ({"new_blocks": {"a": [1.5]}}, r"new_blocks\['a'\]: block id 1.5 is not an integer"),
        ({"evicted": [1 << 64]}, r"evicted\[0\]: block id .* is not an int64"),
    ],
)
def test_a_replaced_field_is_checked_too(fields: dict[str, Any], message: str) -> None:
    events = StepEvents(new_blocks={"a": [1]})
    with pytest.raises(InvalidArgument, match=message):
        dataclasses.replace(events, **fields)


def test_step_takes_only_step_events() -> None:
    events = StepEvents(new_blocks={"a": [1]})
    assert require_step_events(events) is events
    for wrong in ({"new_blocks": {"a": [1]}}, [events], "events", None):
        with pytest.raises(InvalidArgument, match="step: expected a StepEvents, got a"):
            require_step_events(wrong)
