"""kvdefrag inside vLLM: one package, a room per role.

::

    kvdefrag.vllm.scheduler   the scheduler side, in vLLM's engine-core process:
                              DefragScheduler / DefragAsyncScheduler (--scheduler-cls),
                              over kvdefrag.vllm._scheduler (bridge, ledger, ranks, gaudi).
    kvdefrag.vllm.worker      the worker side, in each rank's process: DefragWorker /
                              DefragWorkerMixin (--worker-cls), over kvdefrag.vllm._worker
                              (passes, translation, kv_binding, startup, gaudi).
    kvdefrag.vllm.gaudi       the Gaudi classes, each looked up from its own side.
    shared                    contract (engine id, run directory, step stamp),
                              output_blocks, refusals, config, errors, _discovery, _run_dir.

The scheduler side never imports the worker side or the server. Only ``scheduler``
imports vLLM when imported; ``worker`` and ``gaudi`` import it when a class is looked up.
The map with its reasons: docs/design/packages.md.
"""
