"""Where the scheduler finds the ranks (``_discovery``): ``ranks.json`` for vLLM's own
processes, Ray's key-value store under Ray, wherever Ray placed rank 0, both under the
engine's id; without Ray or vLLM (a dictionary stands in for Ray's store, as
``ray.experimental.internal_kv`` answers)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.vllm._discovery import (
    RANKS_FILE,
    RANKS_WAIT_S,
    RAY_KV_NAMESPACE,
    FileRankDirectory,
    PublishedRank,
    RanksOfAnotherEngine,
    RayRankDirectory,
    ensure_run_dir,
    publish_ranks,
    published_ranks,
    rank_directory,
)
from kvdefrag.vllm.contract import engine_id
from kvdefrag.vllm.errors import StartupRefused, UnsafeRunDir

SECRETS = [bytes([rank]) * 32 for rank in range(2)]
NOBODY = 65534  # another user: the tests run as root, so they can hand files to it

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


def config(backend: object, dp_index: int = 0, instance_id: str = "engine-a") -> SimpleNamespace:
    """What the rank directory reads of a ``VllmConfig``: the engine's id and its layout."""
    parallel = SimpleNamespace(
        distributed_executor_backend=backend, data_parallel_index=dp_index, world_size=2
    )
    return SimpleNamespace(instance_id=instance_id, parallel_config=parallel)


ENGINE_ID = engine_id(config("ray"))


@pytest.mark.parametrize("backend", [None, "uni", "mp", "external_launcher"])
def test_vllms_own_processes_meet_in_ranks_json(backend: object, tmp_path: Path) -> None:
    directory = rank_directory(config(backend), os.fspath(tmp_path))
    assert isinstance(directory, FileRankDirectory)
    directory.publish(RANKS)
    assert (tmp_path / RANKS_FILE).is_file()
    assert rank_directory(config(backend), os.fspath(tmp_path)).ranks(2) == RANKS


def test_ranks_json_of_another_engine_sharing_the_run_dir_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    """Two engines given one run directory (their ranks on TCP, so no socket collides):
    the second one's rank 0 replaces the first's record before the first's scheduler reads
    it, which refuses it by name instead of stepping the other engine's ranks."""
    others = [PublishedRank(rank.address + "0", rank.secret[::-1]) for rank in RANKS]
    rank_directory(config("mp", instance_id="engine-a"), os.fspath(tmp_path)).publish(RANKS)
    rank_directory(config("mp", instance_id="engine-b"), os.fspath(tmp_path)).publish(others)
    directory = rank_directory(config("mp", instance_id="engine-a"), os.fspath(tmp_path))
    with pytest.raises(RanksOfAnotherEngine) as raised:
        directory.ranks(2)
    assert raised.value.expected_engine_id == "engine-a_dp0"
    assert raised.value.found_engine_id == "engine-b_dp0"
    message = str(raised.value)
    assert "'engine-b_dp0'" in message and "'engine-a_dp0'" in message
    assert str(tmp_path / RANKS_FILE) in message


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
    rank0 = rank_directory(config(backend), os.fspath(run_dir), store)
    assert isinstance(rank0, RayRankDirectory)
    rank0.publish(RANKS)
    assert (run_dir / RANKS_FILE).is_file()  # for the operator, on that node
    # the engine core's node: the same setting, nothing there
    os.remove(run_dir / RANKS_FILE)
    engine_core = rank_directory(config(backend), os.fspath(run_dir), store)
    assert engine_core.ranks(2) == RANKS


def test_two_engines_with_one_run_dir_path_on_two_nodes_keep_their_own_records(
    tmp_path: Path,
) -> None:
    """Replicas started from one manifest: the same run directory path, each on its own
    node (here, each rank 0's file goes to a folder of its own; the path they name is one).
    Each engine's scheduler gets its own engine's ranks."""
    store = DictStore()
    others = [PublishedRank(rank.address + "0", rank.secret[::-1]) for rank in RANKS]
    same_path = os.fspath(tmp_path / "node-a")
    (tmp_path / "node-a").mkdir(mode=0o700)
    rank_directory(config("ray", instance_id="engine-a"), same_path, store).publish(RANKS)
    rank_directory(config("ray", instance_id="engine-b"), same_path, store).publish(others)
    assert len(store.values) == 2
    assert rank_directory(config("ray", instance_id="engine-a"), same_path, store).ranks(2) == RANKS
    assert (
        rank_directory(config("ray", instance_id="engine-b"), same_path, store).ranks(2) == others
    )


def test_one_engine_whose_nodes_give_different_run_dirs_finds_its_ranks(tmp_path: Path) -> None:
    """Each host with its own run directory (a per-host path, or a variable vLLM does not
    carry to Ray's workers): rank 0's node and the engine core's node name different
    paths, and the scheduler still finds rank 0's record."""
    store = DictStore()
    (tmp_path / "on-rank-0s-node").mkdir(mode=0o700)
    rank0 = rank_directory(config("ray"), os.fspath(tmp_path / "on-rank-0s-node"), store)
    rank0.publish(RANKS)
    engine_core = rank_directory(config("ray"), os.fspath(tmp_path / "on-the-core-node"), store)
    assert engine_core.ranks(2) == RANKS


def test_each_engine_and_dp_engine_has_its_own_key(tmp_path: Path) -> None:
    """The DP engines of one ``vllm serve`` share vLLM's instance id (unless vLLM adds their
    DP rank itself, as under Ray data parallelism): the DP index keeps them apart, whatever
    run directory each names."""
    store = DictStore()
    others = [PublishedRank(rank.address + "0", rank.secret[::-1]) for rank in RANKS]
    thirds = [PublishedRank(rank.address + "1", rank.secret[::-1]) for rank in RANKS]
    (tmp_path / "run").mkdir(mode=0o700)
    run_dir = os.fspath(tmp_path / "run")

    def directory(instance_id: str, dp_index: int) -> RayRankDirectory | FileRankDirectory:
        return rank_directory(config("ray", dp_index, instance_id), run_dir, store)

    directory("a", 0).publish(RANKS)
    directory("a", 1).publish(others)
    directory("b", 0).publish(thirds)
    assert len(store.values) == 3
    assert directory("a", 0).ranks(2) == RANKS
    assert directory("a", 1).ranks(2) == others
    assert directory("b", 0).ranks(2) == thirds


def test_a_record_under_this_engines_key_naming_another_engine_is_refused(
    tmp_path: Path,
) -> None:
    store = DictStore()
    directory = RayRankDirectory(ENGINE_ID, os.fspath(tmp_path), store)
    other = RayRankDirectory("engine-b_dp0", os.fspath(tmp_path), store)
    other.publish(RANKS)
    store.put(directory.key, store.values[other.key])
    with pytest.raises(RanksOfAnotherEngine, match="holds the ranks of engine 'engine-b_dp0'"):
        directory.ranks(2)


def test_the_scheduler_waits_for_rank_0s_record(tmp_path: Path) -> None:
    store, clock = DictStore(), FakeClock()
    real_get = store.get

    def get_published_at_the_third_read(key: bytes) -> bytes | None:
        if store.num_gets == 2:
            RayRankDirectory(ENGINE_ID, os.fspath(tmp_path), store).publish(RANKS)
        return real_get(key)

    store.get = get_published_at_the_third_read  # type: ignore[method-assign]
    directory = RayRankDirectory(
        ENGINE_ID, os.fspath(tmp_path), store, clock=clock, sleep=clock.sleep
    )
    assert directory.ranks(2) == RANKS
    assert 0 < clock.now_s < RANKS_WAIT_S


def test_no_record_in_time_names_what_was_awaited_and_the_fix(tmp_path: Path) -> None:
    store, clock = DictStore(), FakeClock()
    directory = RayRankDirectory(
        ENGINE_ID, os.fspath(tmp_path / "engine"), store, wait_s=5.0, clock=clock, sleep=clock.sleep
    )
    with pytest.raises(StartupRefused) as raised:
        directory.ranks(2)
    message = str(raised.value)
    assert f"namespace {RAY_KV_NAMESPACE!r}" in message
    assert repr(f"ranks:{ENGINE_ID}") in message
    assert "--worker-cls kvdefrag.vllm.worker.DefragWorker" in message
    assert "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=KVDEFRAG_" in message
    assert clock.now_s >= 5.0
    assert store.values == {}  # nothing written by the reader


class BlockingStore(DictStore):
    """A store whose reads do not answer until ``answer`` is set (a GCS that is down)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()

    def get(self, key: bytes) -> bytes | None:
        self.num_gets += 1
        self.answer.wait()
        return self.values.get(key)


def test_a_store_that_does_not_answer_ends_the_wait_on_time_naming_it(tmp_path: Path) -> None:
    store = BlockingStore()
    directory = RayRankDirectory(ENGINE_ID, os.fspath(tmp_path), store, wait_s=0.5)
    outcome: list[BaseException | list[PublishedRank]] = []
    reader = threading.Thread(target=lambda: outcome.append(_ranks_or_error(directory)))
    try:
        reader.start()
        reader.join(timeout=60)  # generous: the wait is 0.5 s
        assert not reader.is_alive(), "the scheduler still waits on the store's read"
    finally:
        store.answer.set()
        reader.join()
    [error] = outcome
    assert isinstance(error, StartupRefused)
    message = str(error)
    assert f"key {f'ranks:{ENGINE_ID}'!r}) did not answer within the 0.5 s wait" in message
    assert "GCS reachable from the engine core" in message
    assert store.num_gets == 1


def _ranks_or_error(directory: RayRankDirectory) -> BaseException | list[PublishedRank]:
    try:
        return directory.ranks(2)
    except BaseException as err:
        return err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"not json", "is not a rank list written by kvdefrag's rank 0"),
        (b'{"addresses": ["a:1", "b:1"], "secrets": []}', "holds the ranks of no engine"),
        (
            b'{"engine_id": "' + ENGINE_ID.encode() + b'", "addresses": ["a:1"], '
            b'"secrets": ["00"]}',
            "lists 1 rank addresses",
        ),
        (
            b'{"engine_id": "' + ENGINE_ID.encode() + b'", "addresses": ["a:1", "b:1"], '
            b'"secrets": ["00", "00"]}',
            "no identity secret",
        ),
    ],
)
def test_a_record_that_is_not_this_engines_ranks_is_refused(
    value: bytes, message: str, tmp_path: Path
) -> None:
    store = DictStore()
    directory = RayRankDirectory(ENGINE_ID, os.fspath(tmp_path), store)
    store.put(directory.key, value)
    with pytest.raises(StartupRefused, match=message):
        directory.ranks(2)


def test_importing_the_rank_directory_imports_neither_ray_nor_vllm() -> None:
    code = (
        "import sys, kvdefrag.vllm._discovery\n"
        "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_ray_missing_is_named_when_its_store_is_needed(tmp_path: Path) -> None:
    if _has_ray():
        pytest.skip("Ray is installed here")
    directory = RayRankDirectory(ENGINE_ID, os.fspath(tmp_path))
    with pytest.raises(StartupRefused, match="Ray is not installed"):
        directory.ranks(2)


def _has_ray() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


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


def _write_ranks(run_dir: Path, document: object) -> None:
    path = run_dir / RANKS_FILE
    path.write_text(json.dumps(document))
    path.chmod(0o600)
