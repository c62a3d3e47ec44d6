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
from typing import Any

from kvdefrag.vllm.errors import UnsupportedByKvdefrag

RAY_V2_ENV = "VLLM_USE_RAY_V2_EXECUTOR_BACKEND"
"""vLLM 0.32's switch between its Ray executors (``v1/executor/abstract.py``): unset or
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

    As vLLM 0.32's ``Executor.get_class`` (``v1/executor/abstract.py``) picks it:
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
        UnsupportedByKvdefrag: Decode/prefill context parallelism, a KV connector not
            served (``check_kv_connector``), vLLM's legacy Ray executor, or an external
            launcher with more than one rank (tensor, pipeline or data parallel); the
            message names the setting and what to do instead.
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
    kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer_config is not None:
        check_kv_connector(kv_transfer_config)
    if uses_legacy_ray_executor(parallel):
        # NOTE: its compiled graph calls worker.model_runner.execute_model and
        # sample_tokens directly (vLLM 0.32 v1/executor/ray_utils.py), never the
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


_DRAFTERS_THAT_READ_NO_KV = frozenset({"ngram", "ngram_gpu", "suffix"})
"""Speculative methods whose proposer reads no KV cache (vLLM 0.33,
``vllm/config/speculative.py``: they match on token ids); every other method's drafter
runs attention over the target's blocks or a draft KV cache of its own."""


def check_drafter(vllm_config: Any) -> None:
    """Refuses, at start-up, a speculative drafter on vLLM's runners that reads KV data.

    vLLM's V1 and V2 runners run the drafter in ``sample_tokens``, inside the pass, over
    the runner's (physical) rows; no test here runs an EAGLE, MTP or draft-model drafter
    on a real engine, so kvdefrag does not claim them. N-gram and suffix proposers read
    token ids only. vllm-gaudi's Eagle draft resolves through the switch and is covered
    (``kvdefrag.vllm.gaudi``).

    Raises:
        UnsupportedByKvdefrag: Naming the method and what to do instead.
    """
    speculative = getattr(vllm_config, "speculative_config", None)
    method = getattr(speculative, "method", None)
    if speculative is None or method in _DRAFTERS_THAT_READ_NO_KV:
        return
    raise UnsupportedByKvdefrag(
        f"kvdefrag: speculative decoding with method {method!r} runs a drafter that reads "
        "KV cache blocks, which kvdefrag does not support on vLLM's runners yet; use "
        "--speculative-config with method 'ngram' or 'suffix', or serve without kvdefrag"
    )


def check_v2_runner(model_runner: Any) -> None:
    """Refuses, at startup, a V2 runner whose block table is not where kvdefrag follows it.

    ``remap_v2_runner_rows`` relies on ``model_runner.block_tables.block_tables`` holding
    exactly one table (one KV-cache group) whose ``.gpu`` is a 2-D integer tensor.

    Raises:
        UnsupportedByKvdefrag: Naming the part of that structure the runner lacks.
    """
    import torch

    runner_name = type(model_runner).__name__
    tables = getattr(getattr(model_runner, "block_tables", None), "block_tables", None)
    if not isinstance(tables, (list, tuple)):
        raise UnsupportedByKvdefrag(
            f"kvdefrag: the V2 model runner ({runner_name}) has no list "
            "model_runner.block_tables.block_tables, where kvdefrag follows the blocks it "
            "moves; this vLLM's V2 runner is not the one kvdefrag supports (vLLM 0.33)"
        )
    if len(tables) != 1:
        raise UnsupportedByKvdefrag(
            f"kvdefrag: the V2 model runner ({runner_name}) has {len(tables)} block tables "
            "in model_runner.block_tables.block_tables; kvdefrag serves exactly one "
            "(one KV-cache group)"
        )
    table = getattr(tables[0], "gpu", None)
    if (
        not isinstance(table, torch.Tensor)
        or table.dim() != 2
        or table.dtype not in (torch.int32, torch.int64)
    ):
        found = (
            f"a {table.dtype} tensor of shape {tuple(table.shape)}"
            if isinstance(table, torch.Tensor)
            else type(table).__name__
        )
        raise UnsupportedByKvdefrag(
            f"kvdefrag: model_runner.block_tables.block_tables[0].gpu of the V2 model runner "
            f"({runner_name}) is {found}; expected a 2-D int32 or int64 tensor "
            "[max_num_reqs, max_num_blocks]"
        )


# NOTE: exact types: RSWASpec, SinkFullAttentionSpec and HiddenStateCacheSpec subclass
# these but free or pin blocks differently.
_SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuses, at startup, the configurations kvdefrag cannot keep correct.

    Raises:
        UnsupportedByKvdefrag: Naming the feature and what to do instead.
    """
    check_one_kv_cache_group(kv_cache_config)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    if not _is_supported_spec(spec):
        raise UnsupportedByKvdefrag(
            f"kvdefrag cannot serve KV-cache spec {type(spec).__name__}: sliding-window "
            "and chunked-local attention free a running request's blocks without any "
            "SchedulerOutput field saying so. Serve it without kvdefrag."
        )
    # NOTE: the workers refused these already, before the model loaded; checked again here
    # for a worker class that is not kvdefrag's.
    check_engine_config(vllm_config)


def check_one_kv_cache_group(kv_cache_config: Any) -> None:
    """Refuses a model with more than one KV-cache group (a hybrid model), on both sides.

    Raises:
        UnsupportedByKvdefrag: Naming the groups' specs.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        specs = ", ".join(type(getattr(group, "kv_cache_spec", group)).__name__ for group in groups)
        raise UnsupportedByKvdefrag(
            f"kvdefrag serves one KV-cache group; this model has {len(groups)} ({specs}): "
            "hybrid models (sliding window plus full attention, Mamba, EAGLE draft "
            "groups) are not supported. Serve it without --scheduler-cls "
            "kvdefrag.vllm.scheduler.DefragScheduler."
        )


def _is_supported_spec(spec: object) -> bool:
    """Whether ``spec``'s exact type is one of vLLM's ``_SUPPORTED_SPECS``."""
    from vllm.v1 import kv_cache_interface

    return type(spec) in tuple(getattr(kv_cache_interface, name) for name in _SUPPORTED_SPECS)


SERVED_CONNECTORS = (
    "ExampleConnector",
    "MooncakeConnector",
    "NixlConnector",
    "NixlPullConnector",
    "OffloadingConnector",
)
"""The KV connectors kvdefrag serves end to end (and ``MultiConnector`` over them): the
worker translates their metadata, and the scheduler side pins their transfers
(docs/operator/kv-connectors.md)."""

_NOT_YET_SERVED = {
    "NixlPushConnector": "its writer thread writes blocks outside any pass by ids kvdefrag "
    "does not translate",
    "SimpleCPUOffloadConnector": "its store and load lists are not pinned by kvdefrag yet",
    "LMCacheConnectorV1": "it is not tested with kvdefrag",
}


def check_kv_connector(kv_transfer_config: Any) -> None:
    """Refuses a KV connector kvdefrag does not serve (``SERVED_CONNECTORS``).

    Raises:
        UnsupportedByKvdefrag: The connector (or a MultiConnector child) is not served,
            or is loaded from ``kv_connector_module_path``; the message names it.
    """
    pairs = _connectors(kv_transfer_config)
    for name, module_path in pairs:
        if module_path:
            raise UnsupportedByKvdefrag(
                f"kvdefrag cannot serve KV connector {name!r} from kv_connector_module_path "
                f"{module_path!r}: one block id it uses unmapped is silent corruption. It "
                f"serves {', '.join(SERVED_CONNECTORS)}; drop --kv-transfer-config or kvdefrag."
            )
        if name not in SERVED_CONNECTORS:
            why = _NOT_YET_SERVED.get(name, "kvdefrag does not know where it uses block ids")
            raise UnsupportedByKvdefrag(
                f"kvdefrag cannot serve KV connector {name!r}: {why}. It serves "
                f"{', '.join(SERVED_CONNECTORS)} (and MultiConnector over them); use one of "
                "these, or drop --kv-transfer-config or kvdefrag."
            )
        if name == "OffloadingConnector" and len(pairs) > 1:
            # NOTE: its jobs are read from the step's metadata, and under MultiConnector
            # that is MultiConnector's, which kvdefrag does not open.
            raise UnsupportedByKvdefrag(
                "kvdefrag serves OffloadingConnector on its own, not as a MultiConnector "
                "child (its offload jobs would go unpinned): drop the MultiConnector or "
                "kvdefrag."
            )


def _connectors(config: Any) -> list[tuple[str, str | None]]:
    """``(kv_connector, kv_connector_module_path)`` of a config and, for a
    MultiConnector, of each child (a dict or a config object)."""

    def read(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    name = str(read("kv_connector"))
    if name != "MultiConnector":
        return [(name, read("kv_connector_module_path") or None)]
    extra = read("kv_connector_extra_config") or {}
    return [pair for child in extra.get("connectors", ()) for pair in _connectors(child)]
