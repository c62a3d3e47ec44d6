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
from kvdefrag.server import Move, make_executor
from kvdefrag.vllm import refusals as _engine_checks
from kvdefrag.vllm._discovery import RANKS_FILE, published_ranks
from kvdefrag.vllm._scheduler.ranks import connect_ranks
from kvdefrag.vllm._worker import passes as _pass
from kvdefrag.vllm._worker.kv_binding import bind_vllm_kv_caches
from kvdefrag.vllm._worker.translation import (
    BlockIdTranslator,
)
from kvdefrag.vllm.contract import StepStamp, attach_step_stamp, engine_id
from kvdefrag.vllm.errors import (
    BadSetting,
    PassRefused,
    StartupRefused,
    UnsafeRunDir,
    UnsupportedByKvdefrag,
)
from kvdefrag.vllm.refusals import check_drafter
from kvdefrag.vllm.worker import DefragWorkerMixin

from support.ports import free_port_block
from support.public_api import assert_public_names
from support.runners import FakeMoveHistory, block_naming_output, v2_runner

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
    output = block_naming_output()
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
    output = block_naming_output()
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
        output = block_naming_output()
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
        self.execute_model(block_naming_output())
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
    worker.execute_model(block_naming_output())  # the next step's pass begins as usual
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
    assert worker.execute_model(block_naming_output()) is None  # the pass stays open
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
        worker.execute_model(block_naming_output())
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
    with pytest.raises(UnsupportedByKvdefrag, match="serves one KV-cache group; this model has 2"):
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
        config.kv_transfer_config = SimpleNamespace(kv_connector="NixlPushConnector")
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
            reason = (
                "rank 1: UnsupportedByKvdefrag: kvdefrag serves one KV-cache group; "
                "this model has 2"
            )
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
    runner = v2_runner([[1, 2, 3], [4]])
    worker = _V2Worker(rank=0, runner=runner)
    worker.initialize_from_config(_kv_cache_config())
    assert worker.kvdefrag_is_v2_runner and worker.kvdefrag_translator is not None
    service = FakeMoveHistory()
    worker.kvdefrag_translator = BlockIdTranslator(service, NUM_BLOCKS)
    service.compact([0, 6, 2, 3, 5, 4, 1, 7], (1, 6, True), (4, 5, False))
    output = block_naming_output()
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
    assert_public_names("kvdefrag.vllm.worker", {"DefragWorkerMixin"})


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_reset_between_a_passs_step_check_and_kv_lock_fails_the_pass_before_it_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, runner: str
) -> None:
    """A Reset that takes ``kv_lock`` after the pass found its step applied publishes the
    identity mapping while the data stays where the step put it: the pass must not run
    on it. Held deterministically in that window; a later dummy batch is refused too."""
    monkeypatch.setenv("KVDEFRAG_VLLM_RUN_DIR", str(tmp_path))
    worker = _Worker(rank=0) if runner == "v1" else _V2Worker(0, v2_runner([[5, 6]]))
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
        first = block_naming_output()
        attach_step_stamp(first, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert worker.execute_model(first) is None and worker.sample_tokens(None) == "sampled"
        client.step(StepEvents(new_blocks={"c": [5, 6]}))  # placed low: 5, 6 -> 4, 5
        assert handle.resolve([5, 6]).tolist() == [4, 5]
        output = block_naming_output()
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
