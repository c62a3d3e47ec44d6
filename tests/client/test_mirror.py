"""The client's mirror: reference counts, deltas, digest and local resolve.

The mirror must follow the engine's rules exactly (finished releases, resumed replaces,
new blocks append, block 0 never counted), so the property test replays random
workloads through a real engine and the mirror side by side.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdefrag.client import InvalidArgument, StepEvents
from kvdefrag.client._mirror import Mirror
from kvdefrag.common import mapping_digest
from kvdefrag.server import Engine, EngineConfig

from support.kv import SignedKv
from support.random_workload import RandomWorkload


def events(**kwargs: Any) -> StepEvents:
    return StepEvents(**kwargs)


def live_digest(mirror: Mirror) -> int:
    return mapping_digest(mirror.live_pairs())


def test_a_new_mirror_is_the_identity_with_nothing_live() -> None:
    mirror = Mirror(8)

    assert mirror.resolve(range(8)) == list(range(8))
    assert mirror.digest == 0
    assert mirror.live_pairs() == []


def test_new_blocks_and_deltas_update_mapping_and_digest() -> None:
    mirror = Mirror(16)

    digest = mirror.apply_step(events(new_blocks={"a": [5, 9]}), [5, 9, 1, 2], [1, 2, 5, 9])

    assert mirror.resolve([5, 9, 1, 2]) == [1, 2, 5, 9]
    assert mirror.live_pairs() == [(5, 1), (9, 2)]
    assert digest == mirror.digest == mapping_digest([(5, 1), (9, 2)])


def test_an_id_listed_twice_in_the_deltas_ends_with_its_last_mapping() -> None:
    mirror = Mirror(64)
    events = StepEvents(new_blocks={"a": list(range(1, 41))})
    logical_ids = [*range(1, 41), 5]  # 5 twice: first to 25, then to 63
    physical_ids = [*range(21, 61), 63]

    digest = mirror.apply_step(events, logical_ids, physical_ids)

    assert mirror.fwd[5] == 63
    assert digest == mapping_digest(mirror.live_pairs())


def test_finished_releases_and_unknown_finished_is_tolerated() -> None:
    mirror = Mirror(16)
    mirror.apply_step(events(new_blocks={"a": [3], "b": [4]}), [], [])

    mirror.apply_step(events(finished=["a", "never-seen"]), [], [])

    assert mirror.requests == {"b": [4]}
    assert mirror.live_pairs() == [(4, 4)]
    assert mirror.digest == live_digest(mirror)


def test_the_null_block_is_listed_but_never_counted() -> None:
    mirror = Mirror(8)

    mirror.apply_step(events(new_blocks={"a": [0, 3, 0]}), [], [])

    assert mirror.requests == {"a": [0, 3, 0]}
    assert mirror.refs[0] == 0
    assert mirror.live_pairs() == [(3, 3)]
    mirror.apply_step(events(finished=["a"]), [], [])
    assert mirror.digest == 0


def test_resumed_replaces_the_old_list_then_new_blocks_append() -> None:
    mirror = Mirror(16)
    mirror.apply_step(events(new_blocks={"a": [2, 3, 4]}), [], [])

    mirror.apply_step(events(resumed={"a": [3, 7]}, new_blocks={"a": [8]}), [], [])

    assert mirror.requests == {"a": [3, 7, 8]}
    assert [i for i, refs in enumerate(mirror.refs) if refs] == [3, 7, 8]
    assert mirror.digest == live_digest(mirror)


def test_a_request_finished_and_readmitted_in_one_step_keeps_its_new_blocks() -> None:
    mirror = Mirror(16)
    mirror.apply_step(events(new_blocks={"a": [2, 3]}), [], [])

    mirror.apply_step(events(finished=["a"], new_blocks={"a": [3, 5]}), [], [])

    assert mirror.requests == {"a": [3, 5]}
    assert [i for i, refs in enumerate(mirror.refs) if refs] == [3, 5]


def test_shared_blocks_stay_live_until_the_last_reference_goes() -> None:
    mirror = Mirror(16)
    mirror.apply_step(events(new_blocks={"a": [6, 7], "b": [6]}), [], [])

    mirror.apply_step(events(finished=["a"]), [], [])
    assert mirror.live_pairs() == [(6, 6)]

    # A move of a shared block is one mapping change, whoever holds it.
    mirror.apply_step(events(), [6, 1], [1, 6])
    assert mirror.live_pairs() == [(6, 1)]
    assert mirror.digest == live_digest(mirror)
    mirror.apply_step(events(finished=["b"]), [], [])
    assert mirror.digest == 0


def test_moves_of_free_blocks_change_the_mapping_but_not_the_digest() -> None:
    mirror = Mirror(8)
    mirror.apply_step(events(new_blocks={"a": [2]}), [], [])
    before = mirror.digest

    mirror.apply_step(events(), [5, 6], [6, 5])

    assert mirror.resolve([5, 6]) == [6, 5]
    assert mirror.digest == before


@pytest.mark.parametrize(
    ("logical_ids", "message"),
    [
        ([1, -1], r"logical_ids\[1\] = -1 is outside \[0, 8\)"),
        ([8], r"logical_ids\[0\] = 8 is outside \[0, 8\)"),
        ([2, "3"], r"logical_ids\[1\] = '3' is not an integer"),
        ([1.5], r"logical_ids\[0\] = 1.5 is not an integer"),
    ],
)
def test_resolve_refuses_bad_ids_naming_them(logical_ids: list[Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Mirror(8).resolve(logical_ids)


def test_resolve_takes_any_iterable_and_tables() -> None:
    mirror = Mirror(8)
    mirror.apply_step(events(new_blocks={"a": [4]}), [4, 1], [1, 4])

    assert mirror.resolve(iter([4, 1])) == [1, 4]
    assert mirror.resolve(()) == []
    assert mirror.resolve_tables([[4], [], (1, 0)]) == [[1], [], [4, 0]]


@pytest.mark.parametrize(
    ("logical_ids", "physical_ids", "message"),
    [
        ([1, 2], [2], "2 logical ids but 1 physical ids"),
        ([0], [3], r"0 -> 3 is outside \[1, 8\)"),
        ([3], [8], r"3 -> 8 is outside \[1, 8\)"),
    ],
)
def test_malformed_deltas_are_refused(
    logical_ids: list[int], physical_ids: list[int], message: str
) -> None:
    mirror = Mirror(8)

    with pytest.raises(InvalidArgument, match=message):
        mirror.apply_step(events(new_blocks={"a": [3]}), logical_ids, physical_ids)

    assert mirror.requests == {}  # checked before anything changed


def test_from_tables_rebuilds_the_same_mirror() -> None:
    mirror = Mirror(8)
    mirror.apply_step(events(new_blocks={"a": [5, 6], "b": [6]}), [5, 6, 1, 2], [1, 2, 5, 6])

    rebuilt = Mirror.from_tables(mirror.fwd, mirror.requests)

    assert rebuilt.fwd == mirror.fwd
    assert rebuilt.refs == mirror.refs
    assert rebuilt.digest == mirror.digest


@pytest.mark.parametrize(
    ("fwd", "requests", "message"),
    [
        ([0, 1, 1, 3], {}, "not a permutation"),
        ([1, 0, 2, 3], {}, "not a permutation fixing 0"),
        ([0, 1, 2, 3], {"a": [4]}, r"requests\['a'\]: block id 4 is outside \[0, 4\)"),
    ],
)
def test_from_tables_refuses_inconsistent_tables(
    fwd: list[int], requests: dict[str, list[int]], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Mirror.from_tables(fwd, requests)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"finished": "req-a"}, "finished: expected a collection of request ids"),
        ({"finished": [3]}, "finished: request id must be a str, got 3"),
        ({"new_blocks": {"a": [1, "x"]}}, r"new_blocks\['a'\]: block id .* is not an integer"),
        ({"new_blocks": {7: [1]}}, "new_blocks: request id must be a str, got 7"),
        ({"new_blocks": [("a", [1])]}, "new_blocks: expected a mapping"),
        ({"resumed": {"a": [1 << 63]}}, r"resumed\['a'\]\[0\]: block id .* is not an int64"),
        ({"fresh": [None]}, "fresh: block id .* is not an integer"),
        ({"evicted": "12"}, "evicted: expected a sequence of block ids"),
    ],
)
def test_step_events_refuse_values_the_wire_cannot_carry(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StepEvents(**kwargs)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    prefix_caching=st.booleans(),
    threshold=st.integers(0, 6),
    max_moves=st.integers(1, 8),
)
def test_mirror_follows_the_engine_step_by_step(
    seed: int, prefix_caching: bool, threshold: int, max_moves: int
) -> None:
    num_blocks = 40
    kv = SignedKv.create(num_blocks, block_size=2)
    engine = Engine(
        kv.kv_caches,
        2,
        config=EngineConfig(
            threshold=threshold, prefix_caching=prefix_caching, max_moves_per_step=max_moves
        ),
    )
    mirror = Mirror(num_blocks)
    workload = RandomWorkload(num_blocks, prefix_caching, seed)

    for _ in range(25):
        step, _ = workload.next_step()
        result = engine.step(step)
        digest = mirror.apply_step(
            step,
            list(result.block_mapping),
            list(result.block_mapping.values()),
        )

        assert digest == result.digest
        assert mirror.fwd == engine.resolve(range(num_blocks)).tolist()
        assert mirror.requests == engine.list_requests()
