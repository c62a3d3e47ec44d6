"""Finding the ranks at start-up, in one place: where every worker serves, where rank 0
publishes every rank's address and secret, and where the scheduler finds them.

Every worker (rank ``N``) serves on ``unix:<run dir>/rank<N>.sock`` (``rank_address``),
or, with ``KVDEFRAG_VLLM_TCP_PORT`` set, on ``HOST:PORT+offset``
(``contract.rank_port_offset``), and proves a secret of its own (``IdentityService``).
Once every rank serves, the workers gather their addresses and secrets over vLLM's world
process group and rank 0 publishes them (``publish_ranks``); the scheduler reads them and
checks each rank's proof before it trusts the address (``_scheduler.ranks``).

vLLM builds the scheduler in the engine core (vLLM 0.33 ``v1/engine/core.py``,
``Scheduler(vllm_config=..., kv_cache_config=..., ...)``) with no handle on the executor
that built the workers (``core.py``); the engine core gathers KV connectors'
handshake metadata over the executor only after the scheduler exists
(``core.py``, ``_set_kv_connector_handshake_metadata``). So the
scheduler cannot ask the workers; it reads a record rank 0 left where both sides can
reach it, chosen once per engine (``rank_directory``)::

    executor            rank 0 writes                        the scheduler reads
    uni, mp             <run dir>/ranks.json (0600)          that file (rank 0 shares
                                                             its host: vLLM starts
                                                             mp workers on its own)
    ray                 <run dir>/ranks.json on rank 0's     Ray's key-value store (GCS),
                        node, and Ray's key-value store      waiting up to
                        under this engine's key              RANKS_WAIT_S

Under Ray the workers are actors that Ray may place on any node, rank 0 too, but the
engine core and every worker are connected to one Ray cluster, whose GCS key-value store
every process of it reaches. The key is the engine's id (``contract.engine_id``: vLLM's
instance id and the DP index), never a path: a run directory is a node's own, so two
engines may give the same path on two nodes, and one engine's nodes may give different
ones. Two engines (or two DP engines of one ``vllm serve``) never read each other's
record, and every record names the engine it was written for: one of another engine is
refused (``RanksOfAnotherEngine``), in the store and in ``ranks.json`` alike.

NOTE: the record holds each rank's identity secret. Anyone who can reach the GCS can run
code on the Ray workers (submit a task, attach to an actor), so the secrets are no more
exposed there than the KV caches themselves. An address that does not serve the rank
(another process on the port) is refused: each rank must prove its secret
(``_scheduler.ranks.verify_rank``) before the scheduler trusts its address.

Duck-typed: importing this module imports neither vLLM nor Ray; ``RayRankDirectory``
imports Ray on its first use unless given a key-value store.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.vllm._run_dir import ensure_private_dir, read_private_file, write_private_file
from kvdefrag.vllm.config import RAY_ENV_PREFIXES_ENV, RUN_DIR_ENV, uses_ray
from kvdefrag.vllm.contract import engine_id
from kvdefrag.vllm.errors import StartupRefused

__all__ = [
    "RANKS_FILE",
    "RANKS_WAIT_S",
    "RAY_KV_NAMESPACE",
    "FileRankDirectory",
    "KeyValueStore",
    "PublishedRank",
    "RankDirectory",
    "RanksOfAnotherEngine",
    "RayRankDirectory",
    "ensure_run_dir",
    "publish_ranks",
    "published_ranks",
    "rank_address",
    "rank_directory",
]

RANKS_WAIT_S = 30.0
"""How long the scheduler waits for rank 0's record in Ray's key-value store, each read of
the store included. The engine core builds the scheduler only once every worker bound its
KV caches (rank 0 published by then), so this covers a slow GCS, not a slow worker."""

RAY_KV_NAMESPACE = "kvdefrag"
"""The namespace of kvdefrag's keys in Ray's key-value store."""

_POLL_S = 0.2


class RankDirectory(Protocol):
    """Where one engine's ranks are published (by rank 0) and found (by the scheduler)."""

    def publish(self, ranks: Sequence[PublishedRank]) -> None:
        """Records every rank's address and secret, rank 0 first (rank 0's worker)."""
        ...

    def ranks(self, world_size: int) -> list[PublishedRank]:
        """Every rank's address and secret, rank 0 first (the scheduler)."""
        ...


class FileRankDirectory:
    """``ranks.json`` in the engine's run directory (``publish_ranks``), naming the
    engine it was written for.

    Args:
        run_dir: The engine's run directory (``contract.engine_run_dir``).
        engine_id: The engine's id (``contract.engine_id``).
    """

    def __init__(self, run_dir: str, engine_id: str) -> None:
        self.run_dir = run_dir
        self.engine_id = engine_id

    def publish(self, ranks: Sequence[PublishedRank]) -> None:
        """Writes ``<run dir>/ranks.json`` (0600, atomically).

        Raises:
            UnsafeRunDir: The run directory is not private.
        """
        publish_ranks(self.run_dir, ranks, engine_id=self.engine_id)

    def ranks(self, world_size: int) -> list[PublishedRank]:
        """Reads ``<run dir>/ranks.json``.

        Raises:
            UnsafeRunDir, RanksOfAnotherEngine, StartupRefused: As
                ``published_ranks``.
        """
        return published_ranks(self.run_dir, world_size, engine_id=self.engine_id)


class KeyValueStore(Protocol):
    """The part of Ray's internal key-value store (``ray.experimental.internal_kv``) used."""

    def put(self, key: bytes, value: bytes) -> None: ...

    def get(self, key: bytes) -> bytes | None: ...


class _RayInternalKV:
    """Ray's GCS key-value store, through the connection this process already has."""

    def __init__(self) -> None:
        try:
            import ray
            from ray.experimental import internal_kv
        except ModuleNotFoundError:
            raise StartupRefused(
                "kvdefrag: vLLM runs this engine's workers with Ray, but Ray is not "
                "installed in this environment: install the Ray your vLLM asks for"
            ) from None
        if not ray.is_initialized():
            raise StartupRefused(
                "kvdefrag: vLLM runs this engine's workers with Ray, but this process is "
                "not connected to the Ray cluster, whose key-value store holds the ranks: "
                "start vLLM with --distributed-executor-backend ray on a Ray cluster"
            )
        self._kv = internal_kv

    def put(self, key: bytes, value: bytes) -> None:
        self._kv._internal_kv_put(key, value, overwrite=True, namespace=RAY_KV_NAMESPACE)

    def get(self, key: bytes) -> bytes | None:
        value = self._kv._internal_kv_get(key, namespace=RAY_KV_NAMESPACE)
        return None if value is None else bytes(value)


class RayRankDirectory:
    """Ray's key-value store under this engine's key; rank 0 also writes ``ranks.json`` on
    its own node (for the operator: the scheduler reads the store).

    Args:
        engine_id: The engine's id (``contract.engine_id``): the key is ``ranks:<engine id>``.
        run_dir: The engine's run directory on this node (``contract.engine_run_dir``), where
            rank 0 writes ``ranks.json``.
        store: The key-value store; Ray's, connected on first use, when None.
        wait_s: How long ``ranks`` waits for the record, its reads of the store included.
        clock, sleep: For the tests.
    """

    def __init__(
        self,
        engine_id: str,
        run_dir: str,
        store: KeyValueStore | None = None,
        *,
        wait_s: float = RANKS_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.engine_id = engine_id
        self.key = f"ranks:{engine_id}".encode()
        self.file = FileRankDirectory(run_dir, engine_id)
        self._store = store
        self._wait_s = wait_s
        self._clock = clock
        self._sleep = sleep

    @property
    def store(self) -> KeyValueStore:
        if self._store is None:
            self._store = _RayInternalKV()
        return self._store

    def publish(self, ranks: Sequence[PublishedRank]) -> None:
        """Writes ``ranks.json`` on this node, then the record in Ray's store.

        Raises:
            UnsafeRunDir: The run directory is not private.
            StartupRefused: This process is not connected to Ray.
        """
        self.file.publish(ranks)
        self.store.put(self.key, _encoded_ranks(ranks, self.engine_id))

    def ranks(self, world_size: int) -> list[PublishedRank]:
        """Rank 0's record in Ray's store, waiting up to ``wait_s`` for it; a read the store
        does not answer is given up at the end of that wait.

        Raises:
            RanksOfAnotherEngine: The record under this engine's key names another engine.
            StartupRefused: No record within ``wait_s`` (naming the key and the likely
                cause), no answer from the store within it, or a record that is not for
                this engine's ranks.
        """
        store = self.store
        where = f"Ray's key-value store (namespace {RAY_KV_NAMESPACE!r}, key {self.key.decode()!r})"
        deadline = self._clock() + self._wait_s
        while True:
            value = self._get_before(store, deadline, where)
            if value is not None:
                return _decoded_ranks(value, world_size, where, self.engine_id)
            if self._clock() >= deadline:
                raise StartupRefused(
                    f"kvdefrag: waited {self._wait_s:.0f} s for rank 0's rank list in {where}: "
                    "rank 0's worker publishes it there when the KV caches are bound. Run the "
                    "workers with --worker-cls kvdefrag.vllm.worker.DefragWorker and the same "
                    f"{RUN_DIR_ENV} (export {RAY_ENV_PREFIXES_ENV}=KVDEFRAG_ where vLLM "
                    "starts, so it reaches the Ray workers)"
                )
            self._sleep(_POLL_S)

    def _get_before(self, store: KeyValueStore, deadline: float, where: str) -> bytes | None:
        """One read of the store, given what is left of the wait (one poll interval at
        least).

        NOTE: Ray's read may block while the GCS does not answer (Ray retries it), and
        takes no deadline of ours; it runs on a daemon thread of its own so that the wait
        ends on time whatever the store does (a read given up on ends, or not, unseen).
        """
        answer: concurrent.futures.Future[bytes | None] = concurrent.futures.Future()

        def read() -> None:
            try:
                answer.set_result(store.get(self.key))
            except BaseException as err:  # handed to the waiting scheduler as it is
                answer.set_exception(err)

        threading.Thread(target=read, name="kvdefrag-ranks-read", daemon=True).start()
        timeout_s = max(deadline - self._clock(), _POLL_S)
        try:
            return answer.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise StartupRefused(
                f"kvdefrag: {where} did not answer within the {self._wait_s:g} s wait for "
                "rank 0's rank list: is the Ray cluster's GCS reachable from the engine core "
                "(the vllm serve process), and not overloaded?"
            ) from None


def rank_directory(
    vllm_config: object, run_dir: str, store: KeyValueStore | None = None
) -> FileRankDirectory | RayRankDirectory:
    """This engine's rank directory, the same on rank 0's worker and the scheduler: Ray's
    key-value store when vLLM runs the workers with Ray
    (``ParallelConfig.distributed_executor_backend == "ray"``), else ``ranks.json``; both
    under the engine's id (``contract.engine_id``).

    Args:
        vllm_config: vLLM's ``VllmConfig`` (the scheduler's or the worker's).
        run_dir: The engine's run directory (``contract.engine_run_dir``).

    Raises:
        StartupRefused: The configuration has no instance id (``contract.engine_id``).
    """
    parallel_config = getattr(vllm_config, "parallel_config", None)
    engine = engine_id(vllm_config)
    if uses_ray(getattr(parallel_config, "distributed_executor_backend", None)):
        return RayRankDirectory(engine, run_dir, store)
    return FileRankDirectory(run_dir, engine)


def ensure_run_dir(run_dir: str) -> None:
    """Creates the run directory (and missing parents) mode 0700, or checks the existing one.

    Raises:
        UnsafeRunDir: It (or a directory created on the way) belongs to another user, is
            reachable by group or others, or is a symlink: the message says how to fix it.
    """
    ensure_private_dir(run_dir)


def rank_address(run_dir: str, rank: int) -> str:
    """The gRPC address of rank ``rank``'s service."""
    return f"unix:{os.path.join(run_dir, f'rank{rank}.sock')}"


RANKS_FILE = "ranks.json"
"""Written by rank 0's worker into the run directory: every rank's address, rank 0 first."""


@dataclasses.dataclass(frozen=True)
class PublishedRank:
    """One rank as rank 0 publishes it: where it serves and the secret it proves.

    Attributes:
        address: The rank's gRPC address.
        secret: The rank's identity secret (``IDENTITY_SECRET_BYTES`` random bytes): its
            service proves it holds it (``IdentityService``), so an address that a stale
            or swapped file names is never trusted.
    """

    address: str
    secret: bytes = dataclasses.field(repr=False)


class RanksOfAnotherEngine(StartupRefused):
    """The rank record the scheduler found was published for another engine.

    It names another engine id than this engine's (``engine_id``), or none (an older
    kvdefrag's record): left by an earlier run, or written by another engine sharing the
    run directory. Its addresses are never tried.

    Attributes:
        expected_engine_id: This engine's id.
        found_engine_id: The id the record names; None when it names none.
    """

    def __init__(self, where: str, expected_engine_id: str, found_engine_id: str | None) -> None:
        found = "no engine" if found_engine_id is None else f"engine {found_engine_id!r}"
        super().__init__(
            f"kvdefrag: {where} holds the ranks of {found}, not of this engine "
            f"({expected_engine_id!r}): left by an earlier run whose workers were not "
            f"kvdefrag's this time, or written by another engine sharing {RUN_DIR_ENV}? Give "
            "every engine its own run directory, run the workers with --worker-cls "
            "kvdefrag.vllm.worker.DefragWorker, and restart vLLM"
        )
        self.expected_engine_id = expected_engine_id
        self.found_engine_id = found_engine_id


def publish_ranks(run_dir: str, ranks: Sequence[PublishedRank], *, engine_id: str) -> None:
    """Writes ``ranks.json`` (0600) atomically, for engine ``engine_id``: the scheduler
    never reads half a file.

    Raises:
        UnsafeRunDir: The run directory is not private (see ``ensure_run_dir``).
    """
    write_private_file(run_dir, RANKS_FILE, _encoded_ranks(ranks, engine_id))


def published_ranks(run_dir: str, world_size: int, *, engine_id: str) -> list[PublishedRank]:
    """Every rank's address and secret as engine ``engine_id``'s workers published them,
    rank 0 first.

    Raises:
        UnsafeRunDir: The run directory or ``ranks.json`` is not private, or ``ranks.json``
            is a symlink.
        RanksOfAnotherEngine: ``ranks.json`` was published for another engine.
        StartupRefused: No ``ranks.json`` (the workers are not kvdefrag's), one for another
            number of ranks, or one without a valid secret for every rank.
    """
    path = os.path.join(run_dir, RANKS_FILE)
    try:
        data = read_private_file(run_dir, RANKS_FILE)
    except FileNotFoundError:
        raise StartupRefused(
            f"kvdefrag: {path} does not exist: rank 0's worker writes it when the KV caches "
            "are bound; run the workers with --worker-cls "
            f"kvdefrag.vllm.worker.DefragWorker and the same {RUN_DIR_ENV}"
        ) from None
    return _decoded_ranks(data, world_size, path, engine_id)


def _encoded_ranks(ranks: Sequence[PublishedRank], engine_id: str) -> bytes:
    """Engine ``engine_id``'s rank list as rank 0 publishes it (``ranks.json``, or Ray's
    key-value store)."""
    document = {
        "engine_id": engine_id,
        "addresses": [rank.address for rank in ranks],
        "secrets": [rank.secret.hex() for rank in ranks],
    }
    return json.dumps(document).encode()


def _decoded_ranks(data: bytes, world_size: int, where: str, engine_id: str) -> list[PublishedRank]:
    """``_encoded_ranks``'s rank list, checked to be engine ``engine_id``'s; ``where`` names
    it in the messages.

    Raises:
        RanksOfAnotherEngine: A rank list published for another engine.
        StartupRefused: Not such a list, one for another number of ranks, or one without a
            valid secret for every rank.
    """
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        document = None
    addresses = document.get("addresses") if isinstance(document, dict) else None
    secrets = document.get("secrets") if isinstance(document, dict) else None
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise StartupRefused(
            f"kvdefrag: {where} is not a rank list written by kvdefrag's rank 0: remove it "
            "and restart vLLM"
        )
    assert isinstance(document, dict)
    found = document.get("engine_id")
    if found != engine_id:
        raise RanksOfAnotherEngine(where, engine_id, found if isinstance(found, str) else None)
    if len(addresses) != world_size:
        raise StartupRefused(
            f"kvdefrag: {where} lists {len(addresses)} rank addresses, the engine has "
            f"{world_size} ranks: it was not written by this engine's rank 0; remove it and "
            "restart vLLM"
        )
    decoded = _decoded_secrets(secrets, world_size)
    if decoded is None:
        raise StartupRefused(
            f"kvdefrag: {where} has no identity secret for every rank (written by an older "
            "kvdefrag worker, or not by rank 0): run every worker with this kvdefrag "
            "version and restart vLLM"
        )
    return [PublishedRank(a, secret) for a, secret in zip(addresses, decoded, strict=True)]


def _decoded_secrets(secrets: object, world_size: int) -> list[bytes] | None:
    if not isinstance(secrets, list) or len(secrets) != world_size:
        return None
    decoded = []
    for text in secrets:
        try:
            secret = bytes.fromhex(text) if isinstance(text, str) else b""
        except ValueError:
            return None
        if len(secret) != IDENTITY_SECRET_BYTES:
            return None
        decoded.append(secret)
    return decoded
