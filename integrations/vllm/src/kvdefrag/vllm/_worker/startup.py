"""A rank's start-up: its metrics port, and every rank learning whether every other one
started (their addresses and secrets gathered for rank 0 to publish).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvdefrag.common import InvalidArgument
from kvdefrag.server.config import ServiceConfig
from kvdefrag.vllm._discovery import PublishedRank
from kvdefrag.vllm.config import TCP_PORT_ENV
from kvdefrag.vllm.errors import BadSetting, StartupRefused

__all__ = ["RankStart", "describe_error", "gather_ranks", "host_ip", "metrics_config_for_rank"]


def metrics_config_for_rank(service_config: ServiceConfig, port_offset: int) -> ServiceConfig:
    """``service_config`` with this rank's metrics port: ``KVDEFRAG_METRICS_PORT`` +
    ``port_offset`` (``rank_port_offset``: DP rank x world size + local rank), so no two
    ranks of one host contend for one port (0 stays 0: each picks one).

    Raises:
        InvalidArgument: The rank's port would be past 65535.
    """
    base = service_config.metrics_port
    if not base or not port_offset:
        return service_config
    if base + port_offset > 65535:
        raise InvalidArgument(
            f"KVDEFRAG_METRICS_PORT={base}: this rank serves its metrics on "
            f"KVDEFRAG_METRICS_PORT + {port_offset} (DP rank x world size + local rank) = "
            f"port {base + port_offset}; choose KVDEFRAG_METRICS_PORT at most "
            f"{65535 - port_offset}"
        )
    return dataclasses.replace(service_config, metrics_port=base + port_offset)


@dataclasses.dataclass(frozen=True)
class RankStart:
    """What one rank tells the others once it tried to start: its address, or its error.

    ``rank`` is the rank inside its data-parallel engine ``dp_rank``."""

    rank: int
    dp_rank: int
    host: str
    address: str
    secret: str
    error: str


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def host_ip() -> str:
    """The IP vLLM itself uses for this host (``VLLM_HOST_IP`` or its guess)."""
    from vllm.utils.network_utils import get_ip

    return str(get_ip())


def gather_ranks(
    mine: RankStart, world_size: int, failure: Exception | None = None
) -> list[PublishedRank]:
    """Every rank's address and secret, rank 0 first, gathered over vLLM's world group.

    Every rank calls this once it tried to start its service (a collective), whether it
    started or not, so no rank waits for one that failed. The world group spans every
    data-parallel engine's ranks when the model is MoE (vLLM 0.33
    ``distributed/parallel_state.py``: rank offset by ``data_parallel_rank *
    world_size``, world size ``world_size_across_dp``) and one engine's otherwise; each
    engine keeps its own ranks (``dp_rank``), so every engine's rank 0 publishes only them.

    Raises:
        Exception: This rank's own ``failure`` (a single rank).
        StartupRefused: Some rank of the group failed to start (naming each and its
            reason; chained from this rank's own failure).
        BadSetting: This engine's ranks span hosts but some serve on a unix socket.
    """
    if world_size == 1:
        if failure is not None:
            raise failure
        return [PublishedRank(mine.address, bytes.fromhex(mine.secret))]
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, dataclasses.asdict(mine), group=group.cpu_group)
    every = [RankStart(**start) for start in gathered]
    failed = [start for start in every if start.error]
    if failed:
        reasons = "; ".join(f"{rank_name(start)}: {start.error}" for start in failed)
        raise StartupRefused(
            f"kvdefrag: {len(failed)} of {len(every)} ranks could not start their service "
            f"({reasons}); vLLM stops on every rank: fix the cause and restart it"
        ) from failure
    starts = sorted(
        (start for start in every if start.dp_rank == mine.dp_rank), key=lambda s: s.rank
    )
    assert [start.rank for start in starts] == list(range(world_size)), (
        f"DP engine {mine.dp_rank} gathered ranks {[start.rank for start in starts]}, "
        f"not 0..{world_size - 1}"
    )
    hosts = sorted({start.host for start in starts})
    if len(hosts) > 1 and any(start.address.startswith("unix:") for start in starts):
        raise BadSetting(
            f"kvdefrag: the ranks span hosts {hosts} but serve on unix sockets: set "
            f"{TCP_PORT_ENV} (and the KVDEFRAG_TLS_* files) on every host"
        )
    return [PublishedRank(start.address, bytes.fromhex(start.secret)) for start in starts]


def rank_name(start: RankStart) -> str:
    return (
        f"rank {start.rank}" if not start.dp_rank else f"DP rank {start.dp_rank} rank {start.rank}"
    )
