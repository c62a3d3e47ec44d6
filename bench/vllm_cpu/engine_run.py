"""Real vLLM CPU engine runs, one per mode in turn: prints a JSON line of each one's results.

    python engine_run.py MODE[,MODE...] MODEL_DIR RUN_DIR [--prefix-caching] [--tp N]
        [--dp N] [--engine-processes] [--async-scheduling] [--force-async] [--reset-every N]
        [--num-requests N] [--max-num-seqs N]

The modes run in this one process (vLLM is imported once), each engine started, run to
the end and shut down before the next; each mode's run directory is ``RUN_DIR/MODE``.
A mode says who schedules and what is sabotaged:

* ``plain``: vLLM's Scheduler (measuring only) and CPUWorker;
* ``defrag``: DefragScheduler and DefragWorker (the workers wait for each output's step
  and translate it; their runner rows follow the blocks that moved);
* ``corrupt``: plain, the KV cache overwritten once;
* ``unfollowed_rows``: defrag, but the worker's runner rows never follow the blocks that
  moved (it reads moved blocks at their old places).

The options are vLLM's settings, the same for every mode: ``--prefix-caching``,
``--tp N`` (tensor parallel over N worker processes, one core each), ``--dp N`` (data
parallel: N engines, each in its own engine-core process, driven through vLLM's
``AsyncLLM`` and its DP coordinator as ``vllm serve --data-parallel-size N`` does, since
vLLM's ``LLM`` refuses ``data_parallel_size > 1``; a dense model, so the engines are
independent; with ``--tp 1`` only),
``--executor ray`` (with ``--tp``: vLLM's Ray executor on the Ray cluster that
``RAY_ADDRESS`` names, in place of its multiprocess one), ``--metrics-at HOST:PORT,...``
(where each rank serves its metrics, when the ranks are on several hosts),
``--engine-processes`` (vLLM's engine-core and worker processes, as under ``vllm
serve``; otherwise the engine core runs in this process), ``--async-scheduling`` (NOTE:
vLLM 0.32's CPU platform turns it off again, ``platforms/cpu.py``; the result line says
what the engine ran with), ``--force-async`` (async scheduling, vLLM's default elsewhere,
turned back on after the CPU platform's config check: its runner is vLLM's GPU runner,
which runs it; in-process engine core only; the schedulers are the async classes and
plain vLLM runs without the block-free fence), ``--reset-every N`` (the engine is stepped
here, and every ``N`` steps its prefix cache is reset with
``reset_running_requests=True``, as vLLM's sleep does, usually with a step in flight; the
result line lists what each reset returned).

Every run writes the tiny Llama's ``config.json`` into MODEL_DIR, draws the same large
random weights (vLLM's dummy weights are too small for the output to depend on the KV
cache) and generates greedily from the same token ids: requests that share a few
system-prompt prefixes (prefix-cache hits when it is on), through a pool small enough that
vLLM preempts. The result line::

    RESULT {"mode": ..., "async_scheduling": ..., "tokens": [[...], ...],
            "num_cached_tokens": ..., "scheduler": {...}, "metrics": [...]}

one per mode, in order; ``scheduler`` is what ``measured_schedulers`` wrote when the
last request finished (with kvdefrag: every rank's moves under ``ranks``); ``metrics``,
with ``KVDEFRAG_METRICS_PORT`` set and kvdefrag's workers, what each rank's ``/metrics``
endpoint (that port + local rank) served once the requests were done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

MODES = ("plain", "defrag", "corrupt", "unfollowed_rows")
SCHEDULERS = {
    "plain": "MeasuredScheduler",
    "corrupt": "MeasuredScheduler",
    "defrag": "MeasuredDefragScheduler",
    "unfollowed_rows": "MeasuredDefragScheduler",
}
ASYNC_SCHEDULERS = {
    "plain": "MeasuredAsyncScheduler",
    "corrupt": "MeasuredAsyncScheduler",
    "defrag": "MeasuredDefragAsyncScheduler",
    "unfollowed_rows": "MeasuredDefragAsyncScheduler",
}
WORKERS = {
    "plain": "WeightedCPUWorker",
    "corrupt": "CorruptingCPUWorker",
    "defrag": "WeightedDefragWorker",
    "unfollowed_rows": "UnfollowingDefragWorker",
}
NUM_BLOCKS = 40
BLOCK_SIZE = 32
VOCAB_SIZE = 512
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,  # head_size 64: the CPU attention kernels' smallest
    "num_key_value_heads": 2,  # divisible by --tp 2
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modes", type=_modes, help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("model_dir")
    parser.add_argument("run_dir")
    parser.add_argument("--prefix-caching", action="store_true")
    parser.add_argument("--tp", type=int, default=1, metavar="N")
    parser.add_argument("--dp", type=int, default=1, metavar="N")
    parser.add_argument("--executor", choices=("mp", "ray"), default="mp")
    parser.add_argument("--metrics-at", type=lambda text: text.split(","), default=None)
    parser.add_argument("--engine-processes", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--force-async", action="store_true")
    parser.add_argument("--reset-every", type=int, default=0, metavar="N")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    return parser.parse_args(argv)


def force_async_scheduling() -> None:
    """Keeps async scheduling on through vLLM 0.32's CPU platform check, which turns it
    off ("async scheduling is not required on CPU", ``platforms/cpu.py`` L330-331)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_keeping_async(cls: Any, vllm_config: Any) -> None:
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_keeping_async)  # type: ignore[method-assign, assignment]


def generate_with_resets(
    llm: Any, requests: list[dict[str, list[int]]], params: list[Any], reset_every: int
) -> tuple[list[list[int]], int, list[bool]]:
    """Steps the engine here until every request is done, resetting its prefix cache
    with ``reset_running_requests=True`` every ``reset_every`` steps; returns each
    request's tokens (in order), the cached prompt tokens and each reset's result."""
    engine = llm.llm_engine
    for index, (prompt, param) in enumerate(zip(requests, params, strict=True)):
        engine.add_request(str(index), prompt, param)
    tokens: dict[str, list[int]] = {}
    num_cached = 0
    resets: list[bool] = []
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
                num_cached += output.num_cached_tokens or 0
        steps += 1
        if steps % reset_every == 0 and engine.has_unfinished_requests():
            resets.append(bool(engine.reset_prefix_cache(reset_running_requests=True)))
    return [tokens[str(index)] for index in range(len(requests))], num_cached, resets


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modes {unknown}; choose from {MODES}")
    return modes


def set_environment(args: argparse.Namespace) -> None:
    """vLLM and kvdefrag read these when imported or started: set them first."""
    # NOTE: these runs test the V1 runner; kvdefrag serves V2 too (tests/with_vllm, simulated).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_processes else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # NOTE: vLLM caches what it learns of a model class by file hash under one name; a
    # vLLM of another version sharing ~/.cache/vllm rewrites it (about 15 s a run).
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(sys.prefix, "vllm-cache"))
    if args.tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # NOTE: "auto" binds one NUMA node per rank and refuses more ranks than nodes.
        cpu_ids = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(cpu_ids[rank % len(cpu_ids)]) for rank in range(args.tp)
        )
    os.environ.setdefault("KVDEFRAG_THRESHOLD", "2")  # a small pool: compact early
    if args.force_async:
        if args.engine_processes:
            sys.exit("engine_run.py: --force-async patches the platform in this process only")
        force_async_scheduling()


def write_model_config(model_dir: str) -> None:
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "config.json")
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as file:
        json.dump(TINY_LLAMA, file)
    os.replace(partial, path)  # runs started together never read a half-written file


def prompts(num_requests: int) -> list[dict[str, list[int]]]:
    """Token ids: three in four requests start with one of four shared prefixes."""
    rng = random.Random(7)
    prefixes = [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in (32, 64, 80, 96)
    ]
    requests = []
    for _ in range(num_requests):
        prefix = rng.choice(prefixes) if rng.random() < 0.75 else []
        suffix = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(8, 120))]
        requests.append({"prompt_token_ids": prefix + suffix})
    return requests


def report_path(run_dir: str) -> str:
    return os.path.join(run_dir, "scheduler.json")


def read_report(run_dir: str) -> dict[str, Any]:
    with open(report_path(run_dir)) as file:
        report: dict[str, Any] = json.load(file)
    return report


def engine_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """vLLM's engine settings every mode and layout shares (the tiny Llama, drawn weights,
    the 40-block pool, the mode's scheduler and worker classes)."""
    schedulers = ASYNC_SCHEDULERS if args.force_async else SCHEDULERS
    return {
        "model": args.model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": 512,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": 512,
        "enable_prefix_caching": args.prefix_caching,
        "scheduler_cls": f"measured_schedulers.{schedulers[mode]}",
        "worker_cls": f"weighted_workers.{WORKERS[mode]}",
        "dtype": "float32",
        "seed": 0,
    }


def run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one engine to the end and shuts it down; returns its result."""
    from vllm import LLM, SamplingParams

    if args.dp > 1:
        return asyncio.run(run_data_parallel(mode, args))

    run_dir = os.path.join(args.run_dir, mode)
    os.environ["KVDEFRAG_VLLM_RUN_DIR"] = os.path.abspath(run_dir)
    # The scheduler side compares its ledger with vLLM's after every step (the engine
    # core's process reads it when the scheduler starts).
    os.environ.setdefault("KVDEFRAG_VLLM_AUDIT_EVERY", "1")
    if os.path.exists(report_path(run_dir)):
        os.remove(report_path(run_dir))  # an earlier run's, in a reused directory
    llm = LLM(
        **engine_options(args, mode),
        async_scheduling=args.async_scheduling or args.force_async,
        tensor_parallel_size=args.tp,
        distributed_executor_backend=args.executor if args.tp > 1 else None,
    )
    rng = random.Random(11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 64), ignore_eos=True)
        for _ in range(args.num_requests)
    ]
    resets: list[bool] = []
    if args.reset_every:
        tokens, num_cached_tokens, resets = generate_with_resets(
            llm, prompts(args.num_requests), params, args.reset_every
        )
    else:
        outputs = llm.generate(prompts(args.num_requests), params, use_tqdm=False)
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        num_cached_tokens = sum(output.num_cached_tokens or 0 for output in outputs)
    # NOTE: while the workers still serve: their services stop when the engine shuts down.
    metrics = (
        scrape_rank_metrics(args.tp, args.metrics_at) if WORKERS[mode] != WORKERS["plain"] else []
    )
    llm.llm_engine.engine_core.shutdown()
    scheduler = read_report(run_dir)  # written when the last request finished
    waits = os.path.join(run_dir, "worker0_waits.json")  # weighted_workers.WAITS_NAME
    worker_waits_s: list[float] = []
    if os.path.exists(waits):
        with open(waits) as file:
            worker_waits_s = json.load(file)
        os.remove(waits)
    return {
        "mode": mode,
        "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
        "tokens": tokens,
        "num_cached_tokens": num_cached_tokens,
        "resets": resets,
        "scheduler": scheduler,
        "worker_waits_s": worker_waits_s,
        "metrics": metrics,
    }


def engine_dirs(run_dir: str, dp: int) -> list[str]:
    """Each DP engine's run directory (``kvdefrag.vllm.contract.engine_run_dir``)."""
    return [run_dir] + [os.path.join(run_dir, f"dp{k}") for k in range(1, dp)]


async def run_data_parallel(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """``run`` for ``--dp N``: the requests go to vLLM's ``AsyncLLM`` at once, which
    spreads them over its DP engines; each engine's scheduler writes its own report in its
    own run directory. The result has every engine's report (``schedulers``), their
    preemptions summed and moves per engine, and, with ``KVDEFRAG_METRICS_PORT``, each
    engine's rank's metrics (that port + DP rank x TP + local rank)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    if args.tp != 1 or args.force_async or args.reset_every:
        sys.exit("engine_run.py: --dp runs with --tp 1, without --force-async or --reset-every")
    run_dir = os.path.join(args.run_dir, mode)
    os.environ["KVDEFRAG_VLLM_RUN_DIR"] = os.path.abspath(run_dir)
    os.environ.setdefault("KVDEFRAG_VLLM_AUDIT_EVERY", "1")
    dirs = engine_dirs(run_dir, args.dp)
    for folder in dirs:
        if os.path.exists(report_path(folder)):
            os.remove(report_path(folder))
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_options(args, mode), data_parallel_size=args.dp)
    )
    rng = random.Random(11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(8, 64), ignore_eos=True)
        for _ in range(args.num_requests)
    ]

    async def generate(index: int, prompt: dict[str, list[int]]) -> Any:
        last = None
        async for output in engine.generate(prompt, params[index], request_id=str(index)):
            last = output
        return last

    try:
        outputs = await asyncio.gather(
            *(generate(index, prompt) for index, prompt in enumerate(prompts(args.num_requests)))
        )
        metrics = (
            scrape_rank_metrics(args.dp) if WORKERS[mode] != WORKERS["plain"] else []
        )  # one rank per engine: DP rank k serves on the port + k
    finally:
        engine.shutdown()
    schedulers = [read_report(folder) for folder in dirs]
    return {
        "mode": mode,
        "async_scheduling": False,
        "tokens": [list(output.outputs[0].token_ids) for output in outputs],
        "num_cached_tokens": sum(output.num_cached_tokens or 0 for output in outputs),
        "resets": [],
        "scheduler": {
            "num_preempted": sum(report["num_preempted"] for report in schedulers),
            "num_moves": sum(report.get("num_moves", 0) for report in schedulers),
        },
        "schedulers": schedulers,
        "engine_dirs": {folder: sorted(os.listdir(folder)) for folder in dirs},
        "worker_waits_s": [],
        "metrics": metrics,
    }


def scrape_rank_metrics(num_ranks: int, targets: list[str] | None = None) -> list[dict[str, Any]]:
    """Each rank's kvdefrag metrics, when ``KVDEFRAG_METRICS_PORT`` is set: rank ``i`` (local
    rank ``i`` here, one host) serves on that port + ``i``, or at ``targets[i]``
    (``--metrics-at HOST:PORT,...``: ranks on several hosts). Per rank: the port and its
    ``kvdefrag_*`` samples (``name{labels}`` -> value); none when the variable is unset.

    NOTE: the engine core may still send one step after the last output returns (the one
    that releases the finished requests), without waiting for it; until every rank has
    applied it their step counts differ, so the ranks are scraped again (for up to 10 s)
    until the counts agree.
    """
    base = os.environ.get("KVDEFRAG_METRICS_PORT", "").strip()
    if not base:
        return []
    host = os.environ.get("KVDEFRAG_METRICS_HOST", "").strip() or "127.0.0.1"
    deadline = time.monotonic() + 10.0
    while True:
        scraped = (
            [_scrape(*target.rsplit(":", 1)) for target in targets]
            if targets
            else [_scrape(host, int(base) + local_rank) for local_rank in range(num_ranks)]
        )
        steps = {
            value
            for rank in scraped
            for name, value in rank["samples"].items()
            if name.startswith("kvdefrag_steps_total")
        }
        if len(steps) <= 1 or time.monotonic() > deadline:
            return scraped
        time.sleep(0.2)


def _scrape(host: str, port: int | str) -> dict[str, Any]:
    import urllib.request

    port = int(port)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("kvdefrag_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return {"port": port, "samples": samples}


def main() -> None:
    args = parse_args(sys.argv[1:])
    set_environment(args)
    write_model_config(args.model_dir)
    for mode in args.modes:
        print("RESULT " + json.dumps(run(mode, args)), flush=True)


if __name__ == "__main__":
    main()
