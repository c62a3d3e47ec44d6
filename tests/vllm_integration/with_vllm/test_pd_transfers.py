"""A prefill/decode pair of vLLM 0.33's real schedulers, each behind kvdefrag, joined by
MooncakeConnector's real scheduler side and a fake Mooncake transport.

Each instance has its own kvdefrag service (threshold 0: every hole is compacted) over a
signed int64 KV cache, and a worker that runs as ``DefragWorker`` does: it waits for its
step, its rows follow the moves, and it makes the output and the connector's metadata
physical (``_worker.connectors``). The transport does what Mooncake's workers do, later
than the pass that posted it: P's worker registers ``reqs_to_send`` (P's physical ids),
D's worker posts ``reqs_to_recv`` (D's physical ids); one to four polls later the
transport copies P's slots into D's and reports ``finished_sending`` on P and
``finished_recving`` on D. Meanwhile both instances keep scheduling other requests,
finishing, preempting (a small pool) and compacting, and some D requests are aborted while
they load.

D's worker checks every prompt token it reads against the signature P wrote: a block
that moved during a transfer, or an id a worker used unmapped, is a corrupted read.
Both schedulers audit their ledgers against vLLM's KV cache manager after every step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvdefrag.vllm._discovery import PublishedRank, publish_ranks, published_ranks, rank_address
from kvdefrag.vllm._scheduler import ledger as _ledger
from kvdefrag.vllm._worker.connectors import connector_adapter
from kvdefrag.vllm._worker.translation import BlockIdTranslator
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.contract import engine_id
from kvdefrag.vllm.scheduler import DefragAsyncScheduler, DefragScheduler

from support.vllm_harness import (
    BLOCK_SIZE,
    SignedWorker,
    harness_engine_id,
    make_scheduler,
    serve_rank,
    spy_preemptions,
)

NUM_BLOCKS = 40  # small: both instances preempt
PREFILL, DECODE = "prefill-engine", "decode-engine"


@pytest.fixture(autouse=True)
def _uvicorn_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's connector module imports uvicorn (for its bootstrap server, which the
    scheduler side never starts); .venv-vllm lacks it."""
    if importlib.util.find_spec("uvicorn") is None:
        module = types.ModuleType("uvicorn")
        module.__getattr__ = _stand_in  # type: ignore[method-assign]
        monkeypatch.setitem(sys.modules, "uvicorn", module)


def _stand_in(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})


CONNECTORS = ["MooncakeConnector", "NixlConnector"]


def _connector_config(connector: str, role: str, engine: str) -> KVTransferConfig:
    extra = {"mooncake_protocol": "tcp"} if connector == "MooncakeConnector" else {}
    return KVTransferConfig(
        kv_connector=connector, kv_role=role, engine_id=engine, kv_connector_extra_config=extra
    )


class FakeTransport:
    """The connector's transfers between the two workers, by the ids their metadata names:
    Mooncake's (P registers ``reqs_to_send``, D posts ``reqs_to_recv`` and P writes:
    ``mooncake/mooncake_connector.py:694-721``) or NIXL's in pull mode (D reads P's blocks
    at the ``remote_block_ids`` P published: ``nixl/metadata.py:231-300``,
    ``nixl/pull_scheduler.py:278-293``). Completions come back as the workers report them
    (``finished_sending`` / ``finished_recving``, ``v1/outputs.py`` ``KVConnectorOutput``).

    Attributes:
        sends: Transfer id -> (P's request id, P's physical block ids), as P registered
            them (Mooncake) or published them (NIXL: keyed by P's request id).
        pulls: D's posted pulls: [poll due, transfer id, D's request id, D's physical ids].
        num_copied: Blocks copied from P to D.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.sends: dict[str, tuple[str, list[int]]] = {}
        self.pulls: list[tuple[int, str, str, list[int]]] = []
        self.finished: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        self.num_polls = 0
        self.num_copied = 0
        self.num_transfers = 0

    def post(self, role: str, metadata: Any) -> None:
        """What the worker-side connector starts in a pass (``start_load_kv``)."""
        if metadata is None:
            return
        if type(metadata).__name__ == "NixlConnectorMetadata":
            for request_id, meta in metadata.reqs_to_recv.items():
                remote = meta.remote
                self.sends[remote.request_id] = (remote.request_id, list(remote.block_ids[0]))
                due = self.num_polls + self._rng.randint(1, 4)
                local_ids = list(meta.local_block_ids[0])
                self.pulls.append((due, remote.request_id, request_id, local_ids))
            return
        for request_id, (transfer_id, groups) in metadata.reqs_to_send.items():
            if groups and groups[0]:  # an empty list only announces the request
                self.sends[transfer_id] = (request_id, list(groups[0]))
        for pulls in metadata.reqs_to_recv.values():
            for request_id, pull in pulls.items():
                due = self.num_polls + self._rng.randint(1, 4)
                groups = pull.local_block_ids
                decode_ids = list(groups[0]) if groups else []
                self.pulls.append((due, pull.transfer_id, request_id, decode_ids))

    def poll(self, prefill_kv: Any, decode_kv: Any) -> None:
        """Runs the transfers that are due: P's slots into D's."""
        self.num_polls += 1
        waiting = []
        for pull in self.pulls:
            due, transfer_id, request_id, decode_ids = pull
            if due > self.num_polls or transfer_id not in self.sends:
                waiting.append(pull)
                continue
            prefill_request, prefill_ids = self.sends.pop(transfer_id)
            for src, dst in zip(prefill_ids, decode_ids, strict=False):
                decode_kv[dst * BLOCK_SIZE : (dst + 1) * BLOCK_SIZE] = prefill_kv[
                    src * BLOCK_SIZE : (src + 1) * BLOCK_SIZE
                ]
                self.num_copied += 1
            self.num_transfers += 1
            self.finished["prefill"].add(prefill_request)
            self.finished["decode"].add(request_id)
        self.pulls = waiting

    def take_finished(self, role: str) -> set[str]:
        finished, self.finished[role] = self.finished[role], set()
        return finished


class ConnectorWorker(SignedWorker):
    """A ``SignedWorker`` with a worker-side connector (``FakeTransport``)."""

    def __init__(
        self,
        handle: Any,
        kv: Any,
        transport: FakeTransport,
        role: str,
        connector: str,
        *,
        translates_metadata: bool = True,
    ) -> None:
        super().__init__(kv, BlockIdTranslator(handle, NUM_BLOCKS), service=(handle, 0))
        self.transport = transport
        self.role = role
        self.translates_metadata = translates_metadata
        self.adapter = connector_adapter(connector)

    def _update_rows(self, output: Any) -> None:
        """The connector starts its transfers (``start_load_kv``) from the pass's metadata,
        made physical as ``DefragWorker`` does (``pass_mapping``: the output's)."""
        metadata = output.kv_connector_metadata
        if self.translates_metadata:
            metadata = self.adapter.translate(metadata, self.pass_mapping, BLOCK_SIZE)
        self.transport.post(self.role, metadata)
        super()._update_rows(output)

    def _forward(self, output: Any) -> ModelRunnerOutput:
        result = super()._forward(output)
        finished = self.transport.take_finished(self.role)
        result.kv_connector_output = KVConnectorOutput(
            finished_sending=finished if self.role == "prefill" else None,
            finished_recving=finished if self.role == "decode" else None,
        )
        return result


def _instance_class(run_dir: str, is_async: bool) -> type[DefragScheduler]:
    """``DefragScheduler`` (``DefragAsyncScheduler``) finding its one rank in ``run_dir``."""
    base = DefragAsyncScheduler if is_async else DefragScheduler

    class OneRankScheduler(base):  # type: ignore[misc, valid-type]
        def kvdefrag_ranks(self) -> list[PublishedRank]:
            return published_ranks(run_dir, 1, engine_id=engine_id(self.vllm_config))

    return OneRankScheduler


class Driver:
    """Runs one instance's steps as vLLM 0.33's engine core does (``v1/engine/core.py``
    ``step`` and ``step_with_batch_queue``): one batch in flight, or two under async
    scheduling (step ``N + 1`` scheduled before step ``N`` runs).

    NOTE: every call schedules, also where the engine core would idle
    (``core.py:675``: ``has_requests()`` is false, ``scheduler.py:3167-3181``, for a
    prefill instance whose only requests wait for their sends in pull mode). vLLM learns
    of those sends at its next step, when a request arrives; here they end without one,
    so the run drains.
    """

    def __init__(self, scheduler: Any, worker: ConnectorWorker, in_flight: int) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.in_flight = in_flight
        self.queue: list[Any] = []

    def step(self) -> dict[str, dict[str, Any]]:
        """Returns the ``kv_transfer_params`` of the requests the step run finished."""
        self.queue.append(self.scheduler.schedule())
        if len(self.queue) < self.in_flight:
            return {}
        output = self.queue.pop(0)
        outputs = self.scheduler.update_from_output(output, self.worker.execute(output))
        return {
            finished.request_id: finished.kv_transfer_params
            for engine_outputs in outputs.values()
            for finished in engine_outputs.outputs
            if finished.kv_transfer_params
        }


@dataclasses.dataclass
class PairRun:
    connector: str
    prefill: Any
    decode: Any
    prefill_worker: ConnectorWorker
    decode_worker: ConnectorWorker
    transport: FakeTransport
    handles: tuple[Any, Any]
    drivers: tuple[Driver, Driver]
    preempted: tuple[list[str], list[str]]
    num_decoded: int = 0
    num_aborted_loads: int = 0
    max_pinned: tuple[int, int] = (0, 0)


@pytest.fixture
def pair_services(tmp_path: Any) -> Iterator[dict[str, tuple[str, Any, Any]]]:
    """One kvdefrag rank per instance (threshold 0), published in its own run directory."""
    served = {}
    for role in ("prefill", "decode"):
        run_dir = tmp_path / role
        run_dir.mkdir(mode=0o700)
        secret = os.urandom(32)
        handle, kv = serve_rank(f"{run_dir}/rank0.sock", NUM_BLOCKS, secret, threshold=0)
        publish_ranks(
            os.fspath(run_dir),
            [PublishedRank(rank_address(os.fspath(run_dir), 0), secret)],
            engine_id=harness_engine_id(),
        )
        served[role] = (os.fspath(run_dir), handle, kv)
    yield served
    for _, handle, _ in served.values():
        handle.stop(grace_s=0.5)


def _start(
    model_dir: str,
    services: dict[str, tuple[str, Any, Any]],
    seed: int,
    connector: str,
    *,
    is_async: bool = False,
    **worker: Any,
) -> PairRun:
    transport = FakeTransport(seed)
    schedulers = {}
    workers = {}
    for role, kv_role, engine in (
        ("prefill", "kv_producer", PREFILL),
        ("decode", "kv_consumer", DECODE),
    ):
        run_dir, handle, kv = services[role]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(RUN_DIR_ENV, run_dir)
            schedulers[role] = make_scheduler(
                _instance_class(run_dir, is_async),
                model_dir,
                num_blocks=NUM_BLOCKS,
                prefix_caching=False,
                async_scheduling=is_async,
                kv_transfer_config=_connector_config(connector, kv_role, engine),
            )
        workers[role] = ConnectorWorker(
            handle, kv, transport, role, connector, **worker.get(role, {})
        )
    return PairRun(
        connector,
        schedulers["prefill"],
        schedulers["decode"],
        workers["prefill"],
        workers["decode"],
        transport,
        (services["prefill"][1], services["decode"][1]),
        tuple(  # type: ignore[arg-type]
            Driver(schedulers[role], workers[role], 2 if is_async else 1)
            for role in ("prefill", "decode")
        ),
        (spy_preemptions(schedulers["prefill"]), spy_preemptions(schedulers["decode"])),
    )


def _run_pair(run: PairRun, seed: int, num_prompts: int = 40, max_steps: int = 1500) -> None:
    """P prefills each prompt (``max_tokens=1``, ``do_remote_decode``) beside local
    requests; once P finished one, D gets it with ``do_remote_prefill`` and decodes it
    beside local requests of its own; some D requests are aborted while they load."""
    rng = random.Random(seed)
    prompts = {
        f"t{index}": [rng.randrange(3, 500) for _ in range(rng.randrange(20, 140))]
        for index in range(num_prompts)
    }
    pending = list(prompts)
    handed_over: set[str] = set()
    published: dict[str, dict[str, Any]] = {}  # P's kv_transfer_params, by request id
    local = 0
    for _ in range(max_steps):
        if pending and rng.random() < 0.5:
            transfer_id = pending.pop(0)
            params = {"do_remote_decode": True, "transfer_id": transfer_id}
            run.prefill.add_request(_request(f"p-{transfer_id}", prompts[transfer_id], 1, params))
        for scheduler in (run.prefill, run.decode):
            if len(handed_over) < num_prompts and rng.random() < 0.3:
                local += 1
                prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(10, 100))]
                scheduler.add_request(_request(f"local-{local}", prompt, rng.randrange(1, 30)))
        for transfer_id in prompts:
            request = run.prefill.requests.get(f"p-{transfer_id}")
            finished = request is None or request.is_finished()
            if transfer_id in handed_over or transfer_id in pending or not finished:
                continue
            handed_over.add(transfer_id)
            if run.connector == "NixlConnector":
                # As vLLM's NIXL proxy does: P's published parameters, for D.
                params = {**published[f"p-{transfer_id}"], "do_remote_prefill": True}
            else:
                params = {
                    "do_remote_prefill": True,
                    "remote_engine_id": PREFILL,
                    "remote_bootstrap_addr": "http://127.0.0.1:1",
                    "transfer_id": transfer_id,
                }
            max_tokens = rng.randrange(2, 20)
            run.decode.add_request(
                _request(f"d-{transfer_id}", prompts[transfer_id], max_tokens, params)
            )
        loading = [
            request_id
            for request_id, request in run.decode.requests.items()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        if loading and rng.random() < 0.05:
            run.decode.finish_requests(rng.choice(sorted(loading)), RequestStatus.FINISHED_ABORTED)
            run.num_aborted_loads += 1
        published.update(run.drivers[0].step())
        run.transport.poll(run.prefill_worker.kv, run.decode_worker.kv)
        run.drivers[1].step()
        pinned = tuple(handle.stats().num_pinned for handle in run.handles)
        run.max_pinned = (max(run.max_pinned[0], pinned[0]), max(run.max_pinned[1], pinned[1]))
        done = not pending and len(handed_over) == num_prompts
        if done and not (run.prefill.requests or run.decode.requests or run.transport.pulls):
            break
    else:
        raise AssertionError(f"the pair did not drain in {max_steps} steps")
    run.num_decoded = len(handed_over)
    for scheduler in (run.prefill, run.decode):
        scheduler.kvdefrag.settle()
        scheduler.kvdefrag.ranks.close()


def _request(
    request_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> Request:
    request = Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
    )
    request.kv_transfer_params = params
    return request


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("connector", CONNECTORS)
def test_every_transferred_token_reads_its_signature_on_both_instances(
    model_dir: str, pair_services: Any, connector: str, is_async: bool
) -> None:
    run = _start(model_dir, pair_services, 1, connector, is_async=is_async)
    _run_pair(run, seed=1)

    assert run.prefill_worker.num_corrupted == 0 and run.decode_worker.num_corrupted == 0
    assert run.transport.num_transfers >= 30 and run.transport.num_copied > 60
    assert run.num_aborted_loads > 0
    assert all(run.preempted), run.preempted  # both instances preempted requests
    stats = [handle.stats() for handle in run.handles]
    assert all(s.totals.num_moves > 0 and s.totals.num_placements > 0 for s in stats), stats
    assert min(run.max_pinned) > 0, run.max_pinned  # both instances pinned blocks
    assert [s.num_pinned for s in stats] == [0, 0]  # and every pin ended
    assert run.decode_worker.num_checked > 1000


@pytest.mark.parametrize("connector", CONNECTORS)
def test_without_the_pins_transfers_read_moved_blocks(
    model_dir: str, pair_services: Any, monkeypatch: pytest.MonkeyPatch, connector: str
) -> None:
    """The sabotage: the ledger holds the sending and loading requests' blocks but sends
    no pin, so compaction moves them while a transfer reads or writes them."""
    plan = _ledger.BlockLedger.plan

    def without_pins(self: Any, changes: Any, is_cached: Any) -> Any:
        return dataclasses.replace(plan(self, changes, is_cached), pins={}, unpinned=())

    monkeypatch.setattr(_ledger.BlockLedger, "plan", without_pins)
    run = _start(model_dir, pair_services, 1, connector)
    _run_pair(run, seed=1)

    assert run.decode_worker.num_corrupted > 0


@pytest.mark.parametrize("connector", CONNECTORS)
def test_metadata_left_logical_corrupts(model_dir: str, pair_services: Any, connector: str) -> None:
    """The sabotage: the workers hand the connector the scheduler's ids."""
    no_translation = {"translates_metadata": False}
    run = _start(
        model_dir, pair_services, 1, connector, prefill=no_translation, decode=no_translation
    )
    _run_pair(run, seed=1)

    assert run.decode_worker.num_corrupted > 0


def test_nixl_remote_ids_left_logical_corrupts(
    model_dir: str, pair_services: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sabotage: P publishes the scheduler's ids as NIXL's ``remote_block_ids``."""
    monkeypatch.setattr(DefragScheduler, "_kvdefrag_publishing", lambda self, finished: finished)
    run = _start(model_dir, pair_services, 1, "NixlConnector")
    _run_pair(run, seed=1)

    assert run.decode_worker.num_corrupted > 0


def test_published_ids_are_translated_once_when_one_method_calls_the_other() -> None:
    """MultiConnector's ``request_finished_all_groups`` calls its ``request_finished``
    through the instance, where both are wrapped: only the outer call translates."""

    class Connector:
        def request_finished(self, request: Any, block_ids: list[int]) -> Any:
            return True, {"remote_block_ids": [list(block_ids)]}

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
            return self.request_finished(request, block_ids[0])

    scheduler = types.SimpleNamespace(
        kvdefrag=types.SimpleNamespace(resolve_settled=lambda ids: [i + 100 for i in ids]),
        _kvdefrag_publish_depth=0,
    )
    connector = Connector()
    for name in ("request_finished", "request_finished_all_groups"):
        wrapped = DefragScheduler._kvdefrag_publishing(scheduler, getattr(connector, name))  # type: ignore[arg-type]
        setattr(connector, name, wrapped)

    assert connector.request_finished_all_groups(None, ([1, 2],)) == (
        True,
        {"remote_block_ids": [[101, 102]]},
    )
    assert connector.request_finished(None, [3]) == (True, {"remote_block_ids": [[103]]})
