"""kvdefrag on Intel Gaudi (vllm-gaudi's HPU runner): the runner's defragmenter, replaced.

vllm-gaudi's HPU model runner does not take physical ids from its output or keep physical
rows: its rows stay in the scheduler's (logical) ids and every block id is resolved when
the inputs are built, through one object at ``model_runner.defragmenter`` (vllm-gaudi's
own ``OnlineDefragmenter``). What this module relies on, as read in vllm-project/vllm-gaudi
at 091bbadd (file:line):

* ``vllm_gaudi/v1/worker/hpu_model_runner.py``: ``execute_model`` (L4151-4224) calls
  ``run_defragmenter`` (L4135: ``defragmenter.update_state(new | cached,
  finished_req_ids)`` then ``defragmenter.defragment()``, skipped in warm-up mode), then
  ``_update_states`` (which APPENDS ``new_block_ids`` to the persistent row of a request
  still in the batch, even one in ``resumed_req_ids``), keeps the output and returns
  None. The engine core then calls ``sample_tokens`` (``hpu_worker.py`` L565, runner
  L4303), and only there are the inputs built: ``_resolve_block`` /
  ``_resolve_all_blocks`` (L1570-1580) and the prefill and decode input builders map
  every block id through ``defragmenter.resolve`` / ``resolve_all``; pad rows name
  ``_PAD_BLOCK_ID`` (``num_blocks``, L6946), which resolves to itself. With contiguous
  PA the decode block list is laid out densely by physical id up to a bucket of at least
  ``max(block_list) + 1``. The forward pass, sampling and the speculative drafter
  (``vllm_gaudi/v1/spec_decode/hpu_eagle.py`` L198/L209, called from the runner about
  L4736) run there too.
* ``HPUWorker.execute_dummy_batch`` (``hpu_worker.py`` L608; an idle data-parallel rank)
  runs the runner's ``_dummy_run(1)`` (L6366): ``execute_model(warmup_mode=True)``,
  ``sample_tokens(None)`` and a clean-up ``execute_model`` (L5703-5730), which resolve
  block 0 outside any scheduled step. Warm-up (``warmup_model``, L6133-6320) runs the
  same dummy steps and re-creates ``OnlineDefragmenter`` at its start and its end;
  ``HPUWorker.initialize_from_config`` warms up (L551), and vLLM's engine core calls
  ``compile_or_warm_up_model`` (L552) once more, which warms up again when no graph was
  captured (eager mode, ``VLLM_SKIP_WARMUP``).
* The dummy decode of ``_dummy_run`` names block 0 for a row of one block and writes its
  token one block further on, so its slot comes from the row's second entry; the
  persistent batch (``hpu_input_batch.py``, over vLLM's ``MultiGroupBlockTable``) puts it
  on a freed row without clearing it, so that entry is whatever the row's last request
  had there. vLLM's data-parallel engine loop runs a dummy batch for every step that
  schedules nothing, and the block-free fence kvdefrag's async scheduler turns on makes
  such steps while requests run (their rows freed, their blocks live): the worker
  clears the block table before each dummy batch (``kvdefrag_clear_rows``), so that entry
  names block 0. Block 0 (vLLM's null block) never moves and nothing is placed on it,
  which vllm-gaudi's data-parallel prefill padding needs too: it writes its dummy prompts
  into physical block 0 without resolving it.
* ``HPUWorker.sleep`` (L642-687), at every level, sets ``model_runner.defragmenter = None``
  and discards the KV caches (``model_runner.kv_caches = []``); ``wake_up`` with the
  ``kv_cache`` tag (the default; L689-735) re-allocates them (``initialize_kv_cache``:
  new, zero-filled tensors) and re-creates an ``OnlineDefragmenter``; it warms nothing.
* vLLM 0.33's engine side (``vllm/v1/engine/core.py``): ``EngineCore.sleep`` at level 1
  and up pauses the scheduler with ``clear_cache``, whose ``_reset_caches`` calls
  ``Scheduler.reset_prefix_cache(reset_running_requests=True)``: every running request
  is preempted, the prefix cache is emptied, and only then do the workers sleep.
* ``initialize_kv_cache``: each layer's ``(key_cache, value_cache, key_scales,
  value_scales)`` over ``num_blocks + 1`` blocks, the last the pad block; the worker
  binds the first ``KVCacheConfig.num_blocks`` blocks, scales included
  (``kvdefrag.vllm._worker.kv_binding``).
* ``vllm_gaudi/utils.py`` rebinds vLLM's ``AsyncScheduler`` to vllm-gaudi's
  ``HPUAsyncScheduler`` (``kvdefrag.vllm._scheduler.gaudi``).

So on Gaudi kvdefrag does not translate the output or remap rows (a physical id
appended to a logical row would be wrong). ``DefragHPUSwitch`` takes the place of the
runner's defragmenter: ``update_state``/``defragment`` plan nothing and
``resolve``/``resolve_all`` answer from the rank's kvdefrag service. The pass is the
worker's (``kvdefrag.vllm._worker.passes.RunnerPass``, as on every runner): it begins in
``execute_model`` once the step stamped on the output is applied, holding ``kv_lock``,
and ends when that step's ``sample_tokens`` has run; dummy batches and warm-ups run
holding ``kv_lock`` with the switch answering from the mapping as it is. The switch
answers only inside a pass.

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

Importing this module imports neither vLLM nor vllm-gaudi; ``DefragHPUWorker`` is built
on first lookup (``kvdefrag.vllm.gaudi``). The scheduler side's Gaudi class is in
``kvdefrag.vllm._scheduler.gaudi``, which never imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvdefrag.server.config import EngineConfig
from kvdefrag.vllm._worker.gaudi_buckets import runner_decode_buckets
from kvdefrag.vllm._worker.passes import PassTarget
from kvdefrag.vllm.contract import read_step_stamp
from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag
from kvdefrag.vllm.worker import DefragWorkerMixin

__all__ = ["HPU_WORKER", "DefragHPUSwitch", "DefragHPUWorkerMixin", "hpu_worker_class"]

logger = logging.getLogger(__name__)

HPU_WORKER = "vllm_gaudi.v1.worker.hpu_worker.HPUWorker"
"""vllm-gaudi's worker class."""


_GAUDI_DRAFTERS = frozenset({"ngram", "suffix", "medusa"})
"""Speculative methods whose vllm-gaudi proposer reads no KV cache
(``hpu_model_runner.py`` L1448-1456 at 091bbadd picks ``NgramProposer`` or Medusa's); the
Eagle-family methods (``SpeculativeConfig.use_eagle()``) run ``HpuEagleProposer``, which
resolves through the switch inside the pass."""


class SwitchService(Protocol):
    """What the switch reads of its rank's service (``ServerHandle``)."""

    def resolve(self, logical_ids: Any = None) -> npt.NDArray[np.int64]: ...

    def warmup(self) -> int: ...


class DefragHPUSwitch:
    """Stands where vllm-gaudi's HPU runner keeps its ``OnlineDefragmenter``.

    The runner calls ``update_state`` and ``defragment`` in ``execute_model``, and
    ``resolve`` / ``resolve_all`` while it builds its inputs in ``sample_tokens`` (the
    Eagle draft step too, and the dummy steps of a data-parallel rank). Here the first two
    plan nothing (the scheduler side plans); the resolvers answer with the rank's kvdefrag
    mapping.

    Invariants: every answer is given between ``begin_pass`` and ``end_pass``, which the
    worker's pass calls holding ``kv_lock`` (``kvdefrag.vllm._worker.passes``), so the mapping
    cannot change meanwhile and answers are memoised for the pass; a resolve outside a
    pass is refused (it could race a move). Ids outside ``[0, num_blocks)`` (the runner's
    ``_PAD_BLOCK_ID`` and -1 pads) are returned unchanged, as vllm-gaudi's ``resolve``
    returns ids beyond its table.

    Attributes:
        enabled: Read by the runner (``run_defragmenter``); always True.
        num_blocks: Blocks in the pool.
        num_passes: Passes begun (scheduled steps and idle calls).
        num_update_states: ``update_state`` calls seen (each planned nothing).
        num_resolved: Block ids resolved (memoised answers included).
        output: The ``SchedulerOutput`` of the pass running; None between passes and in
            a pass outside any scheduled step.
    """

    enabled = True

    def __init__(self, service: SwitchService, num_blocks: int) -> None:
        self._service = service
        self.num_blocks = num_blocks
        self.num_passes = 0
        self.num_update_states = 0
        self.num_resolved = 0
        self.output: Any = None
        self._in_pass = False
        self._memo: dict[int, int] = {}

    @property
    def in_pass(self) -> bool:
        """Whether a pass is running (the resolvers answer)."""
        return self._in_pass

    def begin_pass(self, output: Any) -> None:
        """Marks a pass running ``output`` (None: a dummy batch or a warm-up); call it
        holding ``kv_lock``, after the output's step is applied."""
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
            PassRefused: Called outside a pass.
        """
        self._check_in_pass("update_state")
        self.num_update_states += 1

    def defragment(self) -> None:
        """Nothing to do: the step stamped on the output already moved the blocks."""

    def warmup(self) -> None:
        """Runs the rank's service warm-up (``ServerHandle.warmup``: on HPU every swap
        pad bucket once, with pad-only batches that move nothing), for a runner that asks
        its defragmenter to warm up. Inside a pass (``kv_lock`` held) it does nothing:
        the service warmed up when it bound the caches."""
        if not self._in_pass:
            self._service.warmup()

    def resolve(self, block_id: int) -> int:
        """The physical id of logical ``block_id`` (ids outside the pool unchanged).

        Raises:
            PassRefused: Called outside a pass.
        """
        block_id = int(block_id)
        self.num_resolved += 1
        if not 0 <= block_id < self.num_blocks:
            return block_id
        found = self._memo.get(block_id)
        if found is not None:
            return found
        self._check_in_pass("resolve")
        physical = int(self._service.resolve([block_id])[0])
        self._memo[block_id] = physical
        return physical

    def resolve_all(self, block_table_list: Sequence[Sequence[int]]) -> list[list[int]]:
        """Every id of every list resolved, in one lookup for the ids not seen yet.

        Raises:
            PassRefused: Called outside a pass.
        """
        self._check_in_pass("resolve_all")
        memo = self._memo
        wanted = {
            block_id
            for block_id in map(int, itertools.chain.from_iterable(block_table_list))
            if 0 <= block_id < self.num_blocks and block_id not in memo
        }
        if wanted:
            logical = np.fromiter(sorted(wanted), np.int64, len(wanted))
            physical = self._service.resolve(logical).tolist()
            memo.update(zip(logical.tolist(), physical, strict=True))
        result = []
        for row in block_table_list:
            self.num_resolved += len(row)
            result.append([memo.get(int(block_id), int(block_id)) for block_id in row])
        return result

    def _check_in_pass(self, what: str) -> None:
        if not self._in_pass:
            raise PassRefused(
                f"kvdefrag: the HPU runner called defragmenter.{what} outside a pass of "
                "the worker (execute_model through sample_tokens, a dummy batch or a "
                "warm-up): block ids read then may race a move. Run the worker as "
                "kvdefrag.vllm.gaudi.DefragHPUWorker (or put DefragHPUWorkerMixin in "
                "front of your HPUWorker subclass)"
            )


class _SwitchTarget:
    """Readies vllm-gaudi's runner for a pass: the switch in its place, marking the pass
    (``PassTarget``). The switch goes back in place at the end of every pass too, since
    a warm-up re-creates the runner's ``OnlineDefragmenter``."""

    def __init__(self, runner: Any, switch: DefragHPUSwitch) -> None:
        self._runner = runner
        self._switch = switch

    def begin(self, output: Any) -> None:
        # NOTE: inside an idle pass (a warm-up stepping the runner) outputs carry no stamp.
        is_scheduled = output is not None and not self._switch.in_pass
        if is_scheduled and read_step_stamp(output) is None:
            raise UnsupportedByKvdefrag(
                "kvdefrag: this output carries no step stamp: the scheduler is not "
                "kvdefrag's. Serve with --scheduler-cls "
                "kvdefrag.vllm.gaudi.DefragHPUAsyncScheduler (or "
                "kvdefrag.vllm.scheduler.DefragScheduler with --no-async-scheduling)"
            )
        self._runner.defragmenter = self._switch  # whatever replaced it since
        self._switch.begin_pass(output)

    def end(self) -> None:
        self._switch.end_pass()
        self._runner.defragmenter = self._switch


class DefragHPUWorkerMixin(DefragWorkerMixin):
    """``DefragWorkerMixin`` for vllm-gaudi's ``HPUWorker``: the runner resolves, not us.

    It starts and publishes the rank's service exactly as ``DefragWorkerMixin`` does
    (``initialize_from_config``) and runs the same passes (``execute_model`` through
    ``sample_tokens``, dummy batches, warm-ups, each holding ``kv_lock``); what differs
    is the pass's target: a ``DefragHPUSwitch`` as ``model_runner.defragmenter`` in place
    of vllm-gaudi's ``OnlineDefragmenter``, instead of translated outputs and remapped
    rows (the HPU runner's rows stay logical; it resolves at input build).

    Sleep and wake-up follow vllm-gaudi's: ``sleep`` discards the KV caches, and the
    service lets go of them too (``release_kv_caches``) so their memory is freed;
    ``wake_up`` re-allocates them, and the service binds the new tensors
    (``rebind_kv_caches``, its new executor warmed as at start) or, when they were not
    re-allocated, runs its warm-up again (``warmup``); then the switch goes back in
    place of the ``OnlineDefragmenter`` that vllm-gaudi re-created.

    Invariants: while the service runs, ``model_runner.defragmenter`` is
    ``kvdefrag_switch`` during every pass; outside a sleep the service moves blocks in
    the runner's KV caches (``kvdefrag_kv_ptr`` is the address of their first tensor).
    """

    kvdefrag_switch: DefragHPUSwitch | None = None
    kvdefrag_kv_ptr: int = 0
    kvdefrag_num_blocks: int = 0
    kvdefrag_kv_released: bool = False
    kvdefrag_warned_no_rows: bool = False

    def kvdefrag_pass_target(self, handle: Any, num_blocks: int) -> PassTarget:
        """Installs the switch; the pass marks it (no translator, no row remap)."""
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        switch = DefragHPUSwitch(handle, num_blocks)
        self.kvdefrag_switch = switch
        self.kvdefrag_num_blocks = num_blocks
        self.kvdefrag_kv_ptr = _first_kv_pointer(getattr(runner, "kv_caches", ()))
        self.kvdefrag_install()
        return _SwitchTarget(runner, switch)

    def kvdefrag_engine_config(self, config: EngineConfig, num_blocks: int) -> EngineConfig:
        """The engine plans for the decode buckets the runner warmed up
        (``runner_decode_buckets``: read after ``HPUWorker.initialize_from_config`` has
        warmed up), rather than a list recomputed from the configuration; counts past the
        pool are left out (the pool is the top bucket). Without runner buckets (bucketing
        off, no contiguous PA), ``KVDEFRAG_DECODE_BUCKETS`` as set."""
        buckets = runner_decode_buckets(getattr(self, "model_runner", None))
        if buckets is None:
            return config
        usable = tuple(bucket for bucket in buckets if bucket < num_blocks)
        if config.decode_buckets and config.decode_buckets != usable:
            logger.info(
                "kvdefrag: the runner's decode buckets replace KVDEFRAG_DECODE_BUCKETS (%s)",
                ",".join(map(str, config.decode_buckets)),
            )
        return dataclasses.replace(config, decode_buckets=usable)

    def kvdefrag_check_config(self) -> None:
        """Refuses a speculative method whose vllm-gaudi drafter is not the Eagle one
        (which resolves through the switch) and reads KV.

        Raises:
            UnsupportedByKvdefrag: Naming the method.
        """
        speculative = getattr(getattr(self, "vllm_config", None), "speculative_config", None)
        if speculative is None:
            return
        method = getattr(speculative, "method", None)
        if method in _GAUDI_DRAFTERS or speculative.use_eagle():
            return
        raise UnsupportedByKvdefrag(
            f"kvdefrag: speculative decoding with method {method!r} on Gaudi runs a "
            "drafter that reads KV cache blocks without resolving them; use an Eagle, "
            "n-gram or Medusa method, or serve without kvdefrag"
        )

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        """An idle data-parallel rank's dummy batch (``DefragWorkerMixin``'s: holding
        ``kv_lock``), run on a cleared block table (``kvdefrag_clear_rows``).

        vllm-gaudi's dummy decode names block 0 for a row of one block but writes its
        token one block further on, so its slot comes from the row's second entry,
        which the persistent batch leaves as the row's last request had it. When that
        request is still running (kvdefrag's block-free fence makes vLLM run steps that
        schedule nothing while requests run, and an idle rank runs a dummy batch for
        each), its block would be overwritten; cleared, the entry names block 0, the
        null block, which nobody reads."""
        if self.kvdefrag_switch is not None:
            self.kvdefrag_clear_rows()
        parent: Any = super()
        return parent.execute_dummy_batch(*args, **kwargs)

    def kvdefrag_clear_rows(self) -> None:
        """Zeroes the runner's persistent block table (vLLM's
        ``MultiGroupBlockTable.clear``), so a dummy batch reads no stale entry.

        Safe between steps: the dummy batch schedules only its own request, so
        vllm-gaudi's ``_update_states`` takes every other request off its row, and each
        is written back whole (``add_row``) when it is next scheduled; no row is read in
        between. A runner without that table is left as it is (logged once)."""
        runner: Any = getattr(self, "model_runner", None)
        block_table = getattr(getattr(runner, "input_batch", None), "block_table", None)
        clear = getattr(block_table, "clear", None)
        if clear is not None:
            clear()
        elif not self.kvdefrag_warned_no_rows:
            self.kvdefrag_warned_no_rows = True
            logger.warning(
                "kvdefrag: the HPU runner has no input_batch.block_table.clear(); its "
                "data-parallel dummy batches run on the rows as they are"
            )

    def kvdefrag_install(self) -> None:
        """Puts the switch on ``model_runner.defragmenter`` (nothing before attach)."""
        switch = self.kvdefrag_switch
        if switch is None:
            return
        runner: Any = getattr(self, "model_runner")  # noqa: B009
        runner.defragmenter = switch

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


@functools.cache
def hpu_worker_class() -> type:
    """Builds ``DefragHPUWorker`` (``DefragHPUWorkerMixin`` before vllm-gaudi's
    ``HPUWorker``) on first use: imports vllm-gaudi."""
    module_name, _, class_name = HPU_WORKER.rpartition(".")
    worker = getattr(importlib.import_module(module_name), class_name)
    return type(
        "DefragHPUWorker",
        (DefragHPUWorkerMixin, worker),
        {
            "__module__": "kvdefrag.vllm.gaudi",
            "__qualname__": "DefragHPUWorker",
            "__doc__": DefragHPUWorkerMixin.__doc__,
        },
    )
