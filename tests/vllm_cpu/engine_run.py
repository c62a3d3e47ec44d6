"""One real vLLM CPU engine run, in its own process: prints a JSON line of its results.

    python engine_run.py MODE MODEL_DIR RUN_DIR

MODE: ``plain`` (vLLM's Scheduler and CPUWorker); ``defrag`` (DefragScheduler and
DefragWorker); ``defrag_mp`` (the same in vLLM's engine-core and worker processes, the
worker prints its moves at shutdown); ``corrupt`` (plain, the KV cache overwritten once);
``stale_rows`` (defrag, but the scheduler never re-sends the row of a request whose
blocks moved: the worker reads moved blocks at their old places). Every mode draws the
same large random weights (vLLM's dummy weights are too small for the output to depend
on the KV cache) and generates greedily from the same token ids.
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
# defrag_mp: vLLM's default engine-core and worker processes, as under ``vllm serve``;
# every other mode runs the engine (scheduler and worker) in this process.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if sys.argv[1] == "defrag_mp" else "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("KVDEFRAG_THRESHOLD", "2")  # a small pool: compact early

from vllm import LLM, SamplingParams

from kvdefrag.client.vllm import _ledger
from kvdefrag.client.vllm.scheduler import DefragScheduler

WORKERS = {"plain": "WeightedCPUWorker", "corrupt": "CorruptingCPUWorker"}
NUM_BLOCKS = 40
BLOCK_SIZE = 32
NUM_REQUESTS = 48
VOCAB_SIZE = 512


def prompts() -> list[dict[str, list[int]]]:
    rng = random.Random(7)
    return [
        {"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(20, 180))]}
        for _ in range(NUM_REQUESTS)
    ]


def main() -> None:
    mode, model_dir, run_dir = sys.argv[1:4]
    os.environ["KVDEFRAG_VLLM_RUN_DIR"] = run_dir
    if mode == "stale_rows":
        _ledger.WorkerRows.mark_moved = lambda *args, **kwargs: None  # type: ignore[method-assign]
    is_defrag = mode not in WORKERS
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        async_scheduling=False,
        scheduler_cls=DefragScheduler if is_defrag else None,
        worker_cls=f"weighted_workers.{WORKERS.get(mode, 'WeightedDefragWorker')}",
        dtype="float32",
        seed=0,
    )
    rng = random.Random(11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 64), ignore_eos=True)
        for _ in range(NUM_REQUESTS)
    ]
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    num_moves = 0
    if mode == "defrag_mp":
        llm.llm_engine.engine_core.shutdown()  # the worker prints KVDEFRAG_MOVES
        num_moves = -1
    elif is_defrag:
        # The scheduler's own client (a second writer session would be refused).
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        num_moves = scheduler.kvdefrag.ranks.primary.stats().stats.totals.num_moves
    result = {
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "num_moves": num_moves,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
