"""What kvdefrag refuses from vLLM's configuration alone (``refusals``), without vLLM."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kvdefrag.vllm import refusals as _engine_checks
from kvdefrag.vllm.errors import UnsupportedByKvdefrag
from kvdefrag.vllm.refusals import (
    RAY_V2_ENV,
    check_engine_config,
    uses_legacy_ray_executor,
)


def engine_config(**parallel: Any) -> SimpleNamespace:
    """The parts of vLLM's ``VllmConfig`` the checks read; ``kv_transfer_config`` among
    ``parallel`` goes on the config itself."""
    kv_transfer_config = parallel.pop("kv_transfer_config", None)
    fields = {
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "data_parallel_size": 1,
        "distributed_executor_backend": "mp",
        **parallel,
    }
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**fields), kv_transfer_config=kv_transfer_config
    )


REFUSED = [
    (
        {"distributed_executor_backend": "external_launcher", "pipeline_parallel_size": 2},
        "pipeline parallelism under an external launcher",
    ),
    ({"decode_context_parallel_size": 2}, "drop --decode-context-parallel-size"),
    ({"prefill_context_parallel_size": 2}, "--prefill-context-parallel-size or kvdefrag"),
    (
        {"kv_transfer_config": SimpleNamespace(kv_connector="NixlPushConnector")},
        "'NixlPushConnector': its writer thread writes blocks.*drop --kv-transfer-config",
    ),
    (
        {"kv_transfer_config": SimpleNamespace(kv_connector="SomeStoreConnector")},
        "'SomeStoreConnector': kvdefrag does not know where it uses block ids",
    ),
    (
        {
            "kv_transfer_config": SimpleNamespace(
                kv_connector="ExampleConnector", kv_connector_module_path="my.connectors"
            )
        },
        "from kv_connector_module_path 'my.connectors'",
    ),
    (
        {
            "kv_transfer_config": SimpleNamespace(
                kv_connector="MultiConnector",
                kv_connector_extra_config={
                    "connectors": [
                        {"kv_connector": "MooncakeConnector"},
                        {"kv_connector": "SimpleCPUOffloadConnector"},
                    ]
                },
            )
        },
        "'SimpleCPUOffloadConnector': its store and load lists are not pinned",
    ),
    (
        {
            "kv_transfer_config": SimpleNamespace(
                kv_connector="MultiConnector",
                kv_connector_extra_config={
                    "connectors": [
                        {"kv_connector": "NixlConnector"},
                        {"kv_connector": "OffloadingConnector"},
                    ]
                },
            )
        },
        "OffloadingConnector on its own, not as a MultiConnector child",
    ),
    (
        {"distributed_executor_backend": "external_launcher", "data_parallel_size": 2},
        "external launcher with more than one rank.*--distributed-executor-backend mp or ray",
    ),
    (
        {"distributed_executor_backend": "external_launcher", "world_size": 2},
        "every rank's process runs its own scheduler",
    ),
]
"""Each configuration kvdefrag refuses, and what the message must say."""


@pytest.mark.parametrize(("parallel", "message"), REFUSED)
def test_what_the_configuration_alone_decides_is_refused_naming_the_fix(
    parallel: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedByKvdefrag, match=message):
        check_engine_config(engine_config(**parallel))


def test_tensor_data_and_pipeline_parallelism_are_served() -> None:
    check_engine_config(engine_config(data_parallel_size=2))
    check_engine_config(engine_config(pipeline_parallel_size=4))
    check_engine_config(engine_config(distributed_executor_backend="ray"))
    for backend in ("uni", "mp", "ray", "external_launcher"):  # one rank: one scheduler
        check_engine_config(engine_config(distributed_executor_backend=backend))
    check_engine_config(None)


def test_the_served_kv_connectors_pass() -> None:
    for name in ("ExampleConnector", "MooncakeConnector", "NixlConnector", "OffloadingConnector"):
        check_engine_config(engine_config(kv_transfer_config=SimpleNamespace(kv_connector=name)))
    children = [{"kv_connector": "ExampleConnector"}, {"kv_connector": "MooncakeConnector"}]
    multi = SimpleNamespace(
        kv_connector="MultiConnector", kv_connector_extra_config={"connectors": children}
    )
    check_engine_config(engine_config(kv_transfer_config=multi))


@pytest.fixture
def legacy_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM (0.32) that still has the legacy Ray executor."""
    monkeypatch.setattr(_engine_checks, "has_legacy_ray_executor", lambda: True)


@pytest.mark.usefixtures("legacy_ray")
def test_the_legacy_ray_executor_is_refused_naming_its_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(RAY_V2_ENV, "0")
    with pytest.raises(UnsupportedByKvdefrag, match=f"Unset {RAY_V2_ENV} \\(or set it to 1\\)"):
        check_engine_config(engine_config(distributed_executor_backend="ray"))
    # RayExecutorV2 (vLLM 0.32's default) calls the worker: served
    monkeypatch.setenv(RAY_V2_ENV, "1")
    check_engine_config(engine_config(distributed_executor_backend="ray"))
    monkeypatch.delenv(RAY_V2_ENV)
    check_engine_config(engine_config(distributed_executor_backend="ray"))


@pytest.mark.usefixtures("legacy_ray")
def test_the_legacy_ray_executor_named_as_a_class_is_refused_too() -> None:
    legacy = type("RayDistributedExecutor", (), {"__module__": "vllm.v1.executor.ray_executor"})
    mine = type("MyExecutor", (legacy,), {})
    assert uses_legacy_ray_executor(SimpleNamespace(distributed_executor_backend=mine))
    name = "vllm.v1.executor.ray_executor.RayDistributedExecutor"
    assert uses_legacy_ray_executor(SimpleNamespace(distributed_executor_backend=name))
    assert not uses_legacy_ray_executor(SimpleNamespace(distributed_executor_backend=object))


def test_without_the_legacy_executor_the_switch_means_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.33 has only RayExecutorV2: ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`` is ignored."""
    monkeypatch.setattr(_engine_checks, "has_legacy_ray_executor", lambda: False)
    monkeypatch.setenv(RAY_V2_ENV, "0")
    check_engine_config(engine_config(distributed_executor_backend="ray"))


def test_importing_the_checks_imports_no_vllm() -> None:
    code = (
        "import sys, kvdefrag.vllm.refusals, kvdefrag.vllm.contract\n"
        "assert not [name for name in sys.modules if name.split('.')[0] == 'vllm']\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
