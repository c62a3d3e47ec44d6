"""A worker's persistent rows, kept physical while kvdefrag moves blocks under them.

vLLM's runners keep each running request's block row between steps and only append to
it; when kvdefrag moves blocks, those rows must follow: ``BlockIdTranslator`` says how
physical ids moved since the previous pass (from the service's log of compactions, in
time proportional to the blocks moved), and ``remap_v1_runner_rows`` /
``remap_v2_runner_rows`` rewrite the runner's rows with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.common import NULL_BLOCK_ID
from kvdefrag.server import MoveBatch
from kvdefrag.vllm.errors import PassRefused
from kvdefrag.vllm.output_blocks import map_block_ids


class Remap:
    """How physical ids moved since a worker's previous pass.

    ``table[old] = new`` for every physical id (ids that did not move map to themselves);
    ``old_ids`` are the ids that moved, and ``is_moved[p]`` is True exactly for them.
    Valid until the translator's next ``advance`` (the table is the translator's own,
    patched for this pass only).
    """

    def __init__(
        self,
        table: npt.NDArray[np.int64],
        old_ids: npt.NDArray[np.int64],
        is_moved: npt.NDArray[np.bool_] | None = None,
    ) -> None:
        """``is_moved``: the mask, when the caller keeps one patched as ``table`` is (the
        translator, so a pass costs what moved, not the pool); None builds it."""
        self.table = table
        self.old_ids = old_ids
        if is_moved is None:
            is_moved = np.zeros(len(table), dtype=np.bool_)
            is_moved[old_ids] = True
        self.is_moved = is_moved

    def __getitem__(self, physical_ids: Any) -> npt.NDArray[np.int64]:
        """``table[physical_ids]``."""
        remapped: npt.NDArray[np.int64] = self.table[np.asarray(physical_ids, dtype=np.int64)]
        return remapped


def remap_v1_runner_rows(model_runner: Any, remap: Remap) -> int:
    """Rewrites the V1 runner's persistent rows after blocks moved: ``remap[old] = new``.

    Both copies vLLM 0.33's ``GPUModelRunner`` (and the CPU runner built on it) keeps: the
    block tables of the persistent batch (``input_batch.block_table``, committed to the
    device at every step) and each request's ``block_ids`` lists (rows of requests outside
    the batch come back from these). Cost: two compares over the batch's rows in use
    (the entries between the lowest and the highest moved id), a lookup of those in
    ``remap.is_moved``, then one assignment per entry that names a moved id, in the rows
    and in the lists of the batch's requests (their lists equal their rows), and a scan
    of the lists of requests outside the batch.

    Returns:
        The entries of the batch's rows rewritten (past a row's length too).
    """
    batch = model_runner.input_batch
    row_to_request = getattr(batch, "req_ids", None)
    requests = model_runner.requests
    followed: set[str] = set()
    num_rewritten = 0
    if not remap.old_ids.size:
        return 0
    lowest, highest = int(remap.old_ids.min()), int(remap.old_ids.max())
    for group_index, table in enumerate(batch.block_table.block_tables):
        lengths = table.num_blocks_per_row
        in_use = np.flatnonzero(lengths)
        if in_use.size == 0:
            continue
        num_rows = int(in_use[-1]) + 1
        num_columns = int(lengths[:num_rows].max())
        rows = table.block_table.np[:num_rows, :num_columns]
        if row_to_request is not None:
            followed.update(
                str(request_id) for request_id in row_to_request[:num_rows] if request_id
            )
        # NOTE: the entries in [lowest, highest] moved id first, by two compares (no
        # index conversion, no random reads), then only those looked up in the mask:
        # compaction moves the highest live blocks, so the band is narrow and holds few
        # entries. On 256 rows of ~270 columns left cold by the step, a lookup of every
        # entry (np.take) cost 0.14-0.36 ms.
        candidates = np.flatnonzero((rows >= lowest) & (rows <= highest))
        candidate_rows, candidate_columns = np.divmod(candidates, num_columns)
        old_ids = rows[candidate_rows, candidate_columns]
        is_hit = remap.is_moved[old_ids]
        changed_rows, changed_columns = candidate_rows[is_hit], candidate_columns[is_hit]
        if not changed_rows.size:
            continue
        num_rewritten += changed_rows.size
        new_ids = remap.table[old_ids[is_hit]]
        rows[changed_rows, changed_columns] = new_ids
        if row_to_request is None:
            continue
        in_list = changed_columns < lengths[changed_rows]  # past the length: stale, in no list
        for row, column, new_id in zip(
            changed_rows[in_list].tolist(),
            changed_columns[in_list].tolist(),
            new_ids[in_list].tolist(),
            strict=True,
        ):
            state = requests.get(row_to_request[row])
            if state is not None:
                state.block_ids[group_index][column] = new_id
    outside = requests.keys() - followed
    if outside:
        moved = set(remap.old_ids.tolist())
        for request_id in outside:
            for group in requests[request_id].block_ids:
                if group and not moved.isdisjoint(group):
                    group[:] = remap[group].tolist()
    return num_rewritten


def remap_v2_runner_rows(model_runner: Any, remap: Remap) -> None:
    """Rewrites the V2 runner's persistent block table after blocks moved: ``remap[old] = new``.

    vLLM 0.33's V2 runner (``vllm/v1/worker/gpu/model_runner.py``) keeps one row per
    request slot in ``block_tables.block_tables[0].gpu``, an int32
    ``[max_num_reqs, max_num_blocks]`` tensor on the runner's device; new requests
    overwrite their row, cached requests only append to it. The whole table is rewritten
    on its own device, in stream order before the forward pass: entries past a row's
    length, and rows of free slots, hold stale ids or the null block, which no pass reads
    (the null block 0 never moves, so zeros stay zeros). Staged writes are applied inside
    ``execute_model``, so none is pending when this runs (before it).

    Args:
        model_runner: A runner ``check_v2_runner`` accepts.
        remap: ``remap.table[old_physical] = new_physical`` for every block id.
    """
    assert remap[NULL_BLOCK_ID] == NULL_BLOCK_ID, (
        f"kvdefrag moved the null block to {int(remap[NULL_BLOCK_ID])}"
    )
    for staged in model_runner.block_tables.block_tables:
        table: torch.Tensor = staged.gpu
        lookup = torch.as_tensor(remap.table, dtype=torch.int64, device=table.device)
        table.copy_(lookup[table.long()].to(table.dtype))


class MoveHistory(Protocol):
    """What a translator reads of its rank's service (``ServerHandle``)."""

    def resolve(self, logical_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...

    def moves_since(self, version: int | None) -> tuple[int, list[MoveBatch]] | None: ...


class BlockIdTranslator:
    """Keeps a worker's block ids physical: what moved since its previous pass, and the
    physical ids of what an output names.

    Each ``advance`` (called holding ``kv_lock``, before a forward pass) returns how to
    resolve logical ids now and how physical ids moved since the previous call, so the
    persistent rows can follow. Both cost what changed: the compactions since the last
    pass (``ServerHandle.moves_since``) and the ids an output names, never the pool.

    Invariant: between calls ``_table`` is the identity and ``_moved`` all False.
    """

    def __init__(self, service: MoveHistory, num_blocks: int) -> None:
        self._service = service
        started = service.moves_since(None)
        assert started is not None, "moves_since(None) always answers"
        self._version = started[0]
        self._table = np.arange(num_blocks, dtype=np.int64)
        self._moved = np.zeros(num_blocks, dtype=np.bool_)
        self._patched = np.empty(0, dtype=np.int64)

    def advance(
        self,
    ) -> tuple[Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]], Remap | None]:
        """Returns ``(resolve, remap)``; ``remap`` is None when no data moved since last time.

        Raises:
            PassRefused: The service's log no longer reaches the previous pass (more
                compactions than it keeps came in between): the rows cannot follow;
                restart vLLM.
        """
        table = self._table
        table[self._patched] = self._patched  # the identity again
        self._moved[self._patched] = False
        self._patched = np.empty(0, dtype=np.int64)
        found = self._service.moves_since(self._version)
        if found is None:
            raise PassRefused(
                "kvdefrag: this worker's rows cannot follow the KV data any more: its "
                "service compacted more often than it keeps a record of since the "
                "worker's previous pass; restart vLLM"
            )
        self._version, batches = found
        if not batches:
            return self._service.resolve, None
        old_ids, new_ids = _compose(batches)
        if not old_ids.size:
            return self._service.resolve, None
        table[old_ids] = new_ids
        self._moved[old_ids] = True
        self._patched = old_ids
        return self._service.resolve, Remap(table, old_ids, self._moved)


def _compose(batches: list[MoveBatch]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Where the data of each slot went over ``batches`` (in order; the moves within one
    batch happen at once): ``(old slots, their new slots)``, moved ones only, by old slot."""
    if len(batches) == 1:  # no chains to follow: each slot is in one move at most
        (batch,) = batches
        src_ids = np.asarray(batch.src_ids, dtype=np.int64)
        dst_ids = np.asarray(batch.dst_ids, dtype=np.int64)
        swaps = np.asarray(batch.is_two_way, dtype=np.bool_)
        old_ids = np.concatenate([src_ids, dst_ids[swaps]])
        new_ids = np.concatenate([dst_ids, src_ids[swaps]])
        order = np.argsort(old_ids)
        return old_ids[order], new_ids[order]
    origin: dict[int, int | None] = {}  # slot now -> slot its data came from (None: garbage)
    for batch in batches:
        updates: dict[int, int | None] = {}
        for src, dst, is_two_way in zip(
            batch.src_ids, batch.dst_ids, batch.is_two_way, strict=True
        ):
            updates[dst] = origin.get(src, src)
            updates[src] = origin.get(dst, dst) if is_two_way else None
        origin.update(updates)
    pairs = sorted(
        (came_from, slot)
        for slot, came_from in origin.items()
        if came_from is not None and came_from != slot
    )
    old_ids = np.fromiter((old for old, _ in pairs), np.int64, len(pairs))
    new_ids = np.fromiter((new for _, new in pairs), np.int64, len(pairs))
    return old_ids, new_ids


def translate_scheduler_output(
    output: Any,
    mapping: npt.NDArray[np.int64] | Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]],
) -> None:
    """Rewrites, in place, every block id a ``SchedulerOutput`` names from logical to
    physical (``output_blocks.map_block_ids`` lists the fields: under the V2 runner resumed
    requests come as new ones, whole rows).

    Args:
        output: The ``SchedulerOutput``.
        mapping: ``mapping[logical_id] = physical_id`` as an array, or a function that
            resolves an array of logical ids (``ServerHandle.resolve``): called once,
            with every id the output names.
    """
    named: list[Sequence[int]] = []

    def collect(logical_ids: Sequence[int]) -> list[int]:
        named.append(logical_ids)
        return list(logical_ids)

    # NOTE: two walks of the same fields in the same order: the first gathers every id,
    # one lookup resolves them all, the second hands each list its share.
    map_block_ids(output, collect)
    lengths = [len(logical_ids) for logical_ids in named]
    flat = np.fromiter(itertools.chain.from_iterable(named), np.int64, sum(lengths))
    physical = (mapping[flat] if isinstance(mapping, np.ndarray) else mapping(flat)).tolist()
    shares = iter(lengths)
    start = 0

    def hand_out(logical_ids: Sequence[int]) -> list[int]:
        nonlocal start
        length = next(shares)
        start += length
        share: list[int] = physical[start - length : start]
        return share

    map_block_ids(output, hand_out)


def uses_v2_model_runner(vllm_config: object) -> bool:
    """Whether vLLM runs its V2 model runner (``VllmConfig.use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))
