"""Health has one owner (the engine's observer) and the worker's reads cannot deadlock.

Both run on real servers and real KV tensors with signed blocks.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvdefrag.common import EngineUnhealthy, StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server._executor_cpu import CpuSwapExecutor

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.server import Serve

BLOCK_SIZE = 4


def health_status(address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_a_move_failure_turns_health_off_until_the_handle_resets(serve: Serve) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    executor = ScriptedExecutor.around(CpuSwapExecutor(kv.kv_caches, kv.block_size))
    handle = serve(kv=kv, threshold=0, executor=executor)
    engine = handle._engine  # the scheduler in the worker's process: no servicer involved
    engine.step(StepEvents(new_blocks={"a": list(range(1, 9)), "b": list(range(9, 17))}))
    assert health_status(handle.address) == health_pb2.HealthCheckResponse.SERVING
    executor.is_failing = True
    with pytest.raises(EngineUnhealthy):
        engine.step(StepEvents(finished=["a"]))  # b must move down: the move fails
    assert health_status(handle.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    old_epoch = handle.epoch
    assert handle.reset() == handle.epoch != old_epoch
    assert health_status(handle.address) == health_pb2.HealthCheckResponse.SERVING


def test_the_cpu_worker_pattern_runs_beside_steps_without_deadlock() -> None:
    """The CPU worker pattern (docs/library.md): hold ``kv_lock`` for the pass, resolve inside it.

    The scheduler thread steps with a low threshold (so blocks keep moving) while the
    worker thread, holding ``kv_lock``, resolves the block tables, reads ``stats()`` and
    checks that every live block it knows of holds its own signature where it resolves.
    """
    kv = SignedKv.create(256, block_size=BLOCK_SIZE)
    engine = Engine(kv.kv_caches, BLOCK_SIZE, EngineConfig(threshold=2, max_moves_per_step=16))
    live: dict[str, list[int]] = {}  # what the worker may read: always a subset of live
    num_steps, num_checks = 400, [0]
    failures: list[str] = []
    scheduler_done = threading.Event()

    def scheduler() -> None:
        rng = random.Random(5)
        free = list(range(1, 256))
        rng.shuffle(free)
        held: dict[str, list[int]] = {}
        try:
            for index in range(num_steps):
                finished = [rid for rid in held if rng.random() < 0.3]
                with engine.kv_lock:  # the worker stops reading them before they go
                    for request_id in finished:
                        live.pop(request_id, None)
                new_id = f"r{index}"
                count = min(rng.randint(1, 6), len(free))
                blocks = [free.pop() for _ in range(count)]
                engine.step(
                    StepEvents(finished=finished, new_blocks={new_id: blocks} if blocks else None)
                )
                for request_id in finished:
                    free.extend(held.pop(request_id))
                with engine.kv_lock:  # the forward pass fills the new blocks
                    if blocks:
                        held[new_id] = blocks
                        kv.write_fresh(engine, blocks)
                        live[new_id] = blocks
        except Exception as err:  # reported by the main thread
            failures.append(f"scheduler: {err!r}")
        finally:
            scheduler_done.set()

    def worker() -> None:
        try:
            while not scheduler_done.is_set():
                with engine.kv_lock:  # the forward pass
                    tables = list(live.values())
                    physical = engine.resolve_tables(tables)
                    engine.stats()
                    logical_ids = [i for table in tables for i in table]
                    bad = kv.mismatched(logical_ids, [p for row in physical for p in row])
                    if bad:
                        failures.append(f"worker read the wrong data of blocks {bad}")
                        return
                    num_checks[0] += 1
        except Exception as err:
            failures.append(f"worker: {err!r}")

    threads = [threading.Thread(target=scheduler), threading.Thread(target=worker)]
    for thread in threads:
        thread.start()
    for thread in threads:
        # NOTE: a deadlock guard, not a timing assertion: the run takes a few seconds.
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "deadlock: kv_lock against a step"
    assert failures == []
    assert engine.stats().totals.num_moves > 0 and num_checks[0] > 0
