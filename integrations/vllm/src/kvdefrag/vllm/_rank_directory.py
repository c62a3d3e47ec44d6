"""Where rank 0 publishes every rank's address and secret, and the scheduler finds them.

vLLM builds the scheduler in the engine core (vLLM 0.33 ``v1/engine/core.py:181-189``,
``Scheduler(vllm_config=..., kv_cache_config=..., ...)``) with no handle on the executor
that built the workers (``core.py:150``); the engine core gathers KV connectors'
handshake metadata over the executor only after the scheduler exists
(``core.py:202``, ``_set_kv_connector_handshake_metadata`` at ``:910-930``). So the
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
every process of it reaches. The key is the engine's id (``common.engine_id``: vLLM's
instance id and the DP index), never a path: a run directory is a node's own, so two
engines may give the same path on two nodes, and one engine's nodes may give different
ones. Two engines (or two DP engines of one ``vllm serve``) never read each other's
record, and every record names the engine it was written for: one of another engine is
refused (``common.RanksOfAnotherEngine``), in the store and in ``ranks.json`` alike.

NOTE: the record holds each rank's identity secret. Anyone who can reach the GCS can run
code on the Ray workers (submit a task, attach to an actor), so the secrets are no more
exposed there than the KV caches themselves. An address that does not serve the rank
(another process on the port) is refused: each rank must prove its secret
(``_ranks.verify_rank``) before the scheduler trusts its address.

Duck-typed: importing this module imports neither vLLM nor Ray; ``RayRankDirectory``
imports Ray on its first use unless given a key-value store.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvdefrag.vllm.common import (
    PublishedRank,
    _decoded_ranks,
    _encoded_ranks,
    engine_id,
    publish_ranks,
    published_ranks,
)
from kvdefrag.vllm.config import RAY_ENV_PREFIXES_ENV, RUN_DIR_ENV, uses_ray
from kvdefrag.vllm.errors import StartupRefused

__all__ = [
    "RANKS_WAIT_S",
    "RAY_KV_NAMESPACE",
    "FileRankDirectory",
    "KeyValueStore",
    "RankDirectory",
    "RayRankDirectory",
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
    """``ranks.json`` in the engine's run directory (``common.publish_ranks``), naming the
    engine it was written for.

    Args:
        run_dir: The engine's run directory (``common.engine_run_dir``).
        engine_id: The engine's id (``common.engine_id``).
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
                ``common.published_ranks``.
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
        engine_id: The engine's id (``common.engine_id``): the key is ``ranks:<engine id>``.
        run_dir: The engine's run directory on this node (``common.engine_run_dir``), where
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
    under the engine's id (``common.engine_id``).

    Args:
        vllm_config: vLLM's ``VllmConfig`` (the scheduler's or the worker's).
        run_dir: The engine's run directory (``common.engine_run_dir``).

    Raises:
        StartupRefused: The configuration has no instance id (``common.engine_id``).
    """
    parallel_config = getattr(vllm_config, "parallel_config", None)
    engine = engine_id(vllm_config)
    if uses_ray(getattr(parallel_config, "distributed_executor_backend", None)):
        return RayRankDirectory(engine, run_dir, store)
    return FileRankDirectory(run_dir, engine)
