"""What kvdefrag's two sides in vLLM share: where the ranks are, and what an output means.

The scheduler side (``kvdefrag.vllm.scheduler``) and the worker side
(``kvdefrag.vllm.worker``) run in different processes and agree through this module
alone:

* **The run directory and rank discovery.** Every worker (rank ``N`` of ``world_size``)
  serves on ``unix:<run dir>/rank<N>.sock``, or, with ``KVDEFRAG_VLLM_TCP_PORT`` set (ranks
  on several hosts), on ``HOST:PORT+offset`` (``rank_port_offset``) with TLS from the
  ``KVDEFRAG_TLS_*`` variables, and proves a secret of its own (``IdentityService``). Once
  every rank serves, the workers gather their addresses and secrets over vLLM's own world
  process group and rank 0 writes them to ``<run dir>/ranks.json`` (0600), and under vLLM's
  Ray executor also to Ray's key-value store (``_rank_directory``); the scheduler, built
  after the KV caches exist, reads that file on rank 0's host (or, under Ray, the store,
  wherever Ray placed rank 0) and checks each rank's proof before it trusts the address.
  The record names the engine it was written for (``engine_id``: vLLM's id for the engine,
  with its DP index) and is read only by that engine: one of another engine is refused
  (``RanksOfAnotherEngine``).
  The run directory comes from ``KVDEFRAG_VLLM_RUN_DIR`` (set it once for ``vllm serve``;
  every process of the engine inherits it): it must be this user's and unreachable by group
  and others (created 0700 if missing), and no file in it is written or read through a
  link (``_run_dir``; ``UnsafeRunDir`` otherwise). Under data parallelism every DP engine
  has a scheduler and ranks of its own, so each gets a run directory of its own
  (``engine_run_dir``: DP engine ``k > 0`` in ``<run dir>/dp<k>``) and ports of its own
  (``rank_port_offset``).
* **The step stamp**: the step planned with an output, with its events, which a worker
  gets applied before it translates that output (``attach_step_stamp`` /
  ``read_step_stamp``).
* **Which ``SchedulerOutput`` fields carry block ids** (``map_block_ids``), and which
  blocks of a scheduled request are fresh (``first_fresh_block_index``).

Duck-typed against vLLM 0.33's ``SchedulerOutput`` (``vllm/v1/core/sched/output.py``):
this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from kvdefrag.common import StepEvents
from kvdefrag.common.identity import IDENTITY_SECRET_BYTES
from kvdefrag.vllm._run_dir import (
    UnsafeRunDir,
    ensure_private_dir,
    read_private_file,
    write_private_file,
)
from kvdefrag.vllm.config import CLIENT_TLS_ENV, RUN_DIR_ENV, IntegrationConfig
from kvdefrag.vllm.errors import BadSetting, StartupRefused

__all__ = [
    "RANKS_FILE",
    "ClientTls",
    "PublishedRank",
    "RanksOfAnotherEngine",
    "StepStamp",
    "UnsafeRunDir",
    "attach_step_stamp",
    "client_tls",
    "copy_destinations",
    "data_parallel_rank",
    "engine_id",
    "engine_run_dir",
    "ensure_run_dir",
    "first_fresh_block_index",
    "map_block_ids",
    "publish_ranks",
    "published_ranks",
    "rank_address",
    "rank_port_offset",
    "read_step_stamp",
    "uses_v2_model_runner",
]


def data_parallel_rank(parallel_config: object) -> int:
    """The data-parallel engine a process belongs to (0 without data parallelism).

    It is ``ParallelConfig.data_parallel_index`` (vLLM 0.33 ``config/parallel.py:443``),
    which ``EngineCoreProc.run_engine_core`` sets to the engine's DP rank
    (``v1/engine/core.py:1545``) before it builds the engine core, its executor (whose
    workers get this config) and its scheduler. Not ``data_parallel_rank``: for a dense
    model each DP engine is independent and ``reconfigure_for_independent_dp_rank``
    (``config/parallel.py:1191``) resets that to 0 and ``data_parallel_size`` to 1, as
    vLLM's own per-rank names note (``v1/worker/gpu_worker.py:381``). For a MoE model
    (``DPEngineCoreProc``, ``core.py:2281``) the two are equal. Inside one DP engine the
    workers are numbered ``rank`` 0 .. ``world_size - 1`` (``world_size`` = PP x TP x PCP,
    ``config/parallel.py:964``), whatever the DP rank.
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def engine_id(vllm_config: object) -> str:
    """The id this engine's rank record is published and found under, the same on the
    scheduler side and every worker, and no other engine's: ``<instance id>_dp<k>``.

    The instance id is vLLM's id for the engine (``VllmConfig.instance_id``), drawn once
    when vLLM builds the configuration; the engine core and every worker it starts get that
    configuration, so they read the same id wherever Ray places them. The data-parallel
    engines of one ``vllm serve`` share it unless vLLM adds their DP rank itself (it does
    under Ray data parallelism), so the DP index (``data_parallel_rank``) follows it, as
    vLLM's own CPU encoder-cache connector names an engine.

    Raises:
        StartupRefused: The configuration has no instance id (not vLLM's).
    """
    instance_id = getattr(vllm_config, "instance_id", None)
    if not isinstance(instance_id, str) or not instance_id:
        raise StartupRefused(
            f"kvdefrag: this engine's configuration has no instance id ({instance_id!r}): "
            "kvdefrag finds the engine's ranks under the id vLLM gives every engine "
            "(VllmConfig.instance_id); use the vLLM version kvdefrag supports"
        )
    dp_rank = data_parallel_rank(getattr(vllm_config, "parallel_config", None))
    return f"{instance_id}_dp{dp_rank}"


def engine_run_dir(parallel_config: object, run_dir: str) -> str:
    """This engine's run directory, the same on the scheduler side and every worker.

    ``KVDEFRAG_VLLM_RUN_DIR`` itself for DP engine 0 (and any engine without data
    parallelism), ``<KVDEFRAG_VLLM_RUN_DIR>/dp<k>`` for DP engine ``k > 0``::

        $KVDEFRAG_VLLM_RUN_DIR/            DP engine 0 (or no DP)
            rank0.sock  rank1.sock  ranks.json
            dp1/                           DP engine 1
                rank0.sock  rank1.sock  ranks.json

    NOTE: engine 0 stays in the base directory because a dense model's DP engine 0 cannot
    be told from an engine without data parallelism: vLLM leaves it
    ``data_parallel_size == 1`` and ``data_parallel_index == 0`` (``data_parallel_rank``).

    Args:
        parallel_config: vLLM's ``ParallelConfig`` (the scheduler's or the worker's).
        run_dir: The base run directory (``IntegrationConfig.run_dir``).
    """
    dp_rank = data_parallel_rank(parallel_config)
    return run_dir if dp_rank == 0 else os.path.join(run_dir, f"dp{dp_rank}")


def rank_port_offset(parallel_config: object, local_rank: int) -> int:
    """What a rank adds to ``KVDEFRAG_METRICS_PORT`` and ``KVDEFRAG_VLLM_TCP_PORT``:
    ``dp_rank * world_size + local_rank``.

    ``local_rank`` < ``world_size`` (vLLM numbers a DP engine's workers on one host 0 ..
    ``local_world_size - 1``), so no two ranks of any DP engine share an offset: the ranks
    on one host never contend for a port. Without data parallelism it is the local rank.
    """
    world_size = int(getattr(parallel_config, "world_size", 1) or 1)
    return data_parallel_rank(parallel_config) * world_size + local_rank


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


class ClientTls(TypedDict, total=False):
    """``DefragClient``'s TLS keyword arguments."""

    root_certificates: bytes
    certificate_chain: bytes
    private_key: bytes


def client_tls(config: IntegrationConfig) -> ClientTls:
    """The scheduler's TLS arguments for ``DefragClient``, read from the files the
    ``KVDEFRAG_VLLM_TLS_{CA,CERT,KEY}_FILE`` variables name (none set: no TLS).

    Raises:
        BadSetting: A named file cannot be read.
    """
    tls = ClientTls()
    for argument, path in config.client_tls_files.items():
        try:
            with open(path, "rb") as file:
                tls[argument] = file.read()  # type: ignore[literal-required]
        except OSError as err:
            variable = CLIENT_TLS_ENV[argument]
            raise BadSetting(f"kvdefrag: cannot read {variable}={path!r}: {err}") from err
    return tls


def uses_v2_model_runner(vllm_config: object) -> bool:
    """Whether vLLM runs its V2 model runner (``VllmConfig.use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


# ---------------------------------------------------------------------------------------
# The step stamp: which step an output was planned with.

_STAMP_ATTRIBUTE = "kvdefrag_step"


@dataclasses.dataclass(frozen=True)
class StepStamp:
    """The step the scheduler planned with one ``SchedulerOutput``, as each rank numbers it.

    The scheduler sends each step without waiting for its reply; a worker must not
    translate the output before its service has applied that step, or it would name
    blocks at the places the step is about to give to others. Every output carries one
    (a step without events repeats the last step's), so every pass also checks that its
    rank's service is still at the epoch the output was planned against.

    It also carries the step's events on the output that planned it (vLLM carries its
    own per-step scheduler-to-worker data on the output too, e.g. KV connector
    metadata): a worker whose service has not applied the step yet when its pass starts
    applies it itself (``ServerHandle.apply_planned_step``) instead of waiting for the
    scheduler's call, which then finds it applied. A later output that plans no step
    repeats the stamp without them.

    Attributes:
        by_rank: ``(epoch, seq)`` of the step on each rank's service, rank 0 first.
        events: The step's events, on the output that planned it; None on the outputs
            that repeat it (left out of comparisons).
    """

    by_rank: tuple[tuple[int, int], ...]
    events: StepEvents | None = dataclasses.field(default=None, compare=False, repr=False)

    def without_events(self) -> StepStamp:
        """This stamp as a later output that plans no step repeats it."""
        return StepStamp(self.by_rank) if self.events is not None else self

    def for_rank(self, rank: int) -> tuple[int, int]:
        """``(epoch, seq)`` of the step on rank ``rank``'s service.

        Raises:
            ValueError: The stamp has no entry for ``rank`` (the scheduler and the
                workers disagree on the number of ranks).
        """
        if not 0 <= rank < len(self.by_rank):
            raise ValueError(
                f"kvdefrag: the step stamp covers {len(self.by_rank)} ranks, this worker is "
                f"rank {rank}: is {RUN_DIR_ENV} shared with another engine?"
            )
        return self.by_rank[rank]


def attach_step_stamp(output: Any, stamp: StepStamp) -> None:
    """Marks ``output`` with the step planned with it (it travels to the workers with it:
    vLLM hands the same object to in-process workers and pickles it for the others)."""
    setattr(output, _STAMP_ATTRIBUTE, stamp)


def read_step_stamp(output: Any) -> StepStamp | None:
    """The step planned with ``output``; None when it carries none (a scheduler that is
    not kvdefrag's)."""
    stamp = getattr(output, _STAMP_ATTRIBUTE, None)
    assert stamp is None or isinstance(stamp, StepStamp), (
        f"{_STAMP_ATTRIBUTE} holds a {type(stamp).__name__}, not a StepStamp"
    )
    return stamp


# ---------------------------------------------------------------------------------------
# What a SchedulerOutput says about blocks.


def map_block_ids(output: Any, to_physical: Callable[[Sequence[int]], list[int]]) -> None:
    """Rewrites, in place, every block id ``output`` names, through ``to_physical``.

    The one list of the ``SchedulerOutput`` fields that name blocks, for both sides (the
    scheduler when it rewrites, a worker when it translates); what vLLM 0.33's V1 and V2
    runners read::

        scheduled_new_reqs[i].block_ids           one list per KV-cache group
        scheduled_cached_reqs.new_block_ids[i]    None, or one list per group (appended
                                                  ids; a whole row for resumed requests)
        new_block_ids_to_zero                     None or a list
        kv_cache_block_copies                     (src, dst) pairs (absent before 0.33)

    Args:
        output: The ``SchedulerOutput``.
        to_physical: Maps a list of logical ids to their physical ids, in order.
    """
    for request in output.scheduled_new_reqs:
        request.block_ids = tuple(to_physical(group) for group in request.block_ids)
    cached = output.scheduled_cached_reqs
    cached.new_block_ids = [
        None if groups is None else tuple(to_physical(group) for group in groups)
        for groups in cached.new_block_ids
    ]
    if output.new_block_ids_to_zero:
        output.new_block_ids_to_zero = to_physical(output.new_block_ids_to_zero)
    copies = getattr(output, "kv_cache_block_copies", None)
    if copies:
        pairs = [to_physical([int(copy[0]), int(copy[1])]) for copy in copies]
        output.kv_cache_block_copies = [
            (src, dst) if type(copy) is tuple else type(copy)(src, dst)
            for copy, (src, dst) in zip(copies, pairs, strict=True)
        ]


def copy_destinations(output: Any) -> frozenset[int]:
    """Logical ids ``output`` copies into (copy-on-write targets): they must keep the data
    the copy writes, so they are never fresh."""
    copies = getattr(output, "kv_cache_block_copies", None) or ()
    return frozenset(int(copy[1]) for copy in copies)


def first_fresh_block_index(num_computed_tokens: int, block_size: int) -> int:
    """The index of a scheduled request's first block that holds no computed token.

    Blocks from there on hold no data yet (fresh): the engine may place them anywhere
    without a copy.

    NOTE: a block holding some computed tokens is not fresh: after a full prefix-cache hit
    vLLM recomputes only the last token, so ``num_computed_tokens`` stops one short of a
    block boundary and the last hit block must keep its data (hence ceil, not floor).
    """
    return -(-num_computed_tokens // block_size)
