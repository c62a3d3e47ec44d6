"""KV transfers that hold blocks outside what a ``SchedulerOutput`` says: the ledger's view.

A KV connector keeps blocks allocated where the output shows nothing (vLLM 0.33,
``v1/core/sched/scheduler.py``):

* **Delayed frees** (a prefill instance sending, or a request aborted while it loads):
  ``_free_request`` lists the request in ``finished_req_ids`` but keeps its blocks while
  the connector's ``request_finished`` asks it to (``delay_free_blocks``), and frees them
  in ``_free_blocks`` once the worker reports ``finished_sending`` (``finished_recving`` for
  an aborted load). The request stays in ``Scheduler.requests`` until then.
* **Asynchronous loads** (a decode instance receiving): ``update_state_after_alloc``
  allocates the request's blocks and the request waits in ``WAITING_FOR_REMOTE_KVS``,
  unscheduled, until ``finished_recving``; then it is scheduled with its whole list. A
  failed load may truncate the list or free it (``_update_waiting_for_remote_kv``).

* **Offload jobs** (``OffloadingConnector``): each step's metadata names store jobs
  (``src_spec``: the blocks the worker copies out, from the next pass on, even after
  their request freed them) and load jobs (``dst_spec``: the blocks it copies into); a
  job ends when every worker reported it in ``kv_connector_worker_meta.completed_jobs``
  (``offloading/scheduler.py``, ``_update_connector_output``).

In these windows a transfer reads or writes those blocks outside the worker's passes, so
the engines must keep them live and where they are: ``TransferWatch`` turns what it sees
into the ledger's changes (kept lists, loads held from allocation) and pins
(``send/<request id>``, ``load/<request id>``, ``job/<job id>``), and ends each pin when
vLLM ends the window. It reads the requests of open transfers and the step's jobs only,
never a queue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvdefrag.vllm._scheduler.ledger import StepChanges

SEND_PREFIX = "send/"
"""Pin key prefix of a finished request's blocks while the connector sends them."""
LOAD_PREFIX = "load/"
"""Pin key prefix of a request's blocks while the connector loads into them."""
JOB_PREFIX = "job/"
"""Pin key prefix of an offload job's blocks until every worker finished it."""
_OFFLOADING_METADATA = "OffloadingConnectorMetadata"


class TransferWatch:
    """The requests whose blocks a KV connector holds past vLLM's output, by request id.

    Invariants: every id in ``sending`` or ``loading`` is pinned under the key it maps to,
    in the steps planned so far; an id leaves when vLLM ends its window, and its pin ends
    in the same step.
    """

    def __init__(
        self,
        requests: Mapping[str, Any],
        block_ids: Callable[[str], list[int]],
        *,
        waiting_for_remote_kvs: object,
        deferred_loads: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
        requests: vLLM's ``Scheduler.requests`` (read, never changed).
        block_ids: A request's logical block ids in vLLM's KV cache manager now.
        waiting_for_remote_kvs: ``RequestStatus.WAITING_FOR_REMOTE_KVS``.
        deferred_loads: vLLM's ``Scheduler.deferred_loads`` (request id -> ...): loads
            whose blocks ``schedule()`` allocated but whose ``update_state_after_alloc``
            waits for the steps in flight (``_drain_deferred_loads``); held and pinned
            from the allocation all the same.
        """
        self._requests = requests
        self._block_ids = block_ids
        self._waiting = waiting_for_remote_kvs
        self._deferred_loads = deferred_loads if deferred_loads is not None else {}
        self.sending: dict[str, str] = {}
        self.loading: dict[str, str] = {}
        self._loaded_ids: dict[str, list[int]] = {}  # each load's list as pinned
        self._allocated: list[Any] = []
        self.jobs: set[int] = set()  # offload jobs pinned and not yet done
        self._job_reports: dict[int, int] = {}  # job id -> workers that reported it
        self._jobs_done: list[int] = []

    def on_alloc(self, request: Any, num_external_tokens: int) -> None:
        """The connector was told of an allocation (``update_state_after_alloc``): a load
        of ``num_external_tokens`` tokens if the request now waits for them."""
        if num_external_tokens > 0:
            self._allocated.append(request)

    def on_jobs_completed(self, completed_jobs: Mapping[int, int], num_workers: int) -> None:
        """Workers reported offload jobs done (``completed_jobs``: job id -> how many of
        them, this time); a job is done once all ``num_workers`` did."""
        reports = self._job_reports
        for job_id, count in completed_jobs.items():
            if job_id not in self.jobs:
                continue  # not pinned here (before a reset)
            reports[job_id] = reports.get(job_id, 0) + count
            if reports[job_id] >= num_workers:
                del reports[job_id]
                self.jobs.discard(job_id)
                self._jobs_done.append(job_id)

    def adjust(
        self, changes: StepChanges, finished_ids: Iterable[str], metadata: Any = None
    ) -> StepChanges:
        """The step's changes with the connector's windows: lists kept past a finish,
        loads held from allocation, re-read after a load ends, offload jobs, pins and
        unpins.

        Args:
            changes: What ``schedule()`` changed, read from its output.
            finished_ids: The output's ``finished_req_ids``.
            metadata: The output's ``kv_connector_metadata``.
        """
        requests = self._requests
        released = list(changes.released)
        full_rows = dict(changes.full_rows)
        num_computed = dict(changes.num_computed_tokens)
        pins: dict[str, list[int]] = {}
        unpinned: list[str] = [f"{JOB_PREFIX}{job_id}" for job_id in self._jobs_done]
        self._jobs_done = []
        kept: dict[str, str] = {}
        # Windows vLLM ended since the last step.
        for request_id in sorted(self.sending):
            if request_id not in requests:  # freed: finished_sending (or recving)
                unpinned.append(self.sending.pop(request_id))
                released.append(request_id)
        for request_id in sorted(self.loading):
            request = requests.get(request_id)
            if request is None:
                unpinned.append(self.loading.pop(request_id))
                del self._loaded_ids[request_id]
                released.append(request_id)
            elif request.status != self._waiting and not request.is_finished():
                unpinned.append(self.loading.pop(request_id))
                loaded_ids = self._loaded_ids.pop(request_id)
                if request_id not in full_rows:
                    # Received or failed: a failed load may have cut or freed the list.
                    logical_ids = self._block_ids(request_id)
                    if not logical_ids:
                        released.append(request_id)
                    elif logical_ids != loaded_ids:
                        full_rows[request_id] = logical_ids
        # Finishes whose free waits for a transfer.
        for request_id in finished_ids:
            if request_id in requests and request_id not in self.sending:
                key = self.loading.pop(request_id, None)
                self._loaded_ids.pop(request_id, None)
                if key is None:
                    key = kept[request_id] = f"{SEND_PREFIX}{request_id}"
                self.sending[request_id] = key
        if kept or self.sending:
            released = [rid for rid in released if rid not in self.sending]
        # Loads that started this step: held, fresh past the local hits, pinned.
        allocated, self._allocated = self._allocated, []
        allocated += [
            requests[request_id]
            for request_id in self._deferred_loads
            if request_id not in self.loading and request_id in requests
        ]
        for request in allocated:
            request_id = request.request_id
            if request.status != self._waiting or request_id in self.loading:
                continue
            logical_ids = self._block_ids(request_id)
            if not logical_ids:
                continue
            key = f"{LOAD_PREFIX}{request_id}"
            self.loading[request_id] = key
            self._loaded_ids[request_id] = list(logical_ids)
            full_rows[request_id] = logical_ids
            num_computed[request_id] = int(request.num_computed_tokens)
            pins[key] = list(logical_ids)
        for job_id, logical_ids in _offload_jobs(metadata):
            self.jobs.add(job_id)
            pins[f"{JOB_PREFIX}{job_id}"] = logical_ids
        if not (pins or unpinned or kept) and (released, full_rows) == (
            list(changes.released),
            changes.full_rows,
        ):
            return changes
        return dataclasses.replace(
            changes,
            released=released,
            full_rows=full_rows,
            num_computed_tokens=num_computed,
            pins=pins,
            unpinned=unpinned,
            kept=kept,
        )


def _offload_jobs(metadata: Any) -> list[tuple[int, list[int]]]:
    """``(job id, logical block ids)`` of each job an ``OffloadingConnectorMetadata``
    names: a store's source blocks, a load's destination blocks (vLLM 0.33
    ``offloading/common.py``, ``TransferJob``; the GPU side is a ``GPULoadStoreSpec``)."""
    if type(metadata).__name__ != _OFFLOADING_METADATA:
        return []
    jobs = [(job_id, job.src_spec) for job_id, job in sorted(metadata.store_jobs.items())]
    jobs += [(job_id, job.dst_spec) for job_id, job in sorted(metadata.load_jobs.items())]
    return [(job_id, [int(block_id) for block_id in spec.block_ids]) for job_id, spec in jobs]
