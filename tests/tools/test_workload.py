"""The synthetic vLLM workload: block pool rules, scheduler behaviour, integrity end to end."""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter

import pytest

from kvdefrag.client import DefragClient
from kvdefrag.common import InvalidArgument, StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.tools.workload import (
    BlockPool,
    FreeBlockQueue,
    SyntheticWorkload,
    WorkloadConfig,
    WorkloadStep,
    generate_steps,
)

from support.kv import SignedKv


def small_config(**overrides: object) -> WorkloadConfig:
    """A pool of a few hundred 4-token blocks that fills up and preempts."""
    options: dict[str, object] = {
        "num_blocks": 300,
        "block_size": 4,
        "num_steps": 400,
        "arrival_rate": 0.4,
        "initial_requests": 8,
        "prompt_len_median": 40,
        "prompt_len_max": 300,
        "output_len_scale": 20,
        "output_len_max": 200,
        "system_prompt_len": 24,
        "max_num_batched_tokens": 256,
        "seed": 1,
    }
    options.update(overrides)
    return WorkloadConfig(**options)  # type: ignore[arg-type]


class LiveModel:
    """Reference counts rebuilt from the step events alone, as a defragmenter sees them."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.refs: Counter[int] = Counter()

    def apply(self, step: WorkloadStep) -> None:
        for request_id in [*step.events.finished, *step.events.resumed]:
            self.refs.subtract(self.tables.pop(request_id, []))
        for block_id in step.events.fresh:
            assert self.refs[block_id] == 0, f"step {step.index}: fresh block {block_id} is live"
        for request_id, block_ids in [
            *step.events.resumed.items(),
            *step.events.new_blocks.items(),
        ]:
            assert len(set(block_ids)) == len(block_ids), f"{request_id} got a block twice"
            assert 0 not in block_ids, f"{request_id} got the null block"
            self.tables.setdefault(request_id, []).extend(block_ids)
            self.refs.update(block_ids)

    @property
    def live(self) -> set[int]:
        return {block_id for block_id, refs in self.refs.items() if refs > 0}


# --- the free queue and the block pool ------------------------------------------------
def test_free_queue_starts_in_id_order_without_the_null_block() -> None:
    queue = FreeBlockQueue(6)

    assert list(queue) == [1, 2, 3, 4, 5]
    assert len(queue) == 5
    assert 0 not in queue


def test_free_queue_pops_front_removes_middle_prepends_and_appends_in_order() -> None:
    queue = FreeBlockQueue(8)

    assert [queue.popleft(), queue.popleft()] == [1, 2]
    queue.remove(5)
    queue.prepend([2, 1])
    queue.append([5])

    assert list(queue) == [2, 1, 3, 4, 6, 7, 5]
    assert len(queue) == 7
    assert 5 in queue


def test_free_queue_popleft_on_empty_queue_raises() -> None:
    queue = FreeBlockQueue(2)
    queue.popleft()

    with pytest.raises(IndexError):
        queue.popleft()


def test_uncached_frees_go_to_the_front_last_block_first() -> None:
    pool = BlockPool(8, enable_caching=False)
    blocks, _ = pool.allocate(3)

    pool.free(reversed(blocks))

    assert blocks == [1, 2, 3]
    assert list(pool.free_queue) == [3, 2, 1, 4, 5, 6, 7]
    assert pool.allocate(2)[0] == [3, 2]


def test_cached_frees_go_to_the_tail_and_are_evicted_last_block_first() -> None:
    pool = BlockPool(8, enable_caching=True)
    blocks, _ = pool.allocate(3)
    pool.cache(1, "a")
    pool.cache(2, "b")  # block 3 is partial: no cache entry

    pool.free(reversed(blocks))

    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1]
    allocated, evicted = pool.allocate(6)
    assert allocated == [3, 4, 5, 6, 7, 2]
    assert evicted == [2]
    assert pool.lookup("b") is None
    assert pool.lookup("a") == 1


def test_fifo_frees_go_to_the_tail_cached_or_not() -> None:
    # Earlier vLLM v1 appended every freed block: a freed id is reused after all others.
    pool = BlockPool(8, enable_caching=True, free_order="fifo")
    blocks, _ = pool.allocate(3)
    pool.cache(2, "b")

    assert pool.free(reversed(blocks)) == [3, 2, 1]

    assert list(pool.free_queue) == [4, 5, 6, 7, 3, 2, 1]
    assert pool.allocate(5)[0] == [4, 5, 6, 7, 3]


def test_free_order_defaults_to_vllm_0_33_and_is_checked() -> None:
    assert BlockPool(4, enable_caching=False).free_order == "lifo"
    assert WorkloadConfig().free_order == "lifo"
    with pytest.raises(InvalidArgument, match="free_order must be one of lifo, fifo, got 'lru'"):
        BlockPool(4, enable_caching=False, free_order="lru")
    with pytest.raises(InvalidArgument, match="free_order"):
        WorkloadConfig(free_order="LIFO")


def test_prefix_hit_on_a_free_block_takes_it_out_of_the_queue() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks, _ = pool.allocate(2)
    pool.cache(1, "system-0")
    pool.free(reversed(blocks))

    pool.touch([pool.lookup("system-0") or 0])

    assert pool.ref_counts[1] == 1
    assert 1 not in pool.free_queue
    assert pool.allocate(4)[0] == [2, 3, 4, 5]


def test_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks, _ = pool.allocate(1)
    pool.cache(blocks[0], "system-0")
    pool.touch(blocks)

    assert pool.free(blocks) == []
    assert pool.free(blocks) == [1]
    assert list(pool.free_queue)[-1] == 1


# --- the scheduler --------------------------------------------------------------------
@pytest.mark.parametrize("free_order", ["lifo", "fifo"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_never_hands_out_a_live_block(prefix_caching: bool, free_order: str) -> None:
    workload = SyntheticWorkload(
        small_config(enable_prefix_caching=prefix_caching, free_order=free_order)
    )
    model = LiveModel()

    for step in workload:
        model.apply(step)
        assert model.tables == workload.block_tables()
        assert len(model.live) == step.num_live_blocks
        assert max(model.live, default=0) == step.max_live_block_id
        # Evicted: a cached block allocated again, or a block freed that was never full.
        assert (
            not set(step.events.evicted)
            - set(step.events.fresh)
            - set(range(workload.config.num_blocks)).difference(model.live)
        ), "only blocks allocated or free are evicted"


def test_fragmentation_appears_on_the_default_config() -> None:
    ratios = [step.fragmentation_ratio for step in generate_steps(WorkloadConfig())]

    steady = ratios[300:]
    assert sum(steady) / len(steady) > 1.1
    assert max(steady) > 1.4


def test_prefix_caching_shares_system_prompts_and_evicts_cached_blocks() -> None:
    workload = SyntheticWorkload(small_config(enable_prefix_caching=True))
    model = LiveModel()
    max_refs = 0
    steps = []
    for step in workload:
        model.apply(step)
        max_refs = max(max_refs, *model.refs.values())
        steps.append(step)

    assert sum(step.num_prefix_hit_blocks for step in steps) > 100
    assert sum(len(step.events.evicted) for step in steps) > 100
    assert max_refs > 1, "a system prompt block is shared by running requests"
    assert workload.cached_free_blocks()


def test_no_prefix_hits_without_prefix_caching() -> None:
    steps = list(generate_steps(small_config()))

    assert sum(step.num_prefix_hit_blocks for step in steps) == 0
    assert not any(step.events.evicted for step in steps)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_small_pool_preempts_the_newest_request_and_resumes_it(prefix_caching: bool) -> None:
    steps = list(generate_steps(small_config(enable_prefix_caching=prefix_caching)))
    preempted_at: dict[str, int] = {}
    resumed_at: dict[str, int] = {}
    for step in steps:
        for request_id in step.events.resumed:
            resumed_at.setdefault(request_id, step.index)
        if step.num_preempted:
            for request_id in step.events.finished[-step.num_preempted :]:
                preempted_at.setdefault(request_id, step.index)

    assert sum(step.num_preempted for step in steps) > 0
    assert resumed_at, "a preempted request is resumed with a full new list"
    for request_id, index in resumed_at.items():
        assert preempted_at[request_id] < index


def test_resumed_blocks_past_the_prefix_hits_are_fresh() -> None:
    for step in generate_steps(small_config(enable_prefix_caching=True)):
        fresh = set(step.events.fresh)
        for block_ids in step.events.resumed.values():
            # Hits come first, the recomputed remainder is freshly allocated.
            is_fresh = [block_id in fresh for block_id in block_ids]
            assert is_fresh == sorted(is_fresh), f"step {step.index}: hits after fresh blocks"


def test_same_seed_same_steps_other_seed_other_steps() -> None:
    config = small_config(enable_prefix_caching=True)

    first = list(generate_steps(config))
    again = list(generate_steps(config))
    other = list(generate_steps(dataclasses.replace(config, seed=2)))

    assert first == again
    assert first != other


def test_background_blocks_shift_the_same_events_by_a_constant() -> None:
    config = small_config()
    shifted = dataclasses.replace(config, num_blocks=config.num_blocks + 250, background_blocks=250)

    base_steps = list(generate_steps(config))
    shifted_steps = list(generate_steps(shifted))

    background = {
        rid: ids for rid, ids in shifted_steps[0].events.new_blocks.items() if "background" in rid
    }
    assert sorted(i for ids in background.values() for i in ids) == list(range(1, 251))
    for base, moved in zip(base_steps, shifted_steps, strict=True):
        new_blocks = {
            rid: ids for rid, ids in moved.events.new_blocks.items() if rid not in background
        }
        assert new_blocks == {
            rid: [i + 250 for i in ids] for rid, ids in base.events.new_blocks.items()
        }
        assert moved.events.finished == base.events.finished
        assert moved.num_live_blocks == base.num_live_blocks + 250


def test_engine_and_client_step_take_the_events_alone() -> None:
    step = next(generate_steps(small_config()))
    # A synthetic step pins nothing, so its keywords are the event fields without pins.
    assert set(step.events.as_kwargs()) == set(StepEvents.field_names()) - {"unpinned", "pins"}

    for step_method in (Engine.step, DefragClient.step):
        parameters = inspect.signature(step_method).parameters
        assert list(parameters) == ["self", "events"]
        assert parameters["events"].kind is inspect.Parameter.POSITIONAL_ONLY


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 0),
        ("arrival_rate", -1.0),
        ("system_prompt_fraction", 1.5),
        ("prompt_len_max", 100_000),
        ("background_blocks", 290),
    ],
)
def test_bad_config_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=field):
        small_config(**{field: value})


# --- end to end: the workload through a real engine with real KV tensors --------------
@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_engine_keeps_every_block_intact_under_the_workload(prefix_caching: bool) -> None:
    config = small_config(enable_prefix_caching=prefix_caching, num_steps=300)
    kv = SignedKv.create(config.num_blocks, block_size=config.block_size, num_layers=1)
    engine = Engine(
        kv.kv_caches,
        config=EngineConfig(threshold=4, prefix_caching=prefix_caching, max_moves_per_step=16),
        block_size=config.block_size,
    )
    workload = SyntheticWorkload(config)
    num_moves = 0
    ratios_with, ratios_without = [], []

    for step in workload:
        result = engine.step(step.events)
        kv.write_fresh(engine, step.events.fresh)  # the forward pass fills the fresh blocks
        num_moves += len(result.moves)
        live = {i for ids in workload.block_tables().values() for i in ids}
        must_survive = live | set(workload.cached_free_blocks())

        assert kv.lost_blocks(engine, must_survive) == [], f"step {step.index}"
        assert result.stats.num_live == step.num_live_blocks
        ratios_with.append(result.stats.fragmentation_ratio)
        ratios_without.append(step.fragmentation_ratio)

    assert num_moves > 0, "compaction ran"
    assert sum(ratios_with) < sum(ratios_without)
