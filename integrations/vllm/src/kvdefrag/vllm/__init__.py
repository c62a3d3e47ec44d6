"""kvdefrag inside vLLM: one package, one module per role.

::

    kvdefrag.vllm.scheduler   the scheduler side, in vLLM's engine-core process:
                              DefragScheduler / DefragAsyncScheduler (--scheduler-cls).
                              Plans each step from the KV cache manager's truth
                              (_ledger), steps every rank (_ranks) and rewrites or stamps
                              the output (_bridge).
    kvdefrag.vllm.worker      the worker side, in each rank's worker process:
                              DefragWorker / DefragWorkerMixin (--worker-cls). Binds the
                              KV caches (_kv_binding), serves them, holds kv_lock around
                              every forward pass, translates outputs and keeps the
                              runner's rows physical (_runner_rows) when it translates.
    kvdefrag.vllm.common      what both sides agree on: the run directory and rank
                              discovery, who translates, the step stamp, which
                              SchedulerOutput fields carry block ids, the fresh-block rule.
    kvdefrag.vllm.config      the KVDEFRAG_VLLM_* settings, read once per process
                              (load_integration_config) and passed in.
    kvdefrag.vllm.errors      StartupRefused, the one base of every start-up refusal
                              (UnsupportedByKvdefrag, BadSetting, UnsafeRunDir, ...).

Only ``scheduler`` imports vLLM when imported; ``worker`` imports it when a worker class is
looked up. The two switches go together: see docs/operator/vllm.md.
"""
