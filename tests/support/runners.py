"""Stand-ins for what a worker translates: an output naming blocks, vLLM 0.33's V1 and V2
runners' persistent rows, and a rank's move history.

Modelled on vLLM 0.33 (``vllm/v1/worker/``): the V1 runner keeps each request's row twice,
in ``GPUModelRunner.requests`` (``gpu_model_runner.py:686``, a ``CachedRequestState`` whose
``block_ids`` has one list per group, ``gpu_input_batch.py:42``; rewritten whole at
``gpu_model_runner.py:1615``, appended to at ``:1425-1432``) and in the persistent batch's
``input_batch.block_table`` (``MultiGroupBlockTable``, ``gpu_input_batch.py:183``: per group
a ``BlockTable`` with ``block_table.np`` and ``num_blocks_per_row``, ``block_table.py:49-83``,
rows indexed as ``input_batch.req_ids``, ``gpu_input_batch.py:315``). The V2 runner keeps
one ``StagedWriteTensor`` per group in ``block_tables.block_tables``
(``gpu/block_table.py:66-71``) whose ``.gpu`` is the table the forward reads. Only the
attributes kvdefrag's remapping reads are modelled; the runner's own step loop is driven
by the harness (``support.vllm_harness``), which follows vLLM's ``EngineCore.step``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvdefrag.server import MoveBatch

NUM_BLOCKS = 8


def block_naming_output() -> Any:
    """The parts of a vLLM 0.33 SchedulerOutput that name blocks, in logical ids."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", block_ids=([1, 2],))],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["b", "c"], new_block_ids=[None, ([3],)], resumed_req_ids=set()
        ),
        new_block_ids_to_zero=[3],
        kv_cache_block_copies=[(1, 4)],
    )


def v1_runner(rows: list[list[int]]) -> Any:
    """The two copies of every row vLLM 0.33's V1 runner keeps (requests, block table)."""
    table = np.zeros((4, 6), dtype=np.int32)
    for index, row in enumerate(rows):
        table[index, : len(row)] = row
    block_table = SimpleNamespace(
        block_table=SimpleNamespace(np=table),
        num_blocks_per_row=np.array([len(row) for row in rows] + [0] * (4 - len(rows))),
    )
    return SimpleNamespace(
        requests={
            f"r{index}": SimpleNamespace(block_ids=(list(row),)) for index, row in enumerate(rows)
        },
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[block_table])),
    )


class FakeMoveHistory:
    """A rank's service as the translator reads it: a mapping and a log of compactions."""

    def __init__(self) -> None:
        self.mapping = np.arange(NUM_BLOCKS)
        self.batches: list[MoveBatch] = []
        self.num_resolved = 0
        self.is_truncated = False

    def resolve(self, logical_ids: Any) -> Any:
        self.num_resolved += len(logical_ids)
        return self.mapping[logical_ids]

    def moves_since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None:
        now = len(self.batches)
        if version is None:
            return now, []
        if self.is_truncated:
            return None
        return now, self.batches[version:]

    def compact(self, mapping: list[int], *moves: tuple[int, int, bool]) -> None:
        self.mapping = np.array(mapping)
        self.batches.append(
            MoveBatch([m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves])
        )


def v2_runner(rows: list[list[int]], num_groups: int = 1) -> Any:
    """vLLM 0.33's V2 runner as far as kvdefrag reads it: ``block_tables.block_tables[g].gpu``."""
    table = torch.zeros(4, 6, dtype=torch.int32)
    for index, row in enumerate(rows):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    staged = [SimpleNamespace(gpu=table.clone()) for _ in range(num_groups)]
    return SimpleNamespace(kv_caches=[], block_tables=SimpleNamespace(block_tables=staged))
