"""kvdefrag in vLLM: the scheduler side.

Two ways in:

* ``kvdefrag.client.vllm.scheduler.DefragScheduler``, a subclass of vLLM 0.33's
  ``Scheduler`` that an operator turns on with one switch
  (``vllm serve --scheduler-cls kvdefrag.client.vllm.scheduler.DefragScheduler`` or
  ``LLM(..., scheduler_cls=...)``). It reads the KV cache manager's truth after every
  ``schedule()``, steps every rank's service and rewrites the output to physical ids.
  Importing it imports vLLM; nothing else in this package does.
* ``VllmDefragAdapter`` / ``events_from_scheduler_output``: the duck-typed adapter that
  turns one ``SchedulerOutput`` into one step, for schedulers kvdefrag does not subclass.

The worker side is ``kvdefrag.server.vllm_worker``.
"""

from kvdefrag.client.vllm._adapter import (
    StepEvents,
    VllmDefragAdapter,
    copy_pairs,
    events_from_scheduler_output,
)

__all__ = [
    "StepEvents",
    "VllmDefragAdapter",
    "copy_pairs",
    "events_from_scheduler_output",
]
