"""kvdefrag on both sides of a real vLLM CPU engine: greedy outputs token for token.

Each run is one engine in its own process (``engine_run.py``): vLLM 0.32's CPU engine on a
tiny Llama with large drawn weights, 48 requests through a 40-block pool of 32 tokens, so
kvdefrag compacts (moves > 0). With DefragScheduler and DefragWorker every request must
generate exactly what plain vLLM generates, with the engine in this process and in vLLM's
engine-core and worker processes (as under ``vllm serve``); a run whose KV is overwritten
once, and a run whose scheduler never re-sends the rows of requests whose blocks moved,
must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from typing import Any

import pytest

from kvdefrag.server.vllm_worker import DefragWorkerMixin

pytestmark = pytest.mark.slow

ENGINE_RUN = os.path.join(os.path.dirname(__file__), "engine_run.py")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,  # head_size 64: the CPU attention kernels' smallest
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@cache
def run_engine(mode: str, root: str) -> dict[str, Any]:
    """Runs ``engine_run.py MODE`` once per mode; returns its tokens and moves."""
    model_dir = os.path.join(root, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as config:
        json.dump(TINY_LLAMA, config)
    run_dir = os.path.join(root, f"run-{mode}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, ENGINE_RUN, mode, model_dir, run_dir],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    # defrag_mp: the worker process prints its service's moves at shutdown.
    for line in done.stdout.splitlines():
        if line.startswith("KVDEFRAG_MOVES "):
            result["num_moves"] = int(line.removeprefix("KVDEFRAG_MOVES "))
    assert not os.path.exists(os.path.join(run_dir, "rank0.sock")), "service not stopped"
    return result


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.fspath(tmp_path_factory.mktemp("vllm_cpu"))


def _num_differing(tokens: list[list[int]], expected: list[list[int]]) -> int:
    assert len(tokens) == len(expected)
    return sum(got != want for got, want in zip(tokens, expected, strict=True))


def test_outputs_depend_on_the_kv_cache(root: str) -> None:
    plain = run_engine("plain", root)
    corrupt = run_engine("corrupt", root)
    assert len({tuple(tokens) for tokens in plain["tokens"]}) > 1
    assert _num_differing(corrupt["tokens"], plain["tokens"]) > 0


def test_defrag_generates_what_plain_vllm_generates_while_blocks_move(root: str) -> None:
    plain = run_engine("plain", root)
    defrag = run_engine("defrag", root)
    assert defrag["num_moves"] > 0
    assert _num_differing(defrag["tokens"], plain["tokens"]) == 0


def test_defrag_in_vllms_engine_and_worker_processes_generates_what_plain_generates(
    root: str,
) -> None:
    plain = run_engine("plain", root)
    defrag = run_engine("defrag_mp", root)
    assert defrag["num_moves"] > 0
    assert _num_differing(defrag["tokens"], plain["tokens"]) == 0


def test_rows_not_resent_after_moves_change_the_output(root: str) -> None:
    plain = run_engine("plain", root)
    stale = run_engine("stale_rows", root)
    assert stale["num_moves"] > 0
    assert _num_differing(stale["tokens"], plain["tokens"]) > 0


def test_defrag_worker_is_the_cpu_worker_with_the_mixin() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    from kvdefrag.server import vllm_worker

    worker_cls = vllm_worker.DefragWorker
    assert issubclass(worker_cls, DefragWorkerMixin)
    assert issubclass(worker_cls, CPUWorker)
    assert worker_cls is vllm_worker.DefragCPUWorker
