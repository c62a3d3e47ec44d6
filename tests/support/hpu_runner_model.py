"""A CPU model of vllm-gaudi's HPU model runner and worker, as far as block ids go, signing
its KV.

Modelled on vllm-project/vllm-gaudi at commit 091bbadd; ``runner.py:N`` is
``vllm_gaudi/v1/worker/hpu_model_runner.py`` line N, ``worker.py:N`` is
``vllm_gaudi/v1/worker/hpu_worker.py``, ``eagle.py:N`` is
``vllm_gaudi/v1/spec_decode/hpu_eagle.py``, ``input_batch.py:N`` is
``vllm_gaudi/v1/worker/hpu_input_batch.py``, ``common.py:N`` / ``exponential.py:N`` are
``vllm_gaudi/extension/bucketing/``; ``block_table.py:N`` is vLLM 0.33's
``vllm/v1/worker/block_table.py``.

The step is split in two calls, as vLLM 0.33's engine core makes them (``execute_model``,
then ``sample_tokens`` when it returned None):

* ``execute_model(output, warmup_mode)`` (runner.py:4151-4224) runs the defragmenter hook
  (``run_defragmenter``, runner.py:4135-4148: ``update_state(new | cached,
  finished_req_ids)`` then ``defragment()``, skipped in ``warmup_mode``), then
  ``_update_states``, stores the output and returns None; with no token scheduled it
  returns ``EMPTY_MODEL_RUNNER_OUTPUT`` (runner.py:4160-4163). No block id is resolved.
* ``_update_states`` (runner.py:1767-1985): finished requests leave the cached states
  and the persistent batch; requests not scheduled this step leave the batch (their
  state stays); new requests enter both; a cached request's state gets ``new_block_ids``
  appended, or replaced when it is in ``resumed_req_ids``, but a request still in the
  batch gets them APPENDED to its batch row (``block_table.append_row``) even when
  resumed. Rows stay logical.
* The persistent batch (``HPUInputBatchModel``): rows are indices into one table; a
  request entering the batch takes the lowest freed row (runner.py:1963-1968), and
  ``add_row`` writes its ids over the row's first entries without clearing the rest
  (input_batch.py:284, block_table.py:114-129), nor does ``remove_request``
  (input_batch.py:371-376): past its count, a row holds its earlier requests' ids.
* ``sample_tokens(grammar_output)`` (runner.py:4303 on) builds the inputs, resolving
  every block id, runs the forward and samples, then runs the Eagle draft (runner.py:4734).
  A request is a prompt while its computed tokens are short of its prompt or when more
  tokens are scheduled than one plus its draft tokens (``_is_prompt``,
  runner.py:2261-2273); decodes are swapped to the first rows (``_ensure_decodes_first``,
  runner.py:4271-4300) and run as one batch.
* Prefill (``_extract_prefill_batch_contents``, runner.py:2642-2662): the row's first
  ``ceil((computed + scheduled) / block_size)`` ids through ``_resolve_block``
  (runner.py:1570-1574; skipped with ``warmup``). Across DP, as many dummy prefills as
  another rank has more prefill batches (``_prepare_prefill_inputs``,
  runner.py:3074-3087, ``get_dp_padding``, runner.py:2698-2704), whether this rank has
  prompts or not: 128 tokens on a block list of block 0 that is NOT resolved
  (``_create_dummy_prefill_batch_contents``, runner.py:3052-3072), so they write into
  physical block 0.
* Decode (``_create_decode_input_data``, runner.py:3089-3245): each request's table is
  its row's first ``ceil((context + 1) / block_size)`` entries (runner.py:3101, 3119-3123)
  and each scheduled token's block is gathered from its row at ``position //
  block_size`` (runner.py:3192-3195), past the row's count if the position is; a request
  with draft tokens scheduled is a decode of ``1 + drafts`` tokens. With no decode here
  but one on another DP rank, one dummy decode on a zero-filled table (block 0,
  resolved; runner.py:3411-3429). The batch is padded to the
  decode bucket's batch size (``find_decode_bucket(num_decodes, sum(num_blocks))[0]``),
  plus the DP padding (``get_dp_padding``, runner.py:1166, 3113); padded rows are full of
  ``_PAD_BLOCK_ID`` (= ``num_blocks``, runner.py:6946) and go through
  ``block_number.apply_(_resolve_block)`` with the rest (runner.py:3191-3195); their
  slots are then set to the pad block's (runner.py:3202-3204). The block tables go through
  ``_resolve_all_blocks`` (runner.py:1576-1580, 3237). Under contiguous PA
  ``get_habana_paged_attn_buffers`` (runner.py:2415-2489) lays the block list out densely
  by physical id over ``find_decode_bucket(batch, max(block_list) + 1)[2]`` blocks, plus
  the DP padding, at least ``max + 1``, at most ``_PAD_BLOCK_ID + 1``; attention reads the
  first ``bucket`` blocks of the cache, each tagged with its request.
* Decode buckets (``HPUBucketingManager.generate_decode_buckets``, common.py:195-240, the
  exponential strategy's ``get_decode_cfgs`` and ``warmup_range_with_limit``,
  exponential.py:88-203, ``generate_buckets``, common.py:386-547): ``decode_buckets``.
* The Eagle draft (``HpuEagleProposer``, eagle.py:169-215): the first draft forward
  writes the draft KV of the scheduled tokens through the target's resolved slots; each
  further draft token builds ``prepare_attn_metadata``: the rows cut to
  ``ceil((position + 1) / block_size)`` blocks through ``defragmenter.resolve_all``
  (eagle.py:198), the slot's block through ``defragmenter.resolve`` (eagle.py:209), the
  same dense layout over the draft layer. The scheduler allocates the lookahead slots
  those positions need (``num_lookahead_tokens``); drafts are never accepted.
* A DP dummy batch (``HPUWorker.execute_dummy_batch``, worker.py:608 →
  ``_dummy_run(1)``, runner.py:6366-6376 → ``_prepare_dummy_scenario``,
  runner.py:5623-5701 → ``_execute_dummy_scenario``, runner.py:5703-5730): one decode
  request ``"0"`` with ``block_size`` tokens computed whose row is the single block 0
  (contiguous PA: ``min(1 - 1, num_blocks - 1)``, runner.py:5672-5688;
  ``_add_dummy_request``, runner.py:5507-5530), ``execute_model(output,
  warmup_mode=True)``, ``sample_tokens(None)``, then ``execute_model(cleanup,
  warmup_mode=True)`` finishing it, outside any scheduled step. Its token sits at
  position ``block_size``: its slot is gathered from the row's SECOND entry, which
  ``add_row`` left as the row's last occupant had it (``num_dummy_stray_writes`` counts
  the dummy writes that land anywhere but block 0).
* Warm-up (``warmup_model``, runner.py:6133-6320): a new ``OnlineDefragmenter`` at its
  start (runner.py:6200) and again at its end (runner.py:6318), the decode buckets' dummy
  scenarios between (block ids ``min(bucket - 1, num_blocks - 1)``, runner.py:5680-5685).
  ``compile_or_warm_up_model`` (worker.py:552-556) re-runs it while ``graphed_buckets``
  is empty (eager here), and vLLM's engine core calls it after ``initialize_from_config``
  did.
* ``sleep`` (worker.py:642-687): ``model_runner.defragmenter = None`` and
  ``model_runner.kv_caches = []``; ``wake_up`` (worker.py:689-735) re-allocates the KV
  caches (``initialize_kv_cache``: zero-filled) and creates a new ``OnlineDefragmenter``.

Every (request, position) written gets the signature ``vllm_harness.SignedWorker`` uses
(the draft layer its own); every read (prefill context and new tokens, every decode
block the dense layout assigns to a request) is checked, and the token a request samples
is a digest of the values its attention read, in position order: a run that reads a
wrong value samples a different token from there on, so outputs compare across runs.
Dummy and warm-up requests write their slots but their reads are not checked (their rows
name block 0 again and again, as vllm-gaudi's do). Block 0 resolved anywhere but 0, or
another block resolved onto 0, is counted (``num_null_block_moved``,
``num_live_on_null_block``). Nothing here knows kvdefrag: ``support.hpu_subject`` puts
``DefragHPUWorkerMixin`` in front of the worker, and ``support.dp_engine_loop`` drives it
as vLLM's data-parallel engine loop does, each worker on its own thread. Not modelled:
vLLM's scheduler scheduling draft tokens (the tests' drafts are never accepted, so no
decode of more than one token is scheduled).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from support.hpu_buckets import Bucket, decode_buckets, find_decode_bucket
from support.vllm_harness import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    SignedWorker,
    _signature,
    runner_output,
)

_DUMMY_SIGNATURE = 7
"""What a dummy (warm-up or DP) request writes into its slot."""

_MAX_NUM_REQS = 64
"""Rows in the persistent batch (``max_num_seqs``; more than the tests schedule)."""


# -- the runner ------------------------------------------------------------------------------


class IdentityDefragmenter:
    """vllm-gaudi's ``OnlineDefragmenter`` with defragmentation off: ids unchanged."""

    enabled = False

    def update_state(self, new_blocks: Any, finished_reqs: Any) -> None:
        pass

    def defragment(self) -> None:
        pass

    def resolve(self, block_id: int) -> int:
        return int(block_id)

    def resolve_all(self, block_table_list: Any) -> list[list[int]]:
        return [[int(block_id) for block_id in row] for row in block_table_list]


@dataclasses.dataclass
class _State:
    """``CachedRequestState``: the request's logical block ids and tokens."""

    block_ids: list[int]
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    is_dummy: bool = False


class HPUInputBatchModel:
    """The persistent batch's rows as vllm-gaudi keeps them: ``HPUInputBatch``
    (``input_batch.py``) over vLLM 0.33's ``MultiGroupBlockTable`` (``block_table.py``),
    one KV-cache group.

    A row is an index into a fixed table, not a request: ``add_request`` puts a request
    on the given row (or the next one, ``input_batch.py:248-259``) and ``add_row`` resets
    the row's count and writes the request's ids over its first entries, leaving every
    entry past them as the row's last occupant left it (``input_batch.py:284``;
    ``block_table.py:114-129``). ``remove_request`` frees the row without touching its
    entries (``input_batch.py:371-376``); ``condense`` moves the last rows into the freed
    ones, and ``move_row`` clears the row it vacates (``input_batch.py:476-540``,
    ``block_table.py:137-146``); ``swap_states`` swaps two whole rows
    (``input_batch.py:417-474``, ``block_table.py:148-151``). So whoever reads a row past
    its count reads a stale id.

    Attributes:
        table: ``[max_num_reqs, max_num_blocks_per_req]`` logical block ids (the CPU block
            table, zero-filled at start).
        num_blocks_per_row: Each row's count.
        req_ids: The request on each row (None: freed, until ``condense``).
        req_id_to_index: Each request's row.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        self.table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.block_table = SimpleNamespace(clear=self.clear)

    def clear(self) -> None:
        """``block_table.clear()`` (``MultiGroupBlockTable.clear``,
        ``block_table.py:184-186, 296-298``): every entry zeroed, the counts kept."""
        self.table.fill(0)

    @property
    def num_reqs(self) -> int:
        """``input_batch.py:761-762``."""
        return len(self.req_id_to_index)

    def add_request(self, request_id: str, state: _State, req_index: int | None) -> int:
        """``add_request`` (``input_batch.py:242-284``): the row's count reset and the
        request's ids written over its first entries (``add_row``); the rest stays."""
        if req_index is None:
            req_index = self.num_reqs
        assert req_index < len(self.table), "more requests than rows"
        if req_index == len(self.req_ids):
            self.req_ids.append(request_id)
        else:
            self.req_ids[req_index] = request_id
        self.req_id_to_index[request_id] = req_index
        self.num_computed_tokens[req_index] = state.num_computed_tokens
        self.num_blocks_per_row[req_index] = 0
        self.append_row(state.block_ids, req_index)
        return req_index

    def append_row(self, block_ids: list[int], row: int) -> None:
        """``BlockTable.append_row`` (``block_table.py:114-125``)."""
        start = int(self.num_blocks_per_row[row])
        self.num_blocks_per_row[row] = start + len(block_ids)
        self.table[row, start : start + len(block_ids)] = block_ids

    def remove_request(self, request_id: str) -> int | None:
        """``input_batch.py:371-376``: the row freed, its entries left as they are."""
        req_index = self.req_id_to_index.pop(request_id, None)
        if req_index is not None:
            self.req_ids[req_index] = None
        return req_index

    def swap_states(self, first: int, second: int) -> None:
        """``input_batch.py:417-474``: two rows swapped whole (``swap_row``)."""
        ids = self.req_ids
        ids[first], ids[second] = ids[second], ids[first]
        for index in (first, second):
            request_id = ids[index]
            assert request_id is not None
            self.req_id_to_index[request_id] = index
        for array in (self.table, self.num_blocks_per_row, self.num_computed_tokens):
            array[[first, second]] = array[[second, first]]

    def condense(self, empty_req_indices: list[int]) -> None:
        """``input_batch.py:476-540``: the last rows moved into the freed ones (sorted in
        descending order); ``move_row`` clears the row it vacates (``block_table.py:137-146``).
        """
        num_reqs = self.num_reqs
        if num_reqs == 0:
            self.req_ids.clear()
            return
        last_req_index = num_reqs + len(empty_req_indices) - 1
        while empty_req_indices:
            while last_req_index in empty_req_indices:
                last_req_index -= 1
            empty_index = empty_req_indices.pop()
            if empty_index >= last_req_index:
                break
            request_id = self.req_ids[last_req_index]
            assert request_id is not None
            self.req_ids[empty_index] = request_id
            self.req_ids[last_req_index] = None
            self.req_id_to_index[request_id] = empty_index
            self.num_computed_tokens[empty_index] = self.num_computed_tokens[last_req_index]
            num_blocks = int(self.num_blocks_per_row[last_req_index])
            self.table[empty_index, :num_blocks] = self.table[last_req_index, :num_blocks]
            self.num_blocks_per_row[empty_index] = num_blocks
            self.table[last_req_index, :num_blocks] = 0
            self.num_blocks_per_row[last_req_index] = 0
            last_req_index -= 1
        del self.req_ids[self.num_reqs :]

    def row_ids(self, request_id: str) -> list[int]:
        """The request's row up to its count."""
        row = self.req_id_to_index[request_id]
        return [int(block_id) for block_id in self.table[row, : self.num_blocks_per_row[row]]]


class HPURunnerModel:
    """The HPU runner's block handling, on one int64 KV slot per token.

    Attributes:
        defragmenter: What the runner resolves through (``model_runner.defragmenter``).
        skip_resolve: A sabotage: the input build takes row ids as physical.
        skip_draft_resolve: A sabotage: only the Eagle draft step takes row ids as
            physical (``prepare_attn_metadata`` without its two resolves).
        kv_caches: ``[(key, None, None, None)]`` (then the draft layer's): vllm-gaudi's
            ``(key_cache, value_cache, key_scales, value_scales)`` per layer (MLA-like,
            no scales); the pad block ``_PAD_BLOCK_ID`` is kept apart (``pad_kv``).
        num_speculative_tokens: Draft tokens per step (0: no Eagle draft step).
        dp_rng: With DP on, what the other DP ranks' batch sizes and block buckets are
            drawn from (``get_dp_padding`` pads to the largest across ranks); None: DP 1.
        kv_lock: A lock ``sample_tokens`` expects held (counted in ``num_unlocked``).
        num_draft_resolved: Block ids the draft step resolved.
        num_pad_resolved: ``_PAD_BLOCK_ID`` entries resolved; ``num_pad_changed``: those
            the defragmenter did not return unchanged.
        num_resolved_in_execute: Block ids resolved inside ``execute_model`` (none are).
    """

    def __init__(
        self,
        kv: torch.Tensor,
        num_blocks: int,
        *,
        draft_kv: torch.Tensor | None = None,
        num_speculative_tokens: int = 0,
        max_num_seqs: int = 16,
    ) -> None:
        assert (draft_kv is None) == (num_speculative_tokens == 0)
        self.kv = kv
        self.draft_kv = draft_kv
        self.num_blocks = num_blocks
        self.pad_block_id = num_blocks  # _PAD_BLOCK_ID (runner.py:6946)
        self.pad_kv = torch.zeros(BLOCK_SIZE, 1, dtype=torch.int64)
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_caches: list[Any] = []
        self._set_kv_caches()
        self.decode_buckets = decode_buckets(
            max_num_seqs=max_num_seqs,
            num_blocks=num_blocks,
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE,
            num_speculative_tokens=num_speculative_tokens,
        )
        # NOTE: where kvdefrag's worker reads the buckets the runner warmed up.
        self.bucketing_manager = SimpleNamespace(decode_buckets=self.decode_buckets)
        self.defragmenter: Any = IdentityDefragmenter()
        self.graphed_buckets: set[Bucket] = set()  # eager: never filled
        self.dp_rng: random.Random | None = None
        self.kv_lock: Any = None
        self.skip_resolve = False
        self.skip_draft_resolve = False
        self.requests: dict[str, _State] = {}
        self.input_batch = HPUInputBatchModel(
            max_num_reqs=_MAX_NUM_REQS,
            max_num_blocks_per_req=-(-(MAX_MODEL_LEN + num_speculative_tokens) // BLOCK_SIZE) + 1,
        )
        self.scheduler_output: SchedulerOutput | None = None
        self.warmup_mode = False
        self._in_execute = False
        self.num_checked = 0
        self.num_corrupted = 0
        self.num_draft_resolved = 0
        self.num_pad_resolved = 0
        self.num_pad_changed = 0
        self.num_resolved_in_execute = 0
        self.num_sampled_steps = 0
        self.num_unlocked = 0
        self.num_dummy_runs = 0
        self.num_dummy_stray_writes = 0
        self.num_dummy_prefill_pads = 0
        self.num_dummy_decode_pads = 0
        self.num_null_block_moved = 0
        self.num_live_on_null_block = 0
        self.num_warmups = 0
        self._in_dummy_run = False

    def _set_kv_caches(self) -> None:
        self.kv_caches = [(self.kv, None, None, None)] + (
            [] if self.draft_kv is None else [(self.draft_kv, None, None, None)]
        )

    # -- execute_model -------------------------------------------------------------------

    def execute_model(
        self, output: SchedulerOutput, warmup_mode: bool = False
    ) -> ModelRunnerOutput | None:
        """runner.py:4151-4224: the defragmenter hook, ``_update_states``; the output is
        kept for ``sample_tokens`` (None returned), or ``EMPTY_MODEL_RUNNER_OUTPUT``."""
        self._in_execute = True
        try:
            self._run_defragmenter(output, warmup_mode)
            self._update_states(output)
        finally:
            self._in_execute = False
        if not output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.scheduler_output = output
        self.warmup_mode = warmup_mode
        return None

    def _run_defragmenter(self, output: SchedulerOutput, warmup_mode: bool) -> None:
        """runner.py:4135-4148 (skipped without a defragmenter, KV caches, or in warmup)."""
        defragmenter = self.defragmenter
        if not (defragmenter and defragmenter.enabled and self.kv_caches and not warmup_mode):
            return
        new = {req.req_id: list(req.block_ids[0]) for req in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        appended = {
            request_id: list(groups[0])
            for request_id, groups in zip(cached.req_ids, cached.new_block_ids, strict=True)
            if groups
        }
        defragmenter.update_state(new | appended, output.finished_req_ids)
        defragmenter.defragment()

    def _update_states(self, output: SchedulerOutput) -> None:
        """``_update_states`` (runner.py:1767-1985): finished requests leave the cached
        states and their rows; every request in the batch not scheduled this step leaves
        its row (its state stays, runner.py:1799-1814); new requests and requests not in
        the batch are put on the lowest freed rows, then the next ones (runner.py:1963-1968),
        and the batch is condensed (runner.py:1980-1981). A cached request's state gets
        ``new_block_ids`` appended, or replaced when resumed; a request still in the batch
        gets them appended to its row (``append_row``, runner.py:1933-1934), resumed or
        not. Rows stay logical."""
        batch = self.input_batch
        for request_id in output.finished_req_ids:
            self.requests.pop(request_id, None)
        removed: list[int] = []
        for request_id in output.finished_req_ids:
            req_index = batch.remove_request(request_id)
            if req_index is not None:
                removed.append(req_index)
        for request_id in set(batch.req_id_to_index) - set(output.num_scheduled_tokens):
            req_index = batch.remove_request(request_id)  # unscheduled (or preempted)
            assert req_index is not None
            removed.append(req_index)
        to_add: list[str] = []
        for new in output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            self.requests[new.req_id] = _State(
                block_ids=list(new.block_ids[0]),
                token_ids=prompt,
                num_prompt_tokens=len(prompt),
                num_computed_tokens=new.num_computed_tokens,
                is_dummy=new.sampling_params is None,
            )
            to_add.append(new.req_id)
        cached = output.scheduled_cached_reqs
        for position, request_id in enumerate(cached.req_ids):
            state = self.requests[request_id]
            state.num_computed_tokens = cached.num_computed_tokens[position]
            if request_id in cached.all_token_ids:
                state.token_ids = list(cached.all_token_ids[request_id])
            new_ids = cached.new_block_ids[position]
            if request_id not in cached.resumed_req_ids:
                if new_ids is not None:
                    state.block_ids.extend(new_ids[0])
            else:
                assert new_ids is not None
                state.block_ids = list(new_ids[0])
            req_index = batch.req_id_to_index.get(request_id)
            if req_index is None:
                to_add.append(request_id)
                continue
            batch.num_computed_tokens[req_index] = state.num_computed_tokens
            if new_ids is not None:
                batch.append_row(list(new_ids[0]), req_index)  # resumed or not
        removed.sort(reverse=True)
        for request_id in to_add:
            batch.add_request(
                request_id, self.requests[request_id], removed.pop() if removed else None
            )
        if removed:
            batch.condense(removed)
        assert not output.new_block_ids_to_zero and not output.kv_cache_block_copies

    # -- sample_tokens -------------------------------------------------------------------

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | None:
        """runner.py:4303 on: the inputs built (every block id resolved), the forward,
        the sampled tokens, then the Eagle draft (runner.py:4734)."""
        output = self.scheduler_output
        if output is None:
            return None  # runner.py:4305-4307
        warmup_mode = self.warmup_mode
        self.scheduler_output = None
        self.warmup_mode = False
        if self.kv_lock is not None and not warmup_mode:
            self.num_sampled_steps += 1
            if not self.kv_lock.locked():
                self.num_unlocked += 1
        num_decodes = self._ensure_decodes_first(output)
        batch_ids = [str(request_id) for request_id in self.input_batch.req_ids]
        decodes, prefills = batch_ids[:num_decodes], batch_ids[num_decodes:]
        reads: dict[str, dict[int, int]] = {}
        for request_id in prefills:
            reads[request_id] = self._prefill(
                request_id, output.num_scheduled_tokens[request_id], warmup=warmup_mode
            )
        self._pad_prefills_across_dp(1 if prefills else 0)
        if decodes:
            reads |= self._decode_batch(decodes, output)
        else:
            self._pad_decodes_across_dp()
        sampled: dict[str, list[int]] = {}
        for request_id in decodes + prefills:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            num_tokens = output.num_scheduled_tokens[request_id]
            if self.num_speculative_tokens and not state.is_dummy:
                self._draft(state, self.input_batch.row_ids(request_id), start, num_tokens)
            state.num_computed_tokens = start + num_tokens
            if start + num_tokens >= len(state.token_ids) and not state.is_dummy:
                read = reads[request_id]
                token = _signature(tuple(read[position] for position in sorted(read))) % 500 + 3
                state.token_ids.append(token)
                sampled[request_id] = [token]
        return runner_output(output, sampled)

    def _is_prompt(self, req_index: int, output: SchedulerOutput) -> bool:
        """runner.py:2261-2273: a prompt while its computed tokens are short of the
        prompt, or when more tokens are scheduled than one plus its draft tokens."""
        request_id = str(self.input_batch.req_ids[req_index])
        state = self.requests[request_id]
        spec_tokens = output.scheduled_spec_decode_tokens.get(request_id)
        num_decode_tokens = 1 if spec_tokens is None else len(spec_tokens) + 1
        return (
            state.num_computed_tokens < state.num_prompt_tokens
            or output.num_scheduled_tokens[request_id] > num_decode_tokens
        )

    def _ensure_decodes_first(self, output: SchedulerOutput) -> int:
        """runner.py:4271-4300: the first prompt row swapped with the last decode row
        until every decode comes first; returns the number of decodes."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        while True:
            prompts = [i for i in range(num_reqs) if self._is_prompt(i, output)]
            decodes = [i for i in range(num_reqs) if not self._is_prompt(i, output)]
            if not prompts or not decodes or prompts[0] > decodes[-1]:
                return len(decodes)
            batch.swap_states(prompts[0], decodes[-1])

    def _pad_prefills_across_dp(self, num_prefill_batches: int) -> None:
        """``_prepare_prefill_inputs`` (runner.py:3074-3087), which runs whether or not
        this rank has prompts: as many dummy prefills as the other DP ranks have more
        prefill batches (``get_dp_padding``, runner.py:2698-2704), each
        ``_create_dummy_prefill_batch_contents`` (runner.py:3052-3072): 128 tokens, no
        context, a block list of block 0 only, taken as it is (real prompts' blocks go
        through ``_resolve_block``, these do not): their KV lands in physical block 0."""
        for _ in range(self._dp_padding(num_prefill_batches, [0, 1, 2])):
            self.num_dummy_prefill_pads += 1
            for position in range(128):
                self._write(self.kv, 0 * BLOCK_SIZE + position % BLOCK_SIZE, _DUMMY_SIGNATURE)

    def _pad_decodes_across_dp(self) -> None:
        """``_prepare_decode_inputs`` with no decode on this rank (runner.py:3400-3416):
        when another DP rank decodes, one dummy decode
        (``_create_dummy_decode_input_data``, runner.py:3422-3429): context 128 over a
        zero-filled block table, so its slot is block 0's, resolved."""
        if self._dp_padding(0, [0, 1]):
            self.num_dummy_decode_pads += 1
            block_id = self._resolve_block(0)
            self._write(self.kv, block_id * BLOCK_SIZE + 128 % BLOCK_SIZE, _DUMMY_SIGNATURE)

    # -- resolving ------------------------------------------------------------------------

    def _resolve_block(self, block_id: int) -> int:
        """runner.py:1570-1574 (the ids unchanged with no defragmenter)."""
        if self._in_execute:
            self.num_resolved_in_execute += 1
        if self.skip_resolve or not self.defragmenter:
            return int(block_id)
        physical = int(self.defragmenter.resolve(block_id))
        if int(block_id) == self.pad_block_id:
            self.num_pad_resolved += 1
            self.num_pad_changed += physical != self.pad_block_id
        self._check_null_block(int(block_id), physical)
        return physical

    def _resolve_all_blocks(self, tables: list[list[int]]) -> list[list[int]]:
        """runner.py:1576-1580."""
        if self.skip_resolve or not self.defragmenter:
            return [list(map(int, row)) for row in tables]
        resolved: list[list[int]] = self.defragmenter.resolve_all(tables)
        for row, physical_row in zip(tables, resolved, strict=True):
            for block_id, physical in zip(row, physical_row, strict=True):
                self._check_null_block(int(block_id), int(physical))
        return resolved

    def _check_null_block(self, block_id: int, physical_id: int) -> None:
        """Counts block 0 resolved elsewhere, and another block resolved onto it: vllm-gaudi
        writes dummy prefills into physical block 0 unresolved, so it must stay pinned."""
        if block_id == 0:
            self.num_null_block_moved += physical_id != 0
        elif physical_id == 0:
            self.num_live_on_null_block += 1

    def _dp_padding(self, count: int, choices: list[int]) -> int:
        """``get_dp_padding`` (runner.py:1166-1178): up to the largest count across the DP
        ranks, the others' drawn from ``choices`` (0 with DP off)."""
        if self.dp_rng is None:
            return 0
        return max(0, self.dp_rng.choice(choices) - count)

    # -- KV slots -------------------------------------------------------------------------

    def _slot_tensor(self, kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, int]:
        """The tensor and row of ``slot``: the pad block's slots live in ``pad_kv``."""
        if slot >= self.pad_block_id * BLOCK_SIZE:
            return self.pad_kv, slot - self.pad_block_id * BLOCK_SIZE
        return kv, slot

    def _write(self, kv: torch.Tensor, slot: int, value: int) -> None:
        tensor, row = self._slot_tensor(kv, slot)
        tensor[row, 0] = value

    def _read(self, kv: torch.Tensor, slot: int, expected: int | None) -> int:
        """The value at ``slot``, checked against ``expected`` (None: not checked)."""
        tensor, row = self._slot_tensor(kv, slot)
        value = int(tensor[row, 0])
        if expected is not None:
            self.num_checked += 1
            self.num_corrupted += value != expected
        return value

    def _sign(self, state: _State, position: int) -> int | None:
        if state.is_dummy:
            return None
        return _signature(tuple(state.token_ids[: position + 1]))

    # -- the input build and the forward --------------------------------------------------

    def _prefill(self, request_id: str, num_tokens: int, *, warmup: bool) -> dict[int, int]:
        """``_extract_prefill_batch_contents`` + ``_form_prefill_batch``
        (runner.py:2642-2662): the row's first ``ceil((computed + scheduled) /
        block_size)`` entries, each through ``_resolve_block`` (not in warm-up); slots for
        the new tokens; the context read from its first blocks. Returns the values read,
        by position."""
        state = self.requests[request_id]
        batch = self.input_batch
        row = batch.req_id_to_index[request_id]
        start = state.num_computed_tokens
        num_blocks = -(-(start + num_tokens) // BLOCK_SIZE)
        blocks = [int(block_id) for block_id in batch.table[row, :num_blocks]]
        if not warmup:
            blocks = [self._resolve_block(block_id) for block_id in blocks]
        for position in range(start, start + num_tokens):
            slot = blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            self._write(self.kv, slot, self._sign(state, position) or _DUMMY_SIGNATURE)
        return {
            position: self._read(
                self.kv,
                blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE,
                self._sign(state, position),
            )
            for position in range(start + num_tokens)
        }

    def _decode_batch(
        self, request_ids: list[str], output: SchedulerOutput
    ) -> dict[str, dict[int, int]]:
        """``_create_decode_input_data`` (runner.py:3089-3245), on the batch's first rows:
        each request's table is its row's first ``ceil((context + 1) / block_size)``
        entries (runner.py:3101, 3119-3123), and each scheduled token's block is gathered
        from its row at ``position // block_size`` (runner.py:3192-3195), whatever the
        row's count: past it, a stale entry. The batch is padded to its bucket (and
        across DP) with rows of ``_PAD_BLOCK_ID``, the slot mapping resolved element by
        element, the padded rows' slots in the pad block (runner.py:3202-3204), the tables
        through ``_resolve_all_blocks`` (runner.py:3237), then contiguous-PA attention.
        A request with draft tokens scheduled (``scheduled_spec_decode_tokens``) is a
        decode of ``1 + drafts`` tokens, each with its own slot. Returns the values read,
        by request and position."""
        batch = self.input_batch
        states = [self.requests[request_id] for request_id in request_ids]
        rows = [batch.req_id_to_index[request_id] for request_id in request_ids]
        positions = [state.num_computed_tokens for state in states]
        num_tokens = [output.num_scheduled_tokens[request_id] for request_id in request_ids]
        num_blocks = [position // BLOCK_SIZE + 1 for position in positions]
        batch_sizes = sorted({bucket[0] for bucket in self.decode_buckets})
        padded_batch_size = find_decode_bucket(
            self.decode_buckets, len(request_ids), sum(num_blocks)
        )[0]
        padded_batch_size += self._dp_padding(padded_batch_size, batch_sizes)
        token_slots = [
            (state, row, position + offset)
            for state, row, position, count in zip(states, rows, positions, num_tokens, strict=True)
            for offset in range(count)
        ]
        gathered = [
            int(batch.table[row, position // BLOCK_SIZE]) for _, row, position in token_slots
        ]
        block_number = gathered + [self.pad_block_id] * (padded_batch_size - len(request_ids))
        block_number = [self._resolve_block(block_id) for block_id in block_number]
        for (state, _, position), logical_id, block_id in zip(
            token_slots, gathered, block_number, strict=False
        ):
            if self._in_dummy_run and logical_id != 0:
                self.num_dummy_stray_writes += 1
            slot = block_id * BLOCK_SIZE + position % BLOCK_SIZE
            self._write(self.kv, slot, self._sign(state, position) or _DUMMY_SIGNATURE)
        pad_slots = itertools.cycle(range(BLOCK_SIZE))  # runner.py:3202-3204
        for _ in range(padded_batch_size - len(request_ids)):
            self.pad_kv[next(pad_slots), 0] = _DUMMY_SIGNATURE
        tables = self._resolve_all_blocks(
            [
                [int(block_id) for block_id in batch.table[row, :n]]
                for row, n in zip(rows, num_blocks, strict=True)
            ]
        )
        reads = self._attend(self.kv, states, tables, [p + 1 for p in positions], padded_batch_size)
        return dict(zip(request_ids, reads, strict=True))

    def _block_bucket(self, batch_size: int, block_list: list[int]) -> int:
        """The contiguous-PA block bucket of ``get_habana_paged_attn_buffers``
        (runner.py:2443-2467)."""
        needed = max(block_list) + 1 if block_list else 0
        bucket = find_decode_bucket(self.decode_buckets, batch_size, needed)[2]
        bucket += self._dp_padding(bucket, sorted({ctx for _, _, ctx in self.decode_buckets}))
        bucket = max(bucket, needed)
        assert needed <= self.pad_block_id + 1, f"{needed} blocks needed, the cache has fewer"
        return min(bucket, self.pad_block_id + 1)

    def _attend(
        self,
        kv: torch.Tensor,
        states: list[_State],
        tables: list[list[int]],
        ends: list[int],
        batch_size: int,
        expected: Callable[[_State, int], int | None] | None = None,
    ) -> list[dict[int, int]]:
        """Contiguous-PA attention: the tables (physical ids) flattened into one block
        list, laid out densely by physical id over the block bucket (an entry whose id
        another entry also names is lost, runner.py:2469-2471), and every request reads
        the blocks tagged with it, positions below its ``end``, from the first ``bucket``
        blocks of ``kv``."""
        sign = expected or self._sign
        block_list = [block_id for table in tables for block_id in table]
        entries = [
            (group, index) for group, table in enumerate(tables) for index in range(len(table))
        ]
        bucket = self._block_bucket(batch_size, block_list)
        dense: list[int | None] = [None] * bucket
        for entry, block_id in enumerate(block_list):
            dense[block_id] = entry
        reads: list[dict[int, int]] = [{} for _ in states]
        for physical in range(bucket):
            entry = dense[physical]
            if entry is None:
                continue
            group, index = entries[entry]
            state = states[group]
            for offset in range(max(0, min(BLOCK_SIZE, ends[group] - index * BLOCK_SIZE))):
                position = index * BLOCK_SIZE + offset
                reads[group][position] = self._read(
                    kv, physical * BLOCK_SIZE + offset, sign(state, position)
                )
        lost = set(range(len(block_list))) - {entry for entry in dense if entry is not None}
        for entry in lost:
            group, _ = entries[entry]
            if not states[group].is_dummy:
                self.num_checked += 1
                self.num_corrupted += 1
                reads[group][-1 - entry] = 0
        return reads

    # -- the Eagle draft step -------------------------------------------------------------

    def _draft_sign(self, state: _State, position: int, last: int) -> int:
        """The draft layer's value at ``position``: from the verified tokens when
        ``position <= last`` (the first draft forward over the scheduled tokens), else
        from the verified prefix and the draft position."""
        if position <= last:
            return _signature((-1, *state.token_ids[: position + 1]))
        return _signature((-2, position, *state.token_ids[: last + 1]))

    def _draft(self, state: _State, row: list[int], start: int, num_tokens: int) -> None:
        """``HpuEagleProposer.propose`` on the draft layer, from ``sample_tokens``: the
        first forward writes the scheduled positions through the target's resolved slots;
        each further draft token builds ``prepare_attn_metadata`` (the rows through
        ``defragmenter.resolve_all``, eagle.py:198; the slot's block through
        ``defragmenter.resolve``, eagle.py:209) and attends over the draft layer."""
        assert self.draft_kv is not None
        draft_kv = self.draft_kv
        last = start + num_tokens - 1
        for position in range(start, last + 1):
            block = self._resolve_block(row[position // BLOCK_SIZE])
            slot = block * BLOCK_SIZE + position % BLOCK_SIZE
            self._write(draft_kv, slot, self._draft_sign(state, position, last))
        if last + 1 < len(state.token_ids):
            return  # a prefill chunk that samples nothing: no draft tokens
        for position in range(last + 1, last + self.num_speculative_tokens):
            num_blocks = -(-(position + 1) // BLOCK_SIZE)
            assert len(row) >= num_blocks, "the scheduler allocated no lookahead slot"
            if self.skip_draft_resolve:
                table = [int(block_id) for block_id in row[:num_blocks]]
                block = int(row[position // BLOCK_SIZE])
            else:
                (table,) = self.defragmenter.resolve_all([row[:num_blocks]])
                block = int(self.defragmenter.resolve(row[position // BLOCK_SIZE]))
            self.num_draft_resolved += num_blocks + 1
            slot = block * BLOCK_SIZE + position % BLOCK_SIZE
            self._write(draft_kv, slot, self._draft_sign(state, position, last))
            self._attend(
                draft_kv,
                [state],
                [table],
                [position + 1],
                1,
                lambda draft_state, p: self._draft_sign(draft_state, p, last),
            )

    # -- dummy batches and warm-up --------------------------------------------------------

    def _dummy_run(self, max_num_batched_tokens: int) -> None:
        """runner.py:6366-6376: one decode dummy scenario (1, 1, 1): a request whose
        row is the single block 0, one block's tokens computed, so its one token sits at
        position ``block_size``, in the row's second entry, which ``add_row`` left as the
        row's last occupant had it (``num_dummy_stray_writes`` counts such writes)."""
        assert max_num_batched_tokens == 1
        self.num_dummy_runs += 1
        self._in_dummy_run = True
        try:
            self._prepare_dummy_scenario((1, 1, 1))
        finally:
            self._in_dummy_run = False

    def _prepare_dummy_scenario(self, decode_cfg: Bucket) -> None:
        """runner.py:5662-5701 under contiguous PA: ``batch_size`` decode requests of one
        block's tokens, all computed, one token scheduled, their rows naming block
        ``min(bucket - 1, num_blocks - 1)`` (``_add_dummy_request``, runner.py:5507-5530,
        with the Eagle lookahead blocks)."""
        batch_size, _, num_blocks = decode_cfg
        block_id = min(num_blocks - 1, self.num_blocks - 1)
        num_tokens = BLOCK_SIZE
        row_blocks = -(-(num_tokens + self.num_speculative_tokens) // BLOCK_SIZE)
        requests = [
            NewRequestData(
                req_id=str(index),
                prompt_token_ids=list(range(num_tokens)),
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=([block_id] * row_blocks,),
                num_computed_tokens=num_tokens,
                lora_request=None,
            )
            for index in range(batch_size)
        ]
        self._execute_dummy_scenario(requests, {request.req_id: 1 for request in requests})

    def _execute_dummy_scenario(
        self, requests: list[NewRequestData], scheduled_tokens: dict[str, int]
    ) -> None:
        """runner.py:5703-5730: the scenario, ``sample_tokens(None)``, then the cleanup
        step that finishes its requests, both ``execute_model`` calls in warmup mode."""
        scheduled = _scheduler_output(requests, scheduled_tokens, finished=set())
        cleanup = _scheduler_output([], {}, finished={request.req_id for request in requests})
        self.execute_model(scheduled, warmup_mode=True)
        self.sample_tokens(None)
        self.execute_model(cleanup, warmup_mode=True)

    def warmup_model(self) -> None:
        """runner.py:6133-6320, decode buckets only: a new ``OnlineDefragmenter`` first
        (runner.py:6200), every decode bucket's dummy scenario, a new one last
        (runner.py:6318), since reusing the warmed one "causes accuracy drops"."""
        self.num_warmups += 1
        self.defragmenter = IdentityDefragmenter()
        for bucket in self.decode_buckets:
            if bucket[0] <= 2:  # NOTE: two batch sizes are enough to exercise the path
                self._prepare_dummy_scenario(bucket)
        self.defragmenter = IdentityDefragmenter()

    def initialize_kv_cache(self) -> None:
        """The KV caches allocated again, zero-filled (as ``initialize_kv_cache``)."""
        self.kv = torch.zeros_like(self.kv)
        if self.draft_kv is not None:
            self.draft_kv = torch.zeros_like(self.draft_kv)
        self.pad_kv = torch.zeros_like(self.pad_kv)
        self._set_kv_caches()


def _scheduler_output(
    requests: list[NewRequestData], scheduled_tokens: dict[str, int], *, finished: set[str]
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=requests,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled_tokens,
        total_num_scheduled_tokens=sum(scheduled_tokens.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=finished,
        free_encoder_mm_hashes=[],
    )


class HPUWorkerModel(SignedWorker):
    """vllm-gaudi's ``HPUWorker`` around ``HPURunnerModel``; each rank runs its own copy
    of the output (vLLM's executor pickles one to each).

    ``execute`` / ``sample`` / ``dummy_batch`` are what ``vllm_harness.run_loop`` calls:
    vLLM's executor calling ``execute_model``, ``sample_tokens``, ``execute_dummy_batch``
    on the worker (through whatever class is in front of this one).
    """

    def __init__(self, kv: torch.Tensor, num_blocks: int, rank: int = 0, **runner: Any) -> None:
        self.model_runner = HPURunnerModel(kv, num_blocks, **runner)
        super().__init__(kv)
        self.rank = rank
        self.cache_config = SimpleNamespace(block_size=BLOCK_SIZE)
        self.model_sleeping = False
        self.kv_cache_sleeping = False
        self.compile_or_warm_up_model()  # the end of initialize_from_config (worker.py:552)

    @property  # type: ignore[override]
    def num_checked(self) -> int:
        return self.model_runner.num_checked

    @num_checked.setter
    def num_checked(self, value: int) -> None:
        self.model_runner.num_checked = value

    @property  # type: ignore[override]
    def num_corrupted(self) -> int:
        return self.model_runner.num_corrupted

    @num_corrupted.setter
    def num_corrupted(self, value: int) -> None:
        self.model_runner.num_corrupted = value

    # -- HPUWorker ------------------------------------------------------------------------

    def compile_or_warm_up_model(self) -> None:
        """worker.py:552-556: the runner warms up again while no graph was captured."""
        if not self.model_runner.graphed_buckets:
            self.model_runner.warmup_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput | None:
        return self.model_runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        self.model_runner._dummy_run(1)

    def sleep(self, level: int = 1) -> None:
        """worker.py:642-687 (every level runs as 1): the KV caches discarded."""
        if not self.kv_cache_sleeping:
            self.model_runner.defragmenter = None
            self.model_runner.kv_caches = []
            self.kv_cache_sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """worker.py:689-735: with the ``kv_cache`` tag, the caches allocated again and a
        new ``OnlineDefragmenter``."""
        if "kv_cache" in (tags or ["weights", "kv_cache"]) and self.kv_cache_sleeping:
            self.model_runner.initialize_kv_cache()
            self.model_runner.defragmenter = IdentityDefragmenter()
            self.kv_cache_sleeping = False

    # -- what the harness loop calls ------------------------------------------------------

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        result: ModelRunnerOutput | None = self.execute_model(copy.deepcopy(output))
        return result

    def sample(self, grammar_output: Any = None) -> ModelRunnerOutput | None:
        result: ModelRunnerOutput | None = self.sample_tokens(grammar_output)
        return result

    def dummy_batch(self) -> None:
        self.execute_dummy_batch()
