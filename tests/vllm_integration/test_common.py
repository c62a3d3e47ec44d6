"""What the two sides share: who translates block ids, where the scheduler finds each rank
(TCP addresses, the published list) and its client TLS, the step stamp, the block-id
fields of an output and the fresh-block rule."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

from kvdefrag.vllm._discovery import (
    RANKS_FILE,
    PublishedRank,
    RanksOfAnotherEngine,
    ensure_run_dir,
    publish_ranks,
    published_ranks,
)
from kvdefrag.vllm.contract import (
    StepStamp,
    attach_step_stamp,
    data_parallel_rank,
    engine_id,
    engine_run_dir,
    rank_port_offset,
    read_step_stamp,
)
from kvdefrag.vllm.errors import StartupRefused, UnsafeRunDir
from kvdefrag.vllm.output_blocks import copy_destinations, first_fresh_block_index, map_block_ids

from support.public_api import assert_public_names
from support.vllm_output import NewRequestData, cached, output

SECRETS = [bytes([rank]) * 32 for rank in range(2)]
ENGINE_ID = "1765139000000000000_dp0"
NOBODY = 65534  # another user: the tests run as root, so they can hand files to it


def test_published_ranks_round_trip_in_rank_order(tmp_path: Path) -> None:
    run_dir = os.fspath(tmp_path / "run")
    ensure_run_dir(run_dir)
    ranks = [
        PublishedRank("10.0.0.7:50100", SECRETS[0]),
        PublishedRank("10.0.0.8:50100", SECRETS[1]),
    ]
    publish_ranks(run_dir, ranks, engine_id=ENGINE_ID)
    assert published_ranks(run_dir, 2, engine_id=ENGINE_ID) == ranks
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
    assert os.listdir(run_dir) == [RANKS_FILE]  # no partial file left behind
    assert os.stat(os.path.join(run_dir, RANKS_FILE)).st_mode & 0o777 == 0o600  # secrets
    assert "secret" not in repr(ranks[0]) and SECRETS[0].hex() not in repr(ranks[0])


def test_missing_addresses_say_which_worker_class_publishes_them(tmp_path: Path) -> None:
    with pytest.raises(StartupRefused, match=re.escape("kvdefrag.vllm.worker.DefragWorker")):
        published_ranks(os.fspath(tmp_path), 1, engine_id=ENGINE_ID)


def _write_ranks(run_dir: Path, document: object) -> None:
    path = run_dir / RANKS_FILE
    path.write_text(json.dumps(document))
    path.chmod(0o600)


def test_addresses_for_another_world_size_are_refused(tmp_path: Path) -> None:
    _write_ranks(
        tmp_path,
        {"engine_id": ENGINE_ID, "addresses": ["unix:/a.sock"], "secrets": [SECRETS[0].hex()]},
    )
    with pytest.raises(StartupRefused, match="lists 1 rank addresses, the engine has 2 ranks"):
        published_ranks(os.fspath(tmp_path), 2, engine_id=ENGINE_ID)


@pytest.mark.parametrize("secrets", [None, ["00"], ["zz" * 32], [SECRETS[0].hex(), "1"]])
def test_ranks_without_a_secret_for_every_rank_are_refused(
    tmp_path: Path, secrets: list[str] | None
) -> None:
    addresses = ["unix:/a.sock", "unix:/b.sock"]
    _write_ranks(tmp_path, {"engine_id": ENGINE_ID, "addresses": addresses, "secrets": secrets})
    with pytest.raises(StartupRefused, match="no identity secret for every rank"):
        published_ranks(os.fspath(tmp_path), 2, engine_id=ENGINE_ID)


@pytest.mark.parametrize("found", ["1765139000000000001_dp0", None])
def test_a_ranks_file_of_another_engine_is_refused_naming_both(
    tmp_path: Path, found: str | None
) -> None:
    """Another engine's (or an older kvdefrag's, naming none): its addresses would prove
    their secrets, so the engine id is what tells them apart."""
    other = {} if found is None else {"engine_id": found}
    secrets = [secret.hex() for secret in SECRETS]
    _write_ranks(tmp_path, {**other, "addresses": ["unix:/a", "unix:/b"], "secrets": secrets})
    with pytest.raises(RanksOfAnotherEngine) as raised:
        published_ranks(os.fspath(tmp_path), 2, engine_id=ENGINE_ID)
    assert (raised.value.expected_engine_id, raised.value.found_engine_id) == (ENGINE_ID, found)
    named = "no engine" if found is None else f"engine {found!r}"
    assert f"{tmp_path / RANKS_FILE} holds the ranks of {named}, not of this engine" in str(
        raised.value
    )
    assert repr(ENGINE_ID) in str(raised.value)
    assert isinstance(raised.value, StartupRefused)


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


def test_every_directory_made_for_the_run_is_private_whatever_the_umask(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "engine0" / "run"
    previous = os.umask(0o022)
    try:
        ensure_run_dir(os.fspath(run_dir))
    finally:
        os.umask(previous)
    for directory in (run_dir.parent.parent, run_dir.parent, run_dir):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    ensure_run_dir(os.fspath(run_dir))  # an existing private one is accepted


def test_a_run_dir_of_another_user_is_refused_on_both_sides(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    publish_ranks(
        os.fspath(run_dir), [PublishedRank("unix:/a.sock", SECRETS[0])], engine_id=ENGINE_ID
    )
    os.chown(run_dir, NOBODY, NOBODY)
    for use in (
        lambda: ensure_run_dir(os.fspath(run_dir)),
        lambda: publish_ranks(
            os.fspath(run_dir), [PublishedRank("unix:/a.sock", SECRETS[0])], engine_id=ENGINE_ID
        ),
        lambda: published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID),
    ):
        with pytest.raises(UnsafeRunDir, match=f"belongs to uid {NOBODY}.*XDG_RUNTIME_DIR"):
            use()


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o750, 0o701])
def test_a_run_dir_group_or_others_may_reach_is_refused(tmp_path: Path, mode: int) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(mode)
    with pytest.raises(UnsafeRunDir, match=re.escape(f"mode {mode:04o}") + ".*chmod 700"):
        ensure_run_dir(os.fspath(run_dir))
    with pytest.raises(UnsafeRunDir, match="chmod 700"):
        published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID)


def test_a_symlinked_run_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(real)
    with pytest.raises(UnsafeRunDir, match="is a symlink"):
        ensure_run_dir(os.fspath(tmp_path / "run"))


def test_publishing_never_writes_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    precious = tmp_path / "precious"
    precious.write_text("root's file")
    # A link at every name the writer could pick: the first two random names are taken.
    names = iter(["aaaa", "bbbb", "cccc"])
    monkeypatch.setattr("kvdefrag.vllm._run_dir.secrets.token_hex", lambda _: next(names))
    for name in (f".{RANKS_FILE}.aaaa", f".{RANKS_FILE}.bbbb", RANKS_FILE):
        (run_dir / name).symlink_to(precious)
    publish_ranks(
        os.fspath(run_dir), [PublishedRank("unix:/a.sock", SECRETS[0])], engine_id=ENGINE_ID
    )
    assert precious.read_text() == "root's file"
    # the planted links are left as they were; ranks.json is a new file, not the link
    assert (run_dir / f".{RANKS_FILE}.aaaa").is_symlink()
    assert not (run_dir / RANKS_FILE).is_symlink()
    assert published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID) == [
        PublishedRank("unix:/a.sock", SECRETS[0])
    ]


def test_a_ranks_file_that_is_a_link_or_not_private_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"addresses": ["unix:/x.sock"], "secrets": ["00" * 32]}))
    elsewhere.chmod(0o600)
    (run_dir / RANKS_FILE).symlink_to(elsewhere)
    with pytest.raises(UnsafeRunDir, match="is a symlink"):
        published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID)
    (run_dir / RANKS_FILE).unlink()
    publish_ranks(
        os.fspath(run_dir), [PublishedRank("unix:/a.sock", SECRETS[0])], engine_id=ENGINE_ID
    )
    (run_dir / RANKS_FILE).chmod(0o644)
    with pytest.raises(UnsafeRunDir, match="mode 0644: group or others may reach it"):
        published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID)
    (run_dir / RANKS_FILE).chmod(0o600)
    os.chown(run_dir / RANKS_FILE, NOBODY, NOBODY)
    with pytest.raises(UnsafeRunDir, match=f"belongs to uid {NOBODY}"):
        published_ranks(os.fspath(run_dir), 1, engine_id=ENGINE_ID)


def test_a_ranks_file_nested_past_the_parsers_depth_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / RANKS_FILE
    path.write_text("[" * 100_000 + "]" * 100_000)  # json would raise RecursionError
    path.chmod(0o600)
    with pytest.raises(StartupRefused, match=re.escape(f"{path} is not a rank list")) as caught:
        published_ranks(os.fspath(tmp_path), 1, engine_id=ENGINE_ID)
    assert "remove it and restart vLLM" in str(caught.value)


def test_a_ranks_file_that_is_a_directory_is_refused_by_name_on_both_sides(
    tmp_path: Path,
) -> None:
    (tmp_path / RANKS_FILE).mkdir(mode=0o700)
    message = f"{tmp_path / RANKS_FILE} is not a regular file"
    with pytest.raises(UnsafeRunDir, match=re.escape(message)):
        published_ranks(os.fspath(tmp_path), 1, engine_id=ENGINE_ID)
    with pytest.raises(UnsafeRunDir, match=re.escape(f"{tmp_path / RANKS_FILE} is a directory")):
        publish_ranks(
            os.fspath(tmp_path), [PublishedRank("unix:/a.sock", SECRETS[0])], engine_id=ENGINE_ID
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == [RANKS_FILE]  # nothing left


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
def test_every_block_id_field_is_mapped_and_nothing_else() -> None:
    out = output(
        new=[NewRequestData("a", ([3, 4], [5]), 0)],
        running=cached(("b", ([6],), 8), ("c", None, 4), ("d", ([7, 8],), 0), resumed={"d"}),
        finished={"z"},
        preempted_req_ids={"p"},
        new_block_ids_to_zero=[3, 6],
        kv_cache_block_copies=[(4, 6)],
    )
    seen: list[list[int]] = []

    def to_physical(logical_ids: Sequence[int]) -> list[int]:
        seen.append(list(logical_ids))
        return [100 + logical_id for logical_id in logical_ids]

    map_block_ids(out, to_physical)

    assert out.scheduled_new_reqs[0].block_ids == ([103, 104], [105])
    assert out.scheduled_cached_reqs.new_block_ids == [([106],), None, ([107, 108],)]
    assert out.new_block_ids_to_zero == [103, 106]
    assert out.kv_cache_block_copies == [(104, 106)]
    # the rest is left alone
    assert out.scheduled_cached_reqs.resumed_req_ids == {"d"}
    assert (out.finished_req_ids, out.preempted_req_ids) == ({"z"}, {"p"})
    assert sorted(id for ids in seen for id in ids) == [3, 3, 4, 4, 5, 6, 6, 6, 7, 8]


def test_copy_pairs_keep_their_type() -> None:
    class BlockCopy(NamedTuple):
        src: int
        dst: int

    out = output(kv_cache_block_copies=[BlockCopy(1, 2)])  # type: ignore[list-item]
    map_block_ids(out, lambda ids: [i * 10 for i in ids])
    assert out.kv_cache_block_copies == [BlockCopy(10, 20)]
    assert type(out.kv_cache_block_copies[0]) is BlockCopy


def test_copy_targets_come_from_the_outputs_copy_pairs() -> None:
    out = output(
        new=[NewRequestData("a", ([3],), 5)],
        running=cached(("b", ([6],), 8), ("c", None, 4)),
        kv_cache_block_copies=[(4, 6), (2, 9)],
    )
    assert copy_destinations(out) == frozenset({6, 9})
    assert copy_destinations(output()) == frozenset()


@pytest.mark.parametrize(
    ("num_computed_tokens", "expected"),
    # block size 4: a block holding any computed token keeps its data (ceil, not floor)
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (7, 2), (8, 2), (9, 3)],
)
def test_the_first_fresh_block_is_the_first_without_a_computed_token(
    num_computed_tokens: int, expected: int
) -> None:
    assert first_fresh_block_index(num_computed_tokens, 4) == expected


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
