"""A worker's persistent rows, kept physical when the worker translates block ids.

vLLM's runners keep each running request's block row between steps and only append to
it; when kvdefrag moves blocks under a worker that translates, those rows must follow:
``BlockIdTranslator`` says how physical ids moved since the previous pass, and
``remap_v1_runner_rows`` / ``remap_v2_runner_rows`` rewrite the runner's rows with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common import NULL_BLOCK_ID


def remap_v1_runner_rows(model_runner: Any, remap: npt.NDArray[np.int64]) -> None:
    """Rewrites the V1 runner's persistent rows after blocks moved: ``remap[old] = new``.

    Both copies vLLM 0.33's ``GPUModelRunner`` (and the CPU runner built on it) keeps: each
    request's ``block_ids`` lists (rows of requests outside the batch come back from
    these) and the block tables of the persistent batch, committed to the device at
    every step.
    """
    for state in model_runner.requests.values():
        for group in state.block_ids:
            if group:
                group[:] = remap[np.asarray(group, dtype=np.int64)].tolist()
    for table in model_runner.input_batch.block_table.block_tables:
        in_use = np.flatnonzero(table.num_blocks_per_row)
        if in_use.size == 0:
            continue
        rows = table.block_table.np[: int(in_use[-1]) + 1]
        rows[...] = remap[rows]


def remap_v2_runner_rows(model_runner: Any, remap: npt.NDArray[np.int64]) -> None:
    """Rewrites the V2 runner's persistent block table after blocks moved: ``remap[old] = new``.

    vLLM 0.33's V2 runner (``vllm/v1/worker/gpu/model_runner.py``) keeps one row per
    request slot in ``block_tables.block_tables[0].gpu``, an int32
    ``[max_num_reqs, max_num_blocks]`` tensor on the runner's device; new requests
    overwrite their row, cached requests only append to it. The whole table is rewritten
    on its own device, in stream order before the forward pass: entries past a row's
    length, and rows of free slots, hold stale ids or the null block, and since ``remap``
    is a permutation of every block id they stay harmless (the null block 0 never moves,
    so zeros stay zeros). Staged writes are applied inside ``execute_model``, so none is
    pending when this runs (before it).

    Args:
        model_runner: A runner ``check_v2_runner`` accepts.
        remap: ``remap[old_physical] = new_physical`` for every block id.
    """
    assert remap[NULL_BLOCK_ID] == NULL_BLOCK_ID, (
        f"kvdefrag moved the null block to {int(remap[NULL_BLOCK_ID])}"
    )
    for staged in model_runner.block_tables.block_tables:
        table: torch.Tensor = staged.gpu
        lookup = torch.as_tensor(remap, dtype=torch.int64, device=table.device)
        table.copy_(lookup[table.long()].to(table.dtype))


def check_v2_runner(model_runner: Any) -> None:
    """Refuses, at startup, a V2 runner whose block table is not where kvdefrag follows it.

    ``remap_v2_runner_rows`` relies on ``model_runner.block_tables.block_tables`` holding
    exactly one table (one KV-cache group) whose ``.gpu`` is a 2-D integer tensor.

    Raises:
        ValueError: Naming the part of that structure the runner lacks.
    """
    runner_name = type(model_runner).__name__
    tables = getattr(getattr(model_runner, "block_tables", None), "block_tables", None)
    if not isinstance(tables, (list, tuple)):
        raise ValueError(
            f"kvdefrag: the V2 model runner ({runner_name}) has no list "
            "model_runner.block_tables.block_tables, where kvdefrag follows the blocks it "
            "moves; this vLLM's V2 runner is not the one kvdefrag supports (vLLM 0.33)"
        )
    if len(tables) != 1:
        raise ValueError(
            f"kvdefrag: the V2 model runner ({runner_name}) has {len(tables)} block tables "
            "in model_runner.block_tables.block_tables; kvdefrag serves exactly one "
            "(one KV-cache group)"
        )
    table = getattr(tables[0], "gpu", None)
    if (
        not isinstance(table, torch.Tensor)
        or table.dim() != 2
        or table.dtype not in (torch.int32, torch.int64)
    ):
        found = (
            f"a {table.dtype} tensor of shape {tuple(table.shape)}"
            if isinstance(table, torch.Tensor)
            else type(table).__name__
        )
        raise ValueError(
            f"kvdefrag: model_runner.block_tables.block_tables[0].gpu of the V2 model runner "
            f"({runner_name}) is {found}; expected a 2-D int32 or int64 tensor "
            "[max_num_reqs, max_num_blocks]"
        )


class BlockIdTranslator:
    """Keeps a worker's block ids physical when the worker, not the scheduler, translates.

    Each ``advance`` (called holding ``kv_lock``, before a forward pass) returns the
    mapping the KV data is in now and how physical ids moved since the previous call, so
    the persistent rows can follow and the incoming output be translated with one mapping.
    """

    def __init__(self, mapping: Callable[[], npt.NDArray[np.int64]]) -> None:
        self._mapping = mapping
        self._last: npt.NDArray[np.int64] = mapping()

    def advance(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
        """Returns ``(mapping, remap)``; ``remap`` is None when nothing moved since last time."""
        current: npt.NDArray[np.int64] = self._mapping()
        last, self._last = self._last, current
        if np.array_equal(last, current):
            return current, None
        remap = np.empty_like(current)
        remap[last] = current
        return current, remap
