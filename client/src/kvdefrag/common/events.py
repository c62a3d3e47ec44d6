"""One scheduling iteration's block events: the step, as every layer of kvdefrag sees it.

The scheduler builds a ``StepEvents``; the client sends it, the recorder writes it, the
servicer turns the wire message back into one, and the engine validates and applies it.
Adding a field means changing this class, the proto and the two conversion modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvdefrag.common.errors import InvalidArgument, quote

NULL_BLOCK_ID = 0
"""Logical and physical id 0: vLLM's null block, never allocated, never moved."""

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _block_ids(field: str, ids: Iterable[int], request_id: str | None = None) -> list[int]:
    """Checks block ids: a list of ints is returned as it is, anything else as a checked
    list of ints; ``field[request_id]`` names them in errors."""
    if type(ids) is list and _are_int64s(ids):
        return ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidArgument(
            f"{_name(field, request_id)}: expected a sequence of block ids, got {quote(ids)}"
        )
    if not isinstance(ids, (list, tuple)):
        ids = list(ids)  # read once: the slow path below may read it again
    try:
        # NOTE: array("q") takes exactly what operator.index takes and what fits in an
        # int64, in C; anything else falls through to name the culprit.
        fast: list[int] = array("q", ids).tolist()
    except (TypeError, OverflowError):
        pass
    else:
        return fast
    name = _name(field, request_id)
    checked: list[int] = []
    for block_id in ids:
        try:
            checked.append(operator.index(block_id))
        except TypeError:
            raise InvalidArgument(f"{name}: block id {quote(block_id)} is not an integer") from None
    for position, block_id in enumerate(checked):
        if not _INT64_MIN <= block_id <= _INT64_MAX:
            raise InvalidArgument(f"{name}[{position}]: block id {block_id} is not an int64")
    return checked


def _are_int64s(ids: Sequence[int]) -> bool:
    """Whether every id is an ``int`` (exactly) that fits in an int64 (two passes in C)."""
    if not set(map(type, ids)) <= {int}:
        return False
    try:
        array("q", ids)
    except OverflowError:
        return False
    return True


def _name(field: str, request_id: str | None) -> str:
    return field if request_id is None else f"{field}[{quote(request_id)}]"


def _request_id(field: str, request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"{field}: request id must be a str, got {quote(request_id)}")
    return request_id


def _block_lists(field: str, lists: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """Checks request id -> block ids: a dict of str -> list of ints is returned as it is
    (checked in a few passes in C, whatever the number of requests)."""
    if lists is None:
        return {}
    if (
        type(lists) is dict
        and set(map(type, lists)) <= {str}
        and set(map(type, lists.values())) <= {list}
        and _are_int64s(list(itertools.chain.from_iterable(lists.values())))
    ):
        return lists
    if not isinstance(lists, Mapping):
        raise InvalidArgument(
            f"{field}: expected a mapping of request id -> block ids, got {type(lists).__name__}"
        )
    return {
        _request_id(field, request_id): _block_ids(field, ids, request_id)
        for request_id, ids in lists.items()
    }


def _request_ids(field: str, request_ids: Iterable[str]) -> tuple[str, ...]:
    if type(request_ids) is tuple and set(map(type, request_ids)) <= {str}:
        return request_ids
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        raise InvalidArgument(
            f"{field}: expected a collection of request ids, "
            f"got a {type(request_ids).__name__} ({quote(request_ids)})"
        )
    return tuple(_request_id(field, request_id) for request_id in request_ids)


@dataclasses.dataclass(frozen=True)
class StepEvents:
    """One scheduling iteration's block events, applied in this order by the engine.

    Attributes:
        finished: Request ids whose blocks are released (finished or preempted).
        resumed: Request id -> the full new block list of a resumed request (replaces
            whatever the request held).
        evicted: Logical ids dropped from the prefix cache (their content is expendable).
        new_blocks: Request id -> logical block ids appended this step.
        fresh: Logical ids among the new/resumed ones that hold no data yet; None lets
            the engine decide (every newly live block without prefix caching, none with).
        unpinned: Keys of pins that end this step (their blocks may move again).
        pins: Key -> logical ids that must keep their slot from this step until a later
            step unpins the key: a transfer reads or writes them outside the worker's
            passes (a KV connector). A pinned block is never moved, placed on or
            re-pointed, live or free; a block fresh this step is pinned where placement
            puts it.

    The types are checked once, here, when the value is made (the range checks against
    the pool are the engine's), and every ``step()`` (engine, client, rank group) takes
    the value as it is. Lists of ints (and dicts of them) are kept, not copied: leave
    them unchanged once given; any other collection is copied into one.

    Raises:
        InvalidArgument: A request id is not a str, or a block id not an int64 (naming
            the field and the value).

    Example:
        >>> StepEvents(new_blocks={"req-a": (5, 9)}).new_blocks
        {'req-a': [5, 9]}
    """

    finished: tuple[str, ...] = ()
    new_blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    resumed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    fresh: list[int] | None = None
    evicted: list[int] = dataclasses.field(default_factory=list)
    unpinned: tuple[str, ...] = ()
    pins: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        checked = {
            "finished": _request_ids("finished", self.finished),
            "new_blocks": _block_lists("new_blocks", self.new_blocks),
            "resumed": _block_lists("resumed", self.resumed),
            "fresh": None if self.fresh is None else _block_ids("fresh", self.fresh),
            "evicted": _block_ids("evicted", self.evicted),
            "unpinned": _request_ids("unpinned", self.unpinned),
            "pins": _block_lists("pins", self.pins),
        }
        for name, value in checked.items():
            if value is not getattr(self, name):
                object.__setattr__(self, name, value)  # frozen: the one write

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the fields, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    def as_kwargs(self) -> dict[str, Any]:
        """Returns the fields as keywords of ``StepEvents`` (a trace's line), copied:
        changing them does not change this value; ``unpinned`` and ``pins`` only when
        set."""
        kwargs: dict[str, Any] = {
            "finished": list(self.finished),
            "new_blocks": {rid: list(ids) for rid, ids in self.new_blocks.items()},
            "resumed": {rid: list(ids) for rid, ids in self.resumed.items()},
            "fresh": None if self.fresh is None else list(self.fresh),
            "evicted": list(self.evicted),
        }
        # NOTE: only when set, so the traces of steps without pins read as before.
        if self.unpinned:
            kwargs["unpinned"] = list(self.unpinned)
        if self.pins:
            kwargs["pins"] = {key: list(ids) for key, ids in self.pins.items()}
        return kwargs

    @property
    def is_empty(self) -> bool:
        """True when the step carries no event at all."""
        return not (
            self.finished
            or self.new_blocks
            or self.resumed
            or self.fresh
            or self.evicted
            or self.unpinned
            or self.pins
        )


def require_step_events(events: object) -> StepEvents:
    """``events`` if it is a ``StepEvents`` (checked when it was made), for a ``step()``.

    Raises:
        InvalidArgument: It is anything else (nothing was sent or applied).
    """
    if not isinstance(events, StepEvents):
        raise InvalidArgument(
            f"step: expected a StepEvents, got a {type(events).__name__} ({quote(events)}); "
            "pass StepEvents(finished=..., new_blocks=..., ...)"
        )
    return events
