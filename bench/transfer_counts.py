"""What one KV transfer posts, counted from its block ids (``transfer_bench.py``'s rules).

Pure numpy, no vLLM: the rules are read from vLLM 0.33's connectors (each function names
where), and ``load_vllm_function`` compiles one of vLLM's own functions from its source
where its module does not import (the bench checks its counts against Mooncake's).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PAGE_BLOCKS = 16


def count_runs(block_ids: Sequence[int]) -> int:
    """Maximal sequences of consecutive ids (``[4, 5, 6, 9, 10]``: 2)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if not len(ids):
        return 0
    return 1 + int(np.count_nonzero(np.diff(ids) != 1))


def count_joint_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> int:
    """Maximal sequences of pairs where the local and the remote ids both go up by one."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    assert len(local) == len(remote), f"{len(local)} local ids, {len(remote)} remote"
    if not len(local):
        return 0
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    return 1 + int(np.count_nonzero(breaks))


def nixl_descriptors(
    local_ids: Sequence[int], remote_ids: Sequence[int], num_regions: int, *, merged: bool
) -> int:
    """Descriptors one NIXL read posts: one per (region, block) as vLLM 0.33 builds them,
    or one per (region, joint run) when pairs merge where both sides run on."""
    per_region = count_joint_runs(local_ids, remote_ids) if merged else len(local_ids)
    return num_regions * per_region


def offload_copies(gpu_ids: Sequence[int], num_layers: int, *, merged: bool) -> int:
    """Copies one offload store submits: one per (block, layer) as vLLM 0.33 fills them,
    or one per (GPU run, layer) when runs merge (the host side contiguous)."""
    return num_layers * (count_runs(gpu_ids) if merged else len(gpu_ids))


def pages_touched(physical_ids: Sequence[int], page_blocks: int = PAGE_BLOCKS) -> int:
    """Distinct pages of ``page_blocks`` blocks holding at least one of ``physical_ids``."""
    ids = np.asarray(physical_ids, dtype=np.int64)
    return len(np.unique(ids // page_blocks)) if len(ids) else 0


def pages_floor(num_live: int, page_blocks: int = PAGE_BLOCKS) -> int:
    """The fewest pages ``num_live`` blocks can touch: packed from slot 1 (slot 0 is the
    null block's), ``ceil((num_live + 1) / page_blocks)``."""
    return -(-(num_live + 1) // page_blocks) if num_live else 0


def load_vllm_function(relative_path: str, name: str) -> Callable[..., Any]:
    """A module-level function of vLLM's own source, compiled on its own (with numpy as
    ``np``): for code whose module does not import here."""
    import vllm

    path = Path(vllm.__file__).parent / relative_path
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            module = ast.Module(body=[node], type_ignores=[])
            namespace: dict[str, Any] = {"np": np}
            exec(compile(module, str(path), "exec"), namespace)
            function: Callable[..., Any] = namespace[name]
            return function
    raise LookupError(f"{name} is not defined in {path}")
