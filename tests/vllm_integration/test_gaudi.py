"""The Gaudi switch without vLLM or vllm-gaudi: ``DefragHPUSwitch`` in the runner's place,
``DefragHPUWorkerMixin``'s passes (``execute_model`` through ``sample_tokens``, dummy
batches, warm-ups), its sleep and wake-up (the service lets go of the discarded caches,
binds the re-allocated ones and warms up), and the startup checks."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvdefrag.client import DefragClient
from kvdefrag.common import EpochMismatch, InvalidArgument, StepEvents
from kvdefrag.server import EngineConfig, ServerHandle
from kvdefrag.vllm import gaudi
from kvdefrag.vllm._worker import passes as _pass
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.contract import StepStamp, attach_step_stamp
from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag
from kvdefrag.vllm.gaudi import (
    DefragHPUSwitch,
    DefragHPUWorkerMixin,
    GaudiSchedulerMismatch,
    check_gaudi_scheduler,
)

from support.gaudi_kv import gaudi_tensors, make_gaudi_kv_caches
from support.kv import SignedKv, kv_tensors
from support.public_api import assert_public_names
from support.server import Serve

NUM_BLOCKS = 8
BLOCK_SIZE = 2


@pytest.fixture(autouse=True)
def _run_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker here reads its settings from the environment, as in vLLM."""
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))


class FakeService:
    """A rank's service as the switch and the mixin see it (``ServerHandle``)."""

    def __init__(self) -> None:
        self.mapping = np.arange(NUM_BLOCKS, dtype=np.int64)
        self.kv_lock = threading.Lock()
        self.num_lookups = 0
        self.waited: list[tuple[int, int]] = []
        self.kv_calls: list[str] = []  # warmup, release, rebind, in order
        self.rebound: list[Any] = []
        self.applied = (0, 1)  # (epoch, next_seq): what the last wait found applied

    def warmup(self) -> int:
        assert not self.kv_lock.locked(), "warmed up holding kv_lock"
        self.kv_calls.append("warmup")
        return 0

    def release_kv_caches(self) -> None:
        self.kv_calls.append("release")

    def rebind_kv_caches(self, kv_caches: Any) -> None:
        self.kv_calls.append("rebind")
        self.rebound.append(kv_caches)

    def resolve(self, logical_ids: Any = None) -> npt.NDArray[np.int64]:
        self.num_lookups += 1
        return self.mapping[np.asarray(logical_ids, dtype=np.int64)]

    def moves_since(self, version: int | None) -> tuple[int, list[Any]]:
        return 0, []

    def wait_applied(self, epoch: int, seq: int, timeout_s: float) -> None:
        assert not self.kv_lock.locked(), "waited holding kv_lock"
        self.waited.append((epoch, seq))
        self.applied = (epoch, seq + 1)


def test_the_switch_answers_with_the_service_mapping_and_plans_nothing() -> None:
    service = FakeService()
    service.mapping[[2, 5]] = [5, 2]
    switch = DefragHPUSwitch(service, NUM_BLOCKS)
    assert switch.enabled
    switch.begin_pass(object())
    switch.update_state({"a": [2, 3]}, ["b"])  # the runner's hook: nothing planned
    switch.defragment()
    assert switch.resolve(2) == 5
    assert switch.resolve(2) == 5
    assert service.num_lookups == 1  # memoised within the pass
    assert switch.resolve_all([[5, 2, 3], [1]]) == [[2, 5, 3], [1]]
    assert switch.resolve(1000) == 1000  # pad ids beyond the pool pass through
    assert switch.resolve_all([[-1, 2]]) == [[-1, 5]]
    switch.end_pass()
    assert switch.num_update_states == 1


def test_resolving_outside_a_pass_is_refused() -> None:
    switch = DefragHPUSwitch(FakeService(), NUM_BLOCKS)
    with pytest.raises(PassRefused, match="outside a pass of the worker"):
        switch.resolve(3)
    switch.begin_pass(object())
    switch.end_pass()
    with pytest.raises(PassRefused, match="outside a pass of the worker"):
        switch.resolve(3)
    with pytest.raises(PassRefused, match="DefragHPUWorker"):
        switch.resolve_all([[3]])
    with pytest.raises(PassRefused, match="update_state"):
        switch.update_state({}, [])


def test_memo_does_not_outlive_the_pass() -> None:
    service = FakeService()
    switch = DefragHPUSwitch(service, NUM_BLOCKS)
    switch.begin_pass(object())
    assert switch.resolve(4) == 4
    switch.end_pass()
    service.mapping[[4, 6]] = [6, 4]  # a step moved block 4 between passes
    switch.begin_pass(object())
    assert switch.resolve(4) == 6
    switch.end_pass()


def online_defragmenter() -> Any:
    """vllm-gaudi's own ``OnlineDefragmenter``, as far as its runner touches it: off,
    it resolves every id to itself."""
    return SimpleNamespace(
        enabled=False,
        update_state=lambda new, finished: None,
        defragment=lambda: None,
        resolve=lambda block_id: block_id,
    )


def gaudi_kv_caches(num_blocks: int, **layout: Any) -> list[Any]:
    """The runner's ``kv_caches`` as vllm-gaudi allocates them with dynamic fp8 KV:
    ``(key_cache, value_cache, key_scales, value_scales)`` per layer over
    ``num_blocks + 1`` blocks, the last its pad block."""
    return make_gaudi_kv_caches(num_blocks, block_size=BLOCK_SIZE, scales=True, **layout)


class FakeHPURunner:
    """What the mixin touches of vllm-gaudi's HPU runner, split as it is
    (``hpu_model_runner.py`` at 091bbadd): ``execute_model`` (L4151) runs the
    defragmenter hook and keeps the output, returning None; ``sample_tokens`` (L4303)
    resolves and runs the forward; ``_dummy_run`` (L6366, L5703-5730) runs both in warm-up
    mode on block 0; ``warmup_model`` (L6133) re-creates the ``OnlineDefragmenter``.
    ``seen`` records, per resolve, the answer and whether ``kv_lock`` was held."""

    def __init__(self, kv_caches: list[Any], service: Any = None) -> None:
        self.kv_caches = kv_caches
        self.service = service
        self.defragmenter: Any = online_defragmenter()
        self.scheduler_output: Any = None
        self.seen: list[tuple[Any, bool]] = []
        self.num_warmups = 0

    def execute_model(self, scheduler_output: Any, warmup_mode: bool = False) -> Any:
        if not warmup_mode and self.defragmenter.enabled:
            self.defragmenter.update_state({}, [])
            self.defragmenter.defragment()
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            return "empty"  # EMPTY_MODEL_RUNNER_OUTPUT: nothing to sample
        self.scheduler_output = scheduler_output
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        if self.scheduler_output is None:
            return None  # nothing pending (L4305)
        self.scheduler_output = None
        self.seen.append((self.defragmenter.resolve(1), self.service.kv_lock.locked()))
        return "sampled"

    def _dummy_run(self, max_num_batched_tokens: int) -> None:
        self.execute_model(SimpleNamespace(), warmup_mode=True)
        self.sample_tokens(None)  # resolves the dummy request's block (here 1)
        self.execute_model(SimpleNamespace(total_num_scheduled_tokens=0), warmup_mode=True)

    def warmup_model(self) -> None:
        self.defragmenter = online_defragmenter()
        self._dummy_run(1)
        self.defragmenter = online_defragmenter()  # "re-create and re-initialize it"
        self.num_warmups += 1


class FakeHPUWorker:
    """vllm-gaudi's HPUWorker, as far as the mixin goes (``hpu_worker.py`` at 091bbadd):
    ``execute_model`` / ``sample_tokens`` / ``execute_dummy_batch`` call the runner
    (L565-608), ``compile_or_warm_up_model`` warms up when nothing was graphed (L552),
    ``sleep`` sets ``defragmenter = None`` and discards the KV caches (L642-687) and
    ``wake_up`` re-allocates them (laid out as ``wake_up_layout`` says) with a new
    ``OnlineDefragmenter`` (L689-735)."""

    def __init__(self, runner: FakeHPURunner, service: Any, num_blocks: int = NUM_BLOCKS) -> None:
        self.model_runner = runner
        runner.service = service
        self.rank = 0
        self.cache_config = SimpleNamespace(block_size=BLOCK_SIZE)
        self.num_blocks = num_blocks
        self.wake_up_layout: dict[str, Any] = {}

    def execute_model(self, scheduler_output: Any) -> Any:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self.model_runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        self.model_runner._dummy_run(1)

    def compile_or_warm_up_model(self) -> None:
        self.model_runner.warmup_model()

    def sleep(self, level: int = 1) -> None:
        runner = self.model_runner
        if runner.kv_caches:
            runner.defragmenter = None
            runner.kv_caches = []

    def wake_up(self, tags: list[str] | None = None) -> None:
        runner = self.model_runner
        if "kv_cache" in (tags if tags is not None else ["weights", "kv_cache"]):
            if not runner.kv_caches:
                layout = {"num_layers": 2, **self.wake_up_layout}
                runner.kv_caches = gaudi_kv_caches(self.num_blocks, **layout)
            runner.defragmenter = online_defragmenter()  # re-created

    def shutdown(self) -> None:
        pass


class Worker(DefragHPUWorkerMixin, FakeHPUWorker):
    pass


@pytest.fixture
def worker() -> Iterator[tuple[Worker, FakeService]]:
    service = FakeService()
    service.mapping[[1, 7]] = [7, 1]
    built = Worker(FakeHPURunner(gaudi_kv_caches(NUM_BLOCKS)), service)
    built.kvdefrag_attach(service, NUM_BLOCKS)  # type: ignore[arg-type]
    yield built, service


def _stamped(seq: int) -> Any:
    output = SimpleNamespace()
    attach_step_stamp(output, StepStamp(((3, seq),)))
    return output


def test_the_mixin_installs_the_switch_and_runs_the_pass_after_its_step(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    assert isinstance(built.model_runner.defragmenter, DefragHPUSwitch)
    assert built.execute_model(_stamped(4)) is None  # the runner only kept the output
    assert service.waited == [(3, 4)]
    assert service.kv_lock.locked()  # the pass goes on until sample_tokens
    assert built.sample_tokens(None) == "sampled"
    assert not service.kv_lock.locked()
    assert built.model_runner.seen == [(7, True)]  # resolved via kvdefrag, under kv_lock
    switch = built.kvdefrag_switch
    assert switch is not None and switch.num_passes == 1 and switch.output is None


def test_the_lock_is_held_from_execute_model_until_sample_tokens_and_no_move_lands_between(
    serve: Serve,
) -> None:
    built, handle, kv = served_worker(serve, 16)
    with DefragClient(handle.address, timeout_s=10) as client:
        run_workload(client, kv, new_blocks={"a": [1, 2, 3], "b": [9, 10]})
        output = SimpleNamespace()
        attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert built.execute_model(output) is None
        before = handle.resolve(np.arange(16)).tolist()
        moving = threading.Thread(target=lambda: client.step(StepEvents(finished=["a"])))
        moving.start()  # b must move down, which needs kv_lock
        moving.join(timeout=0.5)
        assert moving.is_alive()  # waits for the pass
        assert handle.resolve(np.arange(16)).tolist() == before
        assert built.sample_tokens(None) == "sampled"
        moving.join(timeout=10)
        assert not moving.is_alive()
    assert built.model_runner.seen == [(before[1], True)]
    assert handle.resolve([9, 10]).tolist() != [before[9], before[10]]  # moved after it


def test_an_execute_model_that_returns_its_output_ends_the_pass(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    output = _stamped(5)
    output.total_num_scheduled_tokens = 0
    assert built.execute_model(output) == "empty"
    assert not service.kv_lock.locked()
    assert built.sample_tokens(None) is None  # the engine may still ask: nothing pending


def test_a_pass_whose_sample_tokens_never_came_is_closed_before_the_next(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    assert built.execute_model(_stamped(4)) is None
    built.model_runner.scheduler_output = None  # as if its sample_tokens was lost
    assert built.execute_model(_stamped(5)) is None
    assert built.kvdefrag_pass is not None and built.kvdefrag_pass.num_unclosed == 1
    assert service.waited == [(3, 4), (3, 5)]
    built.sample_tokens(None)
    assert not service.kv_lock.locked()


def test_a_dummy_batch_resolves_with_the_current_mapping_under_kv_lock(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    built.execute_dummy_batch()  # an idle data-parallel rank's step: no output, no stamp
    assert built.model_runner.seen == [(7, True)]
    assert not service.kv_lock.locked() and service.waited == []
    switch = built.kvdefrag_switch
    assert switch is not None and switch.num_update_states == 0  # warm-up mode: no hook


class _BlockTable:
    """vLLM's ``MultiGroupBlockTable`` under vllm-gaudi's ``input_batch``, as far as the
    mixin goes: ``clear()`` zeroes every row. Row 0 holds a request's blocks 3 and 9: a
    dummy decode that reuses the row reads its second entry."""

    def __init__(self) -> None:
        self.rows = np.array([[3, 9], [4, 0]])
        self.num_clears = 0

    def clear(self) -> None:
        self.rows.fill(0)
        self.num_clears += 1


def test_a_dummy_batch_runs_on_a_cleared_block_table(worker: tuple[Worker, FakeService]) -> None:
    """vllm-gaudi's dummy decode gathers its slot from its row's second entry, which the
    persistent batch leaves stale; the worker clears the rows first, so it names block 0.
    Scheduled steps leave the rows alone."""
    built, _ = worker
    runner = built.model_runner
    table = _BlockTable()
    runner.input_batch = SimpleNamespace(block_table=table)  # type: ignore[attr-defined]
    rows_seen: list[list[list[int]]] = []
    dummy_run = runner._dummy_run

    def dummy_run_seeing_rows(max_num_batched_tokens: int) -> None:
        rows_seen.append(table.rows.tolist())
        dummy_run(max_num_batched_tokens)

    runner._dummy_run = dummy_run_seeing_rows  # type: ignore[method-assign]
    built.execute_dummy_batch()
    assert rows_seen == [[[0, 0], [0, 0]]]
    table.rows[0] = [3, 9]
    assert built.execute_model(_stamped(4)) is None
    assert built.sample_tokens(None) == "sampled"
    assert table.num_clears == 1 and table.rows.tolist() == [[3, 9], [0, 0]]


def test_a_dummy_batch_on_a_runner_without_a_block_table_runs_and_says_so_once(
    worker: tuple[Worker, FakeService], caplog: pytest.LogCaptureFixture
) -> None:
    built, _ = worker
    built.execute_dummy_batch()
    built.execute_dummy_batch()
    assert built.model_runner.seen == [(7, True), (7, True)]
    assert caplog.text.count("no input_batch.block_table.clear()") == 1


def test_a_second_warm_up_runs_under_kv_lock_and_puts_the_switch_back(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    built.compile_or_warm_up_model()  # the engine core's call: vllm-gaudi warms up again
    assert built.model_runner.num_warmups == 1
    assert built.model_runner.seen == [(1, True)]  # its own fresh defragmenter: identity
    assert built.model_runner.defragmenter is built.kvdefrag_switch
    assert not service.kv_lock.locked()
    built.execute_model(_stamped(4))
    built.sample_tokens(None)
    assert built.model_runner.seen[-1] == (7, True)


def test_an_output_without_a_stamp_is_refused_by_name(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    with pytest.raises(UnsupportedByKvdefrag, match="DefragHPUAsyncScheduler"):
        built.execute_model(SimpleNamespace())
    assert not service.kv_lock.locked()


def test_the_engine_plans_for_the_decode_buckets_the_runner_warmed_up(
    worker: tuple[Worker, FakeService],
) -> None:
    built, _ = worker
    runner = built.model_runner
    runner.use_contiguous_pa = True  # type: ignore[attr-defined]
    runner.bucketing_manager = SimpleNamespace(  # type: ignore[attr-defined]
        decode_buckets=[(1, 1, 1), (2, 1, 4), (4, 1, 4), (1, 1, 6), (8, 1, 8), (8, 1, 24)]
    )
    config = built.kvdefrag_engine_config(EngineConfig(decode_buckets=(2, 3)), NUM_BLOCKS)
    assert config.decode_buckets == (1, 4, 6)  # the pool (8) and past it: the top bucket
    runner.use_contiguous_pa = False  # type: ignore[attr-defined]
    config = built.kvdefrag_engine_config(EngineConfig(decode_buckets=(2, 3)), NUM_BLOCKS)
    assert config.decode_buckets == (2, 3)  # no runner buckets to use: as configured


def _speculative(method: str, *, eagle: bool = False) -> Any:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method=method, use_eagle=lambda: eagle)
    )


@pytest.mark.parametrize(("method", "eagle"), [("eagle3", True), ("mtp", True), ("ngram", False)])
def test_on_gaudi_the_eagle_and_ngram_drafters_are_served(method: str, eagle: bool) -> None:
    built = Worker(FakeHPURunner(gaudi_kv_caches(NUM_BLOCKS)), FakeService())
    built.vllm_config = _speculative(method, eagle=eagle)  # type: ignore[attr-defined]
    built.kvdefrag_check_config()


def test_on_gaudi_a_drafter_that_reads_kv_unresolved_is_refused_by_name() -> None:
    built = Worker(FakeHPURunner(gaudi_kv_caches(NUM_BLOCKS)), FakeService())
    built.vllm_config = _speculative("draft_model")  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedByKvdefrag, match="'draft_model' on Gaudi"):
        built.kvdefrag_check_config()


def test_the_switch_warms_the_service_up() -> None:
    service = FakeService()
    DefragHPUSwitch(service, NUM_BLOCKS).warmup()
    assert service.kv_calls == ["warmup"]


def test_wake_up_that_kept_the_caches_warms_the_service_and_puts_the_switch_back(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    built.wake_up()  # nothing slept: vllm-gaudi re-creates its defragmenter all the same
    assert built.model_runner.defragmenter is built.kvdefrag_switch
    assert service.kv_calls == ["warmup"]  # no rebind: the caches are the bound ones


def test_sleep_releases_and_wake_up_rebinds_only_once_the_caches_are_back(
    worker: tuple[Worker, FakeService],
) -> None:
    built, service = worker
    built.sleep()  # vllm-gaudi drops its defragmenter, then the caches
    assert built.model_runner.kv_caches == []
    assert service.kv_calls == ["release"]
    built.sleep()  # already asleep: nothing more to let go
    assert service.kv_calls == ["release"]

    built.wake_up(tags=["weights"])  # the KV caches stay asleep
    assert service.kv_calls == ["release", "warmup"]  # nothing bound (0 batches there)
    assert built.model_runner.defragmenter is built.kvdefrag_switch

    built.wake_up(tags=["kv_cache"])
    assert service.kv_calls == ["release", "warmup", "rebind"]  # rebind warms the new one
    (rebound,) = service.rebound
    runner_tensors = {tensor.data_ptr() for tensor in gaudi_tensors(built.model_runner.kv_caches)}
    assert {tensor.data_ptr() for tensor in kv_tensors(rebound)} == runner_tensors  # scales too
    assert built.model_runner.defragmenter is built.kvdefrag_switch

    built.wake_up()  # awake already: the bound caches are warmed, not bound again
    assert service.kv_calls[-1] == "warmup"


def run_workload(client: DefragClient, kv: SignedKv, **fields: Any) -> None:
    client.step(StepEvents(**fields))
    new_ids = sorted({i for ids in fields.get("new_blocks", {}).values() for i in ids})
    kv.write(new_ids, client.resolve(new_ids))


def served_worker(serve: Serve, num_blocks: int) -> tuple[Worker, ServerHandle, SignedKv]:
    """A worker whose runner's caches a real service serves, bound as the worker binds
    them at start (``kvdefrag_kv_caches``), every block signed."""
    runner = FakeHPURunner(gaudi_kv_caches(num_blocks))
    built = Worker(runner, None, num_blocks)
    kv = SignedKv(built.kvdefrag_kv_caches(num_blocks), BLOCK_SIZE)
    handle = serve(kv=kv, threshold=0)
    runner.service = handle
    built.kvdefrag_attach(handle, num_blocks)
    return built, handle, kv


def test_after_sleep_and_wake_up_the_service_moves_blocks_in_the_new_caches(serve: Serve) -> None:
    built, handle, old = served_worker(serve, 64)
    live = [40, 41, 42]
    with DefragClient(handle.address, timeout_s=10) as client:
        run_workload(client, old, new_blocks={"a": list(range(1, 11)), "b": live})
        epoch = handle.epoch
        built.sleep()
        built.wake_up()
        switch = built.kvdefrag_switch
        assert built.model_runner.defragmenter is switch and switch is not None
        old_before = [tensor.clone() for tensor in kv_tensors(old.kv_caches)]

        new = SignedKv(built.kvdefrag_kv_caches(64), BLOCK_SIZE)  # the re-allocated caches
        new.write(live, handle.resolve(live).tolist())  # b recomputed after the wake-up
        reply = client.step(StepEvents(finished=["a"]))  # same session, same epoch: b moves down
        assert reply.num_moves == len(live) and handle.epoch == epoch
        assert new.lost_blocks(handle, live) == []
        for tensor, before in zip(kv_tensors(old.kv_caches), old_before, strict=True):
            assert torch.equal(tensor, before)  # the discarded caches were not written

        output = SimpleNamespace()
        attach_step_stamp(output, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert built.execute_model(output) is None
        assert built.sample_tokens(None) == "sampled"
    assert built.model_runner.seen == [(int(handle.resolve([1])[0]), True)]
    assert switch.num_passes == 1


def test_wake_up_with_caches_of_another_layout_is_refused_and_the_switch_stays(
    serve: Serve,
) -> None:
    built, _, _ = served_worker(serve, 64)
    built.sleep()
    built.wake_up_layout = {"num_heads": 4}
    with pytest.raises(
        InvalidArgument, match=r"kv_caches\[0\]\.key is .* \(128, 16\), the bound one .* \(128, 8\)"
    ):
        built.wake_up()
    assert built.model_runner.defragmenter is built.kvdefrag_switch
    assert built.kvdefrag_kv_released  # the service still holds none


@pytest.fixture
def fake_vllm_gaudi(monkeypatch: pytest.MonkeyPatch) -> type:
    """A stand-in ``vllm_gaudi`` package with its ``HPUAsyncScheduler``."""

    class HPUAsyncScheduler:
        pass

    names = ["vllm_gaudi", "vllm_gaudi.v1", "vllm_gaudi.v1.core", "vllm_gaudi.v1.core.sched"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = types.ModuleType("vllm_gaudi.v1.core.sched.hpu_async_scheduler")
    module.HPUAsyncScheduler = HPUAsyncScheduler  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return HPUAsyncScheduler


def test_without_vllm_gaudi_any_scheduler_passes() -> None:
    assert "vllm_gaudi" not in sys.modules
    check_gaudi_scheduler(object())


def test_on_gaudi_a_scheduler_off_hpu_async_scheduler_is_refused(fake_vllm_gaudi: type) -> None:
    with pytest.raises(GaudiSchedulerMismatch, match=r"DefragHPUAsyncScheduler\(Defrag"):
        check_gaudi_scheduler(object())

    class Good(fake_vllm_gaudi):  # type: ignore[misc, valid-type]
        pass

    check_gaudi_scheduler(Good())
    assert gaudi.hpu_async_scheduler_base() is fake_vllm_gaudi


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError):
        gaudi.DefragNothing  # noqa: B018


def test_gaudi_exports_are_pinned() -> None:
    assert_public_names(
        "kvdefrag.vllm.gaudi",
        {
            "HPU_ASYNC_SCHEDULER",
            "HPU_WORKER",
            "DefragHPUSwitch",
            "DefragHPUWorkerMixin",
            "GaudiSchedulerMismatch",
            "check_gaudi_scheduler",
            "hpu_async_scheduler_base",
        },
    )


def test_a_reset_between_a_passs_step_check_and_kv_lock_fails_the_pass_before_it_resolves(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch resolves in ``sample_tokens`` with the mapping in force: a Reset that
    takes ``kv_lock`` after the pass found its step applied would make it resolve logical
    ids as physical ones. Held deterministically in that window, the pass fails before
    the runner runs, and so does a later dummy batch."""
    built, handle, kv = served_worker(serve, 16)
    real_wait = _pass.wait_for_planned_step

    def wait_then_reset(*args: Any) -> Any:
        step = real_wait(*args)
        handle.reset(force=True)  # in the window: takes kv_lock, publishes the identity
        return step

    with DefragClient(handle.address, timeout_s=10) as client:
        run_workload(client, kv, new_blocks={"a": [1, 2, 3], "b": [9, 10]})
        first = SimpleNamespace()
        attach_step_stamp(first, StepStamp(((client.epoch, client.next_seq - 1),)))
        assert built.execute_model(first) is None and built.sample_tokens(None) == "sampled"
        run_workload(client, kv, finished=["a"])  # b moves down
        assert handle.resolve([1]).tolist() != [1]
        epoch, seq = client.epoch, client.next_seq - 1
        output = SimpleNamespace()
        attach_step_stamp(output, StepStamp(((epoch, seq),)))
        monkeypatch.setattr(_pass, "wait_for_planned_step", wait_then_reset)
        with pytest.raises(EpochMismatch, match=f"step seq {seq} of epoch {epoch} finds"):
            built.execute_model(output)
    assert built.sample_tokens(None) is None  # nothing pending: the runner never got it
    assert len(built.model_runner.seen) == 1  # the first pass's resolve only
    assert not handle.kv_lock.locked()
    with pytest.raises(EpochMismatch, match=f"not at epoch {epoch} its rows follow"):
        built.execute_dummy_batch()
    assert len(built.model_runner.seen) == 1
