"""End to end: random workloads through client -> real server -> engine -> KV tensors.

Every block carries a signature in real torch KV tensors. The test plays the worker: it
writes a new signature into the physical slot the *client* resolves whenever a block is
fresh, and after every step reads every block that holds data back through the client's
``resolve``; each must still carry its own signature. The client's whole mirror must
also equal the server's mapping, and its view of the requests the server's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdefrag.client import DefragClient, ServiceUnavailable
from kvdefrag.common import StepEvents
from kvdefrag.server import Engine, EngineConfig

from support.kv import SignedKv
from support.random_workload import RandomWorkload
from support.server import Serve, running_server
from support.tls import make_certificates

NUM_BLOCKS = 48
BLOCK_SIZE = 2
NUM_STEPS = 40


@pytest.fixture(scope="module")
def socket_paths(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Distinct unix socket addresses, one per server (hypothesis runs many)."""
    directory: Path = tmp_path_factory.mktemp("e2e")
    return (f"unix:{directory}/s{number}.sock" for number in itertools.count())


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    prefix_caching=st.booleans(),
    threshold=st.integers(0, 8),
    max_moves_per_step=st.sampled_from([1, 3, 8, 512]),
    enable_placement=st.booleans(),
    defragment_every=st.sampled_from([0, 4, 7]),
)
def test_every_live_block_reads_its_own_data_through_the_client(
    socket_paths: Iterator[str],
    seed: int,
    prefix_caching: bool,
    threshold: int,
    max_moves_per_step: int,
    enable_placement: bool,
    defragment_every: int,
) -> None:
    signed = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    workload = RandomWorkload(NUM_BLOCKS, prefix_caching, seed)
    with (
        running_server(
            next(socket_paths),
            kv=signed,
            threshold=threshold,
            max_moves_per_step=max_moves_per_step,
            enable_placement=enable_placement,
            # The server starts without prefix caching; the client's handshake switches it.
        ) as handle,
        DefragClient(handle.address, prefix_caching=prefix_caching, timeout_s=10) as client,
    ):
        for step_number in range(1, NUM_STEPS + 1):
            if defragment_every and step_number % defragment_every == 0:
                client.defragment()
            events, outcome = workload.next_step()

            reply = client.step(events)

            assert reply.seq == step_number
            assert not reply.replayed
            fresh = sorted(outcome.fresh)
            signed.write(fresh, client.resolve(fresh))  # the worker's forward pass
            holding = sorted(workload.model.holds_data())
            lost = signed.mismatched(holding, client.resolve(holding))
            assert lost == [], f"step {step_number}: blocks lost their data: {lost}"
            assert client.resolve(range(NUM_BLOCKS)) == (handle.resolve(range(NUM_BLOCKS)).tolist())
            assert client.live_requests() == workload.model.requests
        report = client.audit()
        assert report.is_consistent, report.describe()
        stats = client.stats()
        assert stats.next_seq == NUM_STEPS + 1
        assert stats.stats.totals.num_steps == NUM_STEPS


def test_the_workloads_exercise_moves_placements_and_every_event_kind() -> None:
    """Guards the property test above against a workload too tame to find anything."""
    signed = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    totals = {"moves": 0, "two_way": 0, "placed": 0, "unknown": 0, "resumed": 0, "evicted": 0}
    readmitted = 0
    for seed in range(6):
        engine = Engine(
            signed.kv_caches,
            BLOCK_SIZE,
            config=EngineConfig(threshold=2, prefix_caching=seed % 2 == 1),
        )
        workload = RandomWorkload(NUM_BLOCKS, seed % 2 == 1, seed)
        for _ in range(NUM_STEPS):
            events, _ = workload.next_step()
            result = engine.step(events)
            totals["moves"] += len(result.moves)
            totals["two_way"] += sum(move.is_two_way for move in result.moves)
            totals["placed"] += result.num_placed
            totals["unknown"] += result.num_unknown_finished
            totals["resumed"] += len(events.resumed)
            totals["evicted"] += len(events.evicted)
            readmitted += len(set(events.finished) & set(events.new_blocks))

    assert all(count > 0 for count in totals.values()), totals
    assert readmitted > 0


def test_the_client_speaks_mtls_over_tcp(serve: Serve, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    signed = SignedKv.create(NUM_BLOCKS, block_size=BLOCK_SIZE)
    handle = serve(
        "127.0.0.1:0",
        kv=signed,
        threshold=0,
        tls_cert_file=str(certs["server"]),
        tls_key_file=str(certs["server_key"]),
        tls_client_ca_file=str(certs["ca"]),
    )
    target = f"localhost:{handle.address.rsplit(':', 1)[1]}"
    with DefragClient(
        target,
        timeout_s=10,
        root_certificates=certs["ca"].read_bytes(),
        private_key=certs["client_key"].read_bytes(),
        certificate_chain=certs["client"].read_bytes(),
    ) as client:
        client.step(StepEvents(new_blocks={"a": [30, 31], "b": [40]}))
        signed.write([30, 31, 40], client.resolve([30, 31, 40]))
        client.step(StepEvents(finished=["a"]))  # compaction moves b's block down

        assert signed.mismatched([40], client.resolve([40])) == []
        assert client.resolve([40]) == [1]
        assert client.audit().is_consistent
    with pytest.raises(ServiceUnavailable):  # no client certificate: refused
        DefragClient(target, timeout_s=1, root_certificates=certs["ca"].read_bytes())
