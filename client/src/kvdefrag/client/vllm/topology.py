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
