"""The scheduler side of kvdefrag on Gaudi: the async scheduler class must be vllm-gaudi's.

``vllm_gaudi/utils.py`` (vllm-project/vllm-gaudi at 091bbadd) rebinds vLLM's
``AsyncScheduler`` to vllm-gaudi's ``HPUAsyncScheduler``
(``vllm_gaudi.v1.core.sched.hpu_async_scheduler``), which carries HPU fixes; a scheduler
class built on the upstream class silently loses them. ``check_gaudi_scheduler`` refuses
such a class at start-up.

This module imports neither the worker side, nor the server, nor vLLM; it imports
vllm-gaudi only to look the base class up (``kvdefrag.vllm.scheduler`` builds
``DefragHPUAsyncScheduler`` on it).
"""

from __future__ import annotations

import importlib

from kvdefrag.vllm.errors import UnsupportedByKvdefrag

__all__ = [
    "HPU_ASYNC_SCHEDULER",
    "GaudiSchedulerMismatch",
    "check_gaudi_scheduler",
    "hpu_async_scheduler_base",
]

HPU_ASYNC_SCHEDULER = "vllm_gaudi.v1.core.sched.hpu_async_scheduler.HPUAsyncScheduler"
"""vllm-gaudi's async scheduler (``vllm_gaudi/utils.py`` rebinds vLLM's to it)."""


class GaudiSchedulerMismatch(UnsupportedByKvdefrag):
    """On Gaudi, kvdefrag's async scheduler does not inherit vllm-gaudi's; the message
    says how to build the right class."""


def hpu_async_scheduler_base() -> type | None:
    """vllm-gaudi's ``HPUAsyncScheduler``, or None where vllm-gaudi is not installed."""
    module_name, _, name = HPU_ASYNC_SCHEDULER.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    base: type = getattr(module, name)
    return base


def check_gaudi_scheduler(scheduler: object) -> None:
    """Refuses, at startup, an async kvdefrag scheduler that drops vllm-gaudi's fixes.

    Asked only for async schedulers; does nothing where vllm-gaudi is not installed.

    Raises:
        GaudiSchedulerMismatch: vllm-gaudi is installed and ``scheduler`` is not an
            ``HPUAsyncScheduler``.
    """
    base = hpu_async_scheduler_base()
    if base is None or isinstance(scheduler, base):
        return
    raise GaudiSchedulerMismatch(
        f"kvdefrag: vllm-gaudi is installed but {type(scheduler).__name__} does not "
        f"inherit its {HPU_ASYNC_SCHEDULER} (vllm-gaudi rebinds vLLM's AsyncScheduler to "
        "it; a class built on the upstream one loses its HPU fixes). Serve with "
        "--scheduler-cls kvdefrag.vllm.gaudi.DefragHPUAsyncScheduler (built as "
        "class DefragHPUAsyncScheduler(DefragAsyncScheduler, HPUAsyncScheduler))"
    )
