"""A worker's pass (``kvdefrag.vllm._worker.passes``) against a real service, under stress.

The deterministic cases (a Reset held between a pass's step check and its ``kv_lock``,
on each runner) are in ``test_worker.py`` and ``test_gaudi.py``; here nothing is held:
the scheduler sends step ``N + 1`` while the worker runs pass ``N`` (vLLM's async
scheduling), every step compacts, and a forced Reset lands at a random moment. Each pass
reads its requests' blocks through the mapping in force and checks their signatures.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvdefrag.client import DefragClient
from kvdefrag.common import DefragError, EpochMismatch, StepEvents
from kvdefrag.server import ServerHandle
from kvdefrag.vllm._worker.passes import RunnerPass
from kvdefrag.vllm.contract import StepStamp, attach_step_stamp

from support.kv import SignedKv
from support.server import Serve

NUM_BLOCKS = 64
NUM_PASSES = 1000  # passes run, over as many trials (one Reset each) as that takes
_DONE = None  # the scheduler's last message to the worker in a trial


@pytest.fixture
def fine_switching() -> Iterator[None]:
    """Threads switch every microsecond, not every 5 ms: far more interleavings of the
    pass, the steps and the Reset per second of test (no hook is placed anywhere)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class _SignedTarget:
    """What readies the "runner": each request's logical ids resolved with the mapping
    in force (as a worker's translation does, holding ``kv_lock``)."""

    def __init__(self, handle: ServerHandle) -> None:
        self._handle = handle

    def begin(self, output: Any) -> None:
        if output is not None:
            output.physical = {
                request: self._handle.resolve(ids).tolist()
                for request, ids in output.logical.items()
            }

    def end(self) -> None:
        pass


class _Trial:
    """One session of the scheduler and one worker, until a forced Reset ends them.

    Requests finish in two stages, as vLLM's block-free fence has it under async
    scheduling: a request leaves the outputs at one step and its blocks are freed two
    steps later, after every pass that read them has run.
    """

    def __init__(self, handle: ServerHandle, kv: SignedKv, rng: random.Random) -> None:
        self.handle = handle
        self.kv = kv
        self.rng = rng
        self.passes = RunnerPass(handle, 0, 10.0, _SignedTarget(handle))
        self.outputs: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.written: set[tuple[str, int]] = set()  # (request, logical id) written
        self.num_ran = 0
        self.num_refused = 0
        self.wrong_passes: list[tuple[int, list[int]]] = []  # (seq, corrupted logical ids)

    def run_pass(self, output: Any) -> str:
        """The runner: checks what earlier passes wrote, writes the blocks new to it."""
        self.num_ran += 1
        corrupted: list[int] = []
        for request, logical in output.logical.items():
            physical = output.physical[request]
            old = [i for i, block in enumerate(logical) if (request, block) in self.written]
            corrupted += self.kv.mismatched([logical[i] for i in old], [physical[i] for i in old])
            new = [i for i, block in enumerate(logical) if (request, block) not in self.written]
            self.kv.write([logical[i] for i in new], [physical[i] for i in new])
            self.written.update((request, logical[i]) for i in new)
        if corrupted:
            self.wrong_passes.append((output.seq, corrupted))
        return "ran"

    def worker(self) -> None:
        is_refused = False
        while (output := self.outputs.get()) is not _DONE:
            if is_refused:
                continue  # the rank failed: vLLM stops; the scheduler still drains
            try:
                self.passes.execute_model(output, lambda out=output: self.run_pass(out))
            except EpochMismatch:
                self.num_refused += 1
                is_refused = True

    def scheduler(self, reset_at: int) -> None:
        """Steps until its session is reset; the Reset is let loose at step ``reset_at``."""
        free = list(range(1, NUM_BLOCKS))
        self.rng.shuffle(free)
        running: dict[str, list[int]] = {}
        leaving: list[list[str]] = [[], []]  # left the outputs one and two steps ago
        resetter = threading.Thread(target=self._reset_soon)
        with DefragClient(self.handle.address, prefix_caching=False, timeout_s=10) as client:
            for number in range(10_000):
                if number == reset_at:
                    resetter.start()
                new_blocks: dict[str, list[int]] = {}
                size = self.rng.randint(1, 4)
                if len(free) >= size:
                    new_blocks[f"r{number}"] = [free.pop() for _ in range(size)]
                finished = leaving.pop()
                for request in finished:
                    free.extend(running.pop(request))
                leaving.insert(0, [])
                if len(running) > 3 and self.rng.random() < 0.5:
                    leaving[0].append(self.rng.choice(sorted(set(running) - set(leaving[1]))))
                try:
                    client.step(StepEvents(new_blocks=new_blocks, finished=finished))
                except DefragError:
                    break  # the Reset ended the session
                running.update(new_blocks)
                shown = set(running) - set(leaving[0]) - set(leaving[1])
                output = SimpleNamespace(
                    seq=client.next_seq - 1,
                    logical={request: list(running[request]) for request in sorted(shown)},
                )
                attach_step_stamp(output, StepStamp(((client.epoch, output.seq),)))
                self.outputs.put(output)  # waits while the worker runs the pass before
        self.outputs.put(_DONE)
        resetter.join()

    def _reset_soon(self) -> None:
        threading.Event().wait(self.rng.uniform(0, 0.003))
        self.handle.reset(force=True)


def test_no_pass_runs_on_a_mapping_a_reset_published_after_its_step(
    serve: Serve, fine_switching: None
) -> None:
    kv = SignedKv.create(NUM_BLOCKS)
    handle = serve(kv=kv, num_blocks=NUM_BLOCKS, threshold=0)
    rng = random.Random(7)
    num_ran = num_refused = num_trials = 0
    wrong: list[tuple[int, list[int]]] = []
    while num_ran < NUM_PASSES:
        trial = _Trial(handle, kv, rng)
        worker = threading.Thread(target=trial.worker)
        worker.start()
        trial.scheduler(reset_at=rng.randint(3, 30))
        worker.join(timeout=60)
        assert not worker.is_alive(), "the worker never finished its passes"
        assert not handle.kv_lock.locked()
        num_trials += 1
        num_ran += trial.num_ran
        num_refused += trial.num_refused
        wrong += trial.wrong_passes
    assert wrong == [], f"{len(wrong)} of {num_ran} passes read moved blocks at old places"
    assert num_refused > 0, f"no Reset came after a step and before its pass in {num_trials} trials"
