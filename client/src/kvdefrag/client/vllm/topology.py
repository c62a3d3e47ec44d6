"""Where each rank's service listens: a deterministic path both sides compute.

Every worker (rank ``N`` of ``world_size``) serves on ``unix:<run dir>/rank<N>.sock``;
the scheduler connects to ranks ``0 .. world_size - 1``. The run directory comes from
``KVDEFRAG_VLLM_RUN_DIR`` (set it once for ``vllm serve``; every process of the engine
inherits it), made private (mode 0700) by the first worker.
"""

from __future__ import annotations

import os

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


def rank_addresses(run_dir: str, world_size: int) -> list[str]:
    """The addresses of every rank's service, rank 0 first."""
    return [rank_address(run_dir, rank) for rank in range(world_size)]


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


def uses_v2_model_runner(vllm_config: object) -> bool:
    """Whether vLLM runs its V2 model runner (``VllmConfig.use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))
