"""A CPU model of vllm-gaudi's HPU model runner, as far as block ids go, signing its KV.

Modelled on vllm-project/vllm-gaudi (main, 2026-08-21), file
``vllm_gaudi/v1/worker/hpu_model_runner.py``:

* ``execute_model`` first runs the defragmenter hook (``run_defragmenter``:
  ``defragmenter.update_state(new | cached, finished_req_ids)`` then
  ``defragmenter.defragment()``), then ``_update_states``, then builds the inputs.
* ``_update_states``: finished requests leave the cached states and the persistent batch;
  requests not scheduled this step leave the batch (their state stays); new requests
  enter both; for a cached request the state's block ids are appended to, or replaced
  when it is in ``resumed_req_ids``, but a request still in the persistent batch gets
  ``new_block_ids`` APPENDED to its batch row (``block_table.append_row``) even when
  resumed. Rows stay in the scheduler's (logical) ids.
* Prefill inputs (``_extract_prefill_batch_contents``): the row's first
  ``ceil((computed + scheduled) / block_size)`` ids, each through
  ``defragmenter.resolve``; token slots from that list (``_form_prefill_batch``).
* Decode inputs (``_create_decode_input_data``): the slot mapping gathers the row's id
  for each position and maps it element by element (``block_number.apply_(
  defragmenter.resolve)``); the block tables go through ``defragmenter.resolve_all``;
  with contiguous PA, ``get_habana_paged_attn_buffers`` lays the block list out densely,
  indexed by physical id, over a bucket of at least ``max(block_list) + 1`` blocks, and
  attention reads the first ``bucket`` blocks, each tagged with its request (group).

With ``num_speculative_tokens`` > 0 the runner also runs the Eagle draft step of
``vllm_gaudi/v1/spec_decode/hpu_eagle.py`` on a draft KV layer of its own: the first draft
forward writes the draft KV of the scheduled tokens through the target's (already
resolved) slots; each further draft token (``HpuEagleProposer.propose``'s loop,
``num_speculative_tokens - 1`` of them) builds its metadata in ``prepare_attn_metadata``:
the rows cut to ``ceil((position + 1) / block_size)`` blocks through
``defragmenter.resolve_all``, the slot's block through ``defragmenter.resolve``
(``block_ids.apply_``), then the same dense layout over the draft layer. The scheduler
allocates the lookahead slots those positions need (``num_lookahead_tokens``), as it
does with Eagle configured; drafts are never accepted (one token per step), which
leaves the block handling as it is.

Every (request, position) written gets the signature ``vllm_harness.SignedWorker`` uses
(the draft layer its own); every read (prefill context and new tokens, every decode
block the dense layout assigns to a request) is checked, and the token a request samples
is a digest of the values its attention read, in position order: a run that reads a
wrong value samples a different token from there on, so outputs compare across runs.
``HPUModelWorker`` is the worker with ``DefragHPUWorkerMixin`` in front.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from kvdefrag.server import ServerHandle
from kvdefrag.vllm.gaudi import DefragHPUWorkerMixin

from support.vllm_harness import BLOCK_SIZE, SignedWorker, _signature

DECODE_BUCKET_STEP = 8
"""Decode block buckets are multiples of this (a stand-in for vllm-gaudi's bucketing)."""


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


class HPURunnerModel:
    """The HPU runner's block handling, on one int64 KV slot per token.

    Attributes:
        defragmenter: What the runner resolves through (``model_runner.defragmenter``).
        skip_resolve: A sabotage: the input build takes row ids as physical.
        skip_draft_resolve: A sabotage: only the Eagle draft step takes row ids as
            physical (``prepare_attn_metadata`` without its two resolves).
        kv_caches: ``[(key, None, None, None)]`` (then the draft layer's): vllm-gaudi's
            ``(key_cache, value_cache, key_scales, value_scales)`` per layer, as it hands
            them to its defragmenter (here MLA-like, without scales or a pad block).
        num_speculative_tokens: Draft tokens per step (0: no Eagle draft step).
        num_draft_resolved: Block ids the draft step resolved.
    """

    def __init__(
        self,
        kv: torch.Tensor,
        num_blocks: int,
        *,
        draft_kv: torch.Tensor | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        assert (draft_kv is None) == (num_speculative_tokens == 0)
        self.kv = kv
        self.draft_kv = draft_kv
        self.num_blocks = num_blocks
        self.num_speculative_tokens = num_speculative_tokens
        self.kv_caches = [(kv, None, None, None)] + (
            [] if draft_kv is None else [(draft_kv, None, None, None)]
        )
        self.defragmenter: Any = IdentityDefragmenter()
        self.skip_resolve = False
        self.skip_draft_resolve = False
        self.requests: dict[str, _State] = {}
        self.batch_rows: dict[str, list[int]] = {}  # the persistent batch's block table
        self.num_checked = 0
        self.num_corrupted = 0
        self.num_draft_resolved = 0

    # -- execute_model -------------------------------------------------------------------

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """``run_defragmenter``, ``_update_states``, the input build, the signed pass, the
        Eagle draft step."""
        self._run_defragmenter(output)
        self._update_states(output)
        sampled: dict[str, list[int]] = {}
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            state = self.requests[request_id]
            row = self.batch_rows[request_id]
            start = state.num_computed_tokens
            if start >= state.num_prompt_tokens:
                read = self._decode(state, row, start, num_tokens)
            else:
                read = self._prefill(state, row, start, num_tokens)
            if self.num_speculative_tokens:
                self._draft(state, row, start, num_tokens)
            state.num_computed_tokens = start + num_tokens
            if start + num_tokens >= len(state.token_ids):
                token = _signature(tuple(read[position] for position in sorted(read))) % 500 + 3
                state.token_ids.append(token)
                sampled[request_id] = [token]
        request_ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=request_ids,
            req_id_to_index={request_id: i for i, request_id in enumerate(request_ids)},
            sampled_token_ids=[sampled.get(request_id, []) for request_id in request_ids],
        )

    def _run_defragmenter(self, output: SchedulerOutput) -> None:
        defragmenter = self.defragmenter
        if not defragmenter.enabled:
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
        for request_id in output.finished_req_ids:
            self.requests.pop(request_id, None)
            self.batch_rows.pop(request_id, None)
        for request_id in set(self.batch_rows) - set(output.num_scheduled_tokens):
            del self.batch_rows[request_id]  # unscheduled (or preempted): state kept
        to_add: list[str] = []
        for new in output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            self.requests[new.req_id] = _State(
                block_ids=list(new.block_ids[0]),
                token_ids=prompt,
                num_prompt_tokens=len(prompt),
                num_computed_tokens=new.num_computed_tokens,
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
            row = self.batch_rows.get(request_id)
            if row is None:
                to_add.append(request_id)
            elif new_ids is not None:
                row.extend(new_ids[0])  # append_row, resumed or not
        for request_id in to_add:
            self.batch_rows[request_id] = list(self.requests[request_id].block_ids)
        assert not output.new_block_ids_to_zero and not output.kv_cache_block_copies

    # -- the input build ------------------------------------------------------------------

    def _resolve(self, block_id: int) -> int:
        return int(block_id) if self.skip_resolve else int(self.defragmenter.resolve(block_id))

    def _resolve_all(self, tables: list[list[int]]) -> list[list[int]]:
        if self.skip_resolve:
            return [list(map(int, row)) for row in tables]
        resolved: list[list[int]] = self.defragmenter.resolve_all(tables)
        return resolved

    def _sign(self, state: _State, position: int) -> int:
        return _signature(tuple(state.token_ids[: position + 1]))

    def _read(self, kv: torch.Tensor, slot: int, expected: int) -> int:
        """The value at ``slot`` (0 off the cache), checked against ``expected``."""
        self.num_checked += 1
        value = int(kv[slot, 0]) if 0 <= slot < kv.shape[0] else 0
        if value != expected:
            self.num_corrupted += 1
        return value

    def _prefill(
        self, state: _State, row: list[int], start: int, num_tokens: int
    ) -> dict[int, int]:
        """``_extract_prefill_batch_contents`` + ``_form_prefill_batch``: one resolved
        block list; slots for the new tokens; the context read from its first blocks.
        Returns the values read, by position."""
        num_blocks = -(-(start + num_tokens) // BLOCK_SIZE)
        blocks = [self._resolve(block_id) for block_id in row[:num_blocks]]
        for position in range(start, start + num_tokens):
            slot = blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            self.kv[slot, 0] = self._sign(state, position)
        return {
            position: self._read(
                self.kv,
                blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE,
                self._sign(state, position),
            )
            for position in range(start + num_tokens)
        }

    def _decode(self, state: _State, row: list[int], start: int, num_tokens: int) -> dict[int, int]:
        """``_create_decode_input_data`` with contiguous PA: the slot mapping through
        ``resolve`` (element by element), the block table through ``resolve_all``, then
        the dense block list over a bucket >= max id + 1 that attention reads. Returns
        the values read, by position."""
        for position in range(start, start + num_tokens):
            block = self._resolve(row[position // BLOCK_SIZE])
            self.kv[block * BLOCK_SIZE + position % BLOCK_SIZE, 0] = self._sign(state, position)
        num_blocks = -(-(start + num_tokens) // BLOCK_SIZE)
        (table,) = self._resolve_all([row[:num_blocks]])
        return self._attend(self.kv, table, start + num_tokens, lambda p: self._sign(state, p))

    def _attend(
        self, kv: torch.Tensor, table: list[int], end: int, expected: Any
    ) -> dict[int, int]:
        """Contiguous-PA attention over ``table`` (physical ids) for positions below
        ``end``: the dense list over a bucket >= max id + 1, read block by block in
        physical order (``get_habana_paged_attn_buffers``, ``flat_pa``)."""
        bucket = -(-(max(table) + 1) // DECODE_BUCKET_STEP) * DECODE_BUCKET_STEP
        dense: list[int | None] = [None] * bucket  # physical id -> index in the table
        for index, block_id in enumerate(table):
            dense[block_id] = index
        read: dict[int, int] = {}
        for physical in range(bucket):  # attention over the first ``bucket`` blocks
            index = dense[physical]
            if index is None:
                continue
            for offset in range(min(BLOCK_SIZE, end - index * BLOCK_SIZE)):
                position = index * BLOCK_SIZE + offset
                read[position] = self._read(kv, physical * BLOCK_SIZE + offset, expected(position))
        self.num_checked += 1
        if len(set(table)) != len(table):  # two table entries on one block: one is lost
            self.num_corrupted += 1
            read[-1] = 0
        return read

    # -- the Eagle draft step -------------------------------------------------------------

    def _draft_sign(self, state: _State, position: int, last: int) -> int:
        """The draft layer's value at ``position``: from the verified tokens when
        ``position <= last`` (the first draft forward over the scheduled tokens), else
        from the verified prefix and the draft position."""
        if position <= last:
            return _signature((-1, *state.token_ids[: position + 1]))
        return _signature((-2, position, *state.token_ids[: last + 1]))

    def _draft(self, state: _State, row: list[int], start: int, num_tokens: int) -> None:
        """``HpuEagleProposer.propose`` on the draft layer: the first forward writes the
        scheduled positions through the target's resolved slots; each further draft token
        builds ``prepare_attn_metadata`` (the rows through ``resolve_all``, the slot's
        block through ``resolve``) and attends over the draft layer."""
        assert self.draft_kv is not None
        draft_kv = self.draft_kv
        last = start + num_tokens - 1
        for position in range(start, last + 1):
            block = self._resolve(row[position // BLOCK_SIZE])
            draft_kv[block * BLOCK_SIZE + position % BLOCK_SIZE, 0] = self._draft_sign(
                state, position, last
            )
        if last + 1 < len(state.token_ids):
            return  # a prefill chunk that samples nothing: no draft tokens
        resolve = (lambda b: int(b)) if self.skip_draft_resolve else self._resolve
        for position in range(last + 1, last + self.num_speculative_tokens):
            num_blocks = -(-(position + 1) // BLOCK_SIZE)
            assert len(row) >= num_blocks, "the scheduler allocated no lookahead slot"
            if self.skip_draft_resolve:
                table = [int(block_id) for block_id in row[:num_blocks]]
            else:
                (table,) = self._resolve_all([row[:num_blocks]])
            block = resolve(row[position // BLOCK_SIZE])
            self.num_draft_resolved += num_blocks + 1
            draft_kv[block * BLOCK_SIZE + position % BLOCK_SIZE, 0] = self._draft_sign(
                state, position, last
            )
            self._attend(draft_kv, table, position + 1, lambda p: self._draft_sign(state, p, last))


class HPUWorkerModel(SignedWorker):
    """vllm-gaudi's ``HPUWorker`` around ``HPURunnerModel``; each rank runs its own copy
    of the output (vLLM's executor pickles one to each)."""

    def __init__(self, kv: torch.Tensor, num_blocks: int, rank: int = 0, **runner: Any) -> None:
        super().__init__(kv)
        self.model_runner = HPURunnerModel(kv, num_blocks, **runner)
        self.rank = rank

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(output)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result: ModelRunnerOutput = self.execute_model(copy.deepcopy(output))
        self.num_checked = self.model_runner.num_checked
        self.num_corrupted = self.model_runner.num_corrupted
        return result

    def wake_up(self, tags: Any = None) -> None:
        self.model_runner.defragmenter = IdentityDefragmenter()


class HPUModelWorker(DefragHPUWorkerMixin, HPUWorkerModel):
    """``DefragHPUWorkerMixin`` in front of the model: what ``DefragHPUWorker`` is on
    Gaudi. With a rank's ``handle`` it installs the switch; without, it runs plain.
    ``runner`` goes to ``HPURunnerModel`` (the Eagle draft layer and its token count)."""

    def __init__(
        self,
        kv: torch.Tensor,
        num_blocks: int,
        handle: ServerHandle | None = None,
        rank: int = 0,
        **runner: Any,
    ) -> None:
        super().__init__(kv, num_blocks, rank, **runner)
        if handle is not None:
            self.kvdefrag_attach(handle, num_blocks)

    def rank_service(self) -> ServerHandle | None:
        return self.kvdefrag_handle
