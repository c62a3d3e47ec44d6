"""Deprecated alias of ``kvdefrag.vllm.scheduler`` (removed in the next release).

It keeps ``--scheduler-cls kvdefrag.client.vllm.scheduler.DefragScheduler`` (and
``DefragAsyncScheduler``) working for one release. It needs the ``kvdefrag-vllm``
distribution, which this torch-free one does not depend on.
"""

import warnings

try:
    from kvdefrag.vllm.scheduler import (
        DefragAsyncScheduler,
        DefragScheduler,
        UnsupportedByKvdefrag,
        check_supported,
    )
except ModuleNotFoundError as err:
    if err.name is None or not err.name.startswith("kvdefrag.vllm"):
        raise
    raise ModuleNotFoundError(
        "kvdefrag.client.vllm.scheduler is an alias of kvdefrag.vllm.scheduler, which the "
        "kvdefrag-vllm distribution provides: pip install kvdefrag-vllm (./integrations/vllm "
        "in the repository) and use --scheduler-cls kvdefrag.vllm.scheduler.DefragScheduler",
        name=err.name,
    ) from err

__all__ = ["DefragAsyncScheduler", "DefragScheduler", "UnsupportedByKvdefrag", "check_supported"]

warnings.warn(
    "kvdefrag.client.vllm.scheduler moved to kvdefrag.vllm.scheduler; the old path is an "
    "alias that goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
