"""gRPC round trip of one kvdefrag step against a bare gRPC bidi echo.

Both run in this process, each on its own temporary unix socket, and are timed step by
step, interleaved, so machine noise hits both alike::

    kvdefrag:  DefragClient.step ==StepStream==> servicer -> engine (+ KV moves) -> reply
               (proto build, mirror update, digest check)
    echo:      raw request bytes ==bidi stream==> generic handler -> raw reply bytes
               (the same bytes a kvdefrag step sends and receives, no work)

The typical step of the issue: one new request with 64 fresh blocks, a few finished
requests (2-3 of 256 blocks), and the engine's compaction moving up to 512 blocks. A
setup phase (untimed) fills ~97% of the pool with 256-block requests so that each timed
step frees more than it moves and compaction stays busy. The same steps also run through
an in-process ``Engine`` (no gRPC), so the report splits the round trip into engine work
and what the wire adds.

Run alone: ``python bench/grpc_roundtrip.py [--quick]`` (client and server in one
process). ``make bench`` runs ``step_weights.py`` instead (the server in its own process),
which reuses this module's heavy steps, echo server and echo client.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import queue
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import torch

from kvdefrag.client import DefragClient, StepEvents
from kvdefrag.client import _convert as client_convert
from kvdefrag.server import Engine, EngineConfig, ServiceConfig, serve_in_process
from kvdefrag.server import _convert as server_convert
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig

REQUEST_BLOCKS = 256
NEW_BLOCKS_PER_STEP = 64
SETUP_BLOCKS_PER_STEP = 4_096
FILL_FRACTION = 0.97
MAX_MOVES_PER_STEP = 512
ECHO_METHOD = "/kvdefrag.bench.Echo/Echo"
GOAL_RATIO_P50 = 1.3


def make_steps(num_blocks: int, num_timed: int, seed: int = 0) -> tuple[list[StepEvents], int]:
    """Builds the setup steps followed by ``num_timed`` typical steps.

    NOTE: each is type-checked once, when it is made here (as the vLLM scheduler's ledger
    makes its step, before it is sent): the timed steps send them as they are.

    Returns:
        Every step's events, and how many of them are setup.
    """
    rng = random.Random(seed)
    free_ids = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, 3, ...
    live: dict[str, list[int]] = {}
    steps: list[StepEvents] = []
    counter = 0

    def admit(num_blocks_wanted: int) -> tuple[str, list[int]]:
        nonlocal counter
        request_id = f"req-{counter}"
        counter += 1
        block_ids = [free_ids.pop() for _ in range(num_blocks_wanted)]
        live[request_id] = block_ids
        return request_id, block_ids

    target = int(FILL_FRACTION * (num_blocks - 1))
    while len(free_ids) > num_blocks - target:
        new_blocks: dict[str, list[int]] = {}
        while len(free_ids) > num_blocks - target and len(new_blocks) * REQUEST_BLOCKS < (
            SETUP_BLOCKS_PER_STEP
        ):
            request_id, block_ids = admit(REQUEST_BLOCKS)
            new_blocks[request_id] = block_ids
        fresh = [block_id for ids in new_blocks.values() for block_id in ids]
        steps.append(StepEvents(new_blocks=new_blocks, fresh=fresh))
    num_setup = len(steps)
    for index in range(num_timed):
        finished = rng.sample(sorted(live), 2 + index % 2)
        for request_id in finished:
            free_ids.extend(live.pop(request_id))
        rng.shuffle(free_ids)
        request_id, block_ids = admit(NEW_BLOCKS_PER_STEP)
        steps.append(
            StepEvents(
                finished=tuple(finished), new_blocks={request_id: block_ids}, fresh=block_ids
            )
        )
    return steps, num_setup


def _kv_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A small CPU cache: 16-token blocks of 1 head x 8 float16 (256 bytes per tensor)."""
    shape = (num_blocks * 16, 1, 8)
    return [(torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16))]


@dataclasses.dataclass
class EnginePass:
    """One in-process run of a step stream: wire bytes and engine time of each timed step."""

    requests: list[bytes]
    replies: list[bytes]
    durations_s: list[float]
    swap_s: list[float]  # of which the executor's copy
    moves: list[int]

    @property
    def without_copy_s(self) -> list[float]:
        return [total - swap for total, swap in zip(self.durations_s, self.swap_s, strict=True)]


def engine_pass(steps: list[StepEvents], num_blocks: int, num_setup: int) -> EnginePass:
    """Runs the steps through an in-process ``Engine``; ``steps[:num_setup]`` untimed."""
    engine = Engine(
        _kv_caches(num_blocks), 16, config=EngineConfig(max_moves_per_step=MAX_MOVES_PER_STEP)
    )
    timed = EnginePass([], [], [], [], [])
    for seq, events in enumerate(steps, start=1):
        started = time.perf_counter()
        result = engine.step(events)
        elapsed = time.perf_counter() - started
        if seq <= num_setup:
            continue
        timed.durations_s.append(elapsed)
        timed.swap_s.append(result.swap_duration_s)
        timed.moves.append(len(result.moves))
        request = client_convert.stream_step_request(seq, 1, events)
        timed.requests.append(request.SerializeToString())
        timed.replies.append(server_convert.step_response(result, seq, 1).SerializeToString())
    return timed


class _EchoServer:
    """A bare bidi stream: answers the i-th message with the i-th canned reply."""

    def __init__(self, address: str, replies: list[bytes]) -> None:
        def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            for index, _ in enumerate(requests):
                yield replies[index % len(replies)]

        handler = grpc.method_handlers_generic_handler(
            "kvdefrag.bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)}
        )
        self._pool = futures.ThreadPoolExecutor(max_workers=2)
        self._server = grpc.server(self._pool)
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(address)
        self._server.start()

    def stop(self) -> None:
        self._server.stop(None).wait()
        self._pool.shutdown(wait=False)


class _EchoClient:
    """One long-lived bidi call: send raw bytes, wait for the reply (no proto work)."""

    _END = object()

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Raw bytes both ways: no serializer, no deserializer.
        call = self._channel.stream_stream(ECHO_METHOD, None, None)
        self._replies: Iterator[bytes] = iter(call(iter(self._requests.get, self._END)))

    def round_trip(self, message: bytes) -> bytes:
        self._requests.put(message)
        reply: bytes = next(self._replies)
        return reply

    def close(self) -> None:
        self._requests.put(self._END)
        for _ in self._replies:
            pass
        self._channel.close()


def _percentile_us(samples_s: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples_s)
    return ordered[round(fraction * (len(ordered) - 1))] * 1e6


def _summary(samples_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_us": _percentile_us(samples_s, 0.50),
        "p99_us": _percentile_us(samples_s, 0.99),
        "mean_us": statistics.fmean(samples_s) * 1e6,
    }


def make_workload_steps(num_blocks: int, num_steps: int) -> list[StepEvents]:
    """The realistic synthetic workload's steps (``kvdefrag.tools.workload``)."""
    config = WorkloadConfig(num_blocks=num_blocks, num_steps=num_steps, seed=1)
    return [step.events for step in SyntheticWorkload(config)]


def run_grpc_bench(quick: bool = False) -> dict[str, Any]:
    """Times kvdefrag's step round trip and a bare echo of the same bytes, interleaved, on
    two streams: the issue's heavy "typical" step (hundreds of moves each) and the
    realistic synthetic workload (most steps place fresh blocks and move nothing).

    Args:
        quick: A smaller pool and fewer steps.

    Returns:
        Per stream: latency summaries (µs) for the echo, the kvdefrag stream and the
        in-process engine, the p50 ratio, steps/s, and what a step carried.
    """
    num_blocks = 65_536 if quick else 262_144
    num_timed = 150 if quick else 400
    steps, num_setup = make_steps(num_blocks, num_timed)
    workload_blocks = 10_000
    workload_steps = make_workload_steps(workload_blocks, 800 if quick else 2_000)
    return {
        "typical": _measure(steps, num_setup, num_blocks),
        "workload": _measure(workload_steps, len(workload_steps) // 4, workload_blocks),
    }


def time_alternately(
    client: DefragClient,
    echo: _EchoClient,
    steps: list[StepEvents],
    requests: list[bytes],
    num_setup: int,
) -> tuple[list[float], list[float]]:
    """Steps ``steps[:num_setup]`` untimed, then times each echo and step in turn.

    Returns:
        The echo round trips and the steps, in seconds, one of each per timed step.
    """
    for events in steps[:num_setup]:
        client.step(events)
    for message in requests[:20]:  # warm the echo path; its replies wrap around
        echo.round_trip(message)
    echo_s: list[float] = []
    step_s: list[float] = []
    gc.collect()
    gc.freeze()
    try:
        for message, events in zip(requests, steps[num_setup:], strict=True):
            started = time.perf_counter()
            echo.round_trip(message)
            echo_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.step(events)
            step_s.append(time.perf_counter() - started)
    finally:
        gc.unfreeze()
    return echo_s, step_s


def _measure(steps: list[StepEvents], num_setup: int, num_blocks: int) -> dict[str, Any]:
    """Runs ``steps[:num_setup]`` untimed, then times the rest against the echo."""
    timed = engine_pass(steps, num_blocks, num_setup)
    engine_s, requests, replies, moves = (
        timed.durations_s,
        timed.requests,
        timed.replies,
        timed.moves,
    )
    with tempfile.TemporaryDirectory(prefix="kvdefrag-bench-") as socket_dir:
        echo_address = f"unix:{socket_dir}/echo.sock"
        echo_server = _EchoServer(echo_address, replies)
        handle = serve_in_process(
            _kv_caches(num_blocks),
            16,
            engine_config=EngineConfig(max_moves_per_step=MAX_MOVES_PER_STEP),
            service_config=ServiceConfig(address=f"unix:{socket_dir}/kvdefrag.sock"),
        )
        echo = _EchoClient(echo_address)
        try:
            with DefragClient(handle.address, client_name="bench") as client:
                echo_s, stream_s = time_alternately(client, echo, steps, requests, num_setup)
        finally:
            echo.close()
            echo_server.stop()
            handle.stop(1.0)
    stream = _summary(stream_s)
    echo_summary = _summary(echo_s)
    engine = _summary(engine_s)
    return {
        "num_blocks": num_blocks,
        "num_timed_steps": len(stream_s),
        "mean_moves_per_step": statistics.fmean(moves),
        "max_moves_per_step": max(moves),
        "mean_request_bytes": statistics.fmean(len(message) for message in requests),
        "mean_reply_bytes": statistics.fmean(len(message) for message in replies),
        "echo": echo_summary,
        "kvdefrag_stream": stream,
        "engine_in_process": engine,
        "ratio_p50": stream["p50_us"] / echo_summary["p50_us"],
        "wire_ratio_p50": (stream["p50_us"] - engine["p50_us"]) / echo_summary["p50_us"],
        "steps_per_s": len(stream_s) / sum(stream_s),
        "goal_ratio_p50": GOAL_RATIO_P50,
    }


def format_grpc_bench(results: dict[str, Any]) -> str:
    """The report's section for the round-trip benchmark."""
    typical, workload = results["typical"], results["workload"]
    return "\n".join(
        [
            "== gRPC round trip (unix socket, client and server in one process)",
            f"   heavy step ({typical['num_timed_steps']} steps, {typical['num_blocks']:,} "
            f"blocks): {NEW_BLOCKS_PER_STEP} new blocks, 2-3 finished, "
            f"{typical['mean_moves_per_step']:.0f} moves on average (max "
            f"{typical['max_moves_per_step']})",
            *_format_one(typical),
            f"   synthetic workload ({workload['num_timed_steps']} steps, "
            f"{workload['num_blocks']:,} blocks): "
            f"{workload['mean_moves_per_step']:.1f} moves per step on average (max "
            f"{workload['max_moves_per_step']})",
            *_format_one(workload),
        ]
    )


def _format_one(result: dict[str, Any]) -> list[str]:
    def row(name: str, summary: dict[str, float]) -> str:
        return (
            f"     {name:<34} {summary['p50_us']:>9.0f} {summary['p99_us']:>9.0f} "
            f"{summary['mean_us']:>9.0f}"
        )

    ratio = result["ratio_p50"]
    verdict = "ok" if ratio <= result["goal_ratio_p50"] else "MISSED"
    return [
        f"     request {result['mean_request_bytes']:.0f} B, reply "
        f"{result['mean_reply_bytes']:.0f} B on average",
        f"     {'':<34} {'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9}",
        row("bare gRPC bidi echo (same bytes)", result["echo"]),
        row("kvdefrag DefragClient.step", result["kvdefrag_stream"]),
        row("  of which: Engine.step in process", result["engine_in_process"]),
        f"     ratio at p50: {ratio:.2f}x the echo (goal <= {result['goal_ratio_p50']}x: "
        f"{verdict}); without the engine's own work: {result['wire_ratio_p50']:.2f}x; "
        f"{result['steps_per_s']:,.0f} steps/s",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller pool, fewer steps")
    args = parser.parse_args(argv)
    print(format_grpc_bench(run_grpc_bench(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
