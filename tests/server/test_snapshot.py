"""MappingSnapshots: the double-buffered mapping that lock-free readers resolve through."""

from __future__ import annotations

import random
import threading

import numpy as np

from kvdefrag.server._snapshot import MappingSnapshots


def random_swaps(rng: random.Random, fwd: list[int], num_swaps: int) -> list[int]:
    """Swaps entries of ``fwd`` (a permutation) in place; returns the ids changed."""
    changed: list[int] = []
    for _ in range(num_swaps):
        a, b = rng.randrange(1, len(fwd)), rng.randrange(1, len(fwd))
        fwd[a], fwd[b] = fwd[b], fwd[a]
        changed += (a, b)
    return changed


def test_every_publish_shows_the_whole_mapping_whichever_buffer_is_current() -> None:
    rng = random.Random(5)
    fwd = list(range(512))
    snapshots = MappingSnapshots(512)
    everything = np.arange(512)
    for step in range(60):
        changed = random_swaps(rng, fwd, rng.randrange(0, 20))
        snapshots.publish(fwd, changed)
        assert snapshots.read(everything).tolist() == fwd, f"after publish {step}"
    subset = np.array([3, 3, 7, 0])
    assert snapshots.read(subset).tolist() == [fwd[3], fwd[3], fwd[7], fwd[0]]


def test_an_id_changed_twice_ends_with_its_latest_value_in_both_buffers() -> None:
    fwd = list(range(16))
    snapshots = MappingSnapshots(16)
    fwd[5], fwd[6] = 6, 5
    fwd[5], fwd[7] = 7, 6  # 5 changes twice before one publish
    snapshots.publish(fwd, [5, 6, 5, 7])
    snapshots.publish(fwd, [])  # no change: nothing to do
    fwd[1], fwd[2] = 2, 1
    snapshots.publish(fwd, [1, 2])  # the other buffer catches up on 5, 6, 7 too
    assert snapshots.read(np.arange(16)).tolist() == fwd


def test_readers_never_see_a_mapping_that_is_not_a_published_one() -> None:
    rng = random.Random(9)
    num_blocks = 4096
    fwd = list(range(num_blocks))
    snapshots = MappingSnapshots(num_blocks)
    everything = np.arange(num_blocks)
    published = {tuple(fwd)}
    stop = threading.Event()
    seen: list[tuple[int, ...]] = []

    def read() -> None:
        while not stop.is_set():
            mapping = tuple(snapshots.read(everything).tolist())
            if len(seen) < 1000:  # keep memory bounded; checked after the writer is done
                seen.append(mapping)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(200):
            snapshots.publish(fwd, random_swaps(rng, fwd, 64))
            published.add(tuple(fwd))
    finally:
        stop.set()
        reader.join()
    assert seen and all(mapping in published for mapping in seen)


def test_read_all_is_a_private_copy_of_a_published_mapping() -> None:
    rng = random.Random(3)
    num_blocks = 4096
    fwd = list(range(num_blocks))
    snapshots = MappingSnapshots(num_blocks)
    published = {tuple(fwd)}
    stop = threading.Event()
    seen: list[tuple[int, ...]] = []

    def read_all() -> None:
        while not stop.is_set():
            mapping = snapshots.read_all()
            if len(seen) < 1000:
                seen.append(tuple(mapping.tolist()))

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        for _ in range(200):
            snapshots.publish(fwd, random_swaps(rng, fwd, 64))
            published.add(tuple(fwd))
    finally:
        stop.set()
        reader.join()
    assert seen and all(mapping in published for mapping in seen)
    mapping = snapshots.read_all()
    assert mapping.tolist() == fwd == snapshots.read(np.arange(num_blocks)).tolist()
    mapping[1] = 0  # the caller's copy: the published mapping is untouched
    assert snapshots.read_all().tolist() == fwd
