"""vLLM 0.33's real scheduler in a continuous-batching loop, and a worker that keeps its rows
exactly as vLLM's V1 runner does (gpu_model_runner.py ``_update_states``) and signs every
(request, token position) into the physical slot it writes.

The signature of a token is a function of the token ids up to it, so a block shared through
the prefix cache carries the same signature for every request that reads it. After every
step the worker reads back every computed token of every request it holds rows for, and
every block vLLM still keeps in its prefix cache, and counts what does not match.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvdefrag.server import ServerHandle, serve_in_process
from kvdefrag.server.vllm_worker import (
    BlockIdTranslator,
    translate_scheduler_output,
    wait_for_planned_step,
)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
_MASK = (1 << 62) - 1


def _signature(token_ids: tuple[int, ...]) -> int:
    digest = hashlib.blake2b(repr(token_ids).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK or 1


_MODEL_CONFIG: list[ModelConfig] = []


def model_config(model_dir: str) -> ModelConfig:
    """A tiny Llama's config (no weights, no tokenizer); built once per process."""
    if not _MODEL_CONFIG:
        _MODEL_CONFIG.append(
            ModelConfig(
                model=model_dir,
                skip_tokenizer_init=True,
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
            )
        )
    return _MODEL_CONFIG[0]


def make_scheduler(
    cls: type[Scheduler],
    model_dir: str,
    *,
    num_blocks: int,
    prefix_caching: bool,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    async_scheduling: bool = False,
) -> Scheduler:
    """Builds ``cls`` the way ``EngineCore`` does, on a one-group full-attention cache."""
    vllm_config = VllmConfig(
        model_config=model_config(model_dir),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )


def serve_rank(socket_path: str, num_blocks: int) -> tuple[Any, torch.Tensor]:
    """One rank's service on a tiny int64 KV cache: one layer, one slot per token."""
    key = torch.zeros(num_blocks * BLOCK_SIZE, 1, dtype=torch.int64)
    handle = serve_in_process(
        [(key, None)], block_size=BLOCK_SIZE, address=f"unix:{socket_path}", threshold=2
    )
    return handle, key


@dataclasses.dataclass
class _Row:
    block_ids: list[int]
    token_ids: list[int]
    num_computed_tokens: int = 0


class SignedWorker:
    """A worker that keeps persistent rows like vLLM's V1 runner and signs its KV writes.

    Attributes:
        kv: The rank's KV tensor (slot = physical block * BLOCK_SIZE + offset).
        num_corrupted: Reads that did not find their own signature.
        num_checked: Reads checked.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        translator: BlockIdTranslator | None = None,
        *,
        service: tuple[ServerHandle, int] | None = None,
    ) -> None:
        self.kv = kv
        self.translator = translator
        self.service = service  # (its rank's service, the rank): as DefragWorkerMixin
        self.rows: dict[str, _Row] = {}
        self.cached_signatures: dict[int, list[int]] = {}
        self.num_corrupted = 0
        self.num_checked = 0

    def _slot(self, row: _Row, position: int) -> int:
        return row.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Applies one (rewritten) output, runs the "forward pass", returns sampled tokens.

        With its rank's service, it runs as ``DefragWorkerMixin.execute_model`` does:
        holding ``kv_lock``, after waiting (with a translator) for the step planned with
        the output, which the scheduler sent without waiting for the reply.
        """
        if self.service is None:
            return self._execute(output)
        handle, rank = self.service
        if self.translator is not None:
            wait_for_planned_step(handle, rank, output)
        with handle.engine.kv_lock:
            return self._execute(output)

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """With a translator (the workers translate, as ``DefragWorkerMixin`` does under
        async scheduling) the rows first follow the blocks that moved, then a copy of the
        output (the ranks share it here) turns physical.
        """
        if self.translator is not None:
            mapping, remap = self.translator.advance()
            if remap is not None:
                for held in self.rows.values():
                    held.block_ids = remap[held.block_ids].tolist()
            output = copy.deepcopy(output)
            translate_scheduler_output(output, mapping)
        for request_id in output.finished_req_ids:
            self.rows.pop(request_id, None)
        for block_id in output.new_block_ids_to_zero or ():
            self.kv[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE] = 0
        for src, dst in output.kv_cache_block_copies or ():
            self.kv[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = self.kv[
                src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE
            ].clone()
        for new in output.scheduled_new_reqs:
            self.rows[new.req_id] = _Row(
                block_ids=list(new.block_ids[0]),
                token_ids=list(new.prompt_token_ids or ()),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = output.scheduled_cached_reqs
        for position, request_id in enumerate(cached.req_ids):
            row = self.rows[request_id]
            row.num_computed_tokens = cached.num_computed_tokens[position]
            if request_id in cached.all_token_ids:
                # NOTE: the runner takes the tokens of a request it did not run in the
                # previous step from the scheduler (under async scheduling a token it
                # sampled before a preemption may have been dropped).
                row.token_ids = list(cached.all_token_ids[request_id])
            new_ids = cached.new_block_ids[position]
            if request_id in cached.resumed_req_ids:
                row.block_ids = list(new_ids[0])
            elif new_ids is not None:
                row.block_ids.extend(new_ids[0])
        sampled: dict[str, list[int]] = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            row = self.rows[request_id]
            start = row.num_computed_tokens
            for position in range(start, start + num_tokens):
                self.kv[self._slot(row, position), 0] = _signature(
                    tuple(row.token_ids[: position + 1])
                )
            self._check_row(row, start + num_tokens)
            row.num_computed_tokens = start + num_tokens
            if start + num_tokens >= len(row.token_ids):
                token = _signature(tuple(row.token_ids)) % 500 + 3
                row.token_ids.append(token)
                sampled[request_id] = [token]
        request_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
        )

    def _check_row(self, row: _Row, num_tokens: int) -> None:
        for position in range(num_tokens):
            expected = _signature(tuple(row.token_ids[: position + 1]))
            self.num_checked += 1
            if int(self.kv[self._slot(row, position), 0]) != expected:
                self.num_corrupted += 1

    def check_cached_free(self, scheduler: Scheduler, resolve: Any) -> None:
        """Every block vLLM keeps in its prefix cache still holds the tokens it hashed."""
        pool = scheduler.kv_cache_manager.block_pool
        for block in pool.blocks[1:]:
            if block.ref_cnt or block.block_hash is None:
                continue
            expected = self.cached_signatures.get(block.block_id)
            if expected is None:
                continue
            physical_id = resolve([block.block_id])[0]
            self.num_checked += 1
            got = self.kv[physical_id * BLOCK_SIZE : (physical_id + 1) * BLOCK_SIZE, 0]
            if got.tolist() != expected:
                self.num_corrupted += 1

    def record_full_blocks(self, scheduler: Scheduler) -> None:
        """Remembers what every full block of every running request holds (logical ids)."""
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        for request_id, blocks in manager.req_to_blocks.items():
            row = self.rows.get(request_id)
            if row is None:
                continue
            for index, block in enumerate(blocks):
                end = (index + 1) * BLOCK_SIZE
                if end > row.num_computed_tokens or block.block_hash is None:
                    continue
                self.cached_signatures[block.block_id] = [
                    _signature(tuple(row.token_ids[: position + 1]))
                    for position in range(index * BLOCK_SIZE, end)
                ]


@dataclasses.dataclass
class Workload:
    """A seeded stream of requests: shared system prompts, varied lengths, reused ids."""

    seed: int
    num_requests: int
    reuse_ids: bool = True

    def requests(self, block_size: int) -> Iterator[Request]:
        rng = random.Random(self.seed)
        init_none_hash(sha256)
        hasher = get_request_block_hasher(block_size, sha256)
        system_prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
        for index in range(self.num_requests):
            prompt = list(rng.choice(system_prompts)) if rng.random() < 0.6 else []
            prompt += [rng.randrange(3, 500) for _ in range(rng.randrange(4, 90))]
            request_id = f"r{index % 40}" if self.reuse_ids else f"r{index}"
            yield Request(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True),
                pooling_params=None,
                block_hasher=hasher,
            )


def run_loop(
    scheduler: Scheduler,
    workers: list[SignedWorker],
    workload: Workload,
    *,
    resolve: Any,
    max_steps: int = 2000,
    abort_every: int = 0,
    reset_prefix_cache_every: int = 0,
    in_flight: int = 1,
) -> int:
    """Drives the scheduler and the workers until every request is done; returns steps.

    ``in_flight=2`` is async scheduling as vLLM's engine core runs it (a batch queue of
    two): step ``N + 1`` is scheduled, and its kvdefrag step taken, before the workers
    run step ``N``.
    """
    pending = list(workload.requests(BLOCK_SIZE))
    rng = random.Random(workload.seed + 1)
    steps = 0
    queue: list[SchedulerOutput] = []
    while (pending or scheduler.has_requests() or queue) and steps < max_steps:
        steps += 1
        for _ in range(rng.randrange(0, 4)):
            if pending and not scheduler.has_request(pending[0].request_id):
                scheduler.add_request(pending.pop(0))
        if abort_every and steps % abort_every == 0 and scheduler.requests:
            victim = sorted(scheduler.requests)[rng.randrange(len(scheduler.requests))]
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if reset_prefix_cache_every and steps % reset_prefix_cache_every == 0:
            scheduler.reset_prefix_cache()
        if scheduler.has_requests():
            queue.append(scheduler.schedule())
        if not queue or (len(queue) < in_flight and scheduler.has_requests()):
            continue
        output = queue.pop(0)
        runner_outputs = [worker.execute(output) for worker in workers]
        for worker in workers:
            worker.record_full_blocks(scheduler)
        scheduler.update_from_output(output, runner_outputs[0])
        for worker in workers:
            worker.check_cached_free(scheduler, resolve)
    return steps
