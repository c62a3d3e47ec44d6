"""The contract of the two sides (``kvdefrag.vllm.contract``): the engine's id, each data-
parallel engine's run directory and port offsets, and the step stamp."""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from types import SimpleNamespace
from typing import Any

import pytest

from kvdefrag.vllm.contract import (
    StepStamp,
    attach_step_stamp,
    data_parallel_rank,
    engine_id,
    engine_run_dir,
    rank_port_offset,
    read_step_stamp,
)
from kvdefrag.vllm.errors import StartupRefused

from support.public_api import assert_public_names
from support.vllm_output import NewRequestData, output

SECRETS = [bytes([rank]) * 32 for rank in range(2)]
ENGINE_ID = "1765139000000000000_dp0"
NOBODY = 65534  # another user: the tests run as root, so they can hand files to it


def _vllm_config(instance_id: object, dp_index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        instance_id=instance_id, parallel_config=SimpleNamespace(data_parallel_index=dp_index)
    )


def test_the_engine_id_is_vllms_instance_id_and_the_dp_index() -> None:
    assert engine_id(_vllm_config("1765139000000000000")) == "1765139000000000000_dp0"
    # the DP engines of one vllm serve share the instance id
    assert engine_id(_vllm_config("1765139000000000000", 1)) == "1765139000000000000_dp1"
    # under Ray data parallelism vLLM adds the DP rank itself
    assert engine_id(_vllm_config("1765139000000000000_dp1", 1)) == "1765139000000000000_dp1_dp1"


@pytest.mark.parametrize("instance_id", [None, ""])
def test_a_config_without_an_instance_id_is_refused(instance_id: object) -> None:
    with pytest.raises(StartupRefused, match=re.escape("VllmConfig.instance_id")):
        engine_id(_vllm_config(instance_id))


# --- the step stamp ----------------------------------------------------------------------
def test_an_output_without_a_stamp_reads_none() -> None:
    assert read_step_stamp(output()) is None


def test_a_stamp_travels_with_its_output_through_pickle() -> None:
    """vLLM's multiprocess executor pickles the output for the worker processes."""
    out = output(new=[NewRequestData("a", ([3],), 0)])
    attach_step_stamp(out, StepStamp(((7, 12), (9, 12))))

    received = pickle.loads(pickle.dumps(out))

    stamp = read_step_stamp(received)
    assert stamp == StepStamp(((7, 12), (9, 12)))
    assert (stamp.for_rank(0), stamp.for_rank(1)) == ((7, 12), (9, 12))


def test_a_stamp_is_frozen_and_names_a_rank_it_does_not_cover() -> None:
    stamp = StepStamp(((7, 12),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        stamp.by_rank = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="the step stamp covers 1 ranks, this worker is rank 1"):
        stamp.for_rank(1)


def test_anything_but_a_stamp_in_its_place_is_a_broken_invariant() -> None:
    out = output()
    out.kvdefrag_step = ((1, 2),)  # type: ignore[attr-defined]  # the untyped form of old
    with pytest.raises(AssertionError, match="holds a tuple, not a StepStamp"):
        read_step_stamp(out)


# --- what an output says about blocks --------------------------------------------------


def test_common_exports_are_pinned() -> None:
    assert_public_names(
        "kvdefrag.vllm.contract",
        {
            "StepStamp",
            "attach_step_stamp",
            "data_parallel_rank",
            "engine_id",
            "engine_run_dir",
            "rank_port_offset",
            "read_step_stamp",
        },
    )
    assert_public_names(
        "kvdefrag.vllm.output_blocks",
        {"copy_destinations", "first_fresh_block_index", "map_block_ids"},
    )


# --- data parallelism: each DP engine's run directory and ports ------------------------
def _parallel(
    *, dp_index: int | None = None, dp_rank: int = 0, world_size: int = 1, backend: Any = None
) -> SimpleNamespace:
    """The parts of vLLM's ``ParallelConfig`` the DP rules read (``data_parallel_index``
    absent when None, as on a config that predates it)."""
    config = SimpleNamespace(
        data_parallel_rank=dp_rank, world_size=world_size, distributed_executor_backend=backend
    )
    if dp_index is not None:
        config.data_parallel_index = dp_index
    return config


def test_each_data_parallel_engine_gets_a_run_directory_of_its_own(tmp_path: Any) -> None:
    base = str(tmp_path)
    # a dense model's DP engine 1: vLLM reset data_parallel_rank to 0, the index stays 1
    assert engine_run_dir(_parallel(dp_index=1, dp_rank=0), base) == str(tmp_path / "dp1")
    assert engine_run_dir(_parallel(dp_index=3, dp_rank=3), base) == str(tmp_path / "dp3")
    # DP engine 0, and an engine without data parallelism, keep the directory itself
    assert engine_run_dir(_parallel(dp_index=0), base) == base
    assert engine_run_dir(None, base) == base
    # no data_parallel_index: the DP rank
    assert engine_run_dir(_parallel(dp_rank=2), base) == str(tmp_path / "dp2")
    assert not os.listdir(tmp_path)  # nothing is created


def test_the_data_parallel_rank_is_the_index_vllm_keeps_per_engine() -> None:
    assert data_parallel_rank(_parallel(dp_index=1, dp_rank=0)) == 1
    assert data_parallel_rank(_parallel(dp_rank=1)) == 1
    assert data_parallel_rank(None) == 0


def test_no_two_ranks_of_any_data_parallel_engine_share_a_port_offset() -> None:
    world_size = 4
    offsets = [
        rank_port_offset(_parallel(dp_index=dp_rank, world_size=world_size), local_rank)
        for dp_rank in range(3)
        for local_rank in range(world_size)
    ]
    assert offsets == list(range(12))
    # without data parallelism: the local rank, as before
    assert rank_port_offset(_parallel(world_size=2), 1) == 1
    assert rank_port_offset(None, 3) == 3
