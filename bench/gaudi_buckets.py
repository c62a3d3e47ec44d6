"""Gaudi decode buckets: what each policy costs when decode reads whole buckets.

With contiguous paged attention (vllm-gaudi), a decode step builds a block list indexed by
physical block id and reads the first ``decode_bucket(max live id + 1)`` blocks of the
cache, the buckets being vllm-gaudi's exponential defaults (``exponential_decode_buckets``
in ``kvdefrag.server.config``, for the pool, ``max_num_seqs`` and ``max_model_len``; the
top one is the pool). So compaction saves reads only when it lowers the bucket, and each
bucket never seen before costs a graph compile (200-400 ms on Gaudi). Contiguous PA turns
prefix caching off, so every move is one way: one block read and one written.

Per policy and trace, this bench sums over the steps::

    blocks read + written = sum of decode_bucket(max live id + 1)  +  2 x blocks moved

(no read on a step with no live block) and counts the distinct buckets decode ran in
(the compiles), for: no defragmentation (the allocator's own ids), the seed
(``seed_baseline.py``, vllm-gaudi's ``OnlineDefragmenter`` restated), kvdefrag's threshold
policy and kvdefrag's bucket-aware policy (``EngineConfig.decode_buckets``), the last two
through the real ``Engine`` in process on a tiny KV tensor (one element per block: the
bookkeeping is real, the copies are trivial).

Traces, both kinds in one table (the first column names the source):

* ``sim``: the synthetic workload (``kvdefrag.tools.workload``, vLLM's block pool) in a
  Gaudi configuration (128-token blocks, prefix caching off, ``max_num_seqs`` 128) at
  light, mid and heavy load, each with vLLM 0.33's free order (freed blocks reused first,
  "lifo") and with the one of the earlier vLLM v1 releases vllm-gaudi pinned (freed blocks
  reused last, "fifo").
* ``vllm``: the same loads and orders recorded from vLLM 0.33's real ``Scheduler``
  (``bench/traces/vllm-{load}-{order}.jsonl.gz``, kvdefrag's trace format gzipped; see
  ``record_vllm_gaudi_traces.py``, which re-records them in ``.venv-vllm``). This bench
  only reads them, so it needs no vLLM; the live blocks after each step are worked out
  from the recorded events (``steps_from_events``).

The goals are checked per source, each over all of its traces.
"""

from __future__ import annotations

import dataclasses
import gzip
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from seed_baseline import SeedEquivalentDefragmenter

from kvdefrag.client.record import parse_trace
from kvdefrag.common import NULL_BLOCK_ID, StepEvents
from kvdefrag.server import Engine, EngineConfig
from kvdefrag.server.buckets import decode_bucket, exponential_decode_buckets
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig, WorkloadStep

NUM_BLOCKS = 2_048  # 128-token blocks: 256k tokens of KV
BLOCK_SIZE = 128
MAX_NUM_SEQS = 128  # also vllm-gaudi's bucket step (it uses max_num_seqs)
# As record_vllm_gaudi_traces.py's; the longest simulated request (8,192 + 4,096 tokens)
# fits. The decode buckets' worst case, 128 x 128 blocks, is above the pool, so they run
# up to the pool.
MAX_MODEL_LEN = 16_384
# Mean arrivals per step: light, mid and heavy load (about 25%, 45% and 90% of the pool
# live; heavy preempts).
LOADS = {"light": 0.03, "mid": 0.08, "heavy": 0.4}
FREE_ORDERS = ("lifo", "fifo")
POLICIES = ("none", "seed", "kvdefrag threshold", "kvdefrag buckets")
TRACES_DIR = Path(__file__).resolve().parent / "traces"
SIMULATOR, RECORDED = "sim", "vllm"  # where a trace's steps come from
# Steps of a simulated trace, --quick or not (see run_gaudi_buckets); the recorded ones
# have as many.
NUM_STEPS = 3_000

# Goals, from the Gaudi issue: the bucket-aware policy reads and writes no more blocks
# than the seed with at most half its moves, on every trace, and decode runs in no more
# distinct buckets than without defragmentation.
GOAL_MOVED_VS_SEED = 0.5


@dataclasses.dataclass
class BucketCost:
    """What one policy cost over one trace.

    Attributes:
        policy: Its name.
        blocks_read: Sum over the steps of ``decode_bucket(max live id + 1)``.
        blocks_moved: Blocks copied by compaction (a swap would count 2; none here).
        buckets: The distinct decode buckets the steps ran in.
        num_steps: Steps accounted (a step with no live block reads nothing).
    """

    policy: str
    blocks_read: int = 0
    blocks_moved: int = 0
    buckets: set[int] = dataclasses.field(default_factory=set)
    num_steps: int = 0

    @property
    def blocks_read_written(self) -> int:
        """Decode reads plus 2 per moved block (one read, one write)."""
        return self.blocks_read + 2 * self.blocks_moved


def account(
    policy: str,
    buckets: Sequence[int],
    num_blocks: int,
    per_step: Iterable[tuple[int, int]],
) -> BucketCost:
    """Sums the cost of a policy from, for each step, its highest live id after the step
    (0: nothing live) and the blocks it moved in that step."""
    cost = BucketCost(policy)
    for max_live, num_moved in per_step:
        cost.num_steps += 1
        cost.blocks_moved += num_moved
        if max_live:
            bucket = decode_bucket(buckets, max_live + 1, num_blocks)
            cost.blocks_read += bucket
            cost.buckets.add(bucket)
    return cost


def without_defragmentation(steps: Sequence[WorkloadStep]) -> list[tuple[int, int]]:
    """The allocator's own ids: nothing moves."""
    return [(step.max_live_block_id, 0) for step in steps]


def seed_steps(steps: Sequence[WorkloadStep], threshold: int = 32) -> list[tuple[int, int]]:
    """The seed-equivalent defragmenter (up to 512 one-way moves a step)."""
    seed = SeedEquivalentDefragmenter(lambda pairs, bucket: None, threshold=threshold)
    per_step = []
    for step in steps:
        moved_before = seed.num_moves
        seed.step(**step.events.as_kwargs())
        per_step.append((seed.max_used, seed.num_moves - moved_before))
    return per_step


def engine_steps(
    steps: Sequence[WorkloadStep], num_blocks: int, config: EngineConfig
) -> list[tuple[int, int]]:
    """kvdefrag's ``Engine`` with ``config``, on a tiny CPU KV tensor of the pool's size."""
    kv = [(torch.zeros(num_blocks, 1), torch.zeros(num_blocks, 1))]
    engine = Engine(kv, block_size=1, config=config)
    per_step = []
    for step in steps:
        result = engine.step(step.events)
        moved = len(result.moves) + result.moves.num_two_way  # a swap copies two blocks
        per_step.append((result.stats.max_live, moved))
    return per_step


def run_trace(
    steps: Sequence[WorkloadStep],
    num_blocks: int,
    buckets: Sequence[int],
    *,
    threshold: int = 32,
) -> list[BucketCost]:
    """Every policy of ``POLICIES`` over one trace; ``threshold`` is the seed's and the
    threshold policy's (32: both defaults)."""
    threshold_policy = EngineConfig(threshold=threshold)
    bucket_aware = EngineConfig(threshold=threshold, decode_buckets=tuple(buckets))
    runs = {
        "none": without_defragmentation(steps),
        "seed": seed_steps(steps, threshold),
        "kvdefrag threshold": engine_steps(steps, num_blocks, threshold_policy),
        "kvdefrag buckets": engine_steps(steps, num_blocks, bucket_aware),
    }
    return [account(name, buckets, num_blocks, runs[name]) for name in POLICIES]


def make_trace(load: str, free_order: str, num_steps: int) -> list[WorkloadStep]:
    config = WorkloadConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_steps=num_steps,
        arrival_rate=LOADS[load],
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=4_096,
        enable_prefix_caching=False,
        free_order=free_order,
    )
    return list(SyntheticWorkload(config))


def steps_from_events(events: Sequence[StepEvents]) -> list[WorkloadStep]:
    """Steps of a recorded trace (prefix caching off), with the live blocks after each
    step worked out from the events: a block is live while a request's list names it."""
    held: dict[str, list[int]] = {}
    refs: dict[int, int] = {}

    def drop(block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            refs[block_id] -= 1
            if not refs[block_id]:
                del refs[block_id]

    def take(block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1

    steps = []
    for index, step in enumerate(events):
        for request_id in step.finished:
            drop(held.pop(request_id, ()))
        for request_id, block_ids in step.resumed.items():
            drop(held.pop(request_id, ()))
            held[request_id] = list(block_ids)
            take(block_ids)
        for request_id, block_ids in step.new_blocks.items():
            held.setdefault(request_id, []).extend(block_ids)
            take(block_ids)
        refs.pop(NULL_BLOCK_ID, None)
        steps.append(
            WorkloadStep(
                index=index,
                events=step,
                num_scheduled_tokens={},
                num_live_blocks=len(refs),
                max_live_block_id=max(refs, default=0),
                num_running=0,
                num_waiting=0,
                num_preempted=0,
                num_prefix_hit_blocks=0,
            )
        )
    return steps


def recorded_traces(folder: Path = TRACES_DIR) -> list[tuple[dict[str, Any], list[WorkloadStep]]]:
    """The traces ``record_vllm_gaudi_traces.py`` recorded from vLLM 0.33's scheduler:
    each one's header metadata (``load``, ``free_order``, ...) and its steps."""
    found = []
    for path in sorted(folder.glob("vllm-*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            trace = parse_trace(file, path.name)
        header = trace.header
        assert not header.prefix_caching, f"{path.name}: recorded with prefix caching"
        assert (header.num_blocks, header.block_size) == (NUM_BLOCKS, BLOCK_SIZE), path.name
        found.append((header.metadata, steps_from_events(trace.steps)))
    order = {load: index for index, load in enumerate(LOADS)}
    found.sort(key=lambda item: (order.get(item[0]["load"], 99), item[0]["free_order"] != "lifo"))
    return found


def _trace_row(
    source: str, load: str, free_order: str, steps: Sequence[WorkloadStep], buckets: Sequence[int]
) -> dict[str, Any]:
    costs = run_trace(steps, NUM_BLOCKS, buckets)
    return {
        "source": source,
        "load": load,
        "free_order": free_order,
        "num_steps": len(steps),
        "mean_live": statistics.fmean(step.num_live_blocks for step in steps),
        "mean_max_id": statistics.fmean(step.max_live_block_id for step in steps),
        "policies": [
            {
                "policy": cost.policy,
                "blocks_read": cost.blocks_read,
                "blocks_moved": cost.blocks_moved,
                "blocks_read_written": cost.blocks_read_written,
                "buckets": sorted(cost.buckets),
            }
            for cost in costs
        ],
    }


def run_gaudi_buckets() -> dict[str, Any]:
    """Every policy on every trace, simulated then recorded; ratios against no
    defragmentation and the seed.

    NOTE: ``bench/run.py --quick`` runs the same 3,000 steps. A simulated trace starts
    with 64 requests waiting, and at light load its live blocks take about 1,000 steps to
    come down to their steady state. The first 1,500 steps are mostly that drain, where
    each lower bucket entered costs a move of every live block above it, while the
    bucket-aware policy already reads the least any policy can (the bucket of the live
    count every step): 0.55x the seed's moves there, 0.27x in steps 1,500-3,000. The
    shorter run saved about 3 s and judged the goals mostly on the transient.
    """
    buckets = exponential_decode_buckets(
        NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE
    )
    traces = []
    for load in LOADS:
        for free_order in FREE_ORDERS:
            steps = make_trace(load, free_order, NUM_STEPS)
            traces.append(_trace_row(SIMULATOR, load, free_order, steps, buckets))
    for metadata, steps in recorded_traces():
        traces.append(
            _trace_row(RECORDED, metadata["load"], metadata["free_order"], steps, buckets)
        )
    return {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "num_steps": NUM_STEPS,
        "max_model_len": MAX_MODEL_LEN,
        "decode_buckets": list(buckets),
        "traces": traces,
    }


def trace_label(trace: dict[str, Any]) -> str:
    """``"[source] load free_order"`` (no source for a row that has none)."""
    source = trace.get("source")
    return f"{source + ' ' if source else ''}{trace['load']} {trace['free_order']}"


def goals(results: dict[str, Any], source: str | None = None) -> dict[str, dict[str, Any]]:
    """The worst trace for each goal: bucket-aware read+written over the seed's, its moves
    over the seed's, and its distinct buckets over those without defragmentation.

    Args:
        results: What ``run_gaudi_buckets`` returned.
        source: Only the traces of this source (``SIMULATOR``, ``RECORDED``); None: all.

    Returns:
        Goal -> ``ratio``, ``trace``, ``measured`` and ``baseline`` on the worst trace.
    """
    worst: dict[str, dict[str, Any]] = {}
    for trace in results["traces"]:
        if source is not None and trace.get("source") != source:
            continue
        by_name = {row["policy"]: row for row in trace["policies"]}
        aware, seed, none = by_name["kvdefrag buckets"], by_name["seed"], by_name["none"]
        pairs = {
            "read_written_vs_seed": (aware["blocks_read_written"], seed["blocks_read_written"]),
            "moved_vs_seed": (aware["blocks_moved"], seed["blocks_moved"]),
            "buckets_vs_none": (len(aware["buckets"]), len(none["buckets"])),
        }
        for key, (measured, baseline) in pairs.items():
            ratio = measured / max(1, baseline)
            if key not in worst or ratio > worst[key]["ratio"]:
                worst[key] = {
                    "ratio": ratio,
                    "trace": trace_label(trace),
                    "measured": measured,
                    "baseline": baseline,
                }
    return worst


def _ratio(value: float, baseline: float) -> str:
    return f"{value / baseline:.3f}x" if baseline else "-"


def format_gaudi_buckets(results: dict[str, Any]) -> str:
    """One table: every trace and policy, with its ratios against none and the seed."""
    buckets = results["decode_buckets"]
    lines = [
        "== Gaudi decode buckets: blocks read + written = sum of bucket(max live id + 1) "
        "+ 2 x blocks moved",
        f"   {results['num_blocks']:,} blocks of {results['block_size']} tokens, prefix caching "
        f"off, {results['num_steps']:,} steps a trace; decode buckets (vllm-gaudi's "
        f"exponential defaults, max_num_seqs {MAX_NUM_SEQS}, max_model_len "
        f"{results.get('max_model_len', MAX_MODEL_LEN):,}): {', '.join(map(str, buckets))}",
        "   r+w = blocks read + written; /none, /seed: its ratio to no defragmentation and to "
        "the seed (bench/seed_baseline.py); buckets = distinct decode buckets (compiles)",
    ]
    headers = ["trace", "live/max id", "policy", "r+w", "/none", "/seed", "moved", "/seed"]
    headers.append("buckets")
    rows = []
    for trace in results["traces"]:
        by_name = {row["policy"]: row for row in trace["policies"]}
        none, seed = by_name["none"], by_name["seed"]
        for index, row in enumerate(trace["policies"]):
            first = index == 0
            rows.append(
                [
                    trace_label(trace) if first else "",
                    f"{trace['mean_live']:.0f}/{trace['mean_max_id']:.0f}" if first else "",
                    row["policy"],
                    f"{row['blocks_read_written']:,}",
                    _ratio(row["blocks_read_written"], none["blocks_read_written"]),
                    _ratio(row["blocks_read_written"], seed["blocks_read_written"]),
                    f"{row['blocks_moved']:,}",
                    _ratio(row["blocks_moved"], seed["blocks_moved"]),
                    str(len(row["buckets"])),
                ]
            )
    lines.append(_table(headers, rows))
    sources = dict.fromkeys(trace.get("source") for trace in results["traces"])
    for source in sources:
        worst = goals(results, source)
        for key, what, goal in (
            ("read_written_vs_seed", "r+w over the seed's", 1.0),
            ("moved_vs_seed", "moves over the seed's", GOAL_MOVED_VS_SEED),
            ("buckets_vs_none", "distinct buckets over no defragmentation's", 1.0),
        ):
            ratio = worst[key]["ratio"]
            verdict = "met" if ratio <= goal else f"NOT met (by {ratio / goal - 1:.1%})"
            lines.append(
                f"   goal: bucket-aware {what} <= {goal}x on every {source or ''} trace: worst "
                f"{ratio:.3f}x ({worst[key]['trace']}), {verdict}"
            )
    return "\n".join(lines)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


if __name__ == "__main__":
    print(format_gaudi_buckets(run_gaudi_buckets()))
