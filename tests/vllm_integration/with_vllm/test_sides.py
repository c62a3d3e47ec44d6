"""What each scheduler class loads into vLLM's engine-core process, resolved as vLLM
resolves ``--scheduler-cls``: the client and what both sides share, never the server or
the worker side."""

from __future__ import annotations

import subprocess
import sys

import pytest

# vllm-gaudi is not installed here: a stand-in module holds its HPUAsyncScheduler (vLLM's
# AsyncScheduler under another name), so that the Gaudi class can be built.
_FAKE_VLLM_GAUDI = """
import sys, types
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
names = ["vllm_gaudi", "vllm_gaudi.v1", "vllm_gaudi.v1.core", "vllm_gaudi.v1.core.sched"]
for name in names:
    sys.modules[name] = types.ModuleType(name)
module = types.ModuleType("vllm_gaudi.v1.core.sched.hpu_async_scheduler")
module.HPUAsyncScheduler = type("HPUAsyncScheduler", (AsyncScheduler,), {})
sys.modules[module.__name__] = module
"""

_CHECK = """
from vllm.utils.import_utils import resolve_obj_by_qualname
cls = resolve_obj_by_qualname({qualname!r})
assert isinstance(cls, type), cls
forbidden = ("kvdefrag.server", "kvdefrag.vllm.worker", "kvdefrag.vllm._worker")
loaded = sorted(name for name in sys.modules if name.startswith(forbidden))
assert not loaded, loaded
print(cls.__name__)
"""


@pytest.mark.parametrize(
    "qualname",
    [
        "kvdefrag.vllm.scheduler.DefragScheduler",
        "kvdefrag.vllm.scheduler.DefragAsyncScheduler",
        "kvdefrag.vllm.gaudi.DefragHPUAsyncScheduler",
    ],
)
def test_a_scheduler_class_loads_neither_the_server_nor_the_worker_side(qualname: str) -> None:
    code = "import sys\n" + _FAKE_VLLM_GAUDI + _CHECK.format(qualname=qualname)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == qualname.rpartition(".")[2]


def test_the_check_sees_a_worker_class_load_the_server() -> None:
    """The check itself: resolving the worker's Gaudi class loads the server."""
    code = (
        "import sys\n"
        "import kvdefrag.vllm.gaudi as gaudi\n"
        "gaudi.DefragHPUWorkerMixin\n"
        "assert any(name.startswith('kvdefrag.server') for name in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
