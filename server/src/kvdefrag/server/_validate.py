"""Step validation: every field of a step is checked before anything changes.

Pure reads of the tracker; a violation raises ``InvalidArgument`` naming the field and
the value, and the engine's state stays exactly as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from kvdefrag.common import NULL_BLOCK_ID, InvalidArgument, StepEvents
from kvdefrag.common.errors import quote
from kvdefrag.server._tracker import BlockTracker

MAX_REQUEST_ID_CHARS = 256
MAX_CLIENT_NAME_CHARS = 256


def validate_step(
    tracker: BlockTracker, events: StepEvents, pins: Mapping[str, object] | None = None
) -> None:
    """Checks one step's events (types checked when the ``StepEvents`` was made) against
    the pool: request ids and pin keys well formed, every block id in range, fresh
    blocks free, no key pinned twice (``pins``: the engine's pins before the step).

    Raises:
        InvalidArgument: A field is malformed (the message names it and the value).
    """
    num_blocks = tracker.num_blocks
    for request_id in events.finished:
        check_request_id("finished", request_id)
    _check_block_lists("resumed", events.resumed, num_blocks)
    _check_block_lists("new_blocks", events.new_blocks, num_blocks)
    _check_ids("evicted", events.evicted, num_blocks)
    if events.fresh is not None:
        _check_ids("fresh", events.fresh, num_blocks)
        _check_fresh(tracker, events)
    for key in events.unpinned:
        check_request_id("unpinned", key)
    if events.pins:
        _check_pins(events, num_blocks, pins or {})


def _check_pins(events: StepEvents, num_blocks: int, pinned: Mapping[str, object]) -> None:
    """A pin's key is new (or unpinned this step) and its ids are in the pool."""
    unpinned = set(events.unpinned)
    for key, block_ids in events.pins.items():
        check_request_id("pins", key)
        if key in pinned and key not in unpinned:
            raise InvalidArgument(
                f"pins: key {quote(key)} is pinned already; unpin it first (or in the same step)"
            )
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
            _check_ids(f"pins[{quote(key)}]", block_ids, num_blocks)


def check_request_id(field: str, request_id: object) -> str:
    """Returns a well-formed request id: a non-empty str of bounded length."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument(
            f"{field}: request id must be a non-empty str, got {quote(request_id)}"
        )
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"{field}: request id {quote(request_id)} is longer than {MAX_REQUEST_ID_CHARS} "
            "characters"
        )
    return request_id


def check_client_name(client_name: str) -> str:
    """Returns a stream's client name if it is at most ``MAX_CLIENT_NAME_CHARS`` long."""
    if len(client_name) > MAX_CLIENT_NAME_CHARS:
        raise InvalidArgument(
            f"open.client_name {quote(client_name)} is longer than {MAX_CLIENT_NAME_CHARS} "
            "characters"
        )
    return client_name


def _check_ids(field: str, block_ids: Sequence[int], num_blocks: int) -> None:
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks:
                raise InvalidArgument(f"{field}: block id {block_id} is outside [0, {num_blocks})")


def _check_block_lists(field: str, lists: Mapping[str, Sequence[int]], num_blocks: int) -> None:
    for request_id, block_ids in lists.items():
        check_request_id(field, request_id)
        if not block_ids:
            continue
        # NOTE: C-speed checks first; the message (and the quoting) only on failure.
        if min(block_ids) < 0 or max(block_ids) >= num_blocks:
            _check_ids(f"{field}[{quote(request_id)}]", block_ids, num_blocks)
        if len(set(block_ids)) != len(block_ids):
            seen: set[int] = set()
            for block_id in block_ids:
                if block_id in seen and block_id != NULL_BLOCK_ID:
                    raise InvalidArgument(
                        f"{field}[{quote(request_id)}]: block id {block_id} appears twice"
                    )
                seen.add(block_id)


def _check_fresh(tracker: BlockTracker, events: StepEvents) -> None:
    """A fresh block must be allocated this step and referenced by nobody else."""
    fresh = events.fresh or ()
    allocated = {i for ids in (*events.resumed.values(), *events.new_blocks.values()) for i in ids}
    for logical_id in fresh:
        if logical_id == NULL_BLOCK_ID or logical_id not in allocated:
            raise InvalidArgument(
                f"fresh: block id {logical_id} is not among this step's new or resumed blocks"
            )
    refs = tracker.refs
    held = [logical_id for logical_id in fresh if refs[logical_id]]
    if not held:  # the common case: every fresh block is free before the step
        return
    # NOTE: only then are the releases counted (a step that finishes long requests would
    # otherwise count thousands of blocks to check a few).
    releases: Counter[int] = Counter()
    for request_id in {*events.finished, *events.resumed}:
        releases.update(tracker.requests.get(request_id, ()))
    for logical_id in held:
        if refs[logical_id] > releases[logical_id]:
            raise InvalidArgument(
                f"fresh: block id {logical_id} still holds data for a running request"
            )
