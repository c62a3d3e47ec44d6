"""``make bench-transfer``: how many descriptors a KV transfer posts, plain vLLM against kvdefrag.

A disaggregated (P/D) deployment moves each request's prompt KV from a prefill instance
to a decode instance, and an offloading connector stores it to host memory. Both post
one small copy per block and KV region unless the block ids run consecutively, so the
layout of a request's blocks sets how many copies a transfer posts. This bench counts
them on block ids from vLLM 0.33's real ``Scheduler`` (built as ``EngineCore`` builds it,
``vllm_engineless.build_scheduler``), with the physical ids kvdefrag's real ``Engine``
gives the same steps (in process, on a tiny KV tensor: the bookkeeping is real, the
copies trivial; the steps are what kvdefrag's scheduler side plans,
``changes_from_output`` then ``BlockLedger.plan``, as in ``record_vllm_gaudi_traces.py``)::

    prefill instance (P)                         decode instance (D)
    Scheduler -> ledger -> Engine                Scheduler -> ledger -> Engine
    prompt blocks right after the prefill  ---->  prompt blocks at admission
    logical ids (plain vLLM) or physical ids (kvdefrag), on each side

Two instances, each its own scheduler over the same stream of requests: P with chunked
prefill and a short hold (the blocks stay until the decode side has read them: 1-16
steps), D with the whole prompt allocated in one step (its KV arrives from P) and long
outputs, so its pool churns and preempts. A transfer is a request that completed its
prefill on both; its blocks are ``ceil(prompt tokens / block size)`` on each side.

Counted per transfer, for plain vLLM on both instances, kvdefrag on both, kvdefrag on
P only and on D only:

* ``runs``: maximal sequences of consecutive ids among P's prompt blocks (per KV region).
* ``joint``: Mooncake's ``group_concurrent_contiguous`` groups of (P id, D id) pairs,
  both consecutive: that function is loaded from vLLM 0.33's own
  ``mooncake_connector.py`` source (the module itself does not import here: it needs
  ``uvicorn``). Mooncake posts one transfer per group and region when the whole block
  is copied (``_can_coalesce_block_transfers``).
* NIXL descriptors: vLLM 0.33's NIXL connector posts one descriptor per (region, block)
  (``nixl/base_worker.py`` ``_compute_desc_ids``: ``region_offsets + block_ids``, no
  merge), whatever the layout: ``regions x blocks``. With a joint-run merge (a pair
  merged only where local and remote ids are both consecutive, the rule of
  ``group_concurrent_contiguous`` and of vLLM PR 55841), ``regions x joint``.
* Offload copies per store: vLLM 0.33's CPU offloading (``kv_offload/cpu/gpu_worker.py``
  ``_fill_direct_ops``) fills one copy per (block, layer): ``layers x blocks``, whatever
  the layout. Merging GPU runs (vLLM PR 48434; the host side is taken as contiguous):
  ``layers x runs``.
* Modeled posting time: descriptors x ``NIXL_POST_S`` (NIXL, merged) and copies x
  ``OFFLOAD_COPY_S`` (offload, merged). The bytes are the same either way: only the
  per-descriptor part changes with the layout.

Per instance it also reports the pages of ``PAGE_BLOCKS`` blocks that live blocks touch
against the packed floor (``ceil(live / PAGE_BLOCKS)``), sampled every ten steps, and
the blocks kvdefrag moved per step (a swap counts two).

Prefix caching off and on (on: most prompts open with one of a few long shared system
prompts, so P's prompt blocks start with prefix-cache hits wherever they were cached).

Run: ``make bench-transfer`` (``.venv-vllm``; 1-4 minutes on two cores); ``--quick`` runs
a small pool for a few hundred steps (under a minute); ``--threshold N`` sets kvdefrag's
threshold (32 by default); ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np
import torch
from transfer_counts import (
    count_joint_runs,
    count_runs,
    load_vllm_function,
    pages_floor,
    pages_touched,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm_engineless import build_scheduler, poisson_count, sample_finished

from kvdefrag.server import Engine, EngineConfig
from kvdefrag.vllm._scheduler.bridge import ParkedBlocks, changes_from_output
from kvdefrag.vllm._scheduler.ledger import BlockLedger

BLOCK_SIZE = 16
MAX_MODEL_LEN = 32_768
# A 64-layer model with K and V registered apart: 128 NIXL regions, 64 offload layers.
NUM_LAYERS = 64
NUM_REGIONS = 2 * NUM_LAYERS
# Posting one NIXL descriptor: vLLM PR 55841 measured 79.6 ms for 23,252 descriptors.
NIXL_POST_S = 79.6e-3 / 23_252
# Submitting one offload copy: vLLM PR 48434, about 0.5 µs of CPU per copy.
OFFLOAD_COPY_S = 0.5e-6
SAMPLE_EVERY = 10
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN = 3_000, 0.8, 256
NUM_SYSTEM_PROMPTS = 6
SYSTEM_PROMPT_TOKENS = (1_024, 4_096)
SHARED_FRACTION = 0.6


@dataclasses.dataclass(frozen=True)
class Size:
    """One instance's pool and scheduler limits, and the requests arriving per step."""

    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    arrivals_per_step: float
    max_tokens: tuple[int, int]


# P: chunked prefill, short holds; D: whole prompts in one step, long outputs.
FULL = {
    "P": Size(8_192, 64, 8_192, 2.0, (1, 16)),
    "D": Size(16_384, 128, MAX_MODEL_LEN, 0.5, (200, 1_500)),
}
QUICK = {
    "P": Size(2_048, 32, 4_096, 1.0, (1, 16)),
    "D": Size(4_096, 64, MAX_MODEL_LEN, 0.5, (100, 400)),
}
FULL_STEPS, QUICK_STEPS = 2_500, 300
PROMPT_MAX = {"full": 16_384, "quick": 6_000}


# --- the workload -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]


def request_specs(num_requests: int, seed: int, prompt_max: int) -> list[RequestSpec]:
    """Long lognormal prompts; ``SHARED_FRACTION`` open with one of a few system prompts."""
    rng = random.Random(seed)
    system_prompts = [
        [rng.randrange(3, 32_000) for _ in range(rng.randrange(*SYSTEM_PROMPT_TOKENS))]
        for _ in range(NUM_SYSTEM_PROMPTS)
    ]
    specs = []
    for index in range(num_requests):
        length = int(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))
        length = min(prompt_max, max(PROMPT_MIN, length))
        prompt: list[int] = []
        if rng.random() < SHARED_FRACTION:
            prompt = list(rng.choice(system_prompts))[: length - 1]
        prompt += [rng.randrange(3, 32_000) for _ in range(length - len(prompt))]
        specs.append(RequestSpec(f"req-{index}", prompt))
    return specs


@dataclasses.dataclass
class Captured:
    """One request's prompt blocks, logical and (through the engine) physical."""

    logical_ids: list[int]
    physical_ids: list[int]


@dataclasses.dataclass
class InstanceRun:
    """What one instance recorded."""

    captured: dict[str, Captured]
    pages: list[tuple[int, int, int]]  # (vLLM's pages, kvdefrag's pages, floor)
    moved_per_step: list[int]
    num_preempted: int
    num_steps: int


class Instance:
    """One vLLM scheduler, kvdefrag's scheduler-side planning, and a real ``Engine``."""

    def __init__(self, size: Size, *, prefix_caching: bool, config: EngineConfig) -> None:
        self.size = size
        self.scheduler = build_scheduler(
            Scheduler,
            block_size=BLOCK_SIZE,
            num_blocks=size.num_blocks,
            max_num_seqs=size.max_num_seqs,
            max_num_batched_tokens=size.max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            prefix_caching=prefix_caching,
        )
        self.parked = ParkedBlocks(getattr(self.scheduler, "deferred_frees", ()))
        self.scheduler.deferred_frees = self.parked  # type: ignore[attr-defined]
        self.ledger = BlockLedger(
            num_blocks=size.num_blocks, block_size=BLOCK_SIZE, prefix_caching=prefix_caching
        )
        kv = [(torch.zeros(size.num_blocks, 1), torch.zeros(size.num_blocks, 1))]
        self.engine = Engine(kv, block_size=1, config=config)
        manager = self.scheduler.kv_cache_manager
        self.pool = manager.block_pool.blocks
        self.req_to_blocks = manager.coordinator.single_type_managers[0].req_to_blocks

    def is_cached(self, block_id: int) -> bool:
        return self.pool[block_id].block_hash is not None

    def run(self, specs: Sequence[RequestSpec], num_steps: int, seed: int) -> InstanceRun:
        scheduler, size = self.scheduler, self.size
        rng = random.Random(seed)
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        captured: dict[str, Captured] = {}
        pages: list[tuple[int, int, int]] = []
        moved: list[int] = []
        num_preempted = 0
        pending = iter(specs)
        for step in range(num_steps):
            for _ in range(poisson_count(rng, size.arrivals_per_step)):
                spec = next(pending, None)
                if spec is None:
                    break
                max_tokens = rng.randint(*size.max_tokens)
                scheduler.add_request(
                    Request(
                        request_id=spec.request_id,
                        prompt_token_ids=spec.prompt,
                        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        pooling_params=None,
                        block_hasher=hasher,
                    )
                )
            output = scheduler.schedule()
            num_preempted += len(output.preempted_req_ids or ())
            events = self.ledger.plan(changes_from_output(output, self.parked), self.is_cached)
            result = self.engine.step(events)
            moved.append(len(result.moves) + result.moves.num_two_way)
            for request_id in output.num_scheduled_tokens:
                request = scheduler.requests[request_id]
                if (
                    request_id in captured
                    or request.num_computed_tokens < request.num_prompt_tokens
                ):
                    continue
                num_prompt_blocks = -(-request.num_prompt_tokens // BLOCK_SIZE)
                logical_ids = [
                    block.block_id for block in self.req_to_blocks[request_id][:num_prompt_blocks]
                ]
                physical_ids = self.engine.resolve(logical_ids).tolist()
                captured[request_id] = Captured(logical_ids, physical_ids)
            if step % SAMPLE_EVERY == 0:
                live = [i for i, count in enumerate(self.ledger.refs) if count > 0]
                physical = self.engine.resolve(live).tolist() if live else []
                pages.append((pages_touched(live), pages_touched(physical), pages_floor(len(live))))
            scheduler.update_from_output(output, sample_finished(scheduler, output))
        return InstanceRun(captured, pages, moved, num_preempted, num_steps)


# --- the table ------------------------------------------------------------------------------
LAYOUTS = (
    ("plain vLLM", False, False),
    ("kvdefrag P+D", True, True),
    ("kvdefrag P only", True, False),
    ("kvdefrag D only", False, True),
)


@dataclasses.dataclass(frozen=True)
class LayoutRow:
    """Per-transfer figures of one layout: lists over the transfers, in request order."""

    layout: str
    runs: list[int]
    joint: list[int]
    num_blocks: list[int]

    def nixl(self, *, merged: bool) -> list[int]:
        per_region = self.joint if merged else self.num_blocks
        return [NUM_REGIONS * count for count in per_region]

    def offload(self, *, merged: bool) -> list[int]:
        per_layer = self.runs if merged else self.num_blocks
        return [NUM_LAYERS * count for count in per_layer]


def layout_rows(
    prefill: InstanceRun,
    decode: InstanceRun,
    group: Callable[[list[int], list[int]], tuple[list[list[int]], list[list[int]]]],
) -> list[LayoutRow]:
    """The figures of every layout over the requests both instances prefilled.

    ``group`` is Mooncake's ``group_concurrent_contiguous``: its group count must equal
    ``count_joint_runs`` on every pair (checked).
    """
    request_ids = [rid for rid in prefill.captured if rid in decode.captured]
    rows = []
    for layout, defrag_p, defrag_d in LAYOUTS:
        runs, joint, blocks = [], [], []
        for request_id in request_ids:
            p, d = prefill.captured[request_id], decode.captured[request_id]
            local = p.physical_ids if defrag_p else p.logical_ids
            remote = d.physical_ids if defrag_d else d.logical_ids
            assert len(local) == len(remote), f"{request_id}: {len(local)} vs {len(remote)}"
            runs.append(count_runs(local))
            joint.append(count_joint_runs(local, remote))
            blocks.append(len(local))
            groups, _ = group(local, remote)
            assert len(groups) == joint[-1], f"{request_id}: Mooncake groups {len(groups)}"
        rows.append(LayoutRow(layout, runs, joint, blocks))
    return rows


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def p90(values: Sequence[float]) -> float:
    return float(np.percentile(values, 90)) if values else 0.0


def summarize(rows: list[LayoutRow]) -> list[dict[str, Any]]:
    """One dict per layout: means and p90s, and ratios to plain vLLM (the first row)."""
    plain = rows[0]
    out = []
    for row in rows:
        nixl = row.nixl(merged=True)
        offload = row.offload(merged=True)
        plain_nixl = plain.nixl(merged=True)
        out.append(
            {
                "layout": row.layout,
                "transfers": len(row.runs),
                "blocks_mean": mean(row.num_blocks),
                "runs_mean": mean(row.runs),
                "runs_p90": p90(row.runs),
                "joint_mean": mean(row.joint),
                "joint_p90": p90(row.joint),
                "nixl_033_mean": mean(row.nixl(merged=False)),
                "nixl_merged_mean": mean(nixl),
                "nixl_merged_p90": p90(nixl),
                "fewer_mean": mean(plain_nixl) / mean(nixl) if nixl else 0.0,
                "fewer_p90": p90(plain_nixl) / p90(nixl) if nixl else 0.0,
                "nixl_post_ms_mean": mean(nixl) * NIXL_POST_S * 1e3,
                "offload_033_mean": mean(row.offload(merged=False)),
                "offload_merged_mean": mean(offload),
                "offload_submit_us_mean": mean(offload) * OFFLOAD_COPY_S * 1e6,
                "offload_fewer_mean": mean(plain.offload(merged=True)) / mean(offload)
                if offload
                else 0.0,
            }
        )
    return out


def instance_summary(name: str, run: InstanceRun) -> dict[str, Any]:
    ratios_plain = [vllm_pages / floor for vllm_pages, _, floor in run.pages if floor]
    ratios_defrag = [defrag / floor for _, defrag, floor in run.pages if floor]
    return {
        "instance": name,
        "steps": run.num_steps,
        "prefills": len(run.captured),
        "preempted": run.num_preempted,
        "pages_vs_floor_vllm": mean(ratios_plain),
        "pages_vs_floor_kvdefrag": mean(ratios_defrag),
        "moved_per_step": mean(run.moved_per_step),
        "moved_max": max(run.moved_per_step, default=0),
    }


def run_case(
    prefix_caching: bool,
    sizes: dict[str, Size],
    num_steps: int,
    prompt_max: int,
    seed: int,
    threshold: int = EngineConfig.threshold,
) -> dict[str, Any]:
    specs = request_specs(int(num_steps * sizes["P"].arrivals_per_step * 2) + 64, seed, prompt_max)
    runs = {}
    for name, size in sizes.items():
        started = time.perf_counter()
        config = EngineConfig(prefix_caching=prefix_caching, threshold=threshold)
        instance = Instance(size, prefix_caching=prefix_caching, config=config)
        runs[name] = instance.run(specs, num_steps, seed + (name == "D"))
        print(
            f"  .. prefix caching {'on' if prefix_caching else 'off'}, {name}: "
            f"{num_steps} steps in {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    group = load_vllm_function(
        "distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
        "group_concurrent_contiguous",
    )
    rows = layout_rows(runs["P"], runs["D"], group)
    return {
        "prefix_caching": prefix_caching,
        "layouts": summarize(rows),
        "instances": [instance_summary(name, run) for name, run in runs.items()],
    }


def format_case(case: dict[str, Any]) -> str:
    lines = [
        f"== prefix caching {'on' if case['prefix_caching'] else 'off'}: "
        f"{case['layouts'][0]['transfers']} transfers, "
        f"{case['layouts'][0]['blocks_mean']:.0f} blocks each on average",
        f"   {NUM_REGIONS} NIXL regions, {NUM_LAYERS} offload layers; NIXL as vLLM 0.33 posts "
        f"it: {case['layouts'][0]['nixl_033_mean']:,.0f} descriptors and offload "
        f"{case['layouts'][0]['offload_033_mean']:,.0f} copies per transfer, every layout",
        "   merged = pairs merged where both sides run on (NIXL, Mooncake); fewer = plain"
        " vLLM's over this layout's",
        f"{'layout':>16} {'runs':>6} {'p90':>5} {'joint':>6} {'p90':>5} {'descs':>8}"
        f" {'p90':>8} {'fewer':>6} {'p90':>6} {'post ms':>8} {'offload':>8} {'µs':>7}"
        f" {'fewer':>6}",
    ]
    for row in case["layouts"]:
        lines.append(
            f"{row['layout']:>16} {row['runs_mean']:6.1f} {row['runs_p90']:5.0f}"
            f" {row['joint_mean']:6.1f} {row['joint_p90']:5.0f}"
            f" {row['nixl_merged_mean']:8,.0f} {row['nixl_merged_p90']:8,.0f}"
            f" {row['fewer_mean']:5.2f}x {row['fewer_p90']:5.2f}x"
            f" {row['nixl_post_ms_mean']:8.2f} {row['offload_merged_mean']:8,.0f}"
            f" {row['offload_submit_us_mean']:7.0f} {row['offload_fewer_mean']:5.2f}x"
        )
    lines.append(
        f"{'instance':>16} {'steps':>6} {'prefills':>8} {'preempted':>9}"
        f" {'pages/floor vLLM':>16} {'kvdefrag':>8} {'moved/step':>10} {'max':>5}"
    )
    for inst in case["instances"]:
        lines.append(
            f"{inst['instance']:>16} {inst['steps']:6d} {inst['prefills']:8d}"
            f" {inst['preempted']:9d} {inst['pages_vs_floor_vllm']:15.3f}x"
            f" {inst['pages_vs_floor_kvdefrag']:7.3f}x {inst['moved_per_step']:10.2f}"
            f" {inst['moved_max']:5d}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small pool, a few hundred steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument(
        "--threshold", type=int, default=EngineConfig.threshold, help="kvdefrag's threshold"
    )
    args = parser.parse_args(argv)
    init_none_hash(sha256)
    sizes = QUICK if args.quick else FULL
    num_steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    prompt_max = PROMPT_MAX["quick" if args.quick else "full"]
    cases = []
    for prefix_caching in (False, True):
        case = run_case(prefix_caching, sizes, num_steps, prompt_max, args.seed, args.threshold)
        print(format_case(case), flush=True)
        cases.append(case)
    print(
        f"   modeled: NIXL posting {NIXL_POST_S * 1e6:.2f} µs a descriptor (vLLM PR 55841), "
        f"offload {OFFLOAD_COPY_S * 1e6:.1f} µs a copy (vLLM PR 48434)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(cases, indent=1))
    return cases


if __name__ == "__main__":
    main()
