"""The servicer's step ledger: steps applied in the epoch, by seq, with their path."""

from __future__ import annotations

from kvdefrag.common import StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server._step_ledger import APPLIED_BY_RPC, APPLIED_IN_PROCESS, StepLedger

from support.kv import SignedKv


def _results(num_steps: int) -> list[object]:
    kv = SignedKv.create(16)
    engine = Engine(kv.kv_caches, block_size=kv.block_size, config=EngineConfig(threshold=0))
    return [
        engine.apply_events(StepEvents(new_blocks={f"r{i}": [i + 1]})) for i in range(num_steps)
    ]


def test_each_step_applied_in_process_awaits_its_own_call() -> None:
    ledger = StepLedger(size=4)
    first, second, third = _results(3)
    applied = [
        ledger.record(1, 7, StepEvents(), first, APPLIED_IN_PROCESS),  # type: ignore[arg-type]
        ledger.record(2, 7, StepEvents(), second, APPLIED_IN_PROCESS),  # type: ignore[arg-type]
        ledger.record(3, 7, StepEvents(), third, APPLIED_BY_RPC),  # type: ignore[arg-type]
    ]
    assert [ledger.answer_call(step) for step in applied] == [True, True, False]
    assert [ledger.answer_call(step) for step in applied] == [False, False, False]  # resends


def test_the_reply_is_built_on_first_use_and_the_oldest_steps_go_first() -> None:
    ledger = StepLedger(size=2)
    results = _results(3)
    for seq, result in enumerate(results, start=1):
        ledger.record(seq, 7, StepEvents(), result, APPLIED_IN_PROCESS)  # type: ignore[arg-type]
    assert ledger.get(1) is None and len(ledger) == 2
    kept = ledger.get(3)
    assert kept is not None and kept._response is None  # nothing built in process
    reply = kept.response()
    assert (reply.step.seq, reply.step.epoch) == (3, 7)
    assert kept.response() is reply
    ledger.clear()
    assert ledger.get(3) is None
