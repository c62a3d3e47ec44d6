"""The worker side's KV-connector adapters: a connector's metadata, made physical.

vLLM's scheduler-side connector builds each step's ``kv_connector_metadata`` from the
scheduler's logical block ids; the worker-side connector reads and writes KV data by the
ids it finds there, during the pass and after it (background threads, remote reads,
offload streams). ``ConnectorAdapter.translate`` returns a copy of the metadata with
every *local* id (this instance's) physical, and ``to_logical`` maps the ids the worker
reports back (``get_block_ids_with_load_errors``) to the scheduler's. *Remote* ids
(another instance's, already physical there) are never translated.

One adapter per served connector class, chosen by name (``connector_adapter``); the
fields each one translates, and why the others stay refused, are in
docs/design/kv-connectors.md. Duck-typed against vLLM 0.33's and 0.32's metadata
classes: importing this module imports no vLLM. A metadata object whose class, or whose
fields, are not the ones an adapter knows is refused (``PassRefused``): one id left
logical is silent corruption.
"""

from __future__ import annotations

import copy
import functools
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag

__all__ = [
    "SERVED_CONNECTORS",
    "ConnectorAdapter",
    "Resolve",
    "connector_adapter",
]

Resolve = npt.NDArray[np.int64] | Callable[[npt.NDArray[np.int64]], npt.NDArray[np.int64]]
"""``mapping[logical_id] = physical_id`` as an array, or a function that resolves an
array of logical ids (``ServerHandle.resolve``)."""

_Sink = Callable[[npt.NDArray[np.int64]], None]


def _fields(names: str) -> frozenset[str]:
    """The field names an adapter knows of a record, space-separated."""
    return frozenset(names.split())


_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


class _Gather:
    """The logical ids one metadata object names, resolved in one lookup.

    Each ``add`` names ids and a sink; ``resolve`` looks every id up at once and hands
    each sink its share (physical ids, in the order added).
    """

    def __init__(self) -> None:
        self._parts: list[npt.NDArray[np.int64]] = []
        self._sinks: list[_Sink] = []

    def add(self, logical_ids: npt.ArrayLike, sink: _Sink) -> None:
        """Names ``logical_ids`` (any shape, read flat); ``sink`` gets their physical ids."""
        self._parts.append(np.asarray(logical_ids, dtype=np.int64).reshape(-1))
        self._sinks.append(sink)

    def add_groups(self, groups: Sequence[Sequence[int]], sink: Callable[[Any], None]) -> None:
        """Names one list of ids per KV-cache group; ``sink`` gets the physical lists in a
        container of the same kind (tuple or list)."""
        lengths = [len(group) for group in groups]
        container = tuple if isinstance(groups, tuple) else list
        flat = np.fromiter(itertools.chain.from_iterable(groups), np.int64, sum(lengths))

        def split(physical_ids: npt.NDArray[np.int64]) -> None:
            physical = physical_ids.tolist()
            shares, start = [], 0
            for length in lengths:
                shares.append(physical[start : start + length])
                start += length
            sink(container(shares))

        self.add(flat, split)

    def resolve(self, mapping: Resolve) -> None:
        """Looks every id up through ``mapping`` and fills the sinks.

        Raises:
            PassRefused: An id is outside the pool ``mapping`` covers.
        """
        if not self._parts:
            return
        logical_ids = np.concatenate(self._parts)
        if isinstance(mapping, np.ndarray):
            if logical_ids.size and (logical_ids.min() < 0 or logical_ids.max() >= len(mapping)):
                bad = logical_ids[(logical_ids < 0) | (logical_ids >= len(mapping))][0]
                raise PassRefused(
                    f"kvdefrag: the KV connector's metadata names block {int(bad)}, outside "
                    f"the pool [0, {len(mapping)}); restart vLLM"
                )
            physical_ids = mapping[logical_ids]
        else:
            physical_ids = mapping(logical_ids)
        bounds = np.cumsum([len(part) for part in self._parts])[:-1]
        for sink, share in zip(self._sinks, np.split(physical_ids, bounds), strict=True):
            sink(share)


class ConnectorAdapter(ABC):
    """Translates one connector's metadata for a worker's pass.

    Invariants: ``translate`` never changes the metadata it is given nor any container
    in it (with an in-process executor the scheduler shares them); the copy it returns
    has new containers wherever an id changed, and shares the rest (request ids, remote
    ids, flags) with the original. Every reportable id is local, so ``to_logical`` is the
    same for every connector.
    """

    connector_name: str
    """The ``kv_connector`` name this adapter serves."""

    def translate(self, metadata: Any, mapping: Resolve, block_size: int) -> Any:
        """A copy of ``metadata`` with every local block id (and slot) physical.

        Args:
            metadata: The step's ``kv_connector_metadata`` (None passes through).
            mapping: ``mapping[logical_id] = physical_id``, valid for this pass; looked
                up once, with every id the metadata names.
            block_size: The scheduler's block size in tokens
                (``cache_config.block_size``): a slot is ``block_id * block_size +
                offset``.

        Raises:
            PassRefused: The metadata is not the class, or does not have the fields,
                this adapter knows.
        """
        if metadata is None:
            return None
        gather = _Gather()
        translated = self._collect(metadata, gather, block_size)
        gather.resolve(mapping)
        return translated

    def to_logical(self, physical_ids: Iterable[int], mapping: npt.NDArray[np.int64]) -> set[int]:
        """The logical ids of ``physical_ids`` (the worker's ``invalid_block_ids``).

        Costs nothing without ids; with some, one pass over ``mapping`` (the inverse).

        Args:
            physical_ids: Ids the worker-side connector reported.
            mapping: The whole mapping of the pass whose metadata named them
                (``ServerHandle.resolve()``).

        Raises:
            PassRefused: An id is outside the pool.
        """
        physical = np.fromiter(physical_ids, np.int64)
        if not physical.size:
            return set()
        num_blocks = len(mapping)
        if physical.min() < 0 or physical.max() >= num_blocks:
            bad = physical[(physical < 0) | (physical >= num_blocks)][0]
            raise PassRefused(
                f"kvdefrag: the {self.connector_name} worker reported block {int(bad)}, "
                f"outside the pool [0, {num_blocks}); restart vLLM"
            )
        inverse = np.empty(num_blocks, dtype=np.int64)
        inverse[mapping] = np.arange(num_blocks, dtype=np.int64)
        return set(inverse[physical].tolist())

    @abstractmethod
    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        """Copies ``metadata``, naming to ``gather`` each id list with the sink that
        writes its physical ids into the copy."""

    def _check(self, record: object, class_name: str, fields: frozenset[str]) -> None:
        """Refuses ``record`` unless it is a ``class_name`` with no field beyond
        ``fields`` (a field vLLM added may name ids this adapter would leave logical).

        ``class_name`` is module-qualified for metadata classes (an out-of-tree class of
        the same name names its ids its own way), bare for records inside them.
        """
        kind = type(record)
        found = f"{kind.__module__}.{kind.__qualname__}" if "." in class_name else kind.__name__
        if found != class_name:
            raise PassRefused(
                f"kvdefrag: the {self.connector_name} adapter expected a {class_name}, got "
                f"a {found}: the connector is not the one kvdefrag translates for"
            )
        unknown = vars(record).keys() - fields
        if unknown:
            raise PassRefused(
                f"kvdefrag: vLLM's {kind.__name__} carries field(s) {sorted(unknown)} that "
                f"kvdefrag's {self.connector_name} adapter does not know: they may name "
                "block ids it would leave logical. Use the vLLM release kvdefrag supports."
            )


def _slots_to_physical(
    slot_mapping: Any, gather: _Gather, block_size: int, sink: Callable[[Any], None]
) -> None:
    """Names the blocks of a slot mapping (a tensor, array or list of ``block_id *
    block_size + offset``; negative entries are padding and stay); ``sink`` gets the
    physical slots as the same kind of object (same dtype and device)."""
    is_tensor = isinstance(slot_mapping, torch.Tensor)
    slots = (slot_mapping.detach().cpu().numpy() if is_tensor else np.asarray(slot_mapping)).astype(
        np.int64, copy=False
    )
    is_slot = slots >= 0
    logical_ids, offsets = np.divmod(slots[is_slot], block_size)

    def place(physical_ids: npt.NDArray[np.int64]) -> None:
        physical_slots = slots.copy()
        physical_slots[is_slot] = physical_ids * block_size + offsets
        if is_tensor:
            sink(
                torch.from_numpy(physical_slots).to(
                    device=slot_mapping.device, dtype=slot_mapping.dtype
                )
            )
        elif isinstance(slot_mapping, np.ndarray):
            sink(physical_slots.astype(slot_mapping.dtype, copy=False))
        else:
            sink(physical_slots.tolist())

    gather.add(logical_ids, place)


class _SlotRequestsAdapter(ConnectorAdapter):
    """A metadata class whose ``requests`` each carry a ``slot_mapping``
    (ExampleConnector's and the in-tree LMCache's ``ReqMeta``).

    Each request's copy shares its other fields: LMCache's worker updates ``save_spec``
    and ``disagg_spec`` in place after a store, as it does without kvdefrag.
    """

    def __init__(
        self,
        connector_name: str,
        metadata_class: str,
        metadata_fields: frozenset[str],
        request_fields: frozenset[str],
    ) -> None:
        self.connector_name = connector_name
        self._metadata_class = metadata_class
        self._metadata_fields = metadata_fields
        self._request_fields = request_fields

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._metadata_class, self._metadata_fields)
        requests = []
        for request in metadata.requests:
            self._check(request, "ReqMeta", self._request_fields)
            translated = copy.copy(request)
            _slots_to_physical(
                request.slot_mapping,
                gather,
                block_size,
                functools.partial(setattr, translated, "slot_mapping"),
            )
            requests.append(translated)
        result = copy.copy(metadata)
        result.requests = requests
        return result


def _example_adapter() -> ConnectorAdapter:
    # vLLM example_connector.py: ExampleConnectorMetadata.requests, ReqMeta.slot_mapping.
    return _SlotRequestsAdapter(
        "ExampleConnector",
        f"{_V1}.example_connector.ExampleConnectorMetadata",
        _fields("requests"),
        _fields("token_ids slot_mapping is_store mm_hashes"),
    )


def _lmcache_adapter() -> ConnectorAdapter:
    # NOTE: only the in-tree ("use_native") implementation: its metadata is vLLM's
    # lmcache_integration/vllm_v1_adapter.py; the lmcache package's own (the default)
    # is not read here, and the class check refuses it.
    return _SlotRequestsAdapter(
        "LMCacheConnectorV1",
        f"{_V1}.lmcache_integration.vllm_v1_adapter.LMCacheConnectorMetadata",
        _fields("requests lookup_requests_in_step"),
        _fields(
            "req_id token_ids slot_mapping is_last_prefill save_spec load_spec "
            "disagg_spec request_configs"
        ),
    )


class _MooncakeAdapter(ConnectorAdapter):
    """MooncakeConnector: D's ``reqs_to_recv[engine][req].local_block_ids`` and P's
    ``reqs_to_send[req] = (transfer_id, local_block_ids)``. The metadata names no remote
    id: D sends its (now physical) ids to P over Mooncake's side channel."""

    connector_name = "MooncakeConnector"
    _METADATA = f"{_V1}.mooncake.mooncake_connector.MooncakeConnectorMetadata"
    _METADATA_FIELDS = _fields("reqs_to_recv reqs_to_send reqs_not_processed")
    _PULL_FIELDS = _fields(
        "d_req_id transfer_id local_block_ids remote_engine_id "
        "remote_bootstrap_addr expire_time pull_tasks_count failed"
    )

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._METADATA, self._METADATA_FIELDS)
        to_recv = copy.copy(metadata.reqs_to_recv)  # a defaultdict keeps its factory
        for engine_id, pulls in metadata.reqs_to_recv.items():
            translated_pulls = {}
            for request_id, pull in pulls.items():
                self._check(pull, "PullReqMeta", self._PULL_FIELDS)
                translated = copy.copy(pull)
                gather.add_groups(
                    pull.local_block_ids,
                    functools.partial(setattr, translated, "local_block_ids"),
                )
                translated_pulls[request_id] = translated
            to_recv[engine_id] = translated_pulls
        to_send: dict[Any, tuple[Any, Any]] = {}
        for request_id, (transfer_id, groups) in metadata.reqs_to_send.items():
            to_send[request_id] = (transfer_id, groups)  # its place in the order
            gather.add_groups(
                groups, functools.partial(_put_pair, to_send, request_id, transfer_id)
            )
        result = copy.copy(metadata)
        result.reqs_to_recv = to_recv
        result.reqs_to_send = to_send
        return result


def _put_pair(record: dict[Any, Any], key: Any, first: Any, second: Any) -> None:
    record[key] = (first, second)


class _NixlPullAdapter(ConnectorAdapter):
    """NixlConnector in pull mode: ``reqs_to_recv[req].local_block_ids`` (D) and
    ``reqs_to_save[req].local_block_ids`` (P with a host buffer).

    ``local_physical_block_ids`` is the same list when the scheduler builds the metadata
    (only the worker expands it to kernel pages, from ``local_block_ids``), so the copy
    keeps them one list. ``remote.block_ids`` are P's ids and stay; the ``remote`` record
    is copied, since the worker rebinds its ``block_ids``.

    NOTE: push mode (``NixlPushConnector``) is not served. It would also need D's
    ``push_registrations[req]["local_block_ids"]`` and P's ``push_finished_blocks``
    translated, and P's blocks kept in place while its writer thread writes them to D,
    until ``finished_sending``: pins nothing here provides.
    """

    connector_name = "NixlConnector"
    _METADATA = f"{_V1}.nixl.metadata.NixlConnectorMetadata"
    _METADATA_FIELDS = _fields(
        "reqs_to_recv reqs_to_save reqs_to_send scheduler_clock reqs_in_batch "
        "reqs_not_processed heartbeat_by_engine push_registrations "
        "push_finished_blocks"
    )
    _REQUEST_FIELDS = _fields(
        "local_block_ids local_physical_block_ids tp_size dcp_size "
        "local_num_computed_blocks remote remote_block_size pp_size "
        "awaiting_kvs region_blocks_to_zero"
    )

    def __init__(self, connector_name: str = "NixlConnector") -> None:
        self.connector_name = connector_name

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._METADATA, self._METADATA_FIELDS)
        if metadata.push_registrations or metadata.push_finished_blocks:
            raise PassRefused(
                f"kvdefrag: the {self.connector_name} metadata carries push-mode fields "
                "(push_registrations, push_finished_blocks): kvdefrag serves NIXL in pull "
                "mode only"
            )
        result = copy.copy(metadata)
        result.reqs_to_recv = {
            request_id: self._request(request, gather)
            for request_id, request in metadata.reqs_to_recv.items()
        }
        result.reqs_to_save = {
            request_id: self._request(request, gather)
            for request_id, request in metadata.reqs_to_save.items()
        }
        return result

    def _request(self, request: Any, gather: _Gather) -> Any:
        self._check(request, "ReqMeta", self._REQUEST_FIELDS)
        local, expanded = request.local_block_ids, request.local_physical_block_ids
        if expanded is not local and [list(group) for group in expanded] != [
            list(group) for group in local
        ]:
            raise PassRefused(
                f"kvdefrag: a {self.connector_name} request's local_physical_block_ids "
                "differ from its local_block_ids: the scheduler expanded them, which "
                "kvdefrag cannot translate"
            )
        if request.region_blocks_to_zero is not None:
            raise PassRefused(
                f"kvdefrag: a {self.connector_name} request carries region_blocks_to_zero "
                "(kernel pages the worker sets itself) from the scheduler: kvdefrag cannot "
                "translate them"
            )
        translated = copy.copy(request)
        if request.remote is not None:
            translated.remote = copy.copy(request.remote)

        def place(physical: Any) -> None:
            translated.local_block_ids = physical
            translated.local_physical_block_ids = physical

        gather.add_groups(local, place)
        return translated


class _OffloadingAdapter(ConnectorAdapter):
    """OffloadingConnector: the GPU side of each job, ``load_jobs[j].dst_spec`` and
    ``store_jobs[j].src_spec`` (``GPULoadStoreSpec.block_ids``, int32). The other side
    names the offload medium's own chunks and stays. ``jobs_to_flush`` names job ids."""

    connector_name = "OffloadingConnector"
    _METADATA = f"{_V1}.offloading.common.OffloadingConnectorMetadata"
    _METADATA_FIELDS = _fields("load_jobs store_jobs jobs_to_flush")
    _JOB_FIELDS = _fields("req_id src_spec dst_spec sync")  # sync: 0.33
    _GPU_SPEC_FIELDS = _fields("block_ids group_sizes block_indices")

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._METADATA, self._METADATA_FIELDS)
        result = copy.copy(metadata)
        # NOTE: new dicts above all: the worker's handle_preemptions pops store_jobs.
        result.load_jobs = {
            job_id: self._job(job, "dst_spec", gather) for job_id, job in metadata.load_jobs.items()
        }
        result.store_jobs = {
            job_id: self._job(job, "src_spec", gather)
            for job_id, job in metadata.store_jobs.items()
        }
        return result

    def _job(self, job: Any, gpu_side: str, gather: _Gather) -> Any:
        self._check(job, "TransferJob", self._JOB_FIELDS)
        spec = getattr(job, gpu_side)
        self._check(spec, "GPULoadStoreSpec", self._GPU_SPEC_FIELDS)
        translated_spec = copy.copy(spec)
        dtype = np.asarray(spec.block_ids).dtype

        def place(physical_ids: npt.NDArray[np.int64]) -> None:
            translated_spec.block_ids = physical_ids.astype(dtype)

        gather.add(spec.block_ids, place)
        translated = copy.copy(job)
        setattr(translated, gpu_side, translated_spec)
        return translated


class _SimpleCpuOffloadAdapter(ConnectorAdapter):
    """SimpleCPUOffloadConnector: ``load_gpu_blocks`` and ``store_gpu_blocks``; the
    ``*_cpu_blocks`` lists index its CPU pool and stay."""

    connector_name = "SimpleCPUOffloadConnector"
    _METADATA = "vllm.v1.simple_kv_offload.metadata.SimpleCPUOffloadMetadata"
    _METADATA_FIELDS = _fields(
        "load_event load_gpu_blocks load_cpu_blocks load_event_to_reqs "
        "store_event store_gpu_blocks store_cpu_blocks need_flush"
    )

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._METADATA, self._METADATA_FIELDS)
        result = copy.copy(metadata)
        for field in ("load_gpu_blocks", "store_gpu_blocks"):
            place = functools.partial(_set_list, result, field)
            gather.add(getattr(metadata, field), place)
        return result


def _set_list(record: object, field: str, physical_ids: npt.NDArray[np.int64]) -> None:
    setattr(record, field, physical_ids.tolist())


class _MultiAdapter(ConnectorAdapter):
    """MultiConnector: ``metadata[i]`` is child ``i``'s, translated by its adapter, all
    children's ids in the one lookup."""

    connector_name = "MultiConnector"
    _METADATA = f"{_V1}.multi_connector.MultiKVConnectorMetadata"
    _METADATA_FIELDS = _fields("metadata extra_async_saves")

    def __init__(self, children: Sequence[ConnectorAdapter]) -> None:
        self.children = tuple(children)

    def _collect(self, metadata: Any, gather: _Gather, block_size: int) -> Any:
        self._check(metadata, self._METADATA, self._METADATA_FIELDS)
        if len(metadata.metadata) != len(self.children):
            raise PassRefused(
                f"kvdefrag: the MultiConnector metadata has {len(metadata.metadata)} "
                f"children's, its configuration names {len(self.children)} connectors"
            )
        result = copy.copy(metadata)
        result.metadata = tuple(
            child._collect(child_metadata, gather, block_size)
            for child, child_metadata in zip(self.children, metadata.metadata, strict=True)
        )
        return result


_ADAPTERS: Mapping[str, Callable[[], ConnectorAdapter]] = {
    "ExampleConnector": _example_adapter,
    "LMCacheConnectorV1": _lmcache_adapter,
    "MooncakeConnector": _MooncakeAdapter,
    "NixlConnector": _NixlPullAdapter,
    "NixlPullConnector": functools.partial(_NixlPullAdapter, "NixlPullConnector"),
    "OffloadingConnector": _OffloadingAdapter,
    "SimpleCPUOffloadConnector": _SimpleCpuOffloadAdapter,
}

SERVED_CONNECTORS: tuple[str, ...] = (*sorted(_ADAPTERS), "MultiConnector")
"""The ``kv_connector`` names kvdefrag translates for (MultiConnector: of these)."""

_WHY_REFUSED: Mapping[str, str] = {
    "NixlPushConnector": (
        "its writer thread writes P's blocks to D outside any pass, by ids kvdefrag does "
        "not translate (use NixlConnector, pull mode)"
    ),
}


def connector_adapter(config: str | Any) -> ConnectorAdapter:
    """The adapter for a KV connector, by its ``kv_connector`` name or from vLLM's
    ``KVTransferConfig`` (MultiConnector: from its config, whose
    ``kv_connector_extra_config["connectors"]`` names the children).

    Raises:
        UnsupportedByKvdefrag: kvdefrag cannot translate for this connector: it is not
            served, comes from ``kv_connector_module_path``, is LMCache without
            ``use_native``, or is a MultiConnector named without its children or with
            one that is refused.
    """
    if isinstance(config, str):
        name, module_path, extra = config, None, None
    else:
        name, module_path, extra = _read_config(config)
    if module_path:
        raise UnsupportedByKvdefrag(
            f"kvdefrag cannot serve KV connector {name!r} from kv_connector_module_path "
            f"{module_path!r}: it translates block ids for vLLM's own connectors only "
            f"({', '.join(SERVED_CONNECTORS)}); drop kv_connector_module_path or kvdefrag."
        )
    if name == "MultiConnector":
        if extra is None:
            raise UnsupportedByKvdefrag(
                "kvdefrag needs MultiConnector's kv_transfer_config, not its name, to know "
                "its children's connectors: pass the config."
            )
        return _MultiAdapter([connector_adapter(child) for child in extra.get("connectors", ())])
    if name == "LMCacheConnectorV1" and extra is not None and not extra.get("use_native"):
        raise UnsupportedByKvdefrag(
            "kvdefrag serves LMCacheConnectorV1 only with vLLM's in-tree implementation: "
            'set kv_connector_extra_config {"use_native": true}, or drop kvdefrag.'
        )
    make = _ADAPTERS.get(str(name))
    if make is None:
        why = _WHY_REFUSED.get(
            str(name), "its metadata names block ids kvdefrag does not translate"
        )
        raise UnsupportedByKvdefrag(
            f"kvdefrag cannot serve KV connector {name!r}: {why}. It serves "
            f"{', '.join(SERVED_CONNECTORS)}; use one of these, or drop kvdefrag."
        )
    return make()


def _read_config(config: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``(kv_connector, kv_connector_module_path, kv_connector_extra_config)`` of a
    ``KVTransferConfig``, or of one of MultiConnector's child dicts."""
    if isinstance(config, Mapping):
        return (
            config.get("kv_connector"),
            config.get("kv_connector_module_path"),
            dict(config.get("kv_connector_extra_config") or {}),
        )
    return (
        getattr(config, "kv_connector", None),
        getattr(config, "kv_connector_module_path", None),
        dict(getattr(config, "kv_connector_extra_config", None) or {}),
    )
