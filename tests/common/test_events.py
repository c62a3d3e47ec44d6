"""StepEvents: the step every layer speaks, type-checked and copied at the boundary."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.common.events import checked_step_events, step_call_events


def test_build_copies_every_field_into_plain_lists() -> None:
    new_blocks = {"a": [5, 9]}
    events = StepEvents.build(
        finished=iter(["done"]),
        new_blocks=new_blocks,
        resumed={"b": (3,)},
        fresh=np.array([5]),
        evicted=range(7, 9),
    )
    new_blocks["a"].append(10)  # the caller's lists stay the caller's

    assert events == StepEvents(
        finished=("done",), new_blocks={"a": [5, 9]}, resumed={"b": [3]}, fresh=[5], evicted=[7, 8]
    )
    assert all(type(block_id) is int for block_id in events.fresh or ())


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
def test_build_refuses_wrong_types_naming_the_field(events: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StepEvents.build(**events)


def test_as_kwargs_are_step_keywords_and_a_copy() -> None:
    events = StepEvents.build(finished=["x"], new_blocks={"a": [1]}, fresh=[1])
    kwargs = events.as_kwargs()

    assert tuple(kwargs) == StepEvents.field_names()
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
    assert StepEvents.build(**kwargs).new_blocks == {"a": [1, 2]}


def test_fresh_none_stays_none_and_only_an_event_free_step_is_empty() -> None:
    assert StepEvents.build().fresh is None
    assert StepEvents.build().as_kwargs()["fresh"] is None
    assert StepEvents().is_empty
    assert not StepEvents.build(evicted=[3]).is_empty
    assert not StepEvents.build(finished=["a"]).is_empty


def test_checked_returns_what_build_made_and_checks_a_directly_constructed_value() -> None:
    built = StepEvents.build(new_blocks={"a": [1, 2]}, fresh=[1])
    assert built.checked() is built

    direct = StepEvents(new_blocks={"a": (1, 2)}, fresh=[1])  # not build's: a tuple of ids
    checked = direct.checked()
    assert checked is not direct
    assert checked == StepEvents(new_blocks={"a": [1, 2]}, fresh=[1])
    assert checked.checked() is checked
    # A replaced value is not build's either, even when the original was.
    replaced = dataclasses.replace(built, evicted=[3])
    assert replaced.checked() is not replaced


@pytest.mark.parametrize(
    ("direct", "message"),
    [
        (
            StepEvents(finished=("a", 7)),  # type: ignore[arg-type]
            "finished: request id must be a str, got 7",
        ),
        (
            StepEvents(new_blocks={"a": [1.5]}),  # type: ignore[list-item]
            r"new_blocks\['a'\]: block id 1.5 is not an integer",
        ),
        (StepEvents(evicted=[1 << 64]), r"evicted\[0\]: block id .* is not an int64"),
    ],
)
def test_checked_refuses_a_directly_constructed_value_of_wrong_types(
    direct: StepEvents, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        direct.checked()


def test_step_call_events_takes_one_form_or_the_other() -> None:
    defaults: dict[str, Any] = {
        "finished": (),
        "new_blocks": None,
        "resumed": None,
        "fresh": None,
        "evicted": (),
    }
    built = StepEvents.build(new_blocks={"a": [1]})
    assert step_call_events(built, **defaults) is built
    assert step_call_events(None, **{**defaults, "new_blocks": {"a": [1]}}) == built
    for name, value in [
        ("finished", ["x"]),
        ("finished", []),
        ("new_blocks", {}),
        ("resumed", {"b": [2]}),
        ("fresh", ()),  # "none is fresh": not the default None
        ("evicted", [4]),
    ]:
        with pytest.raises(InvalidArgument, match=f"got events and the keyword '{name}'"):
            step_call_events(built, **{**defaults, name: value})
    for wrong in ({"new_blocks": {"a": [1]}}, [built], "events"):
        with pytest.raises(InvalidArgument, match="step: expected a StepEvents, got a"):
            step_call_events(wrong, **defaults)
    with pytest.raises(InvalidArgument, match="expected a StepEvents"):
        checked_step_events(None)
