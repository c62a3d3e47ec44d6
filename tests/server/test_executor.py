"""The swap executor on CPU tensors, and what an executor failure does to the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from kvdefrag.common import EngineUnhealthy, InvalidArgument, StepEvents, mapping_digest
from kvdefrag.server import Engine, EngineConfig, Move, MoveReport, make_executor
from kvdefrag.server._executor import pad_to_bucket
from kvdefrag.server._executor_cpu import CpuSwapExecutor
from kvdefrag.server._executor_cuda import CudaSwapExecutor

from support.doubles import INJECTED_FAILURE, ScriptedExecutor
from support.kv import SignedKv, make_kv_caches

BLOCK_SIZE = 4
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def untouched(kv: SignedKv, moves: Sequence[Move]) -> list[int]:
    """Blocks no move wrote: each still holds its own version-0 signature."""
    written = {m.dst_physical_id for m in moves}
    written |= {m.src_physical_id for m in moves if m.is_two_way}
    return [i for i in range(kv.num_blocks) if i not in written]


# --- moves -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_one_way_and_two_way_moves_on_signed_blocks(dtype: torch.dtype, mla: bool) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE, dtype=dtype, mla=mla)
    executor = make_executor(kv.kv_caches, BLOCK_SIZE)
    moves = [Move(9, 1, False), Move(12, 3, True), Move(7, 2, False), Move(15, 4, True)]
    report = executor.execute(moves)
    # One-way: the destination holds the source's block, the source is untouched.
    assert kv.mismatched([9, 9, 7, 7], [1, 9, 2, 7]) == []
    # Two-way: the two slots traded contents.
    assert kv.mismatched([12, 3, 15, 4], [3, 12, 4, 15]) == []
    rest = untouched(kv, moves)
    assert kv.mismatched(rest, rest) == []
    assert report == MoveReport(num_moves=4, num_padded=0, num_bytes=6 * kv.bytes_per_block)


@pytest.mark.parametrize("fail_at_row", [1, 40, 95])
@pytest.mark.parametrize(
    "head_size", [32, 128], ids=["16KiB-rows-in-chunks", "64KiB-rows-one-by-one"]
)
def test_a_failure_in_one_thread_undoes_the_swaps_of_every_thread(
    fail_at_row: int, head_size: int
) -> None:
    """A batch large enough to be split across threads fails in one of them, partway
    through a write: every swap either thread already made is undone, and so is the
    failed write, so each block is back at its own slot."""
    num_moves = 48
    kv = SignedKv.create(
        4 * num_moves, block_size=16, num_layers=2, num_heads=8, head_size=head_size
    )
    executor = ScriptedExecutor.for_kv(kv, num_threads=2)
    executor.fail_mid_write(3, at_row=fail_at_row)  # the last tensor: the others are done
    top = 4 * num_moves - 1
    moves = [Move(top - i, 1 + i, True) for i in range(num_moves)]
    assert num_moves * executor.bytes_per_block >= CpuSwapExecutor._THREADED_MIN_BYTES
    with pytest.raises(RuntimeError, match="injected"):
        executor.execute(moves)
    assert executor.failed_writes == [fail_at_row]
    every = list(range(4 * num_moves))
    assert kv.mismatched(every, every) == []


@pytest.mark.parametrize(
    ("head_size", "num_moves"),
    [(128, 80), (512, 24)],
    ids=["64KiB-blocks", "256KiB-blocks"],
)
def test_large_batches_of_large_blocks_move_every_block(head_size: int, num_moves: int) -> None:
    """Batches that span several staging chunks, and blocks large enough to be copied
    row by row: every block lands where it should and nothing else is written."""
    num_blocks = 4 * num_moves + 8
    kv = SignedKv.create(
        num_blocks, block_size=16, num_layers=1, num_heads=8, head_size=head_size, mla=True
    )
    executor = make_executor(kv.kv_caches, 16)
    top = num_blocks - 1
    one_way = [Move(top - i, 1 + i, False) for i in range(num_moves)]
    two_way = [Move(top - num_moves - i, 1 + num_moves + i, True) for i in range(num_moves)]
    executor.execute(one_way + two_way)
    sources = [m.src_physical_id for m in one_way + two_way]
    targets = [m.dst_physical_id for m in one_way + two_way]
    assert kv.mismatched(sources, targets) == []
    assert kv.mismatched(targets[num_moves:], sources[num_moves:]) == []
    assert kv.mismatched(sources[:num_moves], sources[:num_moves]) == []  # one-way: kept
    rest = untouched(kv, one_way + two_way)
    assert kv.mismatched(rest, rest) == []


def test_an_empty_batch_moves_nothing() -> None:
    kv = SignedKv.create(8, block_size=BLOCK_SIZE)
    report = make_executor(kv.kv_caches, BLOCK_SIZE).execute([])
    assert report == MoveReport(0, 0, 0)
    assert kv.mismatched(range(8), range(8)) == []


@pytest.mark.parametrize(
    "bad_move", [Move(16, 1, False), Move(9, -1, False), Move(-2, 3, True)], ids=str
)
def test_a_move_outside_the_pool_is_refused_before_any_write(bad_move: Move) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match="outside the pool"):
        make_executor(kv.kv_caches, BLOCK_SIZE).execute([Move(12, 2, False), bad_move])
    assert kv.mismatched(range(16), range(16)) == []


def test_non_contiguous_tensors_are_refused() -> None:
    strided = torch.zeros(2, 16 * BLOCK_SIZE, 4).transpose(0, 1)  # [slots, heads, head]
    with pytest.raises(InvalidArgument, match="contiguous"):
        make_executor([(strided, None)], BLOCK_SIZE)
    with pytest.raises(InvalidArgument, match="contiguous"):
        Engine([(torch.zeros(16 * BLOCK_SIZE, 2, 4), strided)], BLOCK_SIZE)


# --- padding ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "buckets", "padded_size"),
    [
        (1, (8, 16, 32), 8),
        (8, (8, 16, 32), 8),
        (9, (8, 16, 32), 16),
        (32, (8, 16, 32), 32),
        (33, (8, 16, 32), 33),  # larger than every bucket: not padded, never truncated
        (4, (3, 5), 5),
        (0, (8,), 8),
    ],
)
def test_pad_to_bucket_picks_the_smallest_bucket_with_null_pairs(
    size: int, buckets: tuple[int, ...], padded_size: int
) -> None:
    src_ids = list(range(100, 100 + size))
    dst_ids = list(range(1, 1 + size))
    padded_src, padded_dst, num_padded = pad_to_bucket(src_ids, dst_ids, buckets)
    assert len(padded_src) == len(padded_dst) == padded_size
    assert num_padded == padded_size - size >= 0
    assert padded_src[:size] == src_ids and padded_dst[:size] == dst_ids
    assert padded_src[size:] == padded_dst[size:] == [0] * num_padded
    assert min(padded_src + padded_dst, default=0) >= 0


@pytest.mark.parametrize("is_two_way", [False, True])
def test_null_pad_pairs_are_harmless(is_two_way: bool) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE)
    src_ids, dst_ids, num_padded = pad_to_bucket([9, 11], [1, 2], (8,))
    assert num_padded == 6
    moves = [Move(s, d, is_two_way) for s, d in zip(src_ids, dst_ids, strict=True)]
    make_executor(kv.kv_caches, BLOCK_SIZE).execute(moves)
    assert kv.mismatched([0, 9, 11], [0, 1, 2]) == []
    rest = untouched(kv, moves[:2])
    assert kv.mismatched(rest, rest) == []


# --- backend table ---------------------------------------------------------------------
def test_cpu_tensors_get_the_cpu_row_executor() -> None:
    executor = make_executor(make_kv_caches(8, block_size=BLOCK_SIZE), BLOCK_SIZE)
    assert isinstance(executor, CpuSwapExecutor)
    assert executor.num_blocks == 8


def test_the_cuda_mover_refuses_tensors_off_cuda() -> None:
    with pytest.raises(InvalidArgument, match="CUDA tensors"):
        CudaSwapExecutor(make_kv_caches(8, block_size=BLOCK_SIZE), BLOCK_SIZE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_cuda_tensors_get_the_cuda_mover_which_moves_as_the_cpu_one(dtype: torch.dtype) -> None:
    kv = SignedKv.create(16, block_size=BLOCK_SIZE, dtype=dtype, mla=True)
    on_cuda = [(key.to("cuda"), None) for key, _ in kv.kv_caches]
    stream = torch.cuda.Stream()
    executor = make_executor(on_cuda, BLOCK_SIZE, stream=stream)
    assert isinstance(executor, CudaSwapExecutor)
    moves = [Move(9, 1, False), Move(12, 3, True), Move(7, 2, False), Move(15, 4, True)]
    assert executor.execute(moves) == make_executor(kv.kv_caches, BLOCK_SIZE).execute(moves)
    stream.synchronize()
    assert kv.mismatched([9, 7, 12, 3, 15, 4], [1, 2, 3, 12, 4, 15]) == []
    for (key, _), (cuda_key, _) in zip(kv.kv_caches, on_cuda, strict=True):
        assert torch.equal(cuda_key.cpu().view(torch.uint8), key.view(torch.uint8))


def test_an_unknown_device_type_is_refused() -> None:
    caches = [(torch.empty(8 * BLOCK_SIZE, 2, 4, device="meta"), None)]
    with pytest.raises(InvalidArgument, match="'meta'") as info:
        make_executor(caches, BLOCK_SIZE)
    assert "cpu" in str(info.value) and "hpu" in str(info.value)


def test_only_the_cpu_backend_is_imported_for_cpu_tensors() -> None:
    script = textwrap.dedent(
        """
        import sys
        import torch
        from kvdefrag.server import Engine, EngineConfig, StepEvents

        engine = Engine([(torch.zeros(64, 2), None)], 4, EngineConfig(threshold=0))
        engine.step(StepEvents(new_blocks={"a": [5, 9]}, fresh=[]))
        assert engine.stats().totals.num_moves == 2
        print(sorted(m for m in sys.modules
                     if m.startswith("habana_frameworks")
                     or m.endswith(("_executor_hpu", "_executor_cuda"))))
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "[]"


# --- failures --------------------------------------------------------------------------
def failing_partway(kv: SignedKv, keep: Callable[[list[Move]], list[Move]]) -> ScriptedExecutor:
    """A real executor whose batches fail after the moves ``keep`` picks ran for real."""
    executor = ScriptedExecutor.for_kv(kv)
    executor.is_failing = True
    executor.moves_before_failing = keep
    return executor


def live_pairs(engine: Engine) -> list[tuple[int, int]]:
    live = sorted({i for ids in engine.list_requests().values() for i in ids} - {0})
    return list(zip(live, engine.resolve(live).tolist(), strict=True))


def check_failed_engine(engine: Engine, kv: SignedKv, mapping_before: list[int]) -> None:
    """The failed compaction was not committed and the engine refuses steps."""
    assert engine.resolve(np.arange(engine.num_blocks)).tolist() == mapping_before
    pairs = live_pairs(engine)
    assert pairs, "the scenario should leave live blocks"
    assert kv.mismatched(*zip(*pairs, strict=True)) == []
    assert engine.digest == mapping_digest(pairs)
    stats = engine.stats()
    assert not stats.is_healthy
    assert engine.unhealthy_reason is not None
    assert INJECTED_FAILURE in engine.unhealthy_reason
    with pytest.raises(EngineUnhealthy, match=INJECTED_FAILURE):
        engine.step(StepEvents())
    with pytest.raises(EngineUnhealthy):
        engine.step(StepEvents(new_blocks={"late": [1]}))
    assert engine.stats() == stats  # refused steps change nothing


@pytest.mark.parametrize("num_done", [0, 2, 6])
def test_a_failed_move_commits_nothing_and_leaves_the_engine_unhealthy(num_done: int) -> None:
    kv = SignedKv.create(32, block_size=BLOCK_SIZE)
    executor = failing_partway(kv, lambda moves: moves[:num_done])
    engine = Engine(kv.kv_caches, BLOCK_SIZE, config=EngineConfig(threshold=2), executor=executor)
    engine.step(StepEvents(new_blocks={"a": list(range(1, 7)), "b": list(range(7, 13))}))
    kv.write_fresh(engine, range(1, 13))
    mapping_before = engine.resolve(np.arange(32)).tolist()

    with pytest.raises(EngineUnhealthy, match=INJECTED_FAILURE) as info:
        engine.step(StepEvents(finished=["a"]))  # six holes: the compaction of six blocks fails
    assert isinstance(info.value.__cause__, RuntimeError)
    check_failed_engine(engine, kv, mapping_before)

    engine.reset()
    executor.is_failing = False
    assert engine.stats().is_healthy and engine.unhealthy_reason is None
    assert engine.resolve(np.arange(32)).tolist() == list(range(32))
    result = engine.step(StepEvents(new_blocks={"c": [3, 9]}, fresh=[]))
    assert result.moves == (Move(9, 1, False), Move(3, 2, False))
    assert engine.stats().holes == 0


def test_a_failed_move_keeps_the_placement_of_its_own_step() -> None:
    """The failed step's events and placement stand; only its compaction is dropped."""
    kv, twin_kv = (SignedKv.create(32, block_size=BLOCK_SIZE) for _ in range(2))
    executor = failing_partway(kv, lambda moves: moves)
    engine = Engine(kv.kv_caches, BLOCK_SIZE, config=EngineConfig(threshold=2), executor=executor)
    twin = Engine(twin_kv.kv_caches, BLOCK_SIZE, config=EngineConfig(threshold=10_000))
    steps = [
        (StepEvents(new_blocks={"a": [1, 2, 3], "b": [4, 5], "c": [6, 7, 8]}), range(1, 9)),
        (StepEvents(finished=["b"], new_blocks={"a": [20]}), [20]),
    ]
    for events, fresh in steps:
        for each_engine, each_kv in ((engine, kv), (twin, twin_kv)):
            each_engine.step(events)
            each_kv.write_fresh(each_engine, list(fresh))
    assert engine.stats().totals.num_moves == twin.stats().totals.num_moves == 0
    failing_step = StepEvents(finished=["a"], new_blocks={"d": [30, 31]})
    with pytest.raises(EngineUnhealthy):
        engine.step(failing_step)  # 30, 31 placed low; three holes left above threshold
    twin_result = twin.step(failing_step)
    assert twin_result.num_placed == 2 and twin_result.stats.holes == 3
    kv.write_fresh(engine, [30, 31])  # what the forward pass would write
    check_failed_engine(engine, kv, twin.resolve(np.arange(32)).tolist())


def test_a_failed_move_with_prefix_caching_keeps_live_and_cached_blocks() -> None:
    """The one-way moves ran, then the failure: no live or cached block is lost."""
    kv = SignedKv.create(32, block_size=BLOCK_SIZE)
    executor = failing_partway(kv, lambda moves: [m for m in moves if not m.is_two_way])
    engine = Engine(
        kv.kv_caches,
        BLOCK_SIZE,
        config=EngineConfig(threshold=2, prefix_caching=True),
        executor=executor,
    )
    engine.step(
        StepEvents(new_blocks={"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9]}, fresh=range(1, 10))
    )
    kv.write_fresh(engine, range(1, 10))
    mapping_before = engine.resolve(np.arange(32)).tolist()
    with pytest.raises(EngineUnhealthy):
        engine.step(StepEvents(finished=["a"], evicted=[1, 3]))  # two one-way moves, two swaps
    check_failed_engine(engine, kv, mapping_before)
    assert kv.lost_blocks(engine, [2, 4]) == []  # still cached, still intact


@pytest.mark.parametrize("fail_at_call", [1, 2, 3], ids=["one-way", "swap-dst", "swap-src"])
def test_a_failure_inside_the_swap_executor_keeps_every_block(fail_at_call: int) -> None:
    """A layer fails mid-batch: whatever other layers already swapped is undone."""
    caches = make_kv_caches(32, block_size=BLOCK_SIZE, num_layers=3)
    kv = SignedKv(caches, BLOCK_SIZE)
    executor = ScriptedExecutor.for_kv(kv)
    # The n-th write into the middle layer's key (tensor 2 of k0 v0 k1 v1 k2 v2) fails
    # after writing the first half of its rows.
    executor.fail_mid_write(2, at_write=fail_at_call)

    # Writes into that tensor: 1 is the one-way move, 2 and 3 the three swaps' two halves
    # (destinations, then sources), each one chunk.
    failing = Engine(
        caches,
        BLOCK_SIZE,
        config=EngineConfig(threshold=2, prefix_caching=True),
        executor=executor,
    )
    failing.step(
        StepEvents(new_blocks={"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9]}, fresh=range(1, 10))
    )
    kv.write_fresh(failing, range(1, 10))
    mapping_before = failing.resolve(np.arange(32)).tolist()
    with pytest.raises(EngineUnhealthy):
        failing.step(StepEvents(finished=["a"], evicted=[1]))  # one one-way move, three swaps
    assert executor.failed_writes == [fail_at_call]
    check_failed_engine(failing, kv, mapping_before)
    assert kv.lost_blocks(failing, [2, 3, 4]) == []
