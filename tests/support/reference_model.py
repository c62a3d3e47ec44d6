"""A deliberately naive reference model of docs/design/step.md's block bookkeeping.

Dicts, lists and sets; every query recomputes from scratch. It does not predict where
the engine places or moves blocks (that is the engine's choice); it predicts everything
that must agree whatever the choice: request tables, reference counts, the live set,
the cached (content-kept) free set, ``num_live`` and, given the engine's mapping,
``max_live``, ``holes`` and the digest. ``assert_engine_agrees`` compares an engine
with the model through the engine's public API only.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvdefrag.common import NULL_BLOCK_ID, StepEvents, mapping_digest


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What the model says a step did.

    Attributes:
        newly_referenced: Logical ids named in this step's resumed/new lists (null excluded).
        newly_live: Logical ids that went from no reference to one, in append order.
        fresh: Logical ids that hold no data yet (``fresh``, or its default when None).
        num_unknown_finished: Finished ids the model did not know.
    """

    newly_referenced: list[int]
    newly_live: list[int]
    fresh: list[int]
    num_unknown_finished: int


class ReferenceModel:
    """Requests, reference counts and the cached set, kept the simplest way possible.

    Attributes:
        num_blocks: Blocks in the pool, the null block included.
        prefix_caching: Whether freed blocks keep their content until evicted.
        requests: Running request id -> its logical block ids, in order.
        cached: Free logical ids whose content must be kept (prefix caching only).
    """

    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.requests: dict[str, list[int]] = {}
        self.cached: set[int] = set()

    def copy(self) -> ReferenceModel:
        """Returns an independent copy (to try out part of a step)."""
        return copy.deepcopy(self)

    # --- queries (all recomputed) -------------------------------------------------------
    def refs(self) -> Counter[int]:
        """Reference count of every referenced logical id."""
        counts: Counter[int] = Counter()
        for logical_ids in self.requests.values():
            counts.update(i for i in logical_ids if i != NULL_BLOCK_ID)
        return counts

    def live(self) -> set[int]:
        """Logical ids referenced by at least one running request."""
        return set(self.refs())

    def free(self) -> set[int]:
        """Logical ids nobody references (the null block excluded)."""
        return set(range(1, self.num_blocks)) - self.live()

    def expendable(self) -> set[int]:
        """Free logical ids whose content may be overwritten."""
        return self.free() - self.cached

    def holds_data(self) -> set[int]:
        """Logical ids whose content must survive: live, and cached free blocks."""
        return self.live() | self.cached

    # --- events -------------------------------------------------------------------------
    def release_request(self, request_id: str) -> bool:
        """Drops a request; its blocks that nobody else holds become free."""
        if request_id not in self.requests:
            return False
        dropped = self.requests.pop(request_id)
        if self.prefix_caching:
            still_live = self.live()
            self.cached |= {i for i in dropped if i != NULL_BLOCK_ID} - still_live
        return True

    def evict(self, logical_ids: Sequence[int]) -> None:
        """Forgets the content of free cached blocks (live ones are not affected)."""
        self.cached -= set(logical_ids)

    def append(self, request_id: str, logical_ids: Sequence[int]) -> list[int]:
        """Adds a request's references; returns the ids that became live."""
        newly_live = []
        for logical_id in logical_ids:
            if logical_id != NULL_BLOCK_ID and logical_id not in self.live():
                newly_live.append(logical_id)
            self.requests.setdefault(request_id, []).append(logical_id)
            self.cached.discard(logical_id)
        if set(self.requests.get(request_id, [])) <= {NULL_BLOCK_ID}:
            self.requests.pop(request_id, None)  # nothing but the null block: not kept
        return newly_live

    def apply(self, events: StepEvents) -> StepOutcome:
        """Applies a valid step in docs/design/step.md order: finished, resumed, evicted, new."""
        num_unknown = sum(not self.release_request(rid) for rid in events.finished)
        for request_id in events.resumed:
            self.release_request(request_id)
        self.evict(events.evicted)
        newly_referenced: list[int] = []
        newly_live: list[int] = []
        for lists in (events.resumed, events.new_blocks):
            for request_id, logical_ids in lists.items():
                newly_live += self.append(request_id, logical_ids)
                newly_referenced += [i for i in logical_ids if i != NULL_BLOCK_ID]
        if events.fresh is not None:
            fresh = list(dict.fromkeys(events.fresh))
        else:
            fresh = [] if self.prefix_caching else newly_live
        return StepOutcome(newly_referenced, newly_live, fresh, num_unknown)


def physical_layout(engine: Any) -> np.ndarray:
    """Returns ``engine.resolve`` of every logical id: the whole mapping."""
    return np.asarray(engine.resolve(np.arange(engine.num_blocks)))


def assert_engine_agrees(engine: Any, model: ReferenceModel) -> np.ndarray:
    """Asserts that what the engine reports agrees with the model.

    Checks the request tables, ``num_live``, ``num_requests``, that the mapping is a
    permutation with ``resolve(0) == 0``, ``max_live``/``holes`` of the model's live set
    under the engine's mapping, and the digest of the live pairs.

    Returns:
        The engine's whole mapping (``resolve`` of every logical id).
    """
    mapping = physical_layout(engine)
    assert sorted(mapping.tolist()) == list(range(engine.num_blocks)), "not a permutation"
    assert mapping[NULL_BLOCK_ID] == NULL_BLOCK_ID, "the null block moved"
    assert engine.list_requests() == model.requests
    live = sorted(model.live())
    stats = engine.stats()
    assert stats.num_live == len(live)
    assert stats.num_requests == len(model.requests)
    max_live = int(mapping[live].max()) if live else 0
    assert stats.max_live == max_live
    assert stats.holes == max_live - len(live)
    expected_digest = mapping_digest((i, int(mapping[i])) for i in live)
    assert engine.digest == expected_digest
    return mapping


def assert_step_result(
    result: Any,
    before: np.ndarray,
    after: np.ndarray,
    newly_referenced: Sequence[int],
    max_moves: int,
) -> None:
    """Asserts what every step result must say, whatever the engine chose.

    Args:
        result: The engine's ``StepResult``.
        before: The whole mapping before the step.
        after: The whole mapping after the step.
        newly_referenced: Logical ids named in the step's resumed/new lists.
        max_moves: The engine's ``max_moves_per_step``.
    """
    changed = set(np.flatnonzero(before != after).tolist())
    expected_keys = changed | {i for i in newly_referenced if i != NULL_BLOCK_ID}
    assert expected_keys <= set(result.block_mapping), "block_mapping misses an id"
    assert NULL_BLOCK_ID not in result.block_mapping
    for logical_id, physical_id in result.block_mapping.items():
        assert after[logical_id] == physical_id, f"block_mapping[{logical_id}] is stale"
    assert len(result.moves) <= max_moves
    sources = [move.src_physical_id for move in result.moves]
    targets = [move.dst_physical_id for move in result.moves]
    assert len(set(sources + targets)) == 2 * len(result.moves), "a slot moved twice"
    for move in result.moves:
        # NOTE: only cached data pushed up out of a fresh block's way is copied upwards
        # (one way); whether it arrived is for the signed KV caches to say.
        is_up = move.dst_physical_id > move.src_physical_id
        assert not (is_up and move.is_two_way), f"upward swap {move}"
        assert NULL_BLOCK_ID not in (move.src_physical_id, move.dst_physical_id), move
