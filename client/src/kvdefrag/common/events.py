"""One scheduling iteration's block events: the step, as every layer of kvdefrag sees it.

The scheduler builds a ``StepEvents``; the client sends it, the recorder writes it, the
servicer turns the wire message back into one, and the engine validates and applies it.
Adding a field means changing this class, the proto and the two conversion modules.
"""

from __future__ import annotations

import dataclasses
import operator
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from kvdefrag.common.errors import InvalidArgument, quote

NULL_BLOCK_ID = 0
"""Logical and physical id 0: vLLM's null block, never allocated, never moved."""

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _block_ids(field: str, ids: Iterable[int], request_id: str | None = None) -> list[int]:
    """Checks and copies block ids; ``field[request_id]`` names them in errors."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise InvalidArgument(
            f"{_name(field, request_id)}: expected a sequence of block ids, got {quote(ids)}"
        )
    if not isinstance(ids, (list, tuple)):
        ids = list(ids)  # read once: the slow path below may read it again
    try:
        # NOTE: the fast path: array("q") takes exactly what operator.index takes and
        # what fits in an int64, in C; anything else falls through to name the culprit.
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


def _name(field: str, request_id: str | None) -> str:
    return field if request_id is None else f"{field}[{quote(request_id)}]"


def _request_id(field: str, request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"{field}: request id must be a str, got {quote(request_id)}")
    return request_id


def _block_lists(field: str, lists: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    if lists is None:
        return {}
    if not isinstance(lists, Mapping):
        raise InvalidArgument(
            f"{field}: expected a mapping of request id -> block ids, got {type(lists).__name__}"
        )
    return {
        _request_id(field, request_id): _block_ids(field, ids, request_id)
        for request_id, ids in lists.items()
    }


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

    Build one with ``StepEvents.build(...)`` (it checks types and copies); the range
    checks against the pool are the engine's. ``step()`` (engine, client, rank group)
    takes a built value as is, neither copied nor checked again, so leave it unchanged
    once built. A value constructed directly (``StepEvents(...)``, or
    ``dataclasses.replace``) is not trusted: ``step()`` checks it once, as ``build``
    would, and uses the checked copy (see ``checked()``).

    Example:
        >>> StepEvents.build(new_blocks={"req-a": (5, 9)}).new_blocks
        {'req-a': [5, 9]}
    """

    finished: tuple[str, ...] = ()
    new_blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    resumed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    fresh: list[int] | None = None
    evicted: list[int] = dataclasses.field(default_factory=list)

    # True on the values ``build`` returns (set on the instance; not a field, so equality
    # and repr ignore it).
    _is_checked: ClassVar[bool] = False

    @classmethod
    def build(
        cls,
        *,
        finished: Iterable[str] = (),
        new_blocks: Mapping[str, Sequence[int]] | None = None,
        resumed: Mapping[str, Sequence[int]] | None = None,
        fresh: Iterable[int] | None = None,
        evicted: Iterable[int] = (),
    ) -> StepEvents:
        """Checks the types of the events and copies them.

        Raises:
            InvalidArgument: A request id is not a str, or a block id not an int64.
        """
        if isinstance(finished, (str, bytes)) or not isinstance(finished, Iterable):
            raise InvalidArgument(
                "finished: expected a collection of request ids, "
                f"got a {type(finished).__name__} ({quote(finished)})"
            )
        events = cls(
            finished=tuple(_request_id("finished", request_id) for request_id in finished),
            new_blocks=_block_lists("new_blocks", new_blocks),
            resumed=_block_lists("resumed", resumed),
            fresh=None if fresh is None else _block_ids("fresh", fresh),
            evicted=_block_ids("evicted", evicted),
        )
        object.__setattr__(events, "_is_checked", True)  # frozen: the one write
        return events

    def checked(self) -> StepEvents:
        """Returns these events if ``build`` made them, else a checked copy of them.

        Raises:
            InvalidArgument: A value constructed directly holds a field of the wrong type.
        """
        if self._is_checked:
            return self
        return type(self).build(
            finished=self.finished,
            new_blocks=self.new_blocks,
            resumed=self.resumed,
            fresh=self.fresh,
            evicted=self.evicted,
        )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of the five fields, in declaration order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    def as_kwargs(self) -> dict[str, Any]:
        """Returns the events as the keywords of ``step()`` (client or engine), copied:
        changing them does not change this value."""
        return {
            "finished": list(self.finished),
            "new_blocks": {rid: list(ids) for rid, ids in self.new_blocks.items()},
            "resumed": {rid: list(ids) for rid, ids in self.resumed.items()},
            "fresh": None if self.fresh is None else list(self.fresh),
            "evicted": list(self.evicted),
        }

    @property
    def is_empty(self) -> bool:
        """True when the step carries no event at all."""
        return not (self.finished or self.new_blocks or self.resumed or self.fresh or self.evicted)


def step_call_events(
    events: object,
    *,
    finished: Iterable[str],
    new_blocks: Mapping[str, Sequence[int]] | None,
    resumed: Mapping[str, Sequence[int]] | None,
    fresh: Iterable[int] | None,
    evicted: Iterable[int],
) -> StepEvents:
    """The events of a ``step(events)`` or ``step(**keywords)`` call, checked once.

    Args:
        events: The positional argument: a ``StepEvents``, or None for the keyword form.
        finished: ``step``'s keywords, as passed (their defaults: ``()`` or None).
        new_blocks: As ``finished``.
        resumed: As ``finished``.
        fresh: As ``finished``.
        evicted: As ``finished``.

    Returns:
        ``events`` itself if ``StepEvents.build`` made it, else the checked events.

    Raises:
        InvalidArgument: ``events`` is not a StepEvents, or comes with event keywords,
            or a field has the wrong type.
    """
    if events is None:
        return StepEvents.build(
            finished=finished, new_blocks=new_blocks, resumed=resumed, fresh=fresh, evicted=evicted
        )
    # NOTE: a keyword at its default adds nothing; any other value (even an empty list,
    # or ``fresh=()``, which means "none is fresh") would compete with the events.
    at_default = {
        "finished": isinstance(finished, tuple) and not finished,
        "new_blocks": new_blocks is None,
        "resumed": resumed is None,
        "fresh": fresh is None,
        "evicted": isinstance(evicted, tuple) and not evicted,
    }
    given = [name for name, is_default in at_default.items() if not is_default]
    if given:
        raise InvalidArgument(
            f"step: got events and the keyword {given[0]!r}: pass the events one way, "
            "either a StepEvents or keywords"
        )
    return checked_step_events(events)


def checked_step_events(events: object) -> StepEvents:
    """``events``, type-checked once: itself if ``StepEvents.build`` made it, else the
    checked copy (see ``StepEvents.checked``).

    Raises:
        InvalidArgument: ``events`` is not a ``StepEvents``, or a field has the wrong type.
    """
    if not isinstance(events, StepEvents):
        raise InvalidArgument(
            f"step: expected a StepEvents, got a {type(events).__name__} ({quote(events)}); "
            "pass the events as keywords, or as StepEvents.build(...)"
        )
    return events.checked()
