"""vLLM 0.33's real scheduler in a continuous-batching loop, and a worker that keeps its rows
exactly as vLLM's V1 runner does (gpu_model_runner.py ``_update_states``), or as its V2
runner does (``v1/worker/gpu/model_runner.py``: ``V2SignedWorker``), and signs every
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
import os
import random
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvdefrag.server import EngineConfig, ServerHandle, ServiceConfig, serve_in_process
from kvdefrag.vllm._discovery import PublishedRank, publish_ranks, published_ranks, rank_address
from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm._worker.translation import BlockIdTranslator, translate_scheduler_output
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.contract import engine_id
from kvdefrag.vllm.refusals import check_v2_runner
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler
from kvdefrag.vllm.worker import DefragWorkerMixin

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 96  # small: preemption happens
# NOTE: under async scheduling with prefix caching on, a request preempted while a step
# of it is in flight leaves this harness's cached-block check (``check_cached_free``)
# failing with plain vLLM too (it does not model which in-flight writes a cached block
# may still receive), so the async runs WITH prefix caching use a pool where nothing is
# preempted; async runs without it use ``NUM_BLOCKS`` and preempt.
ASYNC_NUM_BLOCKS = 400
_MASK = (1 << 62) - 1
INSTANCE_ID = "kvdefrag-harness"
"""vLLM's id (``VllmConfig.instance_id``) of every engine ``make_scheduler`` builds, so that
the ranks a test publishes for it (``harness_engine_id``) are the ones it finds."""


def harness_engine_id(parallel_config: Any = None) -> str:
    """The engine id (``contract.engine_id``) of a scheduler ``make_scheduler`` builds with
    ``parallel_config`` (vLLM's default when None: no data parallelism)."""
    return engine_id(SimpleNamespace(instance_id=INSTANCE_ID, parallel_config=parallel_config))


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


class V2VllmConfig(VllmConfig):
    """A ``VllmConfig`` that selects vLLM's V2 model runner, as ``VLLM_USE_V2_MODEL_RUNNER=1``
    does, for this one config (the process runs with ``VLLM_USE_V2_MODEL_RUNNER=0``)."""

    @property
    def use_v2_model_runner(self) -> bool:
        return True


def spy_preemptions(scheduler: Scheduler) -> list[str]:
    """Returns a list that receives the id of every request ``scheduler`` preempts."""
    preempted: list[str] = []
    original = scheduler._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append(request.request_id)
        original(request, *args, **kwargs)

    scheduler._preempt_request = spy  # type: ignore[method-assign]
    return preempted


def translator_for(handle: ServerHandle, num_blocks: int) -> BlockIdTranslator:
    """The translator ``DefragWorkerMixin`` gives a worker of ``handle``'s rank."""
    return BlockIdTranslator(handle, num_blocks)


def translating_workers(ranks: list[Any], num_blocks: int) -> list[SignedWorker]:
    """One worker per ``(handle, kv)`` rank, each running as ``DefragWorkerMixin`` does."""
    return [
        SignedWorker(kv, translator_for(handle, num_blocks), service=(handle, rank))
        for rank, (handle, kv) in enumerate(ranks)
    ]


def make_scheduler(
    cls: type[Scheduler],
    model_dir: str,
    *,
    num_blocks: int,
    prefix_caching: bool,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    async_scheduling: bool = False,
    v2: bool = False,
    parallel_config: ParallelConfig | None = None,
    kv_transfer_config: Any = None,
) -> Scheduler:
    """Builds ``cls`` the way ``EngineCore`` does, on a one-group full-attention cache.

    ``v2`` selects vLLM's V2 model runner: the scheduler then sends resumed requests as new
    ones, with every token (``prefill_token_ids``), and the workers translate.
    ``parallel_config``: vLLM's default (one rank, no data parallelism) when None.
    ``kv_transfer_config``: a KV connector's (``KVTransferConfig``), none when None.
    """
    config_cls = V2VllmConfig if v2 else VllmConfig
    vllm_config = config_cls(
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
        **({} if parallel_config is None else {"parallel_config": parallel_config}),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.instance_id = INSTANCE_ID
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


def serve_rank(
    socket_path: str,
    num_blocks: int,
    secret: bytes | None = None,
    extra_layers: Sequence[torch.Tensor] = (),
    threshold: int = 2,
) -> tuple[Any, torch.Tensor]:
    """One rank's service on a tiny int64 KV cache: one layer, one slot per token (then
    ``extra_layers``, bound and moved with it); it proves ``secret`` when given one and
    compacts above ``threshold`` holes."""
    key = torch.zeros(num_blocks * BLOCK_SIZE, 1, dtype=torch.int64)
    handle = serve_in_process(
        [(key, None), *((layer, None) for layer in extra_layers)],
        BLOCK_SIZE,
        engine_config=EngineConfig(threshold=threshold),
        service_config=ServiceConfig(address=f"unix:{socket_path}"),
        identity_secret=secret,
    )
    return handle, key


def serve_two_ranks(
    run_dir: str, num_blocks: int, extra_layers: Sequence[Sequence[torch.Tensor]] = ((), ())
) -> Iterator[list[Any]]:
    """Rank 0 and rank 1 served in ``run_dir`` and published there as DefragWorker's rank 0
    publishes them (a fixture's body: stops them after); ``extra_layers[rank]`` are
    bound after each rank's first layer."""
    secrets = [os.urandom(32) for _ in range(2)]
    served = [
        serve_rank(f"{run_dir}/rank{rank}.sock", num_blocks, secrets[rank], extra_layers[rank])
        for rank in range(2)
    ]
    publish_ranks(
        run_dir,
        [PublishedRank(rank_address(run_dir, rank), secrets[rank]) for rank in range(2)],
        engine_id=harness_engine_id(),
    )
    yield served
    for handle, _ in served:
        handle.stop(grace_s=0.5)


class TwoRankScheduler(DefragScheduler):
    """Two ranks (as under TP=2) without a TP=2 config on a CPU-only machine."""

    def kvdefrag_ranks(self) -> list[PublishedRank]:
        return published_ranks(os.environ[RUN_DIR_ENV], 2, engine_id=engine_id(self.vllm_config))


class TwoRankAsyncScheduler(DefragAsyncScheduler):
    """``DefragAsyncScheduler`` on two ranks."""

    def kvdefrag_ranks(self) -> list[PublishedRank]:
        return published_ranks(os.environ[RUN_DIR_ENV], 2, engine_id=engine_id(self.vllm_config))


@dataclasses.dataclass
class _Row:
    block_ids: list[int]
    token_ids: list[int]
    num_computed_tokens: int = 0


def _slot(block_ids: list[int], position: int) -> int:
    return block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def runner_output(output: SchedulerOutput, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    """The ``ModelRunnerOutput`` of a step: every scheduled request, in the output's order,
    with the tokens it sampled (none for a prefill chunk that samples nothing)."""
    request_ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
        sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
    )


class SignedWorker:
    """A worker that keeps persistent rows like vLLM's V1 runner and signs its KV writes.

    Attributes:
        kv: The rank's KV tensor (slot = physical block * BLOCK_SIZE + offset).
        salt: Mixed into every signature this worker writes and expects (a pipeline
            stage's layers hold other data than the stage before it).
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
        self.salt = 0
        self.rows: dict[str, _Row] = {}
        self.cached_signatures: dict[int, list[int]] = {}
        self.num_corrupted = 0
        self.num_cached_corrupted = 0  # of num_corrupted: found by check_cached_free
        self.num_checked = 0

    def _block_ids(self, request_id: str) -> list[int]:
        """The physical row the "forward pass" reads and writes for ``request_id``."""
        return self.rows[request_id].block_ids

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Applies one output, runs the "forward pass", returns sampled tokens.

        With its rank's service, it runs as ``DefragWorkerMixin.execute_model`` does:
        holding ``kv_lock``, after waiting for the step planned with the output, which the
        scheduler sent without waiting for the reply.
        """
        if self.service is None:
            return self._execute(output)
        handle, rank = self.service
        wait_for_planned_step(handle, rank, output, timeout_s=60.0)
        with handle.kv_lock:
            return self._execute(output)

    def sample(self, grammar_output: Any = None) -> ModelRunnerOutput | None:
        """vLLM's GPU runner as modelled here samples in ``execute``: never called."""
        raise AssertionError("SignedWorker returned its output from execute")

    def dummy_batch(self) -> None:
        """A DP dummy batch: nothing is read or written through a row here."""

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """With a translator (as ``DefragWorkerMixin`` runs) the rows first follow the
        blocks that moved, then a copy of the output (the ranks share it here) turns
        physical; without one the output is taken as it comes (a sabotage, or plain vLLM).
        """
        if self.translator is not None:
            mapping, remap = self.translator.advance()
            if remap is not None:
                for held in self.rows.values():
                    held.block_ids = remap[held.block_ids].tolist()
            output = copy.deepcopy(output)
            translate_scheduler_output(output, mapping)
            self.pass_mapping = mapping  # for a subclass's KV connector
        self._update_rows(output)
        return self._forward(output)

    def _zero_and_copy(self, output: SchedulerOutput) -> None:
        """New blocks to zero, then copy-on-write copies (both runners, in this order)."""
        for block_id in output.new_block_ids_to_zero or ():
            self.kv[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE] = 0
        for src, dst in output.kv_cache_block_copies or ():
            self.kv[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = self.kv[
                src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE
            ].clone()

    def _update_rows(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_req_ids:
            self.rows.pop(request_id, None)
        self._zero_and_copy(output)
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

    def _forward(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Signs every scheduled token into its slot, checks the row, samples a token."""
        sampled: dict[str, list[int]] = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            row = self.rows[request_id]
            block_ids = self._block_ids(request_id)
            start = row.num_computed_tokens
            for position in range(start, start + num_tokens):
                self.kv[_slot(block_ids, position), 0] = self._sign(row.token_ids, position)
            self._check_row(row, block_ids, start + num_tokens)
            row.num_computed_tokens = start + num_tokens
            if start + num_tokens >= len(row.token_ids):
                token = _signature(tuple(row.token_ids)) % 500 + 3
                row.token_ids.append(token)
                sampled[request_id] = [token]
        return runner_output(output, sampled)

    def _sign(self, token_ids: list[int], position: int) -> int:
        """What this worker writes for the token at ``position``."""
        return _signature(tuple(token_ids[: position + 1])) ^ self.salt

    def _check_row(self, row: _Row, block_ids: list[int], num_tokens: int) -> None:
        for position in range(num_tokens):
            expected = self._sign(row.token_ids, position)
            self.num_checked += 1
            if int(self.kv[_slot(block_ids, position), 0]) != expected:
                self.num_corrupted += 1

    def rank_service(self) -> ServerHandle | None:
        """The service of this worker's rank, when it runs as ``DefragWorkerMixin`` does."""
        return None if self.service is None else self.service[0]

    def check_cached_free(self, scheduler: Scheduler, resolve: Any) -> None:
        """Every block vLLM keeps in its prefix cache still holds the tokens it hashed.

        With its rank's service, it reads as a worker does: holding ``kv_lock``, through
        the mapping the KV data is in (a step may be in flight: the scheduler's mirror,
        ``resolve``, learns its moves only from its reply).
        """
        handle = self.rank_service()
        if handle is None:
            self._check_cached_free(scheduler, resolve)
            return
        with handle.kv_lock:
            self._check_cached_free(scheduler, handle.resolve)

    def _check_cached_free(self, scheduler: Scheduler, resolve: Any) -> None:
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
                self.num_cached_corrupted += 1

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
                    self._sign(row.token_ids, position)
                    for position in range(index * BLOCK_SIZE, end)
                ]


class V2SignedRunner(SignedWorker):
    """Keeps rows exactly as vLLM 0.33's V2 runner does (``v1/worker/gpu/model_runner.py``).

    Its block table is a torch int32 ``[max_num_reqs, max_num_blocks]`` tensor at
    ``model_runner.block_tables.block_tables[0].gpu``, where vLLM's ``BlockTables`` keeps
    it; a request has a slot (a row) from the step it comes as new until it finishes or
    is preempted (``finish_requests``). New requests, resumed ones among them, take a
    free slot and overwrite its row and their tokens (``add_requests``: every token,
    ``prefill_token_ids``); cached requests only append ``new_block_ids``
    (``update_requests``); ``resumed_req_ids`` and ``all_token_ids`` are not read.
    """

    def __init__(self, kv: torch.Tensor, max_num_reqs: int) -> None:
        super().__init__(kv)
        table = torch.zeros(max_num_reqs, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32)
        self.model_runner = SimpleNamespace(
            block_tables=SimpleNamespace(block_tables=[SimpleNamespace(gpu=table)])
        )
        self.req_indices: dict[str, int] = {}
        self.num_blocks = [0] * max_num_reqs
        self._table_rows: list[list[int]] = []

    def _block_ids(self, request_id: str) -> list[int]:
        req_index = self.req_indices[request_id]
        return self._table_rows[req_index][: self.num_blocks[req_index]]

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """The V2 runner's ``execute_model`` as far as rows go, then the signed pass."""
        self._update_rows(output)
        self._table_rows = self.model_runner.block_tables.block_tables[0].gpu.tolist()
        return self._forward(output)

    def _remove(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self.req_indices.pop(request_id, None)

    def _append(self, req_index: int, block_ids: list[int], overwrite: bool) -> None:
        table = self.model_runner.block_tables.block_tables[0].gpu
        start = 0 if overwrite else self.num_blocks[req_index]
        end = start + len(block_ids)
        assert end <= table.shape[1], f"row {req_index} overflows: {end} blocks"
        table[req_index, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[req_index] = end

    def _update_rows(self, output: SchedulerOutput) -> None:
        for request_id in output.finished_req_ids | (output.preempted_req_ids or set()):
            self._remove(request_id)
        for new in output.scheduled_new_reqs:
            assert new.prefill_token_ids is not None, "a V2 scheduler sends every token"
            self._remove(new.req_id)
            in_use = set(self.req_indices.values())
            req_index = min(set(range(len(self.num_blocks))) - in_use)
            self.req_indices[new.req_id] = req_index
            self.rows[new.req_id] = _Row(
                block_ids=[],
                token_ids=list(new.prefill_token_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self._append(req_index, list(new.block_ids[0]), overwrite=True)
        cached = output.scheduled_cached_reqs
        for position, request_id in enumerate(cached.req_ids):
            self.rows[request_id].num_computed_tokens = cached.num_computed_tokens[position]
            new_ids = cached.new_block_ids[position]
            if new_ids is not None:
                self._append(self.req_indices[request_id], list(new_ids[0]), overwrite=False)
        self._zero_and_copy(output)


class V2SignedWorker(DefragWorkerMixin, V2SignedRunner):
    """``DefragWorkerMixin`` in front of ``V2SignedRunner``: what ``DefragWorker`` is to vLLM.

    Given a rank's ``handle``, the mixin's own ``kvdefrag_attach`` and ``execute_model``
    hold ``kv_lock``, make the table follow moved blocks (``remap_v2_runner_rows``) and
    translate each output (``translate_scheduler_output``); without one it runs plain.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        vllm_config: VllmConfig,
        handle: ServerHandle | None = None,
        num_blocks: int = 0,
        rank: int = 0,
    ) -> None:
        super().__init__(kv, max_num_reqs=vllm_config.scheduler_config.max_num_seqs)
        check_v2_runner(self.model_runner)  # what DefragWorker checks before serving
        self.vllm_config = vllm_config
        self.rank = rank
        if handle is not None:
            self.kvdefrag_attach(handle, num_blocks)

    def rank_service(self) -> ServerHandle | None:
        return self.kvdefrag_handle

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Each rank runs its own copy of the output (vLLM's executor sends one to each)."""
        result: ModelRunnerOutput = self.execute_model(copy.deepcopy(output))
        return result


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
    snapshot_outputs: bool = False,
    dummy_batch_every: int = 0,
) -> int:
    """Drives the scheduler and the workers until every request is done; returns steps.

    Each step runs on the workers as vLLM 0.33's ``EngineCore`` calls them
    (``vllm/v1/engine/core.py``, ``step`` and ``step_with_batch_queue``): ``execute``
    (``execute_model``) on every worker; when it returned None, ``sample`` (the engine's
    ``sample_tokens(grammar_output)``) on every worker, whose first output is the step's.
    So each worker sees ``execute(N), sample(N), execute(N + 1), ...`` in order. Workers
    that model vLLM's GPU runner (``SignedWorker``) return their output from
    ``execute``; vllm-gaudi's (``support.hpu_runner_model``) from ``sample``.

    ``in_flight=2`` is async scheduling as vLLM's engine core runs it (a batch queue of
    two): step ``N + 1`` is scheduled, and its kvdefrag step taken, before the workers
    run step ``N``; ``sample`` is called then only when tokens were scheduled.
    ``snapshot_outputs`` hands the workers a copy of each output taken when it was
    scheduled, as vLLM's executor sends it then: a V2 scheduler's ``prefill_token_ids``
    is the request's live token list, which grows meanwhile. ``dummy_batch_every=k``
    runs a DP dummy batch (``dummy_batch``: ``execute_dummy_batch``) on every worker
    after every ``k``-th step's output is processed, as an idle data-parallel rank does
    while another rank runs (``DPEngineCoreProc``), never inside a step.
    """
    pending = list(workload.requests(BLOCK_SIZE))
    rng = random.Random(workload.seed + 1)
    steps = 0
    queue: list[tuple[SchedulerOutput, SchedulerOutput]] = []
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
            output = scheduler.schedule()
            queue.append((output, copy.deepcopy(output) if snapshot_outputs else output))
        if not queue or (len(queue) < in_flight and scheduler.has_requests()):
            continue
        output, sent = queue.pop(0)
        runner_output = _run_step(workers, sent, is_async=in_flight > 1)
        for worker in workers:
            worker.record_full_blocks(scheduler)
        scheduler.update_from_output(output, runner_output)
        for worker in workers:
            worker.check_cached_free(scheduler, resolve)
        if dummy_batch_every and steps % dummy_batch_every == 0:
            for worker in workers:
                worker.dummy_batch()
    return steps


def _run_step(workers: Sequence[Any], output: SchedulerOutput, *, is_async: bool) -> Any:
    """One step on every worker, as ``EngineCore.step`` (sync: ``sample_tokens`` when
    ``execute_model`` returned None) or ``step_with_batch_queue`` (async:
    ``sample_tokens`` when tokens were scheduled) calls them; returns the step's output.
    """
    results = [worker.execute(output) for worker in workers]
    if results[0] is not None:
        return results[0]
    assert not is_async or output.total_num_scheduled_tokens > 0, (
        "execute_model returned None for a step without tokens"
    )
    sampled = [worker.sample(None) for worker in workers]
    return sampled[0]
