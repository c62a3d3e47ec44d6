"""Deprecated alias of ``kvdefrag.vllm.worker`` (removed in the next release).

It keeps ``--worker-cls kvdefrag.server.vllm_worker.DefragWorker`` working for one release.
It needs the ``kvdefrag-vllm`` distribution, which ``kvdefrag-server`` does not depend on.
"""

import warnings
from typing import Any

try:
    from kvdefrag.vllm import worker as _worker
except ModuleNotFoundError as err:
    if err.name is None or not err.name.startswith("kvdefrag.vllm"):
        raise
    raise ModuleNotFoundError(
        "kvdefrag.server.vllm_worker is an alias of kvdefrag.vllm.worker, which the "
        "kvdefrag-vllm distribution provides: pip install kvdefrag-vllm (./integrations/vllm "
        "in the repository) and use --worker-cls kvdefrag.vllm.worker.DefragWorker",
        name=err.name,
    ) from err

warnings.warn(
    "kvdefrag.server.vllm_worker moved to kvdefrag.vllm.worker; the old path is an alias "
    "that goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    """Every name of ``kvdefrag.vllm.worker``, the worker classes included."""
    return getattr(_worker, name)
