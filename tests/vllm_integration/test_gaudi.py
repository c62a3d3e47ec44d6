"""The Gaudi switch without vLLM or vllm-gaudi: ``DefragHPUSwitch`` in the runner's place,
``DefragHPUWorkerMixin``'s pass, and the startup check on the scheduler class."""

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

from kvdefrag.vllm import gaudi
from kvdefrag.vllm.common import StepStamp, attach_step_stamp
from kvdefrag.vllm.gaudi import (
    DefragHPUSwitch,
    DefragHPUWorkerMixin,
    GaudiSchedulerMismatch,
    check_gaudi_scheduler,
)

from support.public_api import assert_public_names

NUM_BLOCKS = 8


class FakeService:
    """A rank's service as the switch and the mixin see it (``ServerHandle``)."""

    def __init__(self) -> None:
        self.mapping = np.arange(NUM_BLOCKS, dtype=np.int64)
        self.kv_lock = threading.Lock()
        self.num_lookups = 0
        self.waited: list[tuple[int, int]] = []

    def resolve(self, logical_ids: Any = None) -> npt.NDArray[np.int64]:
        self.num_lookups += 1
        return self.mapping[np.asarray(logical_ids, dtype=np.int64)]

    def moves_since(self, version: int | None) -> tuple[int, list[Any]]:
        return 0, []

    def wait_applied(self, epoch: int, seq: int, timeout_s: float) -> None:
        assert not self.kv_lock.locked(), "waited holding kv_lock"
        self.waited.append((epoch, seq))


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


def test_after_the_first_pass_resolving_outside_one_is_refused() -> None:
    switch = DefragHPUSwitch(FakeService(), NUM_BLOCKS)
    assert switch.resolve(3) == 3  # warm-up: before any pass
    switch.begin_pass(object())
    switch.end_pass()
    with pytest.raises(RuntimeError, match="outside a pass of DefragHPUWorkerMixin"):
        switch.resolve(3)
    with pytest.raises(RuntimeError, match="DefragHPUWorker"):
        switch.resolve_all([[3]])
    with pytest.raises(RuntimeError, match="update_state"):
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


class FakeHPURunner:
    """What the mixin touches of vllm-gaudi's HPU runner."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv_caches = [(kv, kv)]
        self.defragmenter: Any = SimpleNamespace(enabled=False)  # vllm-gaudi's own
        self.seen: list[tuple[Any, bool]] = []


class FakeHPUWorker:
    """vllm-gaudi's HPUWorker, as far as the mixin goes."""

    def __init__(self, runner: FakeHPURunner, service: FakeService) -> None:
        self.model_runner = runner
        self.rank = 0
        self._service = service

    def execute_model(self, scheduler_output: Any) -> str:
        runner = self.model_runner
        defragmenter = runner.defragmenter
        defragmenter.update_state({}, [])
        defragmenter.defragment()
        runner.seen.append((defragmenter.resolve(1), self._service.kv_lock.locked()))
        return "ran"

    def wake_up(self, tags: Any = None) -> None:
        self.model_runner.defragmenter = SimpleNamespace(enabled=True)  # re-created

    def shutdown(self) -> None:
        pass


class Worker(DefragHPUWorkerMixin, FakeHPUWorker):
    pass


@pytest.fixture
def worker() -> Iterator[tuple[Worker, FakeService]]:
    service = FakeService()
    service.mapping[[1, 7]] = [7, 1]
    built = Worker(FakeHPURunner(torch.zeros(NUM_BLOCKS * 2, 1)), service)
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
    assert built.kvdefrag_translator is None  # no output translation, no row remap
    assert built.execute_model(_stamped(4)) == "ran"
    assert service.waited == [(3, 4)]
    assert built.model_runner.seen == [(7, True)]  # resolved via kvdefrag, under kv_lock
    switch = built.kvdefrag_switch
    assert switch is not None and switch.num_passes == 1 and switch.output is None


def test_an_output_without_a_stamp_is_refused_by_name(
    worker: tuple[Worker, FakeService],
) -> None:
    built, _ = worker
    with pytest.raises(RuntimeError, match="DefragHPUAsyncScheduler"):
        built.execute_model(SimpleNamespace())


def test_wake_up_puts_the_switch_back(worker: tuple[Worker, FakeService]) -> None:
    built, _ = worker
    built.wake_up()
    assert built.model_runner.defragmenter is built.kvdefrag_switch


def test_wake_up_that_reallocated_the_kv_caches_is_refused(
    worker: tuple[Worker, FakeService],
) -> None:
    built, _ = worker
    kv = torch.zeros(NUM_BLOCKS * 2, 1)
    built.model_runner.kv_caches = [(kv, kv)]
    with pytest.raises(RuntimeError, match="re-allocated"):
        built.wake_up()


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
