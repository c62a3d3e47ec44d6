"""What kvdefrag refuses from vLLM's configuration alone, on both sides.

``check_engine_config`` runs in every worker before the model loads
(``DefragWorkerMixin.init_device``: nothing is served or written yet) and again in the
scheduler's ``check_supported``. Each refusal names the setting and the fix.

Duck-typed against vLLM 0.33's (and 0.32's) ``VllmConfig``: importing this module imports
neither vLLM nor torch; ``has_legacy_ray_executor`` looks for vLLM's module only when the
configuration asks for Ray.
"""

from __future__ import annotations

import importlib.util
import os

from kvdefrag.vllm.errors import UnsupportedByKvdefrag

RAY_V2_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
"""vLLM 0.32's switch between its Ray executors (``v1/executor/abstract.py:78``): unset or
non-zero, ``RayExecutorV2``; ``0``, the legacy ``RayDistributedExecutor``."""

_LEGACY_RAY_MODULE = "vllm.v1.executor.ray_executor"
_LEGACY_RAY_CLASS = "RayDistributedExecutor"


def has_legacy_ray_executor() -> bool:
    """Whether the installed vLLM still has the legacy Ray executor (0.32 does, 0.33 not)."""
    try:
        return importlib.util.find_spec(_LEGACY_RAY_MODULE) is not None
    except ModuleNotFoundError:  # no vllm at all
        return False


def uses_legacy_ray_executor(parallel_config: object) -> bool:
    """Whether vLLM will run this engine's workers with its legacy Ray executor.

    As vLLM 0.32's ``Executor.get_class`` (``v1/executor/abstract.py:77``) picks it:
    ``distributed_executor_backend="ray"`` with ``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``, or
    the class (or its qualified name) given as the backend.
    """
    backend = getattr(parallel_config, "distributed_executor_backend", None)
    if isinstance(backend, type):
        return any(
            cls.__module__ == _LEGACY_RAY_MODULE and cls.__name__ == _LEGACY_RAY_CLASS
            for cls in backend.__mro__
        )
    if backend == f"{_LEGACY_RAY_MODULE}.{_LEGACY_RAY_CLASS}":
        return True
    if backend != "ray":
        return False
    text = os.environ.get(RAY_V2_ENV, "1").strip() or "1"
    try:
        wants_v2 = bool(int(text))
    except ValueError:
        return False  # vLLM itself refuses it when it reads the variable
    return not wants_v2 and has_legacy_ray_executor()


def check_engine_config(vllm_config: object) -> None:
    """Refuses what kvdefrag cannot serve, decided by the configuration alone.

    Raises:
        UnsupportedByKvdefrag: Decode/prefill context parallelism, a KV connector,
            vLLM's legacy Ray executor, or an external launcher with more than one rank
            (tensor, pipeline or data parallel); the message names the setting and what
            to do instead.
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    if (
        int(getattr(parallel, "pipeline_parallel_size", 1)) > 1
        and getattr(parallel, "distributed_executor_backend", None) == "external_launcher"
    ):
        # NOTE: there every rank runs an engine core of its own and vLLM's V1 runner
        # broadcasts the last stage's output to every rank (``broadcast_pp_output``); no
        # test covers kvdefrag's steps there.
        raise UnsupportedByKvdefrag(
            "kvdefrag does not support pipeline parallelism under an external launcher "
            "(every rank runs its own scheduler): drop --pipeline-parallel-size, or "
            "launch with vllm serve --pipeline-parallel-size."
        )
    if (
        int(getattr(parallel, "decode_context_parallel_size", 1)) > 1
        or int(getattr(parallel, "prefill_context_parallel_size", 1)) > 1
    ):
        raise UnsupportedByKvdefrag(
            "kvdefrag does not support decode/prefill context parallelism: drop "
            "--decode-context-parallel-size / --prefill-context-parallel-size or kvdefrag."
        )
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise UnsupportedByKvdefrag(
            "kvdefrag cannot serve a KV connector (it reads and writes blocks by the "
            "scheduler's ids): drop --kv-transfer-config or kvdefrag."
        )
    if uses_legacy_ray_executor(parallel):
        # NOTE: its compiled graph calls worker.model_runner.execute_model and
        # sample_tokens directly (vLLM 0.32 v1/executor/ray_utils.py:124-170), never the
        # worker's: kvdefrag's wait, kv_lock and translation would not run.
        raise UnsupportedByKvdefrag(
            f"kvdefrag cannot serve vLLM's legacy Ray executor ({RAY_V2_ENV}=0): it runs "
            "the model runner without the worker, so outputs would name blocks where they "
            f"no longer are. Unset {RAY_V2_ENV} (or set it to 1) for RayExecutorV2, or use "
            "--distributed-executor-backend mp."
        )
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher" and (
        int(getattr(parallel, "world_size", 1)) > 1
        or int(getattr(parallel, "data_parallel_size", 1)) > 1
    ):
        # NOTE: under an external launcher every rank's process builds an engine core and
        # a scheduler of its own (vLLM 0.33 ``v1/executor/uniproc_executor.py``,
        # ``ExecutorWithExternalLauncher``: the schedulers agree by determinism); a rank's
        # kvdefrag service takes one scheduler's session, so the second one would fail
        # after the model loaded.
        raise UnsupportedByKvdefrag(
            "kvdefrag cannot serve vLLM's external launcher with more than one rank (every "
            "rank's process runs its own scheduler, and a rank's kvdefrag service follows "
            "one scheduler): launch with vllm serve and --distributed-executor-backend mp "
            "or ray, or drop kvdefrag."
        )
