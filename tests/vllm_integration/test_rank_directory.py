"""Where the scheduler finds the ranks (``_rank_directory``): ``ranks.json`` for vLLM's own
processes, Ray's key-value store under Ray, wherever Ray placed rank 0; without Ray or vLLM
(a dictionary stands in for Ray's store, as ``ray.experimental.internal_kv`` answers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.vllm._rank_directory import (
    RANKS_WAIT_S,
    RAY_KV_NAMESPACE,
    FileRankDirectory,
    RayRankDirectory,
    rank_directory,
)
from kvdefrag.vllm.common import RANKS_FILE, PublishedRank, engine_run_dir
from kvdefrag.vllm.errors import StartupRefused

RANKS = [
    PublishedRank("10.0.0.2:50100", bytes([1]) * IDENTITY_SECRET_BYTES),
    PublishedRank("10.0.0.3:50100", bytes([2]) * IDENTITY_SECRET_BYTES),
]


class DictStore:
    """Ray's key-value store as one dictionary every node shares; counts the reads."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.num_gets = 0

    def put(self, key: bytes, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: bytes) -> bytes | None:
        self.num_gets += 1
        return self.values.get(key)


class FakeClock:
    """Time that passes only when the directory sleeps."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, duration_s: float) -> None:
        self.now_s += duration_s


def parallel(backend: object, dp_index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        distributed_executor_backend=backend, data_parallel_index=dp_index, world_size=2
    )


@pytest.mark.parametrize("backend", [None, "uni", "mp", "external_launcher"])
def test_vllms_own_processes_meet_in_ranks_json(backend: object, tmp_path: Path) -> None:
    directory = rank_directory(parallel(backend), os.fspath(tmp_path))
    assert isinstance(directory, FileRankDirectory)
    directory.publish(RANKS)
    assert (tmp_path / RANKS_FILE).is_file()
    assert rank_directory(parallel(backend), os.fspath(tmp_path)).ranks(2) == RANKS


class RayLikeExecutor:
    uses_ray = True


@pytest.mark.parametrize("backend", ["ray", RayLikeExecutor], ids=["ray", "a-ray-class"])
def test_under_ray_the_scheduler_finds_rank_0_on_another_node(
    backend: object, tmp_path: Path
) -> None:
    """Rank 0's node and the engine core's node share Ray's store, not a filesystem: the
    scheduler's node has no ranks.json at all."""
    store = DictStore()
    run_dir = tmp_path / "engine"
    run_dir.mkdir(mode=0o700)  # rank 0's worker made it, on its node
    rank0 = rank_directory(parallel(backend), os.fspath(run_dir), store)
    assert isinstance(rank0, RayRankDirectory)
    rank0.publish(RANKS)
    assert (run_dir / RANKS_FILE).is_file()  # for the operator, on that node
    # the engine core's node: the same setting, nothing there
    os.remove(run_dir / RANKS_FILE)
    engine_core = rank_directory(parallel(backend), os.fspath(run_dir), store)
    assert engine_core.ranks(2) == RANKS


def test_each_engine_and_dp_engine_has_its_own_key(tmp_path: Path) -> None:
    store = DictStore()
    others = [PublishedRank(rank.address + "0", rank.secret[::-1]) for rank in RANKS]
    for folder in ("a", "a/dp1", "b"):
        (tmp_path / folder).mkdir(mode=0o700)  # each engine's rank 0 made its own

    def directory(base: str, dp_index: int) -> RayRankDirectory | FileRankDirectory:
        config = parallel("ray", dp_index)
        return rank_directory(config, engine_run_dir(config, os.fspath(tmp_path / base)), store)

    directory("a", 0).publish(RANKS)
    directory("a", 1).publish(others)
    directory("b", 0).publish(others)
    assert len(store.values) == 3
    assert directory("a", 0).ranks(2) == RANKS
    assert directory("a", 1).ranks(2) == others


def test_the_scheduler_waits_for_rank_0s_record(tmp_path: Path) -> None:
    store, clock = DictStore(), FakeClock()
    real_get = store.get

    def get_published_at_the_third_read(key: bytes) -> bytes | None:
        if store.num_gets == 2:
            RayRankDirectory(os.fspath(tmp_path), store).publish(RANKS)
        return real_get(key)

    store.get = get_published_at_the_third_read  # type: ignore[method-assign]
    directory = RayRankDirectory(os.fspath(tmp_path), store, clock=clock, sleep=clock.sleep)
    assert directory.ranks(2) == RANKS
    assert 0 < clock.now_s < RANKS_WAIT_S


def test_no_record_in_time_names_what_was_awaited_and_the_fix(tmp_path: Path) -> None:
    store, clock = DictStore(), FakeClock()
    directory = RayRankDirectory(
        os.fspath(tmp_path / "engine"), store, wait_s=5.0, clock=clock, sleep=clock.sleep
    )
    with pytest.raises(StartupRefused) as raised:
        directory.ranks(2)
    message = str(raised.value)
    assert f"namespace {RAY_KV_NAMESPACE!r}" in message
    assert repr(f"ranks:{tmp_path / 'engine'}") in message
    assert "--worker-cls kvdefrag.vllm.worker.DefragWorker" in message
    assert "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=KVDEFRAG_" in message
    assert clock.now_s >= 5.0
    assert store.values == {}  # nothing written by the reader


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"not json", "is not a rank list written by kvdefrag's rank 0"),
        (b'{"addresses": ["a:1"], "secrets": ["00"]}', "lists 1 rank addresses"),
        (b'{"addresses": ["a:1", "b:1"], "secrets": ["00", "00"]}', "no identity secret"),
    ],
)
def test_a_record_that_is_not_this_engines_ranks_is_refused(
    value: bytes, message: str, tmp_path: Path
) -> None:
    store = DictStore()
    directory = RayRankDirectory(os.fspath(tmp_path), store)
    store.put(directory.key, value)
    with pytest.raises(StartupRefused, match=message):
        directory.ranks(2)


def test_importing_the_rank_directory_imports_neither_ray_nor_vllm() -> None:
    code = (
        "import sys, kvdefrag.vllm._rank_directory\n"
        "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_ray_missing_is_named_when_its_store_is_needed(tmp_path: Path) -> None:
    if _has_ray():
        pytest.skip("Ray is installed here")
    directory = RayRankDirectory(os.fspath(tmp_path))
    with pytest.raises(StartupRefused, match="Ray is not installed"):
        directory.ranks(2)


def _has_ray() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None
