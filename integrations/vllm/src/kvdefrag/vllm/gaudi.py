"""kvdefrag on Intel Gaudi (vllm-gaudi's HPU runner): the runner's defragmenter, replaced.

vllm-gaudi's HPU model runner does not take physical ids from its output or keep physical
rows: its rows stay in the scheduler's (logical) ids and every block id is resolved when
the inputs are built, through one object at ``model_runner.defragmenter`` (vllm-gaudi's
own ``OnlineDefragmenter``). What this module relies on, as read in vllm-project/vllm-gaudi
(main, 2026-08-21):

* ``vllm_gaudi/v1/worker/hpu_model_runner.py``: ``execute_model`` first calls
  ``run_defragmenter(scheduler_output)``, which calls
  ``defragmenter.update_state(new | cached, finished_req_ids)`` then
  ``defragmenter.defragment()``; then ``_update_states`` (which APPENDS
  ``new_block_ids`` to the persistent row of a request still in the batch, even one in
  ``resumed_req_ids``); then the inputs are built: ``_extract_prefill_batch_contents``
  maps each prefill block list through ``defragmenter.resolve``,
  ``_create_decode_input_data`` maps the decode slot mapping element by element
  (``block_number.apply_(self.defragmenter.resolve)``) and the decode block tables
  through ``defragmenter.resolve_all``; ``_resolve_block`` / ``_resolve_all_blocks``
  do the same for the other paths. ``get_habana_paged_attn_buffers`` then, with
  contiguous PA, lays the decode block list out densely by physical id up to a bucket
  of at least ``max(block_list) + 1``.
* ``vllm_gaudi/v1/spec_decode/hpu_eagle.py``: the Eagle draft step calls
  ``defragmenter.resolve_all`` / ``resolve`` directly.
* ``vllm_gaudi/v1/worker/hpu_worker.py``: ``initialize_from_config`` allocates the KV
  caches and warms the model up (``HPUModelRunner.warmup_model``, which warms its own
  ``OnlineDefragmenter`` through ``cache_utils`` and then re-creates it) before the
  mixin installs the switch. ``sleep()``, at every level (level 2 runs as level 1),
  sets ``model_runner.defragmenter.cache_utils.kv_caches = None`` and discards the KV
  caches (``model_runner.kv_caches = []``); ``wake_up()`` with the ``kv_cache`` tag
  (the default) re-allocates them (``initialize_kv_cache``: new, zero-filled tensors)
  and re-creates an ``OnlineDefragmenter``; it warms nothing.
* vLLM 0.33's engine side (``vllm/v1/engine/core.py``): ``EngineCore.sleep`` at level 1
  and up pauses the scheduler with ``clear_cache``, whose ``_reset_caches`` calls
  ``Scheduler.reset_prefix_cache(reset_running_requests=True)``: every running request
  is preempted (``_preempt_request``: its blocks freed, ``num_computed_tokens = 0``),
  the prefix cache is emptied, and only then do the workers sleep. The preemptions
  reach kvdefrag's ledger in the first output after ``wake_up`` (``preempted_req_ids``,
  from ``reset_preempted_req_ids``); scheduling resumes only once every worker is awake.
* ``vllm_gaudi/v1/worker/hpu_model_runner.py``, ``initialize_kv_cache``: each layer's
  ``(key_cache, value_cache, key_scales, value_scales)`` over ``num_blocks + 1`` blocks,
  the last the pad block ``_PAD_BLOCK_ID = num_blocks``; the worker binds the first
  ``KVCacheConfig.num_blocks`` blocks, scales included (``kvdefrag.vllm._kv_binding``).
* ``vllm_gaudi/utils.py`` rebinds vLLM's ``AsyncScheduler`` to vllm-gaudi's
  ``HPUAsyncScheduler`` (``vllm_gaudi.v1.core.sched.hpu_async_scheduler``), which
  carries HPU fixes; a scheduler class built on the upstream class silently loses them.

So on Gaudi kvdefrag does not translate the output or remap rows
(``DefragWorkerMixin``'s path: the HPU runner's rows stay logical, and a physical id
appended to a logical row would be wrong). Instead ``DefragHPUSwitch`` takes the place of
the runner's defragmenter: ``update_state``/``defragment`` plan nothing and
``resolve``/``resolve_all`` answer from the rank's kvdefrag service, and
``DefragHPUWorkerMixin`` runs each pass after the step stamped on its output is applied,
holding ``kv_lock``.

Why the switch plans nothing: kvdefrag's events come from the scheduler side
(``DefragScheduler``'s ledger, read from vLLM's KV cache manager). Correctness first: the
ledger sees preemption (``preempted_req_ids``), resumption (whole rows replacing the old
ones), deferred frees and prefix-cache state, which the worker-side
``update_state(new | cached, finished)`` never sees (vllm-gaudi's own TODO: "Add support
for preempted blocks"; it also applies new blocks before finished requests, so a request
id reused in the same step loses its new blocks). Then cost: one plan per step for all
ranks, off the forward pass, instead of one per rank inside it.

Sleep and wake-up: the mixin's ``sleep`` lets the service drop the discarded caches
(``ServerHandle.release_kv_caches``), so their memory is freed; its ``wake_up`` binds the
service to the re-allocated ones (``ServerHandle.rebind_kv_caches``, which warms the new
executor) or warms the bound one (``ServerHandle.warmup``), then puts the switch back.
The mapping and the epoch stay across it: when the caches are discarded vLLM holds no
block whose content it reads again (above), so whatever the mapping names is as good as
any other place in fresh memory, and the scheduler's session goes on.

Importing this module imports neither vLLM nor vllm-gaudi; the classes built from them
(``DefragHPUAsyncScheduler``, ``DefragHPUWorker``) are made on first lookup.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvdefrag.vllm.common import read_step_stamp
from kvdefrag.vllm.worker import DefragWorkerMixin, wait_for_planned_step

__all__ = [
    "HPU_ASYNC_SCHEDULER",
    "HPU_WORKER",
    "DefragHPUSwitch",
    "DefragHPUWorkerMixin",
    "GaudiSchedulerMismatch",
    "check_gaudi_scheduler",
    "hpu_async_scheduler_base",
]

logger = logging.getLogger(__name__)

HPU_ASYNC_SCHEDULER = "vllm_gaudi.v1.core.sched.hpu_async_scheduler.HPUAsyncScheduler"
"""vllm-gaudi's async scheduler (``vllm_gaudi/utils.py`` rebinds vLLM's to it)."""

HPU_WORKER = "vllm_gaudi.v1.worker.hpu_worker.HPUWorker"
"""vllm-gaudi's worker class."""


class SwitchService(Protocol):
    """What the switch reads of its rank's service (``ServerHandle``)."""

    def resolve(self, logical_ids: Any = None) -> npt.NDArray[np.int64]: ...

    def warmup(self) -> int: ...


class _CacheUtilsSlot:
    """Stands where ``OnlineDefragmenter.cache_utils`` is, for vllm-gaudi's ``sleep``,
    which sets its ``kv_caches`` to None. It holds no tensor (the rank's service binds
    the caches) and swaps nothing.

    Attributes:
        kv_caches: What ``sleep`` clears; always None here.
    """

    def __init__(self) -> None:
        self.kv_caches: Any = None


class DefragHPUSwitch:
    """Stands where vllm-gaudi's HPU runner keeps its ``OnlineDefragmenter``.

    The runner calls ``update_state`` and ``defragment`` first in ``execute_model``, and
    ``resolve`` / ``resolve_all`` while it builds its inputs (the Eagle draft step too).
    Here the first two plan nothing (the scheduler side plans); they record the pass. The
    resolvers answer with the rank's kvdefrag mapping.

    Invariants: between ``begin_pass`` and ``end_pass`` (``DefragHPUWorkerMixin`` calls
    them holding ``kv_lock``, after the step stamped on the output is applied) the
    mapping cannot change, so answers are memoised for the pass; ids outside
    ``[0, num_blocks)`` (the runner's pad ids) are returned unchanged, as vllm-gaudi's
    ``resolve`` returns ids beyond its table; before the first pass (warm-up, when no
    step has been taken yet) the resolvers read the service's current mapping; after
    it, a resolve outside a pass is refused (it could race a move).

    Attributes:
        enabled: Read by the runner (``run_defragmenter``); always True.
        cache_utils: What vllm-gaudi's ``sleep`` clears (``cache_utils.kv_caches =
            None``); holds no tensor.
        num_blocks: Blocks in the pool.
        num_passes: Passes begun.
        num_update_states: ``update_state`` calls seen (each planned nothing).
        num_resolved: Block ids resolved (memoised answers included).
        output: The ``SchedulerOutput`` of the pass running, None between passes.
    """

    enabled = True

    def __init__(self, service: SwitchService, num_blocks: int) -> None:
        self._service = service
        self.cache_utils = _CacheUtilsSlot()
        self.num_blocks = num_blocks
        self.num_passes = 0
        self.num_update_states = 0
        self.num_resolved = 0
        self.output: Any = None
        self._in_pass = False
        self._memo: dict[int, int] = {}

    def begin_pass(self, output: Any) -> None:
        """Marks a pass running ``output``; call holding ``kv_lock`` after its step is
        applied."""
        self.output = output
        self._in_pass = True
        self._memo.clear()
        self.num_passes += 1

    def end_pass(self) -> None:
        """Ends the pass (before ``kv_lock`` is released)."""
        self.output = None
        self._in_pass = False
        self._memo.clear()

    def initialize(self, kv_caches: Any, block_size: int) -> None:
        """What ``OnlineDefragmenter.initialize`` is called with; nothing to do: the
        service bound the caches when it started."""

    def update_state(self, new_blocks: Any, finished_reqs: Any) -> None:
        """Records that the runner ran its defragmenter hook; plans nothing (the
        scheduler side's ledger planned this output's step).

        Raises:
            RuntimeError: Called outside a pass after the first one: the runner ran
                without ``DefragHPUWorkerMixin.execute_model`` around it.
        """
        self._check_guarded("update_state")
        self.num_update_states += 1

    def defragment(self) -> None:
        """Nothing to do: the step stamped on the output already moved the blocks."""

    def warmup(self) -> None:
        """Runs the rank's service warm-up (``ServerHandle.warmup``): on HPU every swap
        pad bucket once, one-way and two-way, with pad-only batches that move nothing, so
        no graph is compiled inside a step. For a runner that asks its defragmenter to
        warm up; ``DefragHPUWorkerMixin.wake_up`` calls it too. Call it between passes,
        without holding ``kv_lock`` (the warm-up takes it)."""
        self._service.warmup()

    def resolve(self, block_id: int) -> int:
        """The physical id of logical ``block_id`` (ids outside the pool unchanged)."""
        block_id = int(block_id)
        self.num_resolved += 1
        found = self._memo.get(block_id)
        if found is not None:
            return found
        if not 0 <= block_id < self.num_blocks:
            return block_id
        self._check_guarded("resolve")
        physical = int(self._service.resolve([block_id])[0])
        if self._in_pass:
            self._memo[block_id] = physical
        return physical

    def resolve_all(self, block_table_list: Sequence[Sequence[int]]) -> list[list[int]]:
        """Every id of every list resolved, in one lookup for the ids not seen yet."""
        wanted = {
            int(block_id)
            for block_id in itertools.chain.from_iterable(block_table_list)
            if 0 <= int(block_id) < self.num_blocks and int(block_id) not in self._memo
        }
        if wanted:
            self._check_guarded("resolve_all")
            logical = np.fromiter(sorted(wanted), np.int64, len(wanted))
            physical = self._service.resolve(logical).tolist()
            answers = dict(zip(logical.tolist(), physical, strict=True))
        else:
            answers = {}
        if self._in_pass:
            self._memo.update(answers)
        memo = self._memo if self._in_pass else {**self._memo, **answers}
        result = []
        for row in block_table_list:
            self.num_resolved += len(row)
            result.append([memo.get(int(block_id), int(block_id)) for block_id in row])
        return result

    def _check_guarded(self, what: str) -> None:
        if not self._in_pass and self.num_passes:
            raise RuntimeError(
                f"kvdefrag: the HPU runner called defragmenter.{what} outside a pass of "
                "DefragHPUWorkerMixin.execute_model: block ids read then may race a move. "
                "Run the worker as kvdefrag.vllm.gaudi.DefragHPUWorker (or put "
                "DefragHPUWorkerMixin in front of your HPUWorker subclass)"
            )


class DefragHPUWorkerMixin(DefragWorkerMixin):
    """``DefragWorkerMixin`` for vllm-gaudi's ``HPUWorker``: the runner resolves, not us.

    It starts and publishes the rank's service exactly as ``DefragWorkerMixin`` does
    (``initialize_from_config``), then installs a ``DefragHPUSwitch`` as
    ``model_runner.defragmenter`` in place of vllm-gaudi's ``OnlineDefragmenter``. Each
    ``execute_model`` waits for the step stamped on its output, then runs vLLM's pass
    holding ``kv_lock`` with the switch marking the pass; the output is NOT translated
    and the runner's rows are NOT remapped (they stay logical; the runner resolves them
    at input build).

    Sleep and wake-up follow vllm-gaudi's: ``sleep`` discards the KV caches, and the
    service lets go of them too (``release_kv_caches``) so their memory is freed;
    ``wake_up`` re-allocates them, and the service binds the new tensors
    (``rebind_kv_caches``, its new executor warmed as at start) or, when they were not
    re-allocated, runs its warm-up again (``warmup``); then the switch goes back in
    place of the ``OnlineDefragmenter`` that vllm-gaudi re-created.

    Invariants: while the service runs, ``model_runner.defragmenter`` is
    ``kvdefrag_switch`` whenever ``execute_model`` runs; outside a sleep the service
    moves blocks in the runner's KV caches (``kvdefrag_kv_ptr`` is the address of
    their first tensor).
    """

    kvdefrag_switch: DefragHPUSwitch | None = None
    kvdefrag_kv_ptr: int = 0
    kvdefrag_num_blocks: int = 0
    kvdefrag_kv_released: bool = False

    def kvdefrag_attach(self, handle: Any, num_blocks: int) -> None:
        """Keeps the service (and its step wait), installs the switch; no translator."""
        super().kvdefrag_attach(handle, num_blocks)
        self.kvdefrag_translator = None  # the HPU runner resolves at input build
        self.kvdefrag_switch = DefragHPUSwitch(handle, num_blocks)
        self.kvdefrag_num_blocks = num_blocks
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        self.kvdefrag_kv_ptr = _first_kv_pointer(getattr(runner, "kv_caches", ()))
        self.kvdefrag_install()

    def kvdefrag_install(self) -> None:
        """Puts the switch on ``model_runner.defragmenter`` (nothing before attach)."""
        switch = self.kvdefrag_switch
        if switch is None:
            return
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        runner.defragmenter = switch

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        """Waits for the stamped step, then runs vLLM's pass holding ``kv_lock``."""
        handle = self.kvdefrag_handle
        switch = self.kvdefrag_switch
        parent: Any = super(DefragWorkerMixin, self)
        if handle is None or switch is None:
            return parent.execute_model(scheduler_output, *args, **kwargs)
        if read_step_stamp(scheduler_output) is None:
            raise RuntimeError(
                "kvdefrag: this output carries no step stamp: the scheduler is not "
                "kvdefrag's. Serve with --scheduler-cls "
                "kvdefrag.vllm.gaudi.DefragHPUAsyncScheduler (or "
                "kvdefrag.vllm.scheduler.DefragScheduler with --no-async-scheduling)"
            )
        wait_for_planned_step(
            handle,
            self.rank,  # type: ignore[attr-defined]
            scheduler_output,
            self.kvdefrag_step_wait_s,
        )
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        with handle.kv_lock:
            runner.defragmenter = switch  # whatever replaced it since
            switch.begin_pass(scheduler_output)
            try:
                return parent.execute_model(scheduler_output, *args, **kwargs)
            finally:
                switch.end_pass()

    def sleep(self, *args: Any, **kwargs: Any) -> None:
        """vllm-gaudi's ``sleep``; once it discarded the KV caches, the service lets go
        of them too (``release_kv_caches``), or their memory would stay taken."""
        parent: Any = super()
        parent.sleep(*args, **kwargs)
        handle = self.kvdefrag_handle
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        if handle is None or _first_kv_pointer(getattr(runner, "kv_caches", ())):
            return
        if not self.kvdefrag_kv_released:
            handle.release_kv_caches()
            self.kvdefrag_kv_released = True

    def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """vllm-gaudi's ``wake_up``, then the service follows the KV caches and warms up,
        and the switch goes back.

        When ``wake_up`` re-allocated the caches (they were discarded by ``sleep``), the
        service binds the new tensors (``rebind_kv_caches``: the mapping and the epoch
        stay, since vLLM preempted every request and emptied its prefix cache before the
        sleep; the new executor is warmed as at start); otherwise it runs its warm-up
        again (``warmup``). A wake-up that left the caches asleep (tags without
        ``kv_cache``) binds nothing; a later one does.

        Raises:
            InvalidArgument: The re-allocated caches are not laid out as the ones the
                service bound at start (the message names the difference); the service
                is left as it was.
            ValueError: As ``bind_vllm_kv_caches``, for the re-allocated caches.
        """
        parent: Any = super()
        parent.wake_up(*args, **kwargs)
        handle = self.kvdefrag_handle
        try:
            if handle is not None:
                runner: Any = getattr(self, "model_runner")  # noqa: B009
                pointer = _first_kv_pointer(getattr(runner, "kv_caches", ()))
                if pointer and (self.kvdefrag_kv_released or pointer != self.kvdefrag_kv_ptr):
                    handle.rebind_kv_caches(self.kvdefrag_kv_caches(self.kvdefrag_num_blocks))
                    self.kvdefrag_kv_ptr = pointer
                    self.kvdefrag_kv_released = False
                else:
                    handle.warmup()
        finally:
            # NOTE: even when the rebind is refused: the OnlineDefragmenter vllm-gaudi
            # re-created must never plan moves of its own next to the service.
            self.kvdefrag_install()


def _first_kv_pointer(kv_caches: Any) -> int:
    """The address of the first KV tensor (0 when there is none)."""
    for layer in kv_caches:
        tensor = layer[0] if isinstance(layer, (tuple, list)) else layer
        if tensor is not None:
            return int(tensor.data_ptr())
    return 0


# ---------------------------------------------------------------------------------------
# The scheduler class on Gaudi.


class GaudiSchedulerMismatch(RuntimeError):
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


@functools.cache
def _hpu_class(name: str) -> type:
    """Builds ``DefragHPUAsyncScheduler`` or ``DefragHPUWorker`` on first use."""
    if name == "DefragHPUAsyncScheduler":
        from kvdefrag.vllm.scheduler import DefragAsyncScheduler

        base = hpu_async_scheduler_base()
        if base is None:
            raise ImportError(
                f"kvdefrag: {name} needs vllm-gaudi ({HPU_ASYNC_SCHEDULER}), which is not "
                "installed; off Gaudi use kvdefrag.vllm.scheduler.DefragAsyncScheduler"
            )
        bases: tuple[type, ...] = (DefragAsyncScheduler, base)
        doc = DefragAsyncScheduler.__doc__
    else:
        module_name, _, class_name = HPU_WORKER.rpartition(".")
        worker = getattr(importlib.import_module(module_name), class_name)
        bases = (DefragHPUWorkerMixin, worker)
        doc = DefragHPUWorkerMixin.__doc__
    return type(name, bases, {"__module__": __name__, "__qualname__": name, "__doc__": doc})


def __getattr__(name: str) -> type:
    """``DefragHPUAsyncScheduler`` and ``DefragHPUWorker`` (import vLLM and vllm-gaudi)."""
    if name in ("DefragHPUAsyncScheduler", "DefragHPUWorker"):
        return _hpu_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
