"""Where each rank's service listens, and how the scheduler learns it.

Every worker (rank ``N`` of ``world_size``) serves on ``unix:<run dir>/rank<N>.sock``, or,
with ``KVDEFRAG_VLLM_TCP_PORT`` set (ranks on several hosts), on ``HOST:PORT+local rank``
with TLS from the ``KVDEFRAG_TLS_*`` variables. Once every rank serves, the workers gather
their addresses over vLLM's own world process group and rank 0 writes them to
``<run dir>/ranks.json``; the scheduler, built on rank 0's host after the KV caches exist,
reads that file. The run directory comes from ``KVDEFRAG_VLLM_RUN_DIR`` (set it once for
``vllm serve``; every process of the engine inherits it), made private (mode 0700) by the
first worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TypedDict

RUN_DIR_ENV = "KVDEFRAG_VLLM_RUN_DIR"
"""The environment variable naming the run directory of one vLLM engine."""


def run_dir_from_env() -> str:
    """Returns the run directory named by ``KVDEFRAG_VLLM_RUN_DIR``.

    Raises:
        RuntimeError: The variable is unset or not an absolute path.
    """
    run_dir = os.environ.get(RUN_DIR_ENV, "")
    if not os.path.isabs(run_dir):
        raise RuntimeError(
            f"kvdefrag: set {RUN_DIR_ENV} to an absolute directory private to this vLLM "
            f"engine (e.g. $XDG_RUNTIME_DIR/kvdefrag/<engine>), got {run_dir!r}"
        )
    return run_dir


def rank_address(run_dir: str, rank: int) -> str:
    """The gRPC address of rank ``rank``'s service."""
    return f"unix:{os.path.join(run_dir, f'rank{rank}.sock')}"


STEP_STAMP = "kvdefrag_step"
"""When the workers translate: the ``SchedulerOutput`` attribute holding, by rank, the
``(epoch, seq)`` of the step planned with it, which that rank's worker waits for
(``ServerHandle.wait_applied``) before it translates the output; absent when no step was
sent."""

STEP_WAIT_ENV = "KVDEFRAG_VLLM_STEP_WAIT_S"
"""How long a worker waits for its step to be applied (seconds; default 60)."""

TRANSLATE_ENV = "KVDEFRAG_VLLM_TRANSLATE"
"""``worker`` makes the workers translate block ids even under synchronous scheduling."""


def workers_translate(vllm_config: object) -> bool:
    """Whether the workers, not the scheduler, turn logical block ids into physical ones.

    Under async scheduling the scheduler plans step ``N + 1`` (and the service may move
    blocks) before the worker has run step ``N``; an output rewritten at planning time can
    then name blocks at their old places. A worker that translates when it runs the
    output, holding ``kv_lock``, always uses the mapping the KV data is in. Both sides call
    this with the same config and environment (vLLM's worker processes inherit both), so
    they agree.

    Under vLLM's V2 model runner the workers translate whatever the scheduling: the
    scheduler's own remedy for a moved row (re-sending it whole, as a resumed request in
    ``scheduled_cached_reqs``) is a V1 runner mechanism. The V2 runner only appends a
    cached request's ``new_block_ids`` to its persistent block table (its scheduler sends
    resumed requests as new ones), so a worker rewrites that table itself when blocks move.
    """
    if uses_v2_model_runner(vllm_config):
        return True
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if bool(getattr(scheduler_config, "async_scheduling", False)):
        return True
    return os.environ.get(TRANSLATE_ENV, "") == "worker"


RANKS_FILE = "ranks.json"
"""Written by rank 0's worker into the run directory: every rank's address, rank 0 first."""

TCP_PORT_ENV = "KVDEFRAG_VLLM_TCP_PORT"
"""Set: rank ``N`` serves on TCP port ``value + local rank`` instead of a unix socket."""

TCP_HOST_ENV = "KVDEFRAG_VLLM_TCP_HOST"
"""The interface TCP ranks listen on and announce (default: the IP vLLM uses for the host)."""

CLIENT_TLS_ENV = {
    "root_certificates": "KVDEFRAG_VLLM_TLS_CA_FILE",
    "certificate_chain": "KVDEFRAG_VLLM_TLS_CERT_FILE",
    "private_key": "KVDEFRAG_VLLM_TLS_KEY_FILE",
}
"""``DefragClient`` TLS argument -> the variable naming its PEM file (scheduler side)."""


def tcp_address(local_rank: int, default_host: Callable[[], str]) -> str | None:
    """``HOST:PORT`` for this rank when ``KVDEFRAG_VLLM_TCP_PORT`` is set, else None.

    ``default_host()`` is asked only when the port is set and the host is not.

    Raises:
        RuntimeError: The port is not a number in 1..65535 for every local rank.
    """
    text = os.environ.get(TCP_PORT_ENV, "").strip()
    if not text:
        return None
    try:
        port = int(text) + local_rank
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise RuntimeError(f"kvdefrag: {TCP_PORT_ENV} must be a TCP port, got {text!r}")
    host = os.environ.get(TCP_HOST_ENV, "").strip() or default_host()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def publish_rank_addresses(run_dir: str, addresses: list[str]) -> None:
    """Writes ``ranks.json`` atomically: the scheduler never reads half a file."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    path = os.path.join(run_dir, RANKS_FILE)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as file:
        json.dump({"addresses": addresses}, file)
    os.replace(partial, path)


def published_rank_addresses(run_dir: str, world_size: int) -> list[str]:
    """Every rank's address as the workers published it, rank 0 first.

    Raises:
        RuntimeError: No ``ranks.json`` (the workers are not kvdefrag's), or one for
            another number of ranks.
    """
    path = os.path.join(run_dir, RANKS_FILE)
    try:
        with open(path) as file:
            addresses = json.load(file)["addresses"]
    except FileNotFoundError:
        raise RuntimeError(
            f"kvdefrag: {path} does not exist: rank 0's worker writes it when the KV caches "
            "are bound; run the workers with --worker-cls "
            f"kvdefrag.server.vllm_worker.DefragWorker and the same {RUN_DIR_ENV}"
        ) from None
    if len(addresses) != world_size or not all(isinstance(a, str) for a in addresses):
        raise RuntimeError(
            f"kvdefrag: {path} lists {len(addresses)} rank addresses, the engine has "
            f"{world_size} ranks: is {RUN_DIR_ENV} shared with another engine?"
        )
    return list(addresses)


class ClientTls(TypedDict, total=False):
    """``DefragClient``'s TLS keyword arguments."""

    root_certificates: bytes
    certificate_chain: bytes
    private_key: bytes


def client_tls_from_env() -> ClientTls:
    """The scheduler's TLS arguments for ``DefragClient``, read from the files named by
    ``KVDEFRAG_VLLM_TLS_{CA,CERT,KEY}_FILE`` (none set: no TLS).

    Raises:
        RuntimeError: A named file cannot be read.
    """
    tls = ClientTls()
    for argument, variable in CLIENT_TLS_ENV.items():
        path = os.environ.get(variable, "").strip()
        if not path:
            continue
        try:
            with open(path, "rb") as file:
                tls[argument] = file.read()  # type: ignore[literal-required]
        except OSError as err:
            raise RuntimeError(f"kvdefrag: cannot read {variable}={path!r}: {err}") from err
    return tls


def uses_v2_model_runner(vllm_config: object) -> bool:
    """Whether vLLM runs its V2 model runner (``VllmConfig.use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))
