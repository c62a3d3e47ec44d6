"""What a scheduler waits for per step: ``DefragClient.step`` against a bare gRPC echo.

The server runs in another process, on a unix socket, as a worker would run it. The same
process serves a bare bidi echo on a second socket that answers each message with the
bytes of the matching kvdefrag reply, so the echo carries the very bytes of the step both
ways and does no work. Echo and step are timed interleaved, in one run::

    client process                         server process
    DefragClient.step ==StepStream=====>   servicer -> engine (+ KV copy) -> reply
    echo.round_trip   ==bidi stream====>   generic handler -> canned reply bytes

Three step weights, each on a fresh server:

* light: a decode step, 16 requests get one block each, nothing finishes;
* mid: 8 requests finish, 8 arrive with 8 blocks each (8,192-block pool);
* heavy: one request of 64 blocks arrives, 2-3 of 256 blocks finish, and compaction
  moves up to 512 blocks (``grpc_roundtrip.make_steps``). Its goal is on the time
  besides the KV copy: the server reports each step's ``swap_duration_s``, which is
  taken off that step's round trip.

The KV rows are tiny (1 head x 8 float16 per token), so the copy itself is cheap and the
figures are the control path's. Run alone: ``python bench/step_weights.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpc_roundtrip import (
    MAX_MOVES_PER_STEP,
    _EchoClient,
    _EchoServer,
    _kv_caches,
    engine_pass,
    make_steps,
    time_alternately,
)

from kvdefrag.client import DefragClient, StepEvents
from kvdefrag.client._stream import Stream
from kvdefrag.server import EngineConfig, ServiceConfig, StepResult, serve_in_process
from kvdefrag.server._servicer import DefragServicer

GOALS = {"light": 1.3, "mid": 1.6, "heavy": 3.0}
GOAL_P99_OVER_P50 = 3.0
GOAL_ENGINE_512_MOVES_MS = 0.5
HEAVY_MAX_STEPS = 150


# --- the three step streams -----------------------------------------------------------------
def light_steps(num_timed: int, seed: int = 0) -> tuple[list[StepEvents], int, int]:
    """Decode steps: 16 of 64 running requests get one new block each; nothing finishes."""
    num_blocks = 8_192
    rng = random.Random(seed)
    free_ids = list(range(1, num_blocks))
    rng.shuffle(free_ids)
    requests = [f"req-{index}" for index in range(64)]
    setup = StepEvents(new_blocks={rid: [free_ids.pop() for _ in range(16)] for rid in requests})
    steps = [setup]
    for _ in range(num_timed):
        growing = rng.sample(requests, 16)
        steps.append(StepEvents(new_blocks={rid: [free_ids.pop()] for rid in growing}))
    return steps, 1, num_blocks


def mid_steps(num_timed: int, seed: int = 0) -> tuple[list[StepEvents], int, int]:
    """8 requests finish and 8 arrive with 8 blocks each, on an 8,192-block pool."""
    num_blocks = 8_192
    rng = random.Random(seed)
    free_ids = list(range(1, num_blocks))
    rng.shuffle(free_ids)
    live: dict[str, list[int]] = {}
    counter = 0

    def admit() -> tuple[str, list[int]]:
        nonlocal counter
        request_id = f"req-{counter}"
        counter += 1
        live[request_id] = [free_ids.pop() for _ in range(8)]
        return request_id, live[request_id]

    steps = [StepEvents(new_blocks=dict(admit() for _ in range(512)))]
    for _ in range(num_timed):
        finished = rng.sample(sorted(live), 8)
        for request_id in finished:
            free_ids.extend(live.pop(request_id))
        rng.shuffle(free_ids)
        steps.append(
            StepEvents(finished=tuple(finished), new_blocks=dict(admit() for _ in range(8)))
        )
    return steps, 1, num_blocks


def heavy_steps(num_timed: int) -> tuple[list[StepEvents], int, int]:
    """Compaction-heavy steps (``grpc_roundtrip.make_steps``): ~500 moves each.

    A step finishes 2.5 of the ~500 requests of 256 blocks the setup admits, so at most
    ~150 steps stay compaction-heavy.
    """
    num_blocks = 131_072
    steps, num_setup = make_steps(num_blocks, min(num_timed, HEAVY_MAX_STEPS))
    return steps, num_setup, num_blocks


# --- where a step's time goes ----------------------------------------------------------------
# NOTE: timers wrapped around two private methods, in the bench only: what a step spends in
# each process's Python besides the wire (``Stream.receive`` is the client's wait for the
# reply; ``DefragServicer._stream_step`` the server's work from the parsed request to the
# built reply). Each adds one perf_counter pair to a step.
class _Timed:
    """Wraps ``owner.name`` (a method) so that every call's duration is kept."""

    def __init__(self, owner: type, name: str) -> None:
        self.durations_s: list[float] = []
        self._owner, self._name = owner, name
        self._original = getattr(owner, name)
        original, durations = self._original, self.durations_s

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                durations.append(time.perf_counter() - started)

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self._owner, self._name, self._original)


# --- the server process ---------------------------------------------------------------------
class _SwapTimes:
    """A step observer that keeps each step's executor time (written out at the end)."""

    def __init__(self) -> None:
        self.swap_s: list[float] = []

    def on_step(self, result: StepResult, duration_s: float) -> None:
        self.swap_s.append(result.swap_duration_s)

    def on_move_failure(self) -> None:
        pass

    def on_reset(self) -> None:
        pass


def serve(socket_dir: str, num_blocks: int) -> None:
    """The server process: kvdefrag and the echo until stdin closes, then the swap times."""
    replies = json.loads((Path(socket_dir) / "replies.json").read_text())
    echo = _EchoServer(f"unix:{socket_dir}/echo.sock", [bytes.fromhex(r) for r in replies])
    swap_times = _SwapTimes()
    handle = serve_in_process(
        _kv_caches(num_blocks),
        16,
        engine_config=EngineConfig(max_moves_per_step=MAX_MOVES_PER_STEP),
        service_config=ServiceConfig(address=f"unix:{socket_dir}/kvdefrag.sock"),
        observer=swap_times,  # besides the server's own metrics
    )
    handler = _Timed(DefragServicer, "_stream_step")
    print("ready", flush=True)
    sys.stdin.read()
    handle.stop(1.0)
    echo.stop()
    times = {"swap_s": swap_times.swap_s, "handler_s": handler.durations_s}
    (Path(socket_dir) / "times.json").write_text(json.dumps(times))


# --- measuring ------------------------------------------------------------------------------


def _percentile(samples: Sequence[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[round(fraction * (len(ordered) - 1))]


def _summary_us(samples_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_us": _percentile(samples_s, 0.5) * 1e6,
        "p99_us": _percentile(samples_s, 0.99) * 1e6,
        "mean_us": statistics.fmean(samples_s) * 1e6,
    }


def measure(
    name: str, make: Callable[[int], tuple[list[StepEvents], int, int]], num_timed: int
) -> dict[str, Any]:
    """Times one step weight through ``DefragClient.step`` and the echo, interleaved."""
    steps, num_setup, num_blocks = make(num_timed)
    timed = engine_pass(steps, num_blocks, num_setup)
    requests, replies, engine_s, moves = (
        timed.requests,
        timed.replies,
        timed.without_copy_s,
        timed.moves,
    )
    with tempfile.TemporaryDirectory(prefix="kvdefrag-bench-") as socket_dir:
        (Path(socket_dir) / "replies.json").write_text(json.dumps([r.hex() for r in replies]))
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", socket_dir, "--num-blocks", str(num_blocks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
                ),
            },
        )
        try:
            assert server.stdout is not None and server.stdin is not None
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{name}: the server process did not start")
            echo = _EchoClient(f"unix:{socket_dir}/echo.sock")
            receive = _Timed(Stream, "receive")
            try:
                with DefragClient(
                    f"unix:{socket_dir}/kvdefrag.sock", client_name="bench"
                ) as client:
                    echo_s, step_s = time_alternately(client, echo, steps, requests, num_setup)
            finally:
                receive.restore()
                echo.close()
            server.stdin.close()
            server.wait(30)
            times = json.loads((Path(socket_dir) / "times.json").read_text())
            swap_s = times["swap_s"][num_setup:]
            handler_s = times["handler_s"][-len(step_s) :]
            # the open's reply and any reconnect come first; a timed step receives once
            wait_s = receive.durations_s[-len(step_s) - 1 : -1]
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    non_copy_s = [total - swap for total, swap in zip(step_s, swap_s, strict=True)]
    client_s = [total - wait for total, wait in zip(step_s, wait_s, strict=True)]
    server_s = [handler - swap for handler, swap in zip(handler_s, swap_s, strict=True)]
    rest_s = [
        total - swap - echo_one - client_one - server_one
        for total, swap, echo_one, client_one, server_one in zip(
            step_s, swap_s, echo_s, client_s, server_s, strict=True
        )
    ]
    step = _summary_us(non_copy_s if name == "heavy" else step_s)
    echo = _summary_us(echo_s)
    return {
        "name": name,
        "num_blocks": num_blocks,
        "num_timed_steps": len(step_s),
        "mean_moves": statistics.fmean(moves),
        "request_bytes": statistics.fmean(len(m) for m in requests),
        "reply_bytes": statistics.fmean(len(m) for m in replies),
        "step": step,
        "echo": echo,
        "swap": _summary_us(swap_s),
        "engine_no_copy": _summary_us(engine_s),
        "client_python": _summary_us(client_s),
        "server_python": _summary_us(server_s),
        "rest": _summary_us(rest_s),
        "max_moves": max(moves),
        "ratio_p50": step["p50_us"] / echo["p50_us"],
        "p99_over_p50": step["p99_us"] / step["p50_us"],
        "goal": GOALS[name],
    }


def engine_bookkeeping(num_timed: int) -> dict[str, Any]:
    """Engine.step without the executor's copy on steps of >= 500 moves (in process)."""
    steps, num_setup, num_blocks = heavy_steps(num_timed)
    timed = engine_pass(steps, num_blocks, num_setup)
    engine_s = timed.without_copy_s
    big = [s for s, n in zip(engine_s, timed.moves, strict=True) if n >= 500]
    return {
        "num_steps": len(big),
        "mean_moves": statistics.fmean(n for n in timed.moves if n >= 500) if big else 0.0,
        "engine_no_copy": _summary_us(big or engine_s),
    }


def run_step_weights(quick: bool = False) -> dict[str, Any]:
    num_timed = 200 if quick else 400
    return {
        "weights": [
            measure("light", light_steps, num_timed),
            measure("mid", mid_steps, num_timed),
            measure("heavy", heavy_steps, num_timed),
        ],
        "engine_512": engine_bookkeeping(num_timed),
    }


def summary_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the summary table: what, measured, baseline, ratio, goal, met."""
    rows = []
    for weight in results["weights"]:
        label = {
            "light": "step light (16 blocks), p50",
            "mid": "step mid (8 out, 8x8 in), p50",
            "heavy": f"step heavy ({weight['mean_moves']:.0f} moves) w/o copy, p50",
        }[weight["name"]]
        rows.append(
            {
                "what": label,
                "measured": f"{weight['step']['p50_us']:.0f} µs",
                "baseline": f"echo {weight['echo']['p50_us']:.0f} µs",
                "ratio": weight["ratio_p50"],
                "goal": f"<= {weight['goal']}x",
                "met": weight["ratio_p50"] <= weight["goal"],
            }
        )
        rows.append(
            {
                "what": f"  {weight['name']} p99 / p50",
                "measured": f"{weight['step']['p99_us']:.0f} µs",
                "baseline": f"p50 {weight['step']['p50_us']:.0f} µs",
                "ratio": weight["p99_over_p50"],
                "goal": f"<= {GOAL_P99_OVER_P50}x",
                "met": weight["p99_over_p50"] <= GOAL_P99_OVER_P50,
            }
        )
    engine = results["engine_512"]
    p50_ms = engine["engine_no_copy"]["p50_us"] / 1e3
    rows.append(
        {
            "what": f"Engine.step w/o copy, {engine['mean_moves']:.0f} moves, p50",
            "measured": f"{p50_ms * 1e3:.0f} µs",
            "baseline": f"goal {GOAL_ENGINE_512_MOVES_MS * 1e3:.0f} µs",
            "ratio": p50_ms / GOAL_ENGINE_512_MOVES_MS,
            "goal": "<= 1.0x",
            "met": p50_ms <= GOAL_ENGINE_512_MOVES_MS,
        }
    )
    return rows


def format_details(results: dict[str, Any]) -> list[str]:
    lines = []
    for weight in results["weights"]:
        lines.append(
            f"   {weight['name']:<5} {weight['num_blocks']:>6,} blocks, "
            f"{weight['num_timed_steps']} steps, {weight['mean_moves']:.0f} moves "
            f"(max {weight['max_moves']}), request {weight['request_bytes']:.0f} B, reply "
            f"{weight['reply_bytes']:.0f} B; p50/p99 µs: step {weight['step']['p50_us']:.0f}/"
            f"{weight['step']['p99_us']:.0f}, echo {weight['echo']['p50_us']:.0f}/"
            f"{weight['echo']['p99_us']:.0f}, engine w/o copy in process "
            f"{weight['engine_no_copy']['p50_us']:.0f}, copy {weight['swap']['p50_us']:.0f}"
        )
        lines.append(
            f"         where a step goes, p50 µs: echo {weight['echo']['p50_us']:.0f} + client "
            f"Python {weight['client_python']['p50_us']:.0f} + server Python (w/o copy) "
            f"{weight['server_python']['p50_us']:.0f} + the rest "
            f"{weight['rest']['p50_us']:.0f} (gRPC's proto (de)serialization, thread "
            f"wake-ups, GIL)"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.num_blocks)
        return 0
    results = run_step_weights(args.quick)
    for row in summary_rows(results):
        print(
            f"{row['what']:<42} {row['measured']:>10} {row['baseline']:>14} "
            f"{row['ratio']:>6.2f}x {row['goal']:>8} {'yes' if row['met'] else 'no'}"
        )
    print("\n".join(format_details(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
