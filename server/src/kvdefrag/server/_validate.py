"""Step validation: every field of a step is checked before anything changes.

Pure reads of the tracker; a violation raises ``InvalidArgument`` naming the field and
the value, and the engine's state stays exactly as it was.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from kvdefrag.common import InvalidArgument
from kvdefrag.server._tracker import NULL_BLOCK_ID, BlockTracker

MAX_REQUEST_ID_CHARS = 256


@dataclasses.dataclass(frozen=True)
class StepInput:
    """A validated step: every id an int in range, every request id well formed."""

    finished: list[str]
    resumed: dict[str, list[int]]
    new_blocks: dict[str, list[int]]
    fresh: list[int] | None
    evicted: list[int]


def validate_step(
    tracker: BlockTracker,
    finished: Iterable[str],
    new_blocks: Mapping[str, Sequence[int]] | None,
    resumed: Mapping[str, Sequence[int]] | None,
    fresh: Iterable[int] | None,
    evicted: Iterable[int],
) -> StepInput:
    """Checks one step's events against the pool; returns them normalised.

    Raises:
        InvalidArgument: A field is malformed (the message names it and the value).
    """
    num_blocks = tracker.num_blocks
    if isinstance(finished, str):
        raise InvalidArgument("finished must be a collection of request ids, got a str")
    finished_ids = [check_request_id("finished", request_id) for request_id in finished]
    resumed_lists = _check_block_lists("resumed", resumed, num_blocks)
    new_lists = _check_block_lists("new_blocks", new_blocks, num_blocks)
    evicted_ids = _check_ids("evicted", evicted, num_blocks)
    fresh_ids = None if fresh is None else _check_ids("fresh", fresh, num_blocks)
    if fresh_ids is not None:
        _check_fresh(tracker, fresh_ids, finished_ids, resumed_lists, new_lists)
    return StepInput(finished_ids, resumed_lists, new_lists, fresh_ids, evicted_ids)


def check_request_id(field: str, request_id: object) -> str:
    """Returns a well-formed request id: a non-empty str of bounded length."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument(f"{field}: request id must be a non-empty str, got {request_id!r}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"{field}: request id {request_id[:32]!r}... is longer "
            f"than {MAX_REQUEST_ID_CHARS} characters"
        )
    return request_id


def _check_ids(field: str, ids: Iterable[int], num_blocks: int) -> list[int]:
    try:
        values = list(ids)
    except TypeError as err:
        raise InvalidArgument(f"{field}: expected a list of block ids, got {ids!r}") from err
    checked: list[int] = []
    for value in values:
        try:
            checked.append(operator.index(value))
        except TypeError as err:
            raise InvalidArgument(f"{field}: block id {value!r} is not an integer") from err
    for block_id in checked:
        if not 0 <= block_id < num_blocks:
            raise InvalidArgument(f"{field}: block id {block_id} is outside [0, {num_blocks})")
    return checked


def _check_block_lists(
    field: str, lists: Mapping[str, Sequence[int]] | None, num_blocks: int
) -> dict[str, list[int]]:
    if lists is None:
        return {}
    if not isinstance(lists, Mapping):
        raise InvalidArgument(
            f"{field}: expected a mapping of request id -> block ids, got {type(lists).__name__}"
        )
    checked: dict[str, list[int]] = {}
    for request_id, ids in lists.items():
        check_request_id(field, request_id)
        name = f"{field}[{request_id!r}]"
        block_ids = _check_ids(name, ids, num_blocks)
        seen: set[int] = set()
        for block_id in block_ids:
            if block_id in seen and block_id != NULL_BLOCK_ID:
                raise InvalidArgument(f"{name}: block id {block_id} appears twice")
            seen.add(block_id)
        checked[request_id] = block_ids
    return checked


def _check_fresh(
    tracker: BlockTracker,
    fresh_ids: list[int],
    finished_ids: list[str],
    resumed_lists: dict[str, list[int]],
    new_lists: dict[str, list[int]],
) -> None:
    """A fresh block must be allocated this step and referenced by nobody else."""
    releases: Counter[int] = Counter()
    for request_id in {*finished_ids, *resumed_lists}:
        releases.update(tracker.requests.get(request_id, ()))
    allocated = {i for ids in (*resumed_lists.values(), *new_lists.values()) for i in ids}
    for logical_id in fresh_ids:
        if logical_id == NULL_BLOCK_ID or logical_id not in allocated:
            raise InvalidArgument(
                f"fresh: block id {logical_id} is not among this step's new or resumed blocks"
            )
        if tracker.refs[logical_id] > releases[logical_id]:
            raise InvalidArgument(
                f"fresh: block id {logical_id} still holds data for a running request"
            )
