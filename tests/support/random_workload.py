"""Random scheduler workloads for client and end-to-end tests.

``RandomWorkload`` plays a vLLM-like scheduler over a ``ReferenceModel``: each ``next_step``
draws one valid step (finished and unknown ids, requests finished and re-admitted in one
step, preempted requests resumed later, requests resumed in place, prefix hits on live
and cached blocks, appends, evictions, the null block) and applies it to the model, so
the model always says which blocks hold data and which were fresh.

Every fresh block comes from the pool that is free once the step's releases are done,
and is handed out once per step, so the engine accepts every step drawn here.
"""

from __future__ import annotations

import random

from kvdefrag.common import NULL_BLOCK_ID, StepEvents

from support.reference_model import ReferenceModel, StepOutcome


class RandomWorkload:
    """A random, always-valid stream of steps and the model they lead to.

    Attributes:
        model: The reference model after every step drawn so far.
        preempted: Request ids released earlier that a later step may resume.
    """

    def __init__(self, num_blocks: int, prefix_caching: bool, seed: int) -> None:
        self.model = ReferenceModel(num_blocks, prefix_caching)
        self.preempted: list[str] = []
        self._rng = random.Random(seed)
        self._num_requests = 0

    def _new_request_id(self) -> str:
        self._num_requests += 1
        return f"req-{self._num_requests}"

    def next_step(self) -> tuple[StepEvents, StepOutcome]:
        """Draws one step, applies it to the model and returns it with the model's outcome."""
        rng = self._rng
        before = self.model
        trial = before.copy()
        running = sorted(trial.requests)
        finished = [rid for rid in running if rng.random() < 0.2]
        if rng.random() < 0.1:
            finished.append(f"ghost-{rng.randrange(1000)}")  # unknown: tolerated
        for request_id in finished:
            trial.release_request(request_id)
        readmitted = [rid for rid in finished if rid in before.requests and rng.random() < 0.3]
        resumed_ids = [rid for rid in self.preempted if rng.random() < 0.3]
        resumed_ids += [
            rid for rid in running if rid not in finished and rng.random() < 0.08
        ]  # resumed in place: the old list is replaced
        for request_id in resumed_ids:
            trial.release_request(request_id)
        evicted: list[int] = []
        if trial.prefix_caching:
            evicted = sorted(i for i in trial.cached if rng.random() < 0.2)
            trial.evict(evicted)

        free_pool = sorted(trial.free())
        rng.shuffle(free_pool)
        # Prefix hits: live blocks (sharing), cached ones, and the ones released this step
        # (they hold their data until the step's moves), never evicted ones.
        hit_pool = sorted(
            (trial.live() | trial.cached | (before.live() - trial.live())) - set(evicted)
        )
        fresh: list[int] = []
        taken: set[int] = set()  # handed out this step from the free pool (fresh or hit)

        def draw_list(length: int) -> list[int]:
            block_ids: list[int] = []
            for _ in range(length):
                if rng.random() < 0.05:
                    block_ids.append(NULL_BLOCK_ID)
                    continue
                if hit_pool and rng.random() < 0.3:
                    hit = rng.choice(hit_pool)
                    if hit not in block_ids and hit not in fresh:
                        block_ids.append(hit)
                        if hit in free_pool:
                            taken.add(hit)
                        continue
                while free_pool and free_pool[-1] in taken:
                    free_pool.pop()
                if free_pool:
                    block_id = free_pool.pop()
                    taken.add(block_id)
                    fresh.append(block_id)
                    block_ids.append(block_id)
            return block_ids

        resumed = {rid: draw_list(rng.randint(0, 4)) for rid in resumed_ids}
        new_blocks: dict[str, list[int]] = {}
        for request_id in readmitted:
            new_blocks[request_id] = draw_list(rng.randint(1, 4))
        for _ in range(rng.randint(0, 2)):
            new_blocks[self._new_request_id()] = draw_list(rng.randint(1, 4))
        for request_id in running:
            if request_id not in finished and request_id not in resumed and rng.random() < 0.3:
                new_blocks[request_id] = draw_list(rng.randint(1, 2))
        # NOTE: without prefix caching the default (None: every newly live block) is as
        # valid as the explicit list; the model computes the same default as the engine.
        use_default = not trial.prefix_caching and rng.random() < 0.3
        events = StepEvents(
            finished=tuple(finished),
            resumed=resumed,
            new_blocks=new_blocks,
            fresh=None if use_default else fresh,
            evicted=evicted,
        )
        outcome = self.model.apply(events)
        self.preempted = [rid for rid in self.preempted if rid not in resumed] + [
            rid
            for rid in finished
            if rid in before.requests and rid not in readmitted and rng.random() < 0.4
        ]
        return events, outcome
