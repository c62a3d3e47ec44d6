"""The contract of kvdefrag's two sides in vLLM: what both read, so both agree.

The scheduler side (``kvdefrag.vllm.scheduler``) and the worker side
(``kvdefrag.vllm.worker``) run in different processes and share only this:

* **Which engine, and where it runs**: the engine's id (``engine_id``: vLLM's id for the
  engine with its DP index), which names its rank record (``_discovery``); its run
  directory (``engine_run_dir``: DP engine ``k > 0`` in ``<run dir>/dp<k>``) and each
  rank's port offset (``rank_port_offset``), so DP engines never share a socket or a port.
* **The step stamp**: the step planned with an output, with its events, which a worker
  gets applied before it translates that output (``attach_step_stamp`` /
  ``read_step_stamp``).

Which ``SchedulerOutput`` fields name blocks is in ``output_blocks``; how the ranks are
found at start-up, in ``_discovery``. This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from kvdefrag.common import StepEvents
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.errors import StartupRefused

__all__ = [
    "StepStamp",
    "attach_step_stamp",
    "data_parallel_rank",
    "engine_id",
    "engine_run_dir",
    "rank_port_offset",
    "read_step_stamp",
]


def data_parallel_rank(parallel_config: object) -> int:
    """The data-parallel engine a process belongs to (0 without data parallelism).

    It is ``ParallelConfig.data_parallel_index`` (vLLM 0.33 ``config/parallel.py``),
    which ``EngineCoreProc.run_engine_core`` sets to the engine's DP rank
    (``v1/engine/core.py``) before it builds the engine core, its executor (whose
    workers get this config) and its scheduler. Not ``data_parallel_rank``: for a dense
    model each DP engine is independent and ``reconfigure_for_independent_dp_rank``
    (``config/parallel.py``) resets that to 0 and ``data_parallel_size`` to 1, as
    vLLM's own per-rank names note (``v1/worker/gpu_worker.py``). For a MoE model
    (``DPEngineCoreProc``, ``core.py``) the two are equal. Inside one DP engine the
    workers are numbered ``rank`` 0 .. ``world_size - 1`` (``world_size`` = PP x TP x PCP,
    ``config/parallel.py``), whatever the DP rank.
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
