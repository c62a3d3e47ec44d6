"""Metrics: values read from a fresh registry after known event sequences on a real Engine.

Also the server's metrics: registered once its engine exists, served on /metrics when asked.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from typing import Any

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from kvdefrag.client import DefragClient
from kvdefrag.common import EngineUnhealthy, InvalidArgument, StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server._executor_cpu import CpuSwapExecutor
from kvdefrag.server.metrics import DURATION_BUCKETS_S, Metrics, serve_metrics
from kvdefrag.v1 import defrag_pb2 as pb
from kvdefrag.v1 import defrag_pb2_grpc as pb_grpc

from support.doubles import ScriptedExecutor
from support.kv import SignedKv
from support.server import Serve

BLOCK_SIZE = 4


def make_engine(
    registry: CollectorRegistry, num_blocks: int = 64, **options: Any
) -> tuple[Engine, Metrics, SignedKv]:
    kv = SignedKv.create(num_blocks, block_size=BLOCK_SIZE)
    executor = options.pop("executor", None)
    engine = Engine(kv.kv_caches, BLOCK_SIZE, EngineConfig(**options), executor=executor)
    return engine, Metrics(registry, engine), kv


def small_engine(num_blocks: int = 16) -> Engine:
    return Engine(SignedKv.create(num_blocks, block_size=BLOCK_SIZE).kv_caches, BLOCK_SIZE)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_far_blocks_take_three_runs_of_at_most_512_moves(registry: CollectorRegistry) -> None:
    engine, _, kv = make_engine(registry, num_blocks=2560, threshold=0)
    far_ids = list(range(1300, 2500))
    engine.step(StepEvents(new_blocks={"long-prompt": far_ids}, fresh=[]))
    while engine.stats().holes:
        engine.step(StepEvents())

    assert value(registry, "kvdefrag_steps_total") == 3
    assert value(registry, "kvdefrag_defrag_runs_total", result="moved") == 3
    assert value(registry, "kvdefrag_defrag_runs_total", result="failed") == 0
    assert value(registry, "kvdefrag_moved_blocks_total", direction="one_way") == 1200
    assert value(registry, "kvdefrag_moved_blocks_total", direction="two_way") == 0
    assert value(registry, "kvdefrag_moved_bytes_total") == 1200 * kv.bytes_per_block
    assert value(registry, "kvdefrag_placements_total") == 0
    assert value(registry, "kvdefrag_padded_slots_total") == 0
    assert value(registry, "kvdefrag_swap_duration_seconds_count") == 3
    assert value(registry, "kvdefrag_step_duration_seconds_count") == 3
    assert value(registry, "kvdefrag_max_live_block_id") == 1200
    assert value(registry, "kvdefrag_fragmentation_ratio") == 1.0
    # The counters describe real moves: every block's data followed it.
    assert kv.lost_blocks(engine, far_ids) == []


def test_fresh_blocks_count_as_placements_not_moves(registry: CollectorRegistry) -> None:
    engine, _, _ = make_engine(registry, threshold=0)
    result = engine.step(StepEvents(new_blocks={"req-a": list(range(50, 60))}))

    assert result.num_placed == 10
    assert value(registry, "kvdefrag_placements_total") == 10
    assert value(registry, "kvdefrag_defrag_runs_total", result="moved") == 0
    assert value(registry, "kvdefrag_moved_blocks_total", direction="one_way") == 0
    assert value(registry, "kvdefrag_moved_bytes_total") == 0
    assert value(registry, "kvdefrag_swap_duration_seconds_count") == 0
    assert value(registry, "kvdefrag_max_live_block_id") == 10


def test_runs_of_each_pinned_list_are_observed_where_its_blocks_stay(
    registry: CollectorRegistry,
) -> None:
    engine, _, _ = make_engine(registry, threshold=1000, enable_placement=False)
    # Fresh and not placed: they stay at their own, scattered slots.
    engine.step(StepEvents(new_blocks={"a": [3, 4, 9, 10, 11, 20]}))
    engine.step(StepEvents(pins={"send/a": [3, 4, 9, 10, 11, 20], "store/x": [0, 30]}))

    assert value(registry, "kvdefrag_transfer_runs_count") == 2
    assert value(registry, "kvdefrag_transfer_runs_sum") == 3 + 1
    assert value(registry, "kvdefrag_transfer_runs_bucket", le="1.0") == 1
    assert value(registry, "kvdefrag_transfer_runs_bucket", le="3.0") == 2
    assert value(registry, "kvdefrag_pinned_blocks") == 7


def test_unknown_finished_ids_are_counted(registry: CollectorRegistry) -> None:
    engine, _, _ = make_engine(registry)
    engine.step(StepEvents(new_blocks={"known": [1, 2]}))
    engine.step(StepEvents(finished=["known", "cancelled-early", "never-seen"]))

    assert value(registry, "kvdefrag_unknown_finished_requests_total") == 2
    assert value(registry, "kvdefrag_steps_total") == 2
    assert value(registry, "kvdefrag_running_requests") == 0


def test_prefix_caching_moves_swap_both_ways(registry: CollectorRegistry) -> None:
    engine, _, kv = make_engine(registry, threshold=0, prefix_caching=True)
    engine.step(StepEvents(new_blocks={"cached": list(range(1, 11))}))
    engine.step(StepEvents(finished=["cached"], new_blocks={"far": list(range(20, 30))}))

    assert value(registry, "kvdefrag_moved_blocks_total", direction="two_way") == 10
    assert value(registry, "kvdefrag_moved_blocks_total", direction="one_way") == 0
    assert value(registry, "kvdefrag_moved_bytes_total") == 2 * 10 * kv.bytes_per_block
    assert value(registry, "kvdefrag_defrag_runs_total", result="moved") == 1
    # The cached blocks' data was kept, not overwritten.
    assert kv.lost_blocks(engine, range(1, 11)) == []


def failing_executor(num_blocks: int) -> ScriptedExecutor:
    """A swap executor whose device is gone."""
    executor = ScriptedExecutor.without_kv(num_blocks)
    executor.is_failing = True
    return executor


def test_move_failure_is_counted_and_turns_healthy_gauge_off(
    registry: CollectorRegistry,
) -> None:
    engine, _, _ = make_engine(registry, threshold=0, executor=failing_executor(64))
    engine.step(StepEvents(new_blocks={"near": [1, 2]}))
    assert value(registry, "kvdefrag_healthy") == 1

    with pytest.raises(EngineUnhealthy):
        engine.step(StepEvents(new_blocks={"far": [40]}, fresh=[]))

    assert value(registry, "kvdefrag_defrag_runs_total", result="failed") == 1
    assert value(registry, "kvdefrag_defrag_runs_total", result="moved") == 0
    assert value(registry, "kvdefrag_healthy") == 0
    assert value(registry, "kvdefrag_steps_total") == 2  # the second without its compaction
    engine.reset()
    assert value(registry, "kvdefrag_healthy") == 1
    assert value(registry, "kvdefrag_defrag_runs_total", result="failed") == 1


def test_padded_slots_are_counted(registry: CollectorRegistry) -> None:
    kv = SignedKv.create(64, block_size=BLOCK_SIZE)
    executor = ScriptedExecutor.around(CpuSwapExecutor(kv.kv_caches, BLOCK_SIZE))
    executor.pad_to((8, 16))  # as static-shape backends do
    engine, _, _ = make_engine(registry, threshold=0, executor=executor)
    engine.step(StepEvents(new_blocks={"far": [40, 41, 42]}, fresh=[]))

    assert value(registry, "kvdefrag_moved_blocks_total", direction="one_way") == 3
    assert value(registry, "kvdefrag_padded_slots_total") == 5
    assert value(registry, "kvdefrag_moved_bytes_total") == 3 * kv.bytes_per_block


def test_pool_gauges_follow_the_engine_at_scrape_time(registry: CollectorRegistry) -> None:
    engine, _, _ = make_engine(registry, threshold=1000, enable_placement=False)
    assert value(registry, "kvdefrag_live_blocks") == 0
    assert value(registry, "kvdefrag_capacity_blocks") == 64
    assert value(registry, "kvdefrag_fragmentation_ratio") == 1.0

    engine.step(StepEvents(new_blocks={"a": [5, 9], "b": [30]}))
    assert value(registry, "kvdefrag_live_blocks") == 3
    assert value(registry, "kvdefrag_max_live_block_id") == 30
    assert value(registry, "kvdefrag_hole_blocks") == 27
    assert value(registry, "kvdefrag_fragmentation_ratio") == 10.0
    assert value(registry, "kvdefrag_running_requests") == 2
    assert value(registry, "kvdefrag_healthy") == 1

    engine.step(StepEvents(finished=["b"]))
    assert value(registry, "kvdefrag_live_blocks") == 2
    assert value(registry, "kvdefrag_max_live_block_id") == 9
    assert value(registry, "kvdefrag_fragmentation_ratio") == 4.5
    assert value(registry, "kvdefrag_running_requests") == 1


def test_one_constructor_registers_everything_and_observes_the_engine(
    registry: CollectorRegistry,
) -> None:
    engine = small_engine()
    Metrics(registry, engine)  # no other set-up step
    assert value(registry, "kvdefrag_capacity_blocks") == 16
    assert value(registry, "kvdefrag_live_blocks") == 0
    assert value(registry, "kvdefrag_steps_total") == 0
    engine.schedule_defragment()
    engine.reset()  # an engine event reaches it: the observer is in place
    assert value(registry, "kvdefrag_healthy") == 1


def test_a_refused_registry_leaves_the_engine_unobserved(registry: CollectorRegistry) -> None:
    engine = small_engine()
    Metrics(registry, engine)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Metrics(registry, engine)
    assert len(engine._observers) == 1  # only the first


def test_errors_and_replays_are_counted_by_label(registry: CollectorRegistry) -> None:
    metrics = Metrics(registry, small_engine())
    metrics.record_error("Step", "INVALID_ARGUMENT")
    metrics.record_error("Step", "INVALID_ARGUMENT")
    metrics.record_error("Resolve", "OUT_OF_RANGE")
    metrics.record_replay()

    assert value(registry, "kvdefrag_errors_total", method="Step", code="INVALID_ARGUMENT") == 2
    assert value(registry, "kvdefrag_errors_total", method="Resolve", code="OUT_OF_RANGE") == 1
    assert value(registry, "kvdefrag_errors_total", method="Step", code="OUT_OF_RANGE") is None
    assert value(registry, "kvdefrag_replayed_steps_total") == 1


def test_duration_histograms_resolve_sub_millisecond_times(registry: CollectorRegistry) -> None:
    engine, _, _ = make_engine(registry, threshold=0)
    for _ in range(5):
        engine.step(StepEvents())
    for name in ("kvdefrag_step_duration_seconds", "kvdefrag_swap_duration_seconds"):
        bounds = [
            float(sample.labels["le"])
            for family in registry.collect()
            if family.name == name
            for sample in family.samples
            if sample.name == f"{name}_bucket"
        ]
        assert bounds == [*DURATION_BUCKETS_S, float("inf")]
        assert bounds[0] <= 50e-6
        assert sum(bound < 1e-3 for bound in bounds) >= 4
        assert 10.0 in bounds
    assert value(registry, "kvdefrag_step_duration_seconds_count") == 5
    total = value(registry, "kvdefrag_step_duration_seconds_sum")
    assert total is not None and total > 0


def test_metrics_use_only_the_injected_registry() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    Metrics(first, small_engine())
    Metrics(second, small_engine()).record_replay()  # the same names elsewhere: no clash

    assert first.get_sample_value("kvdefrag_replayed_steps_total") == 0
    assert second.get_sample_value("kvdefrag_replayed_steps_total") == 1
    assert REGISTRY.get_sample_value("kvdefrag_replayed_steps_total") is None
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Metrics(first, small_engine())


def test_serve_metrics_exposes_the_registry_over_http(registry: CollectorRegistry) -> None:
    engine, _, _ = make_engine(registry, threshold=0)
    engine.step(StepEvents(new_blocks={"a": [1, 2, 3]}))
    server = serve_metrics(registry, 0)
    try:
        assert server.port > 0
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    assert "kvdefrag_live_blocks 3.0" in text
    assert "kvdefrag_steps_total 1.0" in text
    assert 'kvdefrag_defrag_runs_total{result="failed"} 0.0' in text


# --- the server's metrics ---------------------------------------------------------------
def step_through_the_service(address: str, new_blocks: dict[str, list[int]]) -> None:
    """Step 1 of the epoch over gRPC, as any client sends it; no block is fresh (every
    one holds data, so compaction copies it)."""
    request = pb.StepRequest(seq=1, fresh=pb.BlockIds())
    for request_id, block_ids in new_blocks.items():
        request.new_blocks.add(request_id=request_id, block_ids=block_ids)
    with grpc.insecure_channel(address) as channel:
        pb_grpc.DefragServiceStub(channel).Step(request, timeout=10)


def test_metrics_endpoint_follows_the_engine(serve: Serve, registry: CollectorRegistry) -> None:
    handle = serve(metrics_port=0, threshold=0, registry=registry)
    assert handle.metrics_port is not None
    # Registered with the engine's pool gauges before any step, no bind step anywhere.
    assert registry.get_sample_value("kvdefrag_capacity_blocks") == 64
    step_through_the_service(handle.address, {"req-a": [40, 41]})
    url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert "kvdefrag_steps_total 1.0" in text
    assert 'kvdefrag_moved_blocks_total{direction="one_way"} 2.0' in text
    assert "kvdefrag_live_blocks 2.0" in text
    assert registry.get_sample_value("kvdefrag_max_live_block_id") == 2.0


def test_no_metrics_endpoint_unless_asked(serve: Serve, registry: CollectorRegistry) -> None:
    handle = serve(registry=registry)
    assert handle.metrics_port is None
    step_through_the_service(handle.address, {"req-a": [3]})
    assert registry.get_sample_value("kvdefrag_steps_total") == 1.0
    assert registry.get_sample_value("kvdefrag_live_blocks") == 1.0


def test_a_registry_serves_one_server(serve: Serve, registry: CollectorRegistry) -> None:
    serve(registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        serve(registry=registry)


# --- constant labels: one rank of a tensor-parallel engine ------------------------------
def test_constant_labels_go_on_every_series_and_keep_every_name(
    registry: CollectorRegistry,
) -> None:
    engine = small_engine()
    metrics = Metrics(registry, engine, labels={"rank": "1"})
    engine.step(StepEvents(new_blocks={"a": [5, 6]}, fresh=[]))
    metrics.record_error("Step", "INVALID_ARGUMENT")
    metrics.record_replay()
    samples = [sample for family in registry.collect() for sample in family.samples]
    assert samples and all(sample.labels.get("rank") == "1" for sample in samples)
    assert value(registry, "kvdefrag_steps_total", rank="1") == 1
    assert value(registry, "kvdefrag_live_blocks", rank="1") == 2
    assert value(registry, "kvdefrag_replayed_steps_total", rank="1") == 1
    assert value(registry, "kvdefrag_step_duration_seconds_count", rank="1") == 1
    assert value(registry, "kvdefrag_defrag_runs_total", rank="1", result="failed") == 0
    code = {"method": "Step", "code": "INVALID_ARGUMENT"}
    assert value(registry, "kvdefrag_errors_total", rank="1", **code) == 1
    unlabelled = CollectorRegistry()
    Metrics(unlabelled, small_engine())
    assert {f.name for f in registry.collect()} == {f.name for f in unlabelled.collect()}
    assert value(unlabelled, "kvdefrag_steps_total") == 0  # no rank label without one


@pytest.mark.parametrize("name", ["code", "method", "le", "__rank", "1rank", "rank-id"])
def test_a_constant_label_kvdefrag_cannot_take_is_refused(
    registry: CollectorRegistry, name: str
) -> None:
    with pytest.raises(InvalidArgument, match=f"metrics label '{re.escape(name)}'"):
        Metrics(registry, small_engine(), labels={name: "1"})


def test_two_servers_serve_their_ranks_side_by_side(serve: Serve) -> None:
    handles = [serve(metrics_port=0, metrics_labels={"rank": str(rank)}) for rank in range(2)]
    step_through_the_service(handles[1].address, {"req-a": [3]})
    for rank, handle in enumerate(handles):
        url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert f'kvdefrag_steps_total{{rank="{rank}"}} {float(rank)}' in text
        assert f'kvdefrag_capacity_blocks{{rank="{rank}"}} 64.0' in text


def test_a_workers_wait_for_its_step_is_a_histogram(serve: Serve) -> None:
    """``wait_applied`` (the vLLM worker's wait before its pass) records how long it
    waited, a step already applied included."""
    registry = CollectorRegistry()
    handle = serve(registry=registry, metrics_labels={"rank": "0"})
    with DefragClient(handle.address, timeout_s=10) as client:
        client.step(StepEvents(new_blocks={"a": [1, 2]}))
        handle.wait_applied(client.epoch, client.next_seq - 1, 10)
        assert value(registry, "kvdefrag_step_wait_seconds_count", rank="0") == 1
        waiting = threading.Thread(
            target=handle.wait_applied, args=(client.epoch, client.next_seq, 10)
        )
        waiting.start()  # the next step is not sent yet: it waits
        client.step(StepEvents(new_blocks={"b": [3]}))
        waiting.join(timeout=10)
        assert not waiting.is_alive()
    assert value(registry, "kvdefrag_step_wait_seconds_count", rank="0") == 2
    total = value(registry, "kvdefrag_step_wait_seconds_sum", rank="0")
    assert total is not None and total > 0
