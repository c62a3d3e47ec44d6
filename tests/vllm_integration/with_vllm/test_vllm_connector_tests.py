"""vLLM's own scheduler tests that drive a KV connector pass with kvdefrag's scheduler
classes substituted for vLLM's, wherever they pass on plain vLLM.

vLLM's test files come from vLLM 0.33.0's sdist on PyPI, fetched and checked at test time
(``vllm_tests/vllm_sdist.py``), never copied here. Both runs are pytest runs of their own
over the same files, with ``vllm_tests/kvdefrag_substitution.py`` as a plugin:

1. Plain vLLM, every test of ``VLLM_TEST_FILES``. A test *drives a KV connector* when a
   scheduler it builds has one (``Scheduler.connector``): remote KV loads (sync and async),
   delayed frees, load failures and invalid blocks, external prefix-cache metrics,
   preemption with a connector, under ``MockKVConnector`` and ``ExampleConnector``.
2. The tests of 1 that drive a KV connector and pass, with every scheduler kvdefrag's
   (``DefragScheduler`` / ``DefragAsyncScheduler``), each on a real kvdefrag rank of its
   ``num_blocks`` that compacts at every hole, its ledger audited after every step.

Each must pass in 2, or be refused at start-up by design (``UnsupportedByKvdefrag``: a
hybrid or sliding-window model, ``REFUSED_BY_DESIGN``). Some replace the scheduler's
connector, or patch its methods, after building it, or turn on deferred async loads:
kvdefrag follows those too (``DefragScheduler._kvdefrag_watch_connector``, and
``TransferWatch``'s ``deferred_loads``).

vLLM's tests run on its CPU platform (``VLLM_TARGET_DEVICE=cpu``) with the model they name,
``facebook/opt-125m``, resolved offline from a hand-written ``config.json`` (its
architecture only: no weights, no tokenizer, no hub access); tests that need another
model's files fail in run 1 and so are not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

VLLM_TESTS = Path(__file__).parent / "vllm_tests"
VLLM_TEST_FILES = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/kv_connector/unit/test_remote_prefill_lifecycle.py",
    "tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py",
    "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py",
    "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py",
    "tests/v1/kv_connector/unit/test_error_propagation.py",
    "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
    "tests/v1/kv_connector/unit/test_scheduler_kv_connector_override.py",
)

REFUSED_BY_DESIGN = ("KV-cache group", "sliding", "Mamba", "full attention")
"""Words of the start-up refusals vLLM's tests may meet by design (what each refusal names)."""

OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "hidden_size": 768,
    "ffn_dim": 3072,
    "word_embed_proj_dim": 768,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
}
_REVISION = "0" * 40
_TIMEOUT_S = 600.0


def _offline_hub(folder: Path) -> Path:
    """A Hugging Face cache holding only ``facebook/opt-125m``'s ``config.json``."""
    model = folder / "hub" / "models--facebook--opt-125m"
    snapshot = model / "snapshots" / _REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text(_REVISION)
    return folder / "hub"


def _environment(hub: Path) -> dict[str, str]:
    env = dict(os.environ)
    # vLLM's tests run as in vLLM's CI: the runner unset, no kvdefrag run directory.
    for name in ("VLLM_USE_V2_MODEL_RUNNER", "KVDEFRAG_VLLM_RUN_DIR", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=os.fspath(hub),
        TRANSFORMERS_OFFLINE="1",
        KVDEFRAG_VLLM_AUDIT_EVERY="1",
        PYTHONPATH=os.pathsep.join(filter(None, [os.fspath(VLLM_TESTS), env.get("PYTHONPATH")])),
    )
    return env


def _run(root: Path, env: dict[str, str], mode: str, *args: str) -> tuple[dict[str, Any], str]:
    """One pytest run of vLLM's tests in ``root``: its records by node id, and its output."""
    report = root / f"report-{mode}.json"
    command = [
        *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        *("-p", "kvdefrag_substitution", "-W", "ignore::DeprecationWarning"),
        *("-c", os.fspath(root / "pytest.ini"), "--rootdir", os.fspath(root)),
        f"--kvdefrag-mode={mode}",
        f"--kvdefrag-report={report}",
        *args,
    ]
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    output = done.stdout[-20_000:] + done.stderr[-5_000:]
    assert report.exists(), f"the {mode} run wrote no report (rc {done.returncode}):\n{output}"
    with report.open() as records:
        return json.load(records), output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM 0.33.0's tests extracted from its sdist (downloaded once per venv), run on plain
    vLLM, then the ones that drive a KV connector and pass there, with kvdefrag's classes."""
    root = tmp_path_factory.mktemp("vllm-0.33.0")
    subprocess.run(
        [sys.executable, os.fspath(VLLM_TESTS / "vllm_sdist.py"), os.fspath(root)], check=True
    )
    (root / "pytest.ini").write_text("[pytest]\n")
    env = _environment(_offline_hub(tmp_path_factory.mktemp("hf")))
    plain, _ = _run(root, env, "vllm", *VLLM_TEST_FILES)
    selected = sorted(
        nodeid
        for nodeid, record in plain.items()
        if record["num_connector_schedulers"] and record["outcome"] == "passed"
    )
    selection = root / "selected.txt"
    selection.write_text("".join(f"{nodeid}\n" for nodeid in selected))
    substituted, output = _run(
        root, env, "kvdefrag", f"--kvdefrag-select={selection}", *VLLM_TEST_FILES
    )
    return {"selected": selected, "kvdefrag": substituted, "output": output}


@pytest.mark.slow
def test_vllm_connector_tests_pass_with_kvdefrag_schedulers(runs: dict[str, Any]) -> None:
    selected, substituted = runs["selected"], runs["kvdefrag"]
    assert selected, f"no test of {VLLM_TEST_FILES} drove a KV connector and passed on vLLM"
    outcomes = {nodeid: substituted.get(nodeid, {"outcome": "not run"}) for nodeid in selected}
    unexpected = {
        nodeid: f"{record['outcome']}: {record.get('failure', '')}"
        for nodeid, record in outcomes.items()
        if record["outcome"] not in ("passed", "refused")
    }
    refused = {
        nodeid: record["refusal"]
        for nodeid, record in outcomes.items()
        if record["outcome"] == "refused"
    }
    passed = [nodeid for nodeid, record in outcomes.items() if record["outcome"] == "passed"]
    summary = (
        f"{len(selected)} vLLM tests drive a KV connector and pass on vLLM; with kvdefrag "
        f"{len(passed)} pass, {len(refused)} are refused by design ({refused})\n"
        f"{runs['output']}"
    )
    assert not unexpected, f"failed with kvdefrag: {unexpected}\n{summary}"
    # A refusal is by design only for what kvdefrag refuses on purpose: models with more
    # than one KV-cache group or other attention than full (hybrid, sliding window).
    not_by_design = {
        nodeid: message
        for nodeid, message in refused.items()
        if not any(reason in message for reason in REFUSED_BY_DESIGN)
    }
    assert not not_by_design, f"refused with kvdefrag: {not_by_design}"
    # kvdefrag's scheduler really ran them: every scheduler with a connector was kvdefrag's,
    # and they sent steps to their ranks and audited their ledgers.
    not_substituted = [
        nodeid
        for nodeid in passed
        if not 0
        < outcomes[nodeid]["num_kvdefrag_schedulers"]
        == outcomes[nodeid]["num_connector_schedulers"]
    ]
    assert not not_substituted, f"vLLM's own scheduler ran in {not_substituted}"
    assert sum(outcomes[nodeid]["num_steps"] for nodeid in passed) > 0, summary
    assert sum(outcomes[nodeid]["num_audits"] for nodeid in passed) > 0, summary
    assert len(passed) > len(refused), summary
