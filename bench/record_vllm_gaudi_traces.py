"""Records the Gaudi bucket bench's traces from vLLM 0.33's real ``Scheduler``.

Run in ``.venv-vllm`` (``make record-gaudi-traces``); it writes ``bench/traces/
vllm-{load}-{free_order}.jsonl.gz``, which ``gaudi_buckets.py`` reads in the main
``.venv`` (no vLLM needed there). The files are committed: re-record only when the
workload or vLLM changes.

The configuration is vllm-gaudi's with contiguous paged attention: prefix caching off,
128-token blocks, a pool of 2,048 blocks, ``max_num_seqs`` 128, a 4,096-token step
budget (chunked prefill), synchronous scheduling. Requests arrive as a Poisson process
(light, mid and heavy load: the same rates as the simulator's traces in
``gaudi_buckets.py``), with lognormal prompts and Pareto outputs (decode-heavy: most
steps only decode); 64 requests wait before the first step.

Each step runs ``schedule()``, then a stand-in for the model (one sampled token for every
request whose scheduled tokens reach its end; ``ignore_eos``, so a request ends at its
``max_tokens``), then ``update_from_output()``. What the scheduler side would send for
that step is what kvdefrag's own scheduler-side code makes of the output:
``kvdefrag.vllm._scheduler.bridge.changes_from_output`` then ``BlockLedger.plan`` (as
``DefragScheduler.schedule`` does, without a service). Every step is written, empty ones
too (decode still reads its bucket then), in ``kvdefrag.client.record``'s trace format,
gzipped; the ledger is audited against vLLM's KV cache manager every 50 steps.

Free-block order: vLLM 0.33's ``BlockPool.free_blocks`` prepends blocks freed without a
prefix-cache hash to the free queue (``FreeKVCacheBlockQueue.prepend_n``), so they are
reused first ("lifo"). For "fifo" (earlier vLLM v1 releases, which appended every freed
block to the tail), the recording replaces, on this scheduler's queue instance only,
``prepend_n`` by the same queue's ``append_n``: ``free_blocks`` is its only caller, so
every freed block then goes to the tail, in the order ``free_blocks`` got them.
"""

from __future__ import annotations

import argparse
import gzip
import io
import math
import random
from pathlib import Path

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm_engineless import build_scheduler, poisson_count, sample_finished

from kvdefrag.client.record import StepRecorder
from kvdefrag.vllm._scheduler.bridge import ParkedBlocks, changes_from_output
from kvdefrag.vllm._scheduler.ledger import BlockLedger

NUM_BLOCKS = 2_048
BLOCK_SIZE = 128
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 4_096
MAX_MODEL_LEN = 16_384
INITIAL_REQUESTS = 64
LOADS = {"light": 0.03, "mid": 0.08, "heavy": 0.4}  # mean arrivals per step
FREE_ORDERS = ("lifo", "fifo")
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_MIN, PROMPT_MAX = 600, 1.0, 8, 8_192
OUTPUT_SCALE, OUTPUT_ALPHA, OUTPUT_MAX = 260, 1.4, 4_096
AUDIT_EVERY = 50
OUT_DIR = Path(__file__).resolve().parent / "traces"


def make_scheduler(free_order: str) -> Scheduler:
    """vLLM's ``Scheduler`` as ``EngineCore`` builds it, in the Gaudi configuration."""
    scheduler = build_scheduler(
        Scheduler,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        prefix_caching=False,
    )
    if free_order == "fifo":
        queue = scheduler.kv_cache_manager.block_pool.free_block_queue
        queue.prepend_n = queue.append_n  # type: ignore[method-assign]
    return scheduler


def _request(rng: random.Random, index: int) -> Request:
    prompt_len = int(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))
    prompt_len = min(PROMPT_MAX, max(PROMPT_MIN, prompt_len))
    output_len = min(OUTPUT_MAX, int(OUTPUT_SCALE * rng.paretovariate(OUTPUT_ALPHA)))
    return Request(
        request_id=f"req-{index}",
        prompt_token_ids=[rng.randrange(3, 32_000) for _ in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
        pooling_params=None,
    )


def record(load: str, free_order: str, num_steps: int, seed: int) -> Path:
    """Records one trace; returns its path."""
    scheduler = make_scheduler(free_order)
    parked = ParkedBlocks(getattr(scheduler, "deferred_frees", ()))
    scheduler.deferred_frees = parked  # type: ignore[attr-defined]
    ledger = BlockLedger(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, prefix_caching=False)
    pool = scheduler.kv_cache_manager.block_pool.blocks
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    def is_cached(block_id: int) -> bool:
        return pool[block_id].block_hash is not None

    rng = random.Random(seed)
    next_id = 0
    for _ in range(INITIAL_REQUESTS):
        scheduler.add_request(_request(rng, next_id))
        next_id += 1
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / f"vllm-{load}-{free_order}.jsonl.gz"
    metadata = {
        "source": "vllm 0.33 Scheduler (bench/record_vllm_gaudi_traces.py)",
        "load": load,
        "free_order": free_order,
        "arrival_rate": LOADS[load],
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "seed": seed,
    }
    num_preempted = 0
    # mtime=0: the same recording gives the same bytes.
    with (
        gzip.GzipFile(path, "wb", mtime=0) as raw,
        io.TextIOWrapper(raw, encoding="utf-8") as text,
        StepRecorder(
            text,
            close_file=False,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            prefix_caching=False,
            metadata=metadata,
        ) as recorder,
    ):
        for step in range(num_steps):
            for _ in range(poisson_count(rng, LOADS[load])):
                scheduler.add_request(_request(rng, next_id))
                next_id += 1
            output = scheduler.schedule()
            num_preempted += len(output.preempted_req_ids or ())
            events = ledger.plan(changes_from_output(output, parked), is_cached)
            recorder.record(events)
            if step % AUDIT_EVERY == 0:  # where DefragScheduler audits: right after planning
                truth = {rid: [b.block_id for b in held] for rid, held in blocks.items()}
                ledger.audit(truth, parked.block_lists(), is_cached)
            scheduler.update_from_output(output, sample_finished(scheduler, output))
    live = sum(len(ids) for ids in ledger.held.values())
    print(
        f"{path.name}: {num_steps} steps, {next_id} requests, {num_preempted} preempted, "
        f"{live} blocks live at the end, {path.stat().st_size:,} bytes"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loads", nargs="*", default=list(LOADS))
    args = parser.parse_args()
    for load in args.loads:
        for free_order in FREE_ORDERS:
            record(load, free_order, args.steps, args.seed)


if __name__ == "__main__":
    main()
