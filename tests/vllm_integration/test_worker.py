"""The vLLM worker side without vLLM: binding vLLM's KV layouts, and the mixin's lifecycle."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import types
import urllib.request
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import EpochMismatch, InvalidArgument, StepEvents
from kvdefrag.server import Engine, EngineConfig, Move, MoveBatch, make_executor
from kvdefrag.vllm import _engine_checks, _pass
from kvdefrag.vllm._ranks import connect_ranks
from kvdefrag.vllm._runner_rows import Remap
from kvdefrag.vllm.common import (
    RANKS_FILE,
    StepStamp,
    UnsafeRunDir,
    attach_step_stamp,
    engine_id,
    published_ranks,
)
from kvdefrag.vllm.errors import BadSetting, PassRefused, StartupRefused, UnsupportedByKvdefrag
from kvdefrag.vllm.worker import (
    BlockIdTranslator,
    DefragWorkerMixin,
    bind_vllm_kv_caches,
    check_drafter,
    check_v2_runner,
    remap_v1_runner_rows,
    remap_v2_runner_rows,
    translate_scheduler_output,
)

from support.ports import free_port_block
from support.public_api import assert_public_names

NUM_BLOCKS = 8
BLOCK_SIZE = 4
HEADS = 2
HEAD_SIZE = 3

LAYOUTS = {
    # CPU attention: [2, num_blocks, heads, block_size, head_size]
    "cpu": (2, NUM_BLOCKS, HEADS, BLOCK_SIZE, HEAD_SIZE),
    # FlashAttention: [2, num_blocks, block_size, heads, head_size]
    "flash": (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE),
    # FlashInfer: [num_blocks, 2, block_size, heads, head_size]
    "flashinfer": (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE),
    # MLA: [num_blocks, block_size, head_size]
    "mla": (NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE),
}


def _block(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """Everything of block ``block_id`` in a vLLM layout (key and value)."""
    return kv[:, block_id].clone() if kv.shape[0] == 2 else kv[block_id].clone()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_move_on_the_bound_views_moves_the_whole_vllm_block(layout: str) -> None:
    kv = torch.randn(LAYOUTS[layout])
    before = [_block(kv, block_id) for block_id in range(NUM_BLOCKS)]
    pairs = bind_vllm_kv_caches([kv], NUM_BLOCKS, BLOCK_SIZE)
    assert pairs[0][0].shape[0] == NUM_BLOCKS * BLOCK_SIZE
    assert pairs[0][0].data_ptr() == kv.data_ptr()  # a view, not a copy
    make_executor(pairs, BLOCK_SIZE).execute(
        [Move(6, 1, is_two_way=True), Move(7, 2, is_two_way=False)]
    )
    assert torch.equal(_block(kv, 1), before[6])
    assert torch.equal(_block(kv, 6), before[1])
    assert torch.equal(_block(kv, 2), before[7])
    for block_id in (0, 3, 4, 5):
        assert torch.equal(_block(kv, block_id), before[block_id])


def test_a_tensor_two_layers_share_is_bound_once() -> None:
    shared = torch.zeros(LAYOUTS["cpu"])
    other = torch.zeros(LAYOUTS["cpu"])
    assert len(bind_vllm_kv_caches([shared, other, shared], NUM_BLOCKS, BLOCK_SIZE)) == 2


def test_a_layout_that_is_not_a_view_is_refused_by_name() -> None:
    permuted = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_SIZE).transpose(0, 1)
    with pytest.raises(UnsupportedByKvdefrag, match="not contiguous"):
        bind_vllm_kv_caches([permuted], NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(UnsupportedByKvdefrag, match="has shape"):
        bind_vllm_kv_caches([torch.zeros(5, NUM_BLOCKS + 1, 4)], NUM_BLOCKS, BLOCK_SIZE)


class _FakeRunner:
    """A V1 runner with no request in its persistent batch."""

    def __init__(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, Any] = {}
        self.input_batch = SimpleNamespace(block_table=SimpleNamespace(block_tables=[]))


INSTANCE_ID = "1765139000000000000"
"""vLLM's id for the engine every fake worker here belongs to (``VllmConfig.instance_id``)."""


class _FakeVllmWorker:
    """What the mixin uses of vLLM's Worker: ranks, configs, model_runner, hooks."""

    def __init__(self, rank: int, world_size: int = 1, dp_rank: int = 0) -> None:
        self.rank = rank
        self.local_rank = rank
        # NOTE: one rank as far as vLLM's world group goes unless a test fakes the group
        # (_FakeWorld: ranks in threads of this process). ``data_parallel_index`` is the
        # engine's DP rank, as vLLM sets it in every DP engine.
        self.parallel_config = SimpleNamespace(world_size=world_size, data_parallel_index=dp_rank)
        self.vllm_config = SimpleNamespace(
            instance_id=INSTANCE_ID, parallel_config=self.parallel_config
        )
        self.cache_config = type("CacheConfig", (), {"block_size": BLOCK_SIZE})()
        self.model_runner = _FakeRunner()
        self.calls: list[str] = []

    def init_device(self) -> None:
        self.calls.append("init_device")

    def load_model(self) -> None:
        self.calls.append("load_model")

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.model_runner.kv_caches = [torch.zeros(LAYOUTS["cpu"]) for _ in range(2)]
        self.calls.append("initialize_from_config")

    def execute_model(self, scheduler_output: Any) -> Any:
        self.calls.append("execute_model")
        return scheduler_output

    def sample_tokens(self, grammar_output: Any) -> Any:
        self.calls.append("sample_tokens")
        return "sampled"

    def execute_dummy_batch(self) -> None:
        self.calls.append("execute_dummy_batch")

    def compile_or_warm_up_model(self) -> None:
        self.calls.append("compile_or_warm_up_model")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class _Worker(DefragWorkerMixin, _FakeVllmWorker):
    pass


def _kv_cache_config(num_groups: int = 1) -> Any:
    return type(
        "KVCacheConfig", (), {"num_blocks": NUM_BLOCKS, "kv_cache_groups": [None] * num_groups}
    )()


def test_the_mixin_serves_the_rank_holds_kv_lock_and_stops_on_shutdown(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "engine0"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=1)
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    with DefragClient(f"unix:{run_dir}/rank1.sock", prefix_caching=False) as client:
        client.step(StepEvents(new_blocks={"req-0": [5, 6]}))
        assert client.stats().stats.max_live == 2

    held: list[bool] = []

    def execute(scheduler_output: Any) -> Any:
        lock: threading.Lock = handle.kv_lock
        held.append(lock.locked())
        return scheduler_output

    monkeypatch.setattr(_FakeVllmWorker, "execute_model", lambda self, out: execute(out))
    output = _output()
    assert worker.execute_model(output) is output
    assert held == [True]
    # translated: the client's step placed req-0's fresh 5, 6 at the bottom (1, 2), and
    # free 1, 2 took their slots
    assert output.scheduled_new_reqs[0].block_ids == ([5, 6],)
    assert not handle.kv_lock.locked()

    worker.shutdown()
    assert worker.kvdefrag_handle is None
    assert worker.calls[-1] == "shutdown"
    assert not (run_dir / "rank1.sock").exists()


def test_a_step_that_bypasses_the_worker_is_refused_by_the_runner(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor calling the model runner directly (as vLLM 0.32's legacy Ray executor
    does) gets an error at its first step, not wrong tokens; through the worker it runs."""
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path / "run"))
    worker = _Worker(rank=0)
    ran: list[Any] = []
    worker.model_runner.execute_model = lambda output: ran.append(output) or output  # type: ignore[attr-defined]
    monkeypatch.setattr(
        _FakeVllmWorker, "execute_model", lambda self, out: self.model_runner.execute_model(out)
    )
    worker.initialize_from_config(_kv_cache_config())
    output = _output()
    with pytest.raises(UnsupportedByKvdefrag, match="calls the runner directly"):
        worker.model_runner.execute_model(output)
    assert ran == []
    assert worker.execute_model(output) is output
    assert ran == [output]
    worker.shutdown()


def test_a_pass_holds_kv_lock_from_execute_model_through_sample_tokens(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's runners return None from ``execute_model`` and sample and draft in
    ``sample_tokens``: the pass, and ``kv_lock``, span both; a step that moves blocks
    waits for its end."""
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("KVDEFRAG_THRESHOLD", "0")
    worker = _Worker(rank=0)
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None
    held: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        _FakeVllmWorker,
        "execute_model",
        lambda self, out: held.append(("execute_model", handle.kv_lock.locked())),
    )
    monkeypatch.setattr(
        _FakeVllmWorker,
        "sample_tokens",
        lambda self, grammar: held.append(("sample_tokens", handle.kv_lock.locked())) or "out",
    )
    with DefragClient(handle.address, prefix_caching=False) as client:
        client.step(StepEvents(new_blocks={"a": [1, 2, 3], "b": [6, 7]}))
        output = _output()
        attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert worker.execute_model(output) is None
        assert handle.kv_lock.locked()
        before = handle.resolve(np.arange(NUM_BLOCKS)).tolist()
        moving = threading.Thread(target=lambda: client.step(StepEvents(finished=["a"])))
        moving.start()  # compacts b down: needs kv_lock
        moving.join(timeout=0.5)
        assert moving.is_alive()
        assert handle.resolve(np.arange(NUM_BLOCKS)).tolist() == before
        assert worker.sample_tokens(None) == "out"
        moving.join(timeout=10)
        assert not moving.is_alive()
        assert handle.resolve([6, 7]).tolist() != before[6:8]
    assert held == [("execute_model", True), ("sample_tokens", True)]
    assert not handle.kv_lock.locked()
    worker.execute_dummy_batch()  # an idle data-parallel rank: under the lock, no wait
    worker.compile_or_warm_up_model()
    assert worker.calls[-2:] == ["execute_dummy_batch", "compile_or_warm_up_model"]
    assert worker.kvdefrag_pass is not None and worker.kvdefrag_pass.num_idle == 2
    worker.shutdown()


def test_a_warm_up_that_steps_the_runner_through_the_worker_runs_inside_its_pass(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33's GPU worker warms its V2 runner with its own execute_model and
    sample_tokens from compile_or_warm_up_model (``warmup_kernels``): those calls run in
    the warm-up's pass, under the one kv_lock it holds, and the lock is free after."""
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0)
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None
    held: list[tuple[str, bool]] = []

    def execute(self: Any, out: Any) -> None:
        held.append(("execute_model", handle.kv_lock.locked()))

    def sample(self: Any, grammar: Any) -> str:
        held.append(("sample_tokens", handle.kv_lock.locked()))
        return "sampled"

    def warm_up(self: Any) -> None:
        self.execute_model(_output())
        self.sample_tokens(None)
        self.execute_dummy_batch()

    monkeypatch.setattr(_FakeVllmWorker, "execute_model", execute)
    monkeypatch.setattr(_FakeVllmWorker, "sample_tokens", sample)
    monkeypatch.setattr(_FakeVllmWorker, "compile_or_warm_up_model", warm_up)
    worker.compile_or_warm_up_model()
    assert held == [("execute_model", True), ("sample_tokens", True)]
    assert worker.calls[-1] == "execute_dummy_batch"
    assert not handle.kv_lock.locked()
    step = worker.kvdefrag_pass
    assert step is not None and step.num_unclosed == 0 and step.num_idle == 1
    worker.execute_model(_output())  # the next step's pass begins as usual
    assert worker.sample_tokens(None) == "sampled"
    assert not handle.kv_lock.locked()
    worker.shutdown()


def test_a_dummy_batch_between_a_steps_two_halves_is_refused_and_the_pass_goes_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0)
    worker.initialize_from_config(_kv_cache_config())
    monkeypatch.setattr(_FakeVllmWorker, "execute_model", lambda self, out: None)
    assert worker.execute_model(_output()) is None  # the pass stays open
    with pytest.raises(PassRefused, match="between a step's execute_model and its sample"):
        worker.execute_dummy_batch()
    assert "execute_dummy_batch" not in worker.calls
    assert worker.sample_tokens(None) == "sampled"
    handle = worker.kvdefrag_handle
    assert handle is not None and not handle.kv_lock.locked()
    worker.shutdown()


def test_a_failing_execute_model_ends_its_pass(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0)
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None

    def fail(self: Any, out: Any) -> Any:
        raise ValueError("the forward failed")

    monkeypatch.setattr(_FakeVllmWorker, "execute_model", fail)
    with pytest.raises(ValueError, match="the forward failed"):
        worker.execute_model(_output())
    assert not handle.kv_lock.locked()
    worker.shutdown()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model", "dflash"])
def test_a_drafter_that_reads_kv_is_refused_by_name_before_serving(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0)
    worker.vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
        speculative_config=SimpleNamespace(method=method),
        scheduler_config=SimpleNamespace(async_scheduling=False),
    )
    with pytest.raises(UnsupportedByKvdefrag, match=f"method '{method}'"):
        worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_handle is None
    assert not (tmp_path / "rank0.sock").exists()


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix"])
def test_a_drafter_that_reads_token_ids_only_is_served(method: str) -> None:
    check_drafter(SimpleNamespace(speculative_config=SimpleNamespace(method=method)))
    check_drafter(SimpleNamespace(speculative_config=None))


def test_the_mixin_refuses_a_hybrid_model_and_an_unset_run_dir(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    with pytest.raises(UnsupportedByKvdefrag, match="2 KV cache groups"):
        _Worker(rank=0).initialize_from_config(_kv_cache_config(num_groups=2))
    monkeypatch.delenv("KVDEFRAG_VLLM_RUN_DIR")
    with pytest.raises(BadSetting, match="KVDEFRAG_VLLM_RUN_DIR"):
        _Worker(rank=0).initialize_from_config(_kv_cache_config())


# --- the run directory, as the mixin uses it -------------------------------------------
NOBODY = 65534  # another user: the tests run as root, so they can hand files to it


def test_the_mixin_refuses_a_run_dir_another_user_owns_before_serving(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, NOBODY, NOBODY)
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=0)
    with pytest.raises(UnsafeRunDir, match=f"belongs to uid {NOBODY}"):
        worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_handle is None and os.listdir(run_dir) == []


def test_the_mixin_refuses_a_run_dir_others_may_write(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    with pytest.raises(UnsafeRunDir, match=f"mode 0777.*chmod 700 {run_dir}"):
        _Worker(rank=0).initialize_from_config(_kv_cache_config())
    assert os.listdir(run_dir) == []


def test_the_mixin_makes_every_missing_directory_private_whatever_the_umask(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "runs" / "engine0"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    previous = os.umask(0o022)
    try:
        worker = _Worker(rank=0)
        worker.initialize_from_config(_kv_cache_config())
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(os.stat(run_dir.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(run_dir / RANKS_FILE).st_mode) == 0o600
    finally:
        worker.shutdown()


def test_rank_0_never_writes_through_a_link_planted_in_the_run_dir(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    precious.write_text("root's file")
    # where rank 0 used to write its partial file, and the final name
    (run_dir / f"{RANKS_FILE}.{os.getpid()}").symlink_to(precious)
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=0)
    worker.initialize_from_config(_kv_cache_config())
    try:
        assert precious.read_text() == "root's file"
        ranks_file = run_dir / RANKS_FILE
        assert ranks_file.is_file() and not ranks_file.is_symlink()
        ranks = published_ranks(str(run_dir), 1, engine_id=engine_id(worker.vllm_config))
        assert [rank.address for rank in ranks] == [f"unix:{run_dir}/rank0.sock"]
    finally:
        worker.shutdown()


# --- several ranks: vLLM's world group faked for ranks in threads -----------------------
class _FakeWorld:
    """vLLM's world group for workers that run in threads of this process.

    ``all_gather_object`` meets at a barrier, as gloo's does; a rank that never joins
    leaves the others waiting until ``timeout_s`` (then they raise ``BrokenBarrierError``).
    """

    def __init__(self, world_size: int, timeout_s: float = 15.0) -> None:
        self.world_size = world_size
        self.cpu_group = object()
        self.local = threading.local()
        self._slots: list[Any] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def all_gather_object(self, gathered: list[Any], obj: Any, group: Any = None) -> None:
        assert group is self.cpu_group
        self._slots[self.local.rank] = obj
        self._barrier.wait()
        gathered[:] = list(self._slots)
        self._barrier.wait()


def _fake_world(monkeypatch: pytest.MonkeyPatch, world_size: int) -> _FakeWorld:
    world = _FakeWorld(world_size)
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_world_group = lambda: world  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)
    monkeypatch.setattr(torch.distributed, "all_gather_object", world.all_gather_object)
    return world


def _start_ranks(world: _FakeWorld, configs: list[Any]) -> list[Any]:
    """Starts one worker per config, each in its own thread; returns each rank's worker
    (or the exception it raised) once every rank returned.

    NOTE: a rank still blocked after a minute is a rank waiting for a peer that will never
    join the gather (a liveness check, not a timing: the ranks return in milliseconds).
    """
    results: list[Any] = [None] * len(configs)

    def start(rank: int) -> None:
        world.local.rank = rank
        worker = _Worker(rank=rank, world_size=len(configs))
        try:
            worker.initialize_from_config(configs[rank])
            results[rank] = worker
        except BaseException as err:
            results[rank] = err

    threads = [
        threading.Thread(target=start, args=(rank,), daemon=True) for rank in range(len(configs))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"ranks {stuck} still wait in the gather for a rank that failed"
    return results


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on the loopback interface (below the
    ephemeral range: ``support.ports``)."""
    return free_port_block(2)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def test_every_rank_serves_its_metrics_on_base_port_plus_local_rank_labelled_by_rank(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _free_port_pair()
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("KVDEFRAG_METRICS_PORT", str(base))
    world = _fake_world(monkeypatch, 2)
    workers = _start_ranks(world, [_kv_cache_config(), _kv_cache_config()])
    assert all(isinstance(worker, _Worker) for worker in workers), workers
    try:
        for rank, worker in enumerate(workers):
            assert worker.kvdefrag_handle.metrics_port == base + rank
            text = _scrape(base + rank)
            labels = f'dp_rank="0",rank="{rank}"'  # in the order the text format writes them
            assert f"kvdefrag_capacity_blocks{{{labels}}} {float(NUM_BLOCKS)}" in text
            assert f"kvdefrag_steps_total{{{labels}}} 0.0" in text
            # every series carries the rank
            series = [line for line in text.splitlines() if line.startswith("kvdefrag_")]
            assert series and all(f'rank="{rank}"' in line for line in series)
        # rank 0 published both ranks, and each proves the secret it published
        published = published_ranks(
            str(tmp_path / "run"), 2, engine_id=engine_id(workers[0].vllm_config)
        )
        assert [rank.address for rank in published] == [
            f"unix:{tmp_path}/run/rank{rank}.sock" for rank in range(2)
        ]
        for client in connect_ranks(published, prefix_caching=False, tls={}):
            client.close()
    finally:
        for worker in workers:
            if isinstance(worker, _Worker):
                worker.shutdown()


def test_a_metrics_port_past_the_last_port_for_a_rank_is_named(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("KVDEFRAG_METRICS_PORT", "65535")
    worker = _Worker(rank=1)  # one rank here, local rank 1
    with pytest.raises(InvalidArgument, match=r"KVDEFRAG_METRICS_PORT \+ 1 .* = port 65536"):
        worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_handle is None


def _free_ports(count: int) -> int:
    """A port ``p`` with ``p`` .. ``p + count - 1`` free on the loopback interface (below the
    ephemeral range: ``support.ports``)."""
    return free_port_block(count)


def _start_dp_ranks(world: _FakeWorld, dp_size: int, world_size: int) -> list[Any]:
    """Starts ``dp_size`` data-parallel engines of ``world_size`` ranks each, every rank in
    a thread, all in one world group as vLLM makes it for a MoE model (the slot of rank
    ``r`` of DP engine ``d`` is ``d * world_size + r``); returns each worker or its error."""
    results: list[Any] = [None] * (dp_size * world_size)

    def start(slot: int) -> None:
        world.local.rank = slot
        dp_rank, rank = divmod(slot, world_size)
        worker = _Worker(rank=rank, world_size=world_size, dp_rank=dp_rank)
        try:
            worker.init_device()
            worker.initialize_from_config(_kv_cache_config())
            results[slot] = worker
        except BaseException as err:
            results[slot] = err

    threads = [
        threading.Thread(target=start, args=(slot,), daemon=True) for slot in range(len(results))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank still waits in the gather"
    return results


def test_data_parallel_engines_serve_apart_each_publishing_only_its_own_ranks(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two DP engines of two ranks in one world group (a MoE model): each engine's ranks
    serve in its own run directory, on their own metrics ports, labelled with the DP rank,
    and each engine's rank 0 publishes its two ranks only."""
    base = _free_ports(4)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    monkeypatch.setenv("KVDEFRAG_METRICS_PORT", str(base))
    world = _fake_world(monkeypatch, 4)
    workers = _start_dp_ranks(world, dp_size=2, world_size=2)
    assert all(isinstance(worker, _Worker) for worker in workers), workers
    try:
        for dp_rank, engine_dir in enumerate([run_dir, run_dir / "dp1"]):
            engine = engine_id(workers[dp_rank * 2].vllm_config)
            assert engine == f"{INSTANCE_ID}_dp{dp_rank}"
            published = published_ranks(str(engine_dir), 2, engine_id=engine)
            assert [rank.address for rank in published] == [
                f"unix:{engine_dir}/rank{rank}.sock" for rank in range(2)
            ]
            # each published address proves the secret of that engine's rank
            for client in connect_ranks(published, prefix_caching=False, tls={}):
                client.close()
            for rank in range(2):
                port = base + dp_rank * 2 + rank  # DP rank x world size + local rank
                assert workers[dp_rank * 2 + rank].kvdefrag_handle.metrics_port == port
                text = _scrape(port)
                labels = f'dp_rank="{dp_rank}",rank="{rank}"'
                assert f"kvdefrag_capacity_blocks{{{labels}}} {float(NUM_BLOCKS)}" in text
        assert sorted(os.listdir(run_dir / "dp1")) == sorted(
            ["rank0.sock", "rank0.sock.lock", "rank1.sock", "rank1.sock.lock", RANKS_FILE]
        )
    finally:
        for worker in workers:
            if isinstance(worker, _Worker):
                worker.shutdown()


def test_independent_data_parallel_engines_on_one_host_never_share_a_socket_or_port(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm serve --data-parallel-size 2`` of a dense model: two engines of one rank each,
    rank 0 both, one run directory named for both."""
    base = _free_ports(2)
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    monkeypatch.setenv("KVDEFRAG_METRICS_PORT", str(base))
    engines = [_Worker(rank=0, dp_rank=dp_rank) for dp_rank in range(2)]
    try:
        for engine in engines:
            engine.init_device()
            engine.initialize_from_config(_kv_cache_config())
        for dp_rank, engine_dir in enumerate([run_dir, run_dir / "dp1"]):
            engine = engine_id(engines[dp_rank].vllm_config)
            [published] = published_ranks(str(engine_dir), 1, engine_id=engine)
            assert published.address == f"unix:{engine_dir}/rank0.sock"
            assert engines[dp_rank].kvdefrag_handle.metrics_port == base + dp_rank
            assert f'dp_rank="{dp_rank}",rank="0"' in _scrape(base + dp_rank)
    finally:
        for engine in engines:
            engine.shutdown()


def _refused_config(setting: str, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A worker's ``vllm_config`` with ``setting`` kvdefrag refuses (and the environment it
    needs), everything else served."""
    parallel = SimpleNamespace(
        world_size=2,
        data_parallel_index=1,
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
        distributed_executor_backend="mp",
    )
    config = SimpleNamespace(
        parallel_config=parallel, kv_transfer_config=None, speculative_config=None
    )
    if setting == "pipeline_parallel_size":  # served, except under an external launcher
        parallel.pipeline_parallel_size = 2
        parallel.distributed_executor_backend = "external_launcher"
    elif setting == "decode_context_parallel_size":
        setattr(parallel, setting, 2)
    elif setting == "prefill_context_parallel_size":
        parallel.prefill_context_parallel_size = 2
    elif setting == "kv_transfer_config":
        config.kv_transfer_config = SimpleNamespace(kv_connector="NixlConnector")
    elif setting == "speculative_config":
        config.speculative_config = SimpleNamespace(method="eagle")
    elif setting == "VLLM_USE_RAY_V2_EXECUTOR_BACKEND":
        parallel.distributed_executor_backend = "ray"
        monkeypatch.setenv(setting, "0")
        monkeypatch.setattr(_engine_checks, "has_legacy_ray_executor", lambda: True)
    elif setting == "external_launcher":
        parallel.distributed_executor_backend = "external_launcher"
    elif setting in ("KVDEFRAG_METRICS_PORT", "KVDEFRAG_VLLM_TCP_PORT"):
        monkeypatch.setenv(setting, "65534")  # DP rank 1 x 2 ranks + local rank 1: 65537
    else:
        raise AssertionError(setting)
    return config


EARLY_REFUSALS = {
    "pipeline_parallel_size": (UnsupportedByKvdefrag, "--pipeline-parallel-size"),
    "decode_context_parallel_size": (UnsupportedByKvdefrag, "--decode-context-parallel-size"),
    "prefill_context_parallel_size": (UnsupportedByKvdefrag, "--prefill-context-parallel-size"),
    "kv_transfer_config": (UnsupportedByKvdefrag, "drop --kv-transfer-config"),
    "speculative_config": (UnsupportedByKvdefrag, "method 'eagle'"),
    "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": (UnsupportedByKvdefrag, "Unset VLLM_USE_RAY_V2"),
    "external_launcher": (UnsupportedByKvdefrag, "--distributed-executor-backend mp or ray"),
    "KVDEFRAG_METRICS_PORT": (InvalidArgument, "choose KVDEFRAG_METRICS_PORT at most 65532"),
    "KVDEFRAG_VLLM_TCP_PORT": (BadSetting, "choose KVDEFRAG_VLLM_TCP_PORT in 1..65532"),
}
"""What the configuration or the settings alone decide: refused before the model loads."""


@pytest.mark.parametrize("setting", sorted(EARLY_REFUSALS))
def test_what_the_configuration_decides_is_refused_before_the_model_loads(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=1, world_size=2, dp_rank=1)
    worker.vllm_config = _refused_config(setting, monkeypatch)  # type: ignore[attr-defined]
    worker.parallel_config = worker.vllm_config.parallel_config  # type: ignore[attr-defined]
    error, message = EARLY_REFUSALS[setting]
    with pytest.raises(error, match=re.escape(message)):
        worker.init_device()
    assert worker.calls == []  # vLLM's init_device (and so load_model) never ran
    assert not run_dir.exists()  # nothing created, nothing left behind


def test_a_served_configuration_goes_on_to_vllms_init_device(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    worker = _Worker(rank=0)
    worker.init_device()
    assert worker.calls == ["init_device"]
    assert not run_dir.exists()  # created once the caches are bound, not before


def test_a_ray_worker_without_the_run_dir_is_told_how_ray_copies_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVDEFRAG_VLLM_RUN_DIR", raising=False)
    worker = _Worker(rank=0)
    worker.parallel_config.distributed_executor_backend = "ray"
    with pytest.raises(BadSetting, match="VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=KVDEFRAG_"):
        worker.init_device()
    assert worker.calls == []


@pytest.mark.parametrize("cause", ["hybrid model", "metrics port taken"])
def test_a_rank_that_cannot_start_fails_every_rank_at_once_naming_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(run_dir))
    world = _fake_world(monkeypatch, 2)
    configs = [_kv_cache_config(), _kv_cache_config()]
    with contextlib.ExitStack() as stack:
        if cause == "hybrid model":
            configs[1] = _kv_cache_config(2)  # rank 1 fails before it serves
            reason = "rank 1: UnsupportedByKvdefrag: kvdefrag: 2 KV cache groups"
        else:
            base = _free_port_pair()
            taken = stack.enter_context(socket.socket())
            taken.bind(("127.0.0.1", base + 1))  # rank 1's metrics port: someone else's
            taken.listen()
            monkeypatch.setenv("KVDEFRAG_METRICS_PORT", str(base))
            reason = f"rank 1: OSError: [Errno 98] cannot serve metrics on 127.0.0.1:{base + 1}"
        # rank 0 starts and must not wait for rank 1 forever
        results = _start_ranks(world, configs)
    for result in results:
        assert isinstance(result, StartupRefused), result
        assert "1 of 2 ranks could not start their service" in str(result)
        assert reason in str(result)
    assert results[1].__cause__ is not None  # the rank's own error, chained
    # rank 0 stopped the service it had started, and published nothing
    assert sorted(os.listdir(run_dir)) == []


def _output() -> Any:
    """The parts of a vLLM 0.33 SchedulerOutput that name blocks, in logical ids."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([1, 2],))],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["b", "c"], new_block_ids=[None, ([3],)], resumed_req_ids=set()
        ),
        new_block_ids_to_zero=[3],
        kv_cache_block_copies=[(1, 4)],
    )


def test_the_workers_translation_names_every_block_at_its_place() -> None:
    mapping = np.array([0, 5, 6, 7, 1, 2, 3, 4])
    output = _output()
    translate_scheduler_output(output, mapping)
    assert output.scheduled_new_reqs[0].block_ids == ([5, 6],)
    assert output.scheduled_cached_reqs.new_block_ids == [None, ([7],)]
    assert output.new_block_ids_to_zero == [7]
    assert output.kv_cache_block_copies == [(5, 1)]


def _v1_runner(rows: list[list[int]]) -> Any:
    """The two copies of every row vLLM 0.33's V1 runner keeps (requests, block table)."""
    table = np.zeros((4, 6), dtype=np.int32)
    for index, row in enumerate(rows):
        table[index, : len(row)] = row
    block_table = SimpleNamespace(
        block_table=SimpleNamespace(np=table),
        num_blocks_per_row=np.array([len(row) for row in rows] + [0] * (4 - len(rows))),
    )
    return SimpleNamespace(
        requests={
            f"r{index}": SimpleNamespace(block_ids=(list(row),)) for index, row in enumerate(rows)
        },
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[block_table])),
    )


class FakeMoveLog:
    """A rank's service as the translator reads it: a mapping and a log of compactions."""

    def __init__(self) -> None:
        self.mapping = np.arange(NUM_BLOCKS)
        self.batches: list[MoveBatch] = []
        self.num_resolved = 0
        self.is_truncated = False

    def resolve(self, logical_ids: Any) -> Any:
        self.num_resolved += len(logical_ids)
        return self.mapping[logical_ids]

    def moves_since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None:
        now = len(self.batches)
        if version is None:
            return now, []
        if self.is_truncated:
            return None
        return now, self.batches[version:]

    def compact(self, mapping: list[int], *moves: tuple[int, int, bool]) -> None:
        self.mapping = np.array(mapping)
        self.batches.append(
            MoveBatch([m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves])
        )


def test_the_runners_rows_follow_the_blocks_that_moved() -> None:
    service = FakeMoveLog()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    assert translator.advance()[1] is None
    runner = _v1_runner([[1, 2, 3], [4]])
    # the engine swapped the data of physical 1 and 6, and moved 4 to 5 (5 was free)
    service.compact([0, 6, 2, 3, 5, 4, 1, 7], (1, 6, True), (4, 5, False))
    resolve, remap = translator.advance()
    assert remap is not None and resolve(np.array([1, 4])).tolist() == [6, 5]
    assert sorted(remap.old_ids.tolist()) == [1, 4, 6]
    remap_v1_runner_rows(runner, remap)
    assert runner.requests["r0"].block_ids == ([6, 2, 3],)
    assert runner.requests["r1"].block_ids == ([5],)
    table = runner.input_batch.block_table.block_tables[0].block_table.np
    assert table[0, :3].tolist() == [6, 2, 3] and table[1, :1].tolist() == [5]
    assert table[2:].sum() == 0  # unused rows and the null block stay 0
    assert translator.advance()[1] is None
    service.compact([0, 6, 2, 3, 5, 4, 7, 1], (6, 7, True))  # the next pass's own moves
    _, remap = translator.advance()
    assert remap is not None and np.flatnonzero(remap.is_moved).tolist() == [6, 7]
    assert remap[np.arange(NUM_BLOCKS)].tolist() == [0, 1, 2, 3, 4, 5, 7, 6]


def test_the_lists_of_requests_in_the_batch_follow_their_rows_and_the_others_are_scanned() -> None:
    runner = _v1_runner([[1, 2, 3], [4, 6]])
    runner.input_batch.req_ids = ["r0", "r1", None, None]
    runner.requests["out"] = SimpleNamespace(block_ids=([6, 2],))  # preempted: not in the batch
    table = runner.input_batch.block_table.block_tables[0].block_table.np
    table[1, 2] = 1  # a stale entry past row 1's length (2): rewritten, but no list holds it
    # swapped the data of physical 1 and 6, moved 4 to 5
    remap = Remap(np.array([0, 6, 2, 3, 5, 4, 1, 7]), np.array([1, 4, 6]))

    assert remap_v1_runner_rows(runner, remap) == 4  # the entries naming 1, 4 or 6

    assert runner.requests["r0"].block_ids == ([6, 2, 3],)
    assert runner.requests["r1"].block_ids == ([5, 1],)
    assert runner.requests["out"].block_ids == ([1, 2],)
    assert table[0, :3].tolist() == [6, 2, 3] and table[1, :3].tolist() == [5, 1, 6]


def test_rows_are_rewritten_only_where_they_name_a_block_live_before_its_step() -> None:
    """Prefix caching, every free block cached: a shared block that moves is rewritten in
    each row naming it, a finished request's row is left as it is, and a fresh block
    swapped down in the step that allocated it (every later step here) costs the rows
    nothing: the pass has no remap at all."""
    num_blocks = 16
    kv = [(torch.zeros(num_blocks * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0, prefix_caching=True))
    engine.step(StepEvents(new_blocks={"r": list(range(1, num_blocks))}, fresh=[]))
    engine.step(StepEvents(finished=["r"]))
    truth = {"c": [1], "a": [2, 4], "b": [3, 4]}  # 4: a prefix both share
    engine.step(StepEvents(new_blocks=truth, fresh=[]))
    translator = BlockIdTranslator(engine, num_blocks)
    runner = _v1_runner(list(truth.values()))
    runner.input_batch.req_ids = [*truth, None]
    runner.requests = {rid: SimpleNamespace(block_ids=(list(ids),)) for rid, ids in truth.items()}
    block_table = runner.input_batch.block_table.block_tables[0]

    def rows() -> dict[str, list[int]]:
        return {
            rid: block_table.block_table.np[index, : block_table.num_blocks_per_row[index]].tolist()
            for index, rid in enumerate(runner.input_batch.req_ids)
            if rid is not None
        }

    def execute(**events: Any) -> int | None:
        """A step, then the worker's pass: rows follow, then the runner's own updates."""
        engine.step(StepEvents(**events))
        resolve, remap = translator.advance()
        num_rewritten = None if remap is None else remap_v1_runner_rows(runner, remap)
        for rid in events.get("finished", []):
            index = runner.input_batch.req_ids.index(rid)
            runner.input_batch.req_ids[index] = None
            block_table.num_blocks_per_row[index] = 0
            del runner.requests[rid], truth[rid]
        for rid, logical_ids in events.get("new_blocks", {}).items():
            index = runner.input_batch.req_ids.index(rid)
            start = block_table.num_blocks_per_row[index]
            physical_ids = resolve(np.array(logical_ids)).tolist()
            block_table.block_table.np[index, start : start + len(physical_ids)] = physical_ids
            block_table.num_blocks_per_row[index] += len(physical_ids)
            runner.requests[rid].block_ids[0].extend(physical_ids)
            truth[rid] += logical_ids
        expected = {rid: engine.resolve(ids).tolist() for rid, ids in truth.items()}
        assert rows() == expected
        assert {rid: state.block_ids[0] for rid, state in runner.requests.items()} == expected
        return num_rewritten

    assert execute(finished=["c"]) == 2  # the shared block: 4 -> 1, in a's and b's rows
    for rid, fresh_id in [("a", 15), ("b", 14), ("a", 13)]:
        assert execute(new_blocks={rid: [fresh_id]}, fresh=[fresh_id]) is None
    assert engine.stats().totals.num_moves == 4


def test_moves_over_several_compactions_compose() -> None:
    """Data that moved twice between two passes is followed to where it is now; a slot
    whose data moved away one way is not where anything went."""
    service = FakeMoveLog()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.compact(list(range(NUM_BLOCKS)), (7, 3, False), (5, 1, True))
    service.compact(list(range(NUM_BLOCKS)), (3, 2, False), (1, 6, True))
    _, remap = translator.advance()
    assert remap is not None
    # 7 -> 3 -> 2; 5 -> 1 -> 6; 1 -> 5 (swapped with 5), then 6 -> 1 (swapped with 1)
    assert {old: int(remap.table[old]) for old in remap.old_ids.tolist()} == {
        7: 2,
        5: 6,
        1: 5,
        6: 1,
    }
    assert remap.table[3] == 3 and remap.table[4] == 4
    # the next pass starts from the identity again
    service.compact(list(range(NUM_BLOCKS)), (2, 4, False))
    _, remap = translator.advance()
    assert remap is not None and remap.old_ids.tolist() == [2] and remap.table[7] == 7


def test_a_translator_that_lost_track_stops_the_pass() -> None:
    service = FakeMoveLog()
    translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.is_truncated = True
    service.compact(list(range(NUM_BLOCKS)), (2, 4, False))
    with pytest.raises(
        PassRefused, match="rows cannot follow the KV data any more: its service compacted"
    ):
        translator.advance()


def test_an_outputs_ids_are_resolved_in_one_lookup() -> None:
    service = FakeMoveLog()
    service.mapping = np.array([0, 6, 2, 3, 5, 4, 1, 7])
    output = _output()
    calls = []

    def resolve(logical_ids: Any) -> Any:
        calls.append(logical_ids.tolist())
        return service.resolve(logical_ids)

    translate_scheduler_output(output, resolve)

    assert calls == [[1, 2, 3, 3, 1, 4]]
    assert output.scheduled_new_reqs[0].block_ids == ([6, 2],)
    assert output.scheduled_cached_reqs.new_block_ids == [None, ([3],)]
    assert output.new_block_ids_to_zero == [3]
    assert output.kv_cache_block_copies == [(6, 5)]


def test_the_engines_log_gives_where_blocks_live_before_their_step_went() -> None:
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0))
    version, batches = engine.moves_since(None) or (None, None)
    assert batches == []
    # live high, moved in the step they became live in (6 -> 1, 5 -> 2): no output before
    # this step's names them, so no row follows them
    result = engine.step(StepEvents(new_blocks={"a": [5], "b": [6]}, fresh=[]))
    assert len(result.moves) == 2
    assert engine.moves_since(version) == (version, [])
    engine.step(StepEvents(finished=["b"]))  # a hole at 1 below a (at 2): a moves
    found = engine.moves_since(version)
    assert found is not None
    now, batches = found
    assert now == version + 1 and batches == [[Move(2, 1, False)]]
    assert engine.moves_since(now) == (now, [])
    engine.reset()  # the scheduler's session opens with one, after the worker attached
    after_reset = engine.moves_since(version)
    assert after_reset is not None and after_reset[1] == []  # what came before is not followed
    engine.step(StepEvents(new_blocks={"c": [7], "d": [6]}, fresh=[]))
    engine.step(StepEvents(finished=["c"]))
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(2, 1, False)]]  # only since the reset


def test_the_engines_log_follows_a_block_released_and_taken_again_in_one_step() -> None:
    """As the scheduler parks a finished request's blocks while a step in flight still
    reads them: the block is live before and after the step, so its move is logged."""
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0))
    engine.step(StepEvents(new_blocks={"x": [1], "a": [2]}, fresh=[]))
    version, _ = engine.moves_since(None) or (None, None)
    assert version is not None
    engine.step(StepEvents(finished=["x", "a"], new_blocks={"parked": [2]}, fresh=[]))
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(2, 1, False)]]


def test_the_engines_log_leaves_out_blocks_that_became_live_and_the_free_half_of_swaps() -> None:
    """One compaction moves a block live before its step (a swap, logged as a one-way
    move) and a fresh block that became live in it (its cached hole copied up, not
    logged) into cached holes."""
    kv = [(torch.zeros(NUM_BLOCKS * BLOCK_SIZE, 2), None)]
    engine = Engine(kv, BLOCK_SIZE, EngineConfig(threshold=0, prefix_caching=True))
    engine.step(StepEvents(new_blocks={"r": list(range(1, NUM_BLOCKS))}, fresh=[]))
    engine.step(StepEvents(finished=["r"]))  # every free block is cached
    engine.step(StepEvents(new_blocks={"a": [1], "b": [2], "c": [3]}, fresh=[]))
    version, _ = engine.moves_since(None) or (None, None)
    assert version is not None
    # a and b finish (cached holes at 1 and 2); d arrives at 7, no empty slot to place it on
    result = engine.step(StepEvents(finished=["a", "b"], new_blocks={"d": [7]}, fresh=[7]))
    assert list(result.moves) == [Move(1, 7, False), Move(3, 2, True)]
    found = engine.moves_since(version)
    assert found is not None and found[1] == [[Move(3, 2, False)]]


def _v2_runner(rows: list[list[int]], num_groups: int = 1) -> Any:
    """vLLM 0.33's V2 runner as far as kvdefrag reads it: ``block_tables.block_tables[g].gpu``."""
    table = torch.zeros(4, 6, dtype=torch.int32)
    for index, row in enumerate(rows):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    staged = [SimpleNamespace(gpu=table.clone()) for _ in range(num_groups)]
    return SimpleNamespace(kv_caches=[], block_tables=SimpleNamespace(block_tables=staged))


def test_the_v2_runners_table_follows_the_blocks_that_moved_on_its_device() -> None:
    runner = _v2_runner([[1, 2, 3], [4], [7, 7]])
    table = runner.block_tables.block_tables[0].gpu
    before = table.data_ptr()
    # the engine swapped the data of physical 1 and 6, and moved 4 to 5 (5 was free)
    remap_v2_runner_rows(runner, Remap(np.array([0, 6, 2, 3, 5, 4, 1, 7]), np.array([1, 4, 6])))
    assert table.data_ptr() == before and table.dtype == torch.int32  # rewritten in place
    assert table[0, :3].tolist() == [6, 2, 3]
    assert table[1, :1].tolist() == [5]
    assert table[2, :2].tolist() == [7, 7]
    assert table[3].sum() == 0 and table[0, 3:].sum() == 0  # the null block stays 0
    with pytest.raises(AssertionError, match="null block"):
        remap_v2_runner_rows(runner, np.array([1, 0, 2, 3, 4, 5, 6, 7]))


def test_a_v2_runner_without_the_expected_block_table_is_refused_by_name() -> None:
    check_v2_runner(_v2_runner([[1]]))
    with pytest.raises(
        UnsupportedByKvdefrag, match=r"no list model_runner\.block_tables\.block_tables"
    ):
        check_v2_runner(_FakeRunner())
    with pytest.raises(UnsupportedByKvdefrag, match="has 2 block tables"):
        check_v2_runner(_v2_runner([[1]], num_groups=2))
    wrong = [
        (SimpleNamespace(cpu=torch.zeros(4, 6)), "is NoneType"),
        (SimpleNamespace(gpu=np.zeros((4, 6))), "is ndarray"),
        (SimpleNamespace(gpu=torch.zeros(4, 6)), "torch.float32 tensor of shape \\(4, 6\\)"),
        (SimpleNamespace(gpu=torch.zeros(6, dtype=torch.int32)), "shape \\(6,\\)"),
    ]
    for staged, found in wrong:
        runner = SimpleNamespace(block_tables=SimpleNamespace(block_tables=[staged]))
        with pytest.raises(
            UnsupportedByKvdefrag, match=f"gpu of the V2 model runner .* {found}; expected"
        ):
            check_v2_runner(runner)


class _V2Worker(_Worker):
    """The mixin in front of a worker whose config selects vLLM's V2 runner (sync scheduling)."""

    def __init__(self, rank: int, runner: Any) -> None:
        super().__init__(rank)
        self.model_runner = runner
        self.vllm_config = SimpleNamespace(
            instance_id=INSTANCE_ID,
            parallel_config=self.parallel_config,
            use_v2_model_runner=True,
            scheduler_config=SimpleNamespace(async_scheduling=False),
        )


def test_the_mixin_refuses_a_v2_runner_it_cannot_follow_before_serving(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _V2Worker(rank=0, runner=_FakeRunner())
    with pytest.raises(
        UnsupportedByKvdefrag, match="V2 model runner \\(_FakeRunner\\) has no list"
    ):
        worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_handle is None
    assert not (tmp_path / "rank0.sock").exists()


def test_the_mixin_translates_and_remaps_the_v2_runners_table(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    runner = _v2_runner([[1, 2, 3], [4]])
    worker = _V2Worker(rank=0, runner=runner)
    worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_is_v2_runner and worker.kvdefrag_translator is not None
    service = FakeMoveLog()
    worker.kvdefrag_translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.compact([0, 6, 2, 3, 5, 4, 1, 7], (1, 6, True), (4, 5, False))
    output = _output()
    assert worker.execute_model(output) is output
    table = runner.block_tables.block_tables[0].gpu
    assert table[0, :3].tolist() == [6, 2, 3] and table[1, :1].tolist() == [5]
    # the output is translated with the mapping the rows were remapped to
    assert output.scheduled_new_reqs[0].block_ids == ([6, 2],)
    assert output.scheduled_cached_reqs.new_block_ids == [None, ([3],)]
    worker.shutdown()


def test_importing_the_module_imports_no_vllm() -> None:
    code = (
        "import sys, kvdefrag.vllm.worker as module\n"
        "assert not [name for name in sys.modules if name.split('.')[0] == 'vllm']\n"
        "assert not hasattr(module, 'NoSuchWorker')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_worker_exports_are_pinned() -> None:
    assert_public_names(
        "kvdefrag.vllm.worker",
        {
            "BlockIdTranslator",
            "DefragWorkerMixin",
            "Remap",
            "bind_vllm_kv_caches",
            "check_drafter",
            "check_v2_runner",
            "remap_v1_runner_rows",
            "remap_v2_runner_rows",
            "translate_scheduler_output",
            "wait_for_planned_step",
        },
    )


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_reset_between_a_passs_step_check_and_kv_lock_fails_the_pass_before_it_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, runner: str
) -> None:
    """A Reset that takes ``kv_lock`` after the pass found its step applied publishes the
    identity mapping while the data stays where the step put it: the pass must not run
    on it. Held deterministically in that window; a later dummy batch is refused too."""
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0) if runner == "v1" else _V2Worker(0, _v2_runner([[5, 6]]))
    worker.initialize_from_config(_kv_cache_config())
    handle = worker.kvdefrag_handle
    assert handle is not None
    ran: list[Any] = []
    monkeypatch.setattr(_FakeVllmWorker, "execute_model", lambda self, out: ran.append(out))
    real_wait = _pass.wait_for_planned_step

    def wait_then_reset(*args: Any) -> Any:
        step = real_wait(*args)
        handle.reset(force=True)  # in the window: takes kv_lock, publishes the identity
        return step

    with DefragClient(handle.address, prefix_caching=False) as client:
        client.step(StepEvents(new_blocks={"a": [1, 2], "b": [3]}))
        first = _output()
        attach_step_stamp(first, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert worker.execute_model(first) is None and worker.sample_tokens(None) == "sampled"
        client.step(StepEvents(new_blocks={"c": [5, 6]}))  # placed low: 5, 6 -> 4, 5
        assert handle.resolve([5, 6]).tolist() == [4, 5]
        output = _output()
        attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
        epoch = client.epoch
        monkeypatch.setattr(_pass, "wait_for_planned_step", wait_then_reset)
        with pytest.raises(EpochMismatch, match=f"step seq 2 of epoch {epoch} finds the service"):
            worker.execute_model(output)
    assert ran == [first]  # the second pass never reached the runner
    assert output.scheduled_new_reqs[0].block_ids == ([1, 2],)  # left logical
    assert not handle.kv_lock.locked()
    with pytest.raises(EpochMismatch, match=f"not at epoch {epoch} its rows follow"):
        worker.execute_dummy_batch()
    assert "execute_dummy_batch" not in worker.calls
    worker.shutdown()
