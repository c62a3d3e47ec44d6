"""kvdefrag on Gaudi (vllm-gaudi): the two classes to name on vLLM's command line.

::

    --scheduler-cls kvdefrag.vllm.gaudi.DefragHPUAsyncScheduler   the scheduler side
    --worker-cls    kvdefrag.vllm.gaudi.DefragHPUWorker           the worker side

Every name here is looked up on first use from its own side's module: vLLM's engine core,
which resolves the scheduler class, loads nothing of the worker side or of the server,
and a worker nothing of the scheduler side. The worker's pieces (the switch that answers
vllm-gaudi's defragmenter calls, the mixin) are in ``kvdefrag.vllm._worker.gaudi``; the
scheduler's (the check that the async scheduler is vllm-gaudi's) in
``kvdefrag.vllm._scheduler.gaudi``. Design: docs/design/gaudi.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdefrag.vllm._scheduler.gaudi import (
        HPU_ASYNC_SCHEDULER,
        GaudiSchedulerMismatch,
        check_gaudi_scheduler,
        hpu_async_scheduler_base,
    )
    from kvdefrag.vllm._worker.gaudi import HPU_WORKER, DefragHPUSwitch, DefragHPUWorkerMixin

__all__ = [
    "HPU_ASYNC_SCHEDULER",
    "HPU_WORKER",
    "DefragHPUSwitch",
    "DefragHPUWorkerMixin",
    "GaudiSchedulerMismatch",
    "check_gaudi_scheduler",
    "hpu_async_scheduler_base",
]

_SCHEDULER_SIDE = "kvdefrag.vllm._scheduler.gaudi"
_WORKER_SIDE = "kvdefrag.vllm._worker.gaudi"
_HOMES = {
    "HPU_ASYNC_SCHEDULER": _SCHEDULER_SIDE,
    "GaudiSchedulerMismatch": _SCHEDULER_SIDE,
    "check_gaudi_scheduler": _SCHEDULER_SIDE,
    "hpu_async_scheduler_base": _SCHEDULER_SIDE,
    "HPU_WORKER": _WORKER_SIDE,
    "DefragHPUSwitch": _WORKER_SIDE,
    "DefragHPUWorkerMixin": _WORKER_SIDE,
}


def __getattr__(name: str) -> Any:
    """Each public name from its side's module; ``DefragHPUAsyncScheduler`` and
    ``DefragHPUWorker`` are built on first lookup (they import vLLM and vllm-gaudi)."""
    if name == "DefragHPUAsyncScheduler":
        return importlib.import_module("kvdefrag.vllm.scheduler").hpu_async_scheduler_class()
    if name == "DefragHPUWorker":
        return importlib.import_module(_WORKER_SIDE).hpu_worker_class()
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
