"""Property-based tests: the engine against the naive reference model, on real KV data.

Each example draws a small pool and config, then a sequence of steps shaped like what a
vLLM scheduler sends: admissions (with prefix sharing and prefix-cache hits), growth,
finishes (some of them preemptions, resumed later with a new list), implicit
preemption (resumed while running), request id reuse within a step, evictions, forced
passes and, now and then, an invalid step that must change nothing. After every step
the engine must agree with the model, its moves and placements must obey docs/design/step.md,
and every block whose content matters must read back its own signature.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdefrag.common import InvalidArgument
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server.buckets import decode_bucket

from support.kv import SignedKv
from support.reference_model import (
    ReferenceModel,
    StepEvents,
    assert_engine_agrees,
    assert_step_result,
    physical_layout,
)

BLOCK_SIZE = 2
EXAMPLES_PER_MODE = 200  # 400 sequences in all
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES_PER_MODE,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclasses.dataclass
class Pools:
    """Where a step may take blocks from, after its releases and evictions."""

    expendable: list[int]
    cached: list[int]
    live: list[int]


@dataclasses.dataclass
class DrawnStep:
    events: StepEvents
    forced: bool


class Run:
    """One example: an engine, its signed KV caches and the model, stepped together."""

    def __init__(self, data: st.DataObject, prefix_caching: bool, totals: Counter[str]) -> None:
        self.data = data
        self.totals = totals
        self.prefix_caching = prefix_caching
        self.num_blocks = data.draw(st.integers(8, 40), label="num_blocks")
        self.threshold = data.draw(st.sampled_from([0, 1, 2, 4, 8]), label="threshold")
        self.max_moves = data.draw(st.sampled_from([1, 2, 3, 8, 512]), label="max_moves")
        self.enable_placement = data.draw(
            st.sampled_from([True, True, True, False]), label="enable_placement"
        )
        mla = data.draw(st.booleans(), label="mla")
        self.kv = SignedKv.create(
            self.num_blocks,
            block_size=BLOCK_SIZE,
            num_layers=2,
            num_heads=1,
            head_size=2,
            mla=mla,
        )
        self.engine = Engine(
            self.kv.kv_caches,
            BLOCK_SIZE,
            config=EngineConfig(
                threshold=self.threshold,
                prefix_caching=prefix_caching,
                max_moves_per_step=self.max_moves,
                enable_placement=self.enable_placement,
            ),
        )
        self.model = ReferenceModel(self.num_blocks, prefix_caching)
        self.preempted: list[str] = []
        self.next_request = 0

    # --- drawing steps ------------------------------------------------------------------
    def draw_subset(self, items: list[Any], max_size: int, label: str) -> list[Any]:
        if not items:
            return []
        return self.data.draw(
            st.lists(st.sampled_from(items), unique=True, max_size=max_size), label=label
        )

    def take(self, pool: list[int], max_size: int, label: str) -> list[int]:
        """Removes and returns up to ``max_size`` random blocks of ``pool``."""
        taken = self.draw_subset(pool, max_size, label)
        for block_id in taken:
            pool.remove(block_id)
        return taken

    def draw_block_list(self, pools: Pools, *, admission: bool) -> tuple[list[int], list[int]]:
        """Draws a block list: cache hits and shared blocks first, then fresh blocks."""
        held: list[int] = []
        if admission:
            held += self.take(pools.cached, 3, "cache_hits")
            held += self.draw_subset(pools.live, 2, "shared")
        fresh = self.take(pools.expendable, 4, "fresh")
        if self.prefix_caching and self.data.draw(st.booleans(), label="reuse_cached"):
            fresh += self.take(pools.cached, 2, "fresh_from_cache")  # evicted on reuse
        if admission and self.data.draw(st.integers(0, 9), label="null") == 0:
            held.insert(0, 0)  # a null-block entry in the table
        return held + fresh, fresh

    def new_request_id(self) -> str:
        self.next_request += 1
        return f"req-{self.next_request}"

    def draw_step(self) -> tuple[DrawnStep, Pools, list[int]]:
        data, model = self.data, self.model
        running = sorted(model.requests)
        finished = self.draw_subset(running, 3, "finished")
        if data.draw(st.integers(0, 9), label="ghost") == 0:
            finished.append(f"ghost-{data.draw(st.integers(0, 3))}")
        for request_id in finished:
            if request_id in model.requests and data.draw(st.booleans(), label="preempt"):
                self.preempted.append(request_id)
        candidates = [rid for rid in running if rid not in finished]
        candidates += [rid for rid in self.preempted if rid not in model.requests]
        resumed_ids = self.draw_subset(sorted(set(candidates)), 2, "resumed")
        self.preempted = [rid for rid in self.preempted if rid not in resumed_ids]

        trial = model.copy()
        for request_id in (*finished, *resumed_ids):
            trial.release_request(request_id)
        evicted = self.draw_subset(sorted(trial.cached), 3, "evicted")
        evicted += self.draw_subset(sorted(trial.live()), 1, "evicted_live")  # a no-op
        trial.evict(evicted)
        pools = Pools(sorted(trial.expendable()), sorted(trial.cached), sorted(trial.live()))

        resumed: dict[str, list[int]] = {}
        new_blocks: dict[str, list[int]] = {}
        fresh: list[int] = []
        for request_id in resumed_ids:
            resumed[request_id], fresh_ids = self.draw_block_list(pools, admission=True)
            fresh += fresh_ids
        for _ in range(data.draw(st.integers(0, 2), label="num_admissions")):
            reusable = [rid for rid in finished if rid not in new_blocks]
            if reusable and data.draw(st.booleans(), label="reuse_id"):
                request_id = data.draw(st.sampled_from(reusable))
                self.totals["readmitted_same_step"] += 1
            else:
                request_id = self.new_request_id()
            new_blocks[request_id], fresh_ids = self.draw_block_list(pools, admission=True)
            fresh += fresh_ids
        growing = [rid for rid in running if rid not in finished]
        for request_id in self.draw_subset(growing, 3, "growing"):
            appended, fresh_ids = self.draw_block_list(pools, admission=False)
            new_blocks[request_id] = new_blocks.get(request_id, []) + appended
            fresh += fresh_ids

        implied = not fresh if self.prefix_caching else True
        use_none = implied and data.draw(st.booleans(), label="fresh_none")
        events = StepEvents(
            finished=tuple(finished),
            resumed=resumed,
            new_blocks=new_blocks,
            fresh=None if use_none else fresh,
            evicted=evicted,
        )
        forced = data.draw(st.integers(0, 7), label="forced") == 0
        return DrawnStep(events, forced), pools, fresh

    def draw_invalid(self, events: StepEvents, pools: Pools) -> StepEvents:
        kwargs = events.as_kwargs()
        kind = self.data.draw(
            st.sampled_from(
                ["range", "negative", "duplicate", "fresh_live", "empty_id", "evicted"]
            ),
            label="invalid_kind",
        )
        if kind == "range":
            kwargs["new_blocks"]["bad"] = [self.num_blocks]
        elif kind == "negative":
            kwargs["resumed"]["bad"] = [1, -1]
        elif kind == "duplicate":
            kwargs["new_blocks"]["bad"] = [1, 2, 1]
        elif kind == "fresh_live" and pools.live:
            kwargs["new_blocks"]["bad"] = [pools.live[0]]
            kwargs["fresh"] = [*(kwargs["fresh"] or []), pools.live[0]]
        elif kind == "empty_id":
            kwargs["new_blocks"][""] = []
        else:
            kwargs["evicted"].append(self.num_blocks + 3)
        return StepEvents(**kwargs)

    # --- checking -----------------------------------------------------------------------
    def snapshot(self) -> tuple[Any, ...]:
        engine = self.engine
        return (
            engine.stats(),
            engine.digest,
            physical_layout(engine).tolist(),
            engine.list_requests(),
        )

    def prefer_empty(
        self, pairs: list[tuple[int, int]], stays: int, slot_owner: Any
    ) -> list[tuple[int, int]]:
        """Cached destinations, highest first, give way to empty slots between the last
        destination and ``stays`` (the highest live slot that does not move)."""
        model = self.model
        dsts = [dst for _, dst in pairs]
        cached = [dst for dst in dsts if int(slot_owner[dst]) in model.cached]
        expendable = model.expendable()
        empty = [slot for slot in range(max(dsts) + 1, stays) if slot_owner[slot] in expendable]
        for dst, slot in zip(reversed(cached), empty, strict=False):
            dsts[dsts.index(dst)] = slot
            self.totals["empty_preferred"] += 1
        return list(zip([src for src, _ in pairs], sorted(dsts), strict=True))

    def run_step(self) -> None:
        drawn, pools, fresh_drawn = self.draw_step()
        events = drawn.events
        if drawn.forced:
            self.engine.schedule_defragment()
            self.totals["forced"] += 1
        if self.data.draw(st.integers(0, 7), label="invalid") == 0:
            before = self.snapshot()
            with pytest.raises(InvalidArgument):
                self.engine.step(self.draw_invalid(events, pools))
            assert self.snapshot() == before
            self.totals["invalid"] += 1

        before = physical_layout(self.engine)
        result = self.engine.step(events)
        outcome = self.model.apply(events)
        assert sorted(outcome.fresh) == sorted(fresh_drawn)
        after = assert_engine_agrees(self.engine, self.model)
        assert_step_result(result, before, after, outcome.newly_referenced, self.max_moves)
        assert result.num_unknown_finished == outcome.num_unknown_finished
        assert result.digest == self.engine.digest
        self.check_placement_and_compaction(result, before, after, outcome.fresh, drawn.forced)

        self.kv.write_fresh(self.engine, outcome.fresh)
        assert self.kv.lost_blocks(self.engine, self.model.holds_data()) == []

        self.totals["steps"] += 1
        self.totals["moves"] += len(result.moves)
        self.totals["two_way"] += sum(move.is_two_way for move in result.moves)
        self.totals["placed"] += result.num_placed
        self.totals["resumed"] += len(events.resumed)
        self.totals["evicted"] += len(events.evicted)
        self.totals["unknown_finished"] += result.num_unknown_finished
        self.totals["fresh_none"] += events.fresh is None
        refs = self.model.refs()
        moved_logical = np.argsort(after)[[m.dst_physical_id for m in result.moves]]
        self.totals["shared_moved"] += sum(refs[int(i)] > 1 for i in moved_logical)

    def check_placement_and_compaction(
        self,
        result: Any,
        before: np.ndarray,
        after: np.ndarray,
        fresh: list[int],
        forced: bool,
    ) -> None:
        """Rebuilds the mapping between placement and compaction and checks both."""
        placed, slot_owner = self.check_placement(result, before, after, fresh)
        self.check_compaction(result, placed, slot_owner, set(fresh), forced)

    def check_placement(
        self, result: Any, before: np.ndarray, after: np.ndarray, fresh: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Checks placement; returns the mapping after it (logical -> physical) and the
        slot owners after the step with the moves undone (physical -> logical)."""
        model = self.model
        slot_owner = np.argsort(after)  # physical -> logical after the step
        for move in result.moves:
            src, dst = move.src_physical_id, move.dst_physical_id
            slot_owner[src], slot_owner[dst] = slot_owner[dst], slot_owner[src]
            # The slot a block moved onto: its old content lives on only if cached.
            assert move.is_two_way == (int(slot_owner[dst]) in model.cached), move
        placed = np.argsort(slot_owner)  # logical -> physical after placement

        # Placement re-points fresh blocks only: data-holding blocks keep their slot.
        fresh_set = set(fresh)
        for logical_id in model.holds_data() - fresh_set:
            assert placed[logical_id] == before[logical_id], f"block {logical_id} moved"
        moved_fresh = [i for i in fresh_set if placed[i] != before[i]]
        assert result.num_placed == len(moved_fresh)
        # A fresh block goes to a slot that held nothing to keep: an expendable one or
        # another fresh block's (the runs placement lays out are the policy's choice).
        before_owner = np.argsort(before)
        for logical_id in moved_fresh:
            owner = int(before_owner[placed[logical_id]])
            assert owner in fresh_set or owner in model.expendable(), (logical_id, owner)
        if not self.enable_placement:
            assert result.num_placed == 0
        return placed, slot_owner

    def check_compaction(
        self,
        result: Any,
        placed: np.ndarray,
        slot_owner: np.ndarray,
        fresh: set[int],
        forced: bool,
    ) -> None:
        """Compaction: triggered exactly above the threshold (or forced). A scheduled pass
        moves the highest live slots to the lowest free ones, downward only, capped; a
        step's pass moves live blocks down into free slots, capped, and moves something
        whenever it is triggered and no block of the step is fresh. Either way the data of
        a fresh block's cached destination is copied up instead of swapped."""
        model, num_blocks = self.model, self.num_blocks
        live_slots = sorted((int(placed[i]) for i in model.live()), reverse=True)
        holes = (live_slots[0] - len(live_slots)) if live_slots else 0
        triggered = (holes > self.threshold or forced) and holes > 0
        pairs = self.pairs(result, slot_owner, fresh)
        if not triggered:
            assert not pairs
            return
        if forced:
            free_slots = sorted(set(range(1, num_blocks)) - set(live_slots))
            expected = []
            for src, dst in zip(live_slots, free_slots, strict=False):
                if dst > src or len(expected) == self.max_moves:
                    break
                expected.append((src, dst))
            if expected and len(expected) < len(live_slots):
                expected = self.prefer_empty(expected, live_slots[len(expected)], slot_owner)
            # Which block goes to which destination is the policy's choice (runs keep
            # their order): the sources and the destinations are the packing pass's.
            assert sorted(src for src, _ in pairs) == sorted(src for src, _ in expected)
            assert sorted(dst for _, dst in pairs) == sorted(dst for _, dst in expected)
            if len(expected) < self.max_moves:
                assert result.stats.holes == 0
            return
        assert pairs or fresh, "triggered with no fresh block, yet nothing moved"
        assert len(pairs) <= self.max_moves
        live = set(live_slots)
        for src, dst in pairs:
            assert src in live and dst not in live and 0 < dst < src, (src, dst)
        if pairs:
            assert result.stats.max_live <= live_slots[0]

    def pairs(self, result: Any, slot_owner: Any, fresh: set[int]) -> list[tuple[int, int]]:
        """The (live source, free destination) pairs of a pass, read back from its
        copies: a one-way copy upwards is a fresh block's cached destination copied up
        into its slot (checked), every other move is its pair as planned."""
        pairs = []
        for move in result.moves:
            src, dst = move.src_physical_id, move.dst_physical_id
            if dst > src:  # copied up: the pair was (dst, src)
                assert not move.is_two_way
                assert int(slot_owner[dst]) in fresh and int(slot_owner[src]) in self.model.cached
                self.totals["copied_up"] += 1
                src, dst = dst, src
            else:
                assert not (
                    move.is_two_way
                    and int(slot_owner[src]) in fresh
                    and int(slot_owner[dst]) in self.model.cached
                ), f"{move}: a fresh block swapped with a cached one"
            pairs.append((src, dst))
        return pairs


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
def test_engine_matches_reference_model(prefix_caching: bool) -> None:
    totals: Counter[str] = Counter()

    @PROPERTY_SETTINGS
    @given(data=st.data())
    def run_sequence(data: st.DataObject) -> None:
        run = Run(data, prefix_caching, totals)
        totals["sequences"] += 1
        for _ in range(data.draw(st.integers(1, 30), label="num_steps")):
            run.run_step()

    run_sequence()
    assert totals["sequences"] >= EXAMPLES_PER_MODE
    for key in (
        "moves",
        "placed",
        "invalid",
        "forced",
        "resumed",
        "unknown_finished",
        "readmitted_same_step",
        "fresh_none",
        "shared_moved",
    ):
        assert totals[key] > 0, f"no {key} across the run: {dict(totals)}"
    if prefix_caching:
        assert totals["two_way"] > 0 and totals["evicted"] > 0
        assert totals["empty_preferred"] > 0 and totals["copied_up"] > 0
        assert totals["two_way"] < totals["moves"]  # and some one-way moves too
    else:
        assert totals["two_way"] == 0


class BucketRun(Run):
    """A ``Run`` whose engine has decode buckets: bucket-aware compaction (a scheduled pass
    still packs as the threshold policy does)."""

    def __init__(self, data: st.DataObject, prefix_caching: bool, totals: Counter[str]) -> None:
        super().__init__(data, prefix_caching, totals)
        self.buckets = tuple(
            data.draw(
                st.lists(st.integers(1, self.num_blocks + 4), min_size=1, max_size=4, unique=True),
                label="decode_buckets",
            )
        )
        self.buckets = tuple(sorted(self.buckets))
        config = dataclasses.replace(self.engine.config, decode_buckets=self.buckets)
        self.engine = Engine(self.kv.kv_caches, BLOCK_SIZE, config=config)

    def check_compaction(
        self,
        result: Any,
        placed: np.ndarray,
        slot_owner: np.ndarray,
        fresh: set[int],
        forced: bool,
    ) -> None:
        """Compaction happens exactly when at most ``max_moves`` moves can bring the
        highest live id + 1 into a lower bucket; then into the lowest such bucket, moving
        only the live blocks at or above its size, into the lowest free slots below it."""
        if forced:
            super().check_compaction(result, placed, slot_owner, fresh, forced)
            return
        num_blocks, buckets = self.num_blocks, self.buckets
        live_slots = sorted((int(placed[i]) for i in self.model.live()), reverse=True)
        if not live_slots:
            assert not result.moves
            return
        now = decode_bucket(buckets, live_slots[0] + 1, num_blocks)
        candidates = set(buckets) | ({num_blocks} if num_blocks > buckets[-1] else set())
        reachable = [
            size
            for size in candidates
            if len(live_slots) + 1 <= size < now
            and sum(slot >= size for slot in live_slots) <= self.max_moves
        ]
        if not reachable:
            assert not result.moves
            self.totals["bucket_kept"] += live_slots[0] + 1 - len(live_slots) > 1
            return
        target = min(reachable)
        sources = [slot for slot in live_slots if slot >= target]
        free_slots = sorted(set(range(1, target)) - set(live_slots))
        expected = list(zip(sources, free_slots, strict=False))
        if self.prefix_caching:
            expected = self.prefer_empty(expected, target, slot_owner)
        pairs = self.pairs(result, slot_owner, fresh)
        assert sorted(src for src, _ in pairs) == sorted(src for src, _ in expected)
        assert sorted(dst for _, dst in pairs) == sorted(dst for _, dst in expected)
        assert decode_bucket(buckets, result.stats.max_live + 1, num_blocks) == target
        self.totals["bucket_lowered"] += 1


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
def test_engine_with_decode_buckets_compacts_only_to_lower_the_bucket(
    prefix_caching: bool,
) -> None:
    totals: Counter[str] = Counter()

    @settings(PROPERTY_SETTINGS, max_examples=EXAMPLES_PER_MODE // 2)
    @given(data=st.data())
    def run_sequence(data: st.DataObject) -> None:
        run = BucketRun(data, prefix_caching, totals)
        for _ in range(data.draw(st.integers(1, 30), label="num_steps")):
            run.run_step()

    run_sequence()
    assert totals["bucket_lowered"] > 0 and totals["bucket_kept"] > 0, dict(totals)
    assert totals["forced"] > 0 and totals["moves"] > 0, dict(totals)
