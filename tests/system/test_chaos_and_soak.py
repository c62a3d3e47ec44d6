"""Long runs in CI (marked slow): a chaotic connection, and a soak with flat memory.

Both drive a real server and a real ``DefragClient`` with the synthetic vLLM workload
and KV tensors whose blocks carry signatures, so a lost, doubled or misplaced step shows
up as a corrupted block.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdefrag.client import (
    DefragClient,
    ServiceUnavailable,
    StepEvents,
    StepOutcomeUnknown,
    StepReply,
)
from kvdefrag.server import ServerHandle
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig

from support.kv import SignedKv
from support.proxy import SocketProxy
from support.server import Serve

BLOCK_SIZE = 4

pytestmark = pytest.mark.slow


def workload_config(num_steps: int, prefix_caching: bool, seed: int) -> WorkloadConfig:
    """A few hundred 4-token blocks that fill up, preempt and share prefixes."""
    return WorkloadConfig(
        num_blocks=400,
        block_size=BLOCK_SIZE,
        num_steps=num_steps,
        arrival_rate=0.4,
        initial_requests=8,
        prompt_len_median=40,
        prompt_len_max=300,
        output_len_scale=20,
        output_len_max=200,
        system_prompt_len=24,
        max_num_batched_tokens=256,
        enable_prefix_caching=prefix_caching,
        seed=seed,
    )


def step_through_faults(client: DefragClient, events: StepEvents) -> tuple[StepReply, int]:
    """Sends one step by the client's contract, however often the connection fails.

    Returns:
        The step's reply and how many failures it took.
    """
    failures = 0
    while True:
        try:
            return client.step(events), failures
        except StepOutcomeUnknown:
            failures += 1
            break  # sent, outcome unknown: only complete_pending_step() may resend it
        except ServiceUnavailable:
            failures += 1  # not sent (no session): sending again is safe
    while True:
        try:
            reply = client.complete_pending_step()
        except StepOutcomeUnknown:
            failures += 1
            continue
        assert reply is not None, "the pending step vanished"
        return reply, failures


def corrupted_blocks(
    client: DefragClient, signed: SignedKv, workload: SyntheticWorkload, prefix_caching: bool
) -> list[int]:
    """Live blocks, and with prefix caching cached free ones, not holding their data."""
    held = {i for ids in client.live_requests().values() for i in ids}
    if prefix_caching:
        held |= {
            i
            for i in range(1, signed.num_blocks)
            if i not in held and workload.pool.block_key(i) is not None
        }
    checked = sorted(held - {0})
    return signed.mismatched(checked, client.resolve(checked))


def run_workload(
    client: DefragClient,
    signed: SignedKv,
    workload: SyntheticWorkload,
    *,
    check_every: int,
    on_check: Callable[[int], None] = lambda index: None,
) -> int:
    """Drives every step of the workload; the worker writes each step's fresh blocks."""
    prefix_caching = workload.config.enable_prefix_caching
    num_failures = 0
    for step in workload:
        _, failures = step_through_faults(client, step.events)
        num_failures += failures
        fresh = sorted(set(step.events.fresh or ()))
        signed.write(fresh, client.resolve(fresh))  # the forward pass
        if (step.index + 1) % check_every == 0:
            assert corrupted_blocks(client, signed, workload, prefix_caching) == []
            on_check(step.index)
    return num_failures


def serve_pool(
    serve: Serve, tmp_path: Path, prefix_caching: bool, **config: object
) -> tuple[ServerHandle, SignedKv]:
    signed = SignedKv.create(400, block_size=BLOCK_SIZE)
    handle = serve(
        f"unix:{tmp_path}/server.sock",
        kv=signed,
        threshold=2,
        max_moves_per_step=32,
        prefix_caching=prefix_caching,
        **config,
    )
    return handle, signed


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix", "prefix"])
def test_chaos_every_step_is_applied_exactly_once_and_no_block_is_corrupted(
    serve: Serve, tmp_path: Path, prefix_caching: bool
) -> None:
    num_steps = 2_000
    handle, signed = serve_pool(serve, tmp_path, prefix_caching)
    proxy = SocketProxy(f"unix:{tmp_path}/server.sock", listen=f"unix:{tmp_path}/proxy.sock")
    proxy.start_chaos(seed=11)
    try:
        with DefragClient(proxy.address, prefix_caching, timeout_s=0.5) as client:
            workload = SyntheticWorkload(workload_config(num_steps, prefix_caching, seed=3))
            num_failures = run_workload(client, signed, workload, check_every=100)
            proxy.calm()
            client.timeout_s = 10
            totals = handle.stats().totals
            assert totals.num_steps == num_steps == client.next_seq - 1
            assert corrupted_blocks(client, signed, workload, prefix_caching) == []
            assert client.audit().is_consistent
    finally:
        proxy.close()
        handle.stop(1.0)
    # The chaos was real: every kind happened and steps had to be retried.
    assert all(count > 0 for count in proxy.chaos_counts.values()), proxy.chaos_counts
    assert num_failures > 0 and totals.num_moves > 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def test_soak_keeps_every_block_and_memory_flat(serve: Serve, tmp_path: Path) -> None:
    num_steps, replay_cache_size = 20_000, 16
    handle, signed = serve_pool(serve, tmp_path, True, replay_cache_size=replay_cache_size)
    rss_samples: list[int] = []
    cache_sizes: list[int] = []

    def on_check(index: int) -> None:
        rss_samples.append(rss_bytes())
        cache_sizes.append(len(handle._servicer._ledger))

    try:
        with DefragClient(handle.address, prefix_caching=True, timeout_s=30) as client:
            workload = SyntheticWorkload(workload_config(num_steps, True, seed=7))
            run_workload(client, signed, workload, check_every=1_000, on_check=on_check)
            assert handle.stats().totals.num_steps == num_steps
    finally:
        handle.stop(1.0)
    assert max(cache_sizes) == replay_cache_size
    # After warm-up (the first 5k steps), RSS may wobble but not grow with the step count.
    warm = rss_samples[4]
    assert max(rss_samples[5:]) - warm < 64 * 2**20, [s // 2**20 for s in rss_samples]
