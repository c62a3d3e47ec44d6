"""The client's value types: what its calls return (plain frozen dataclasses, no protobuf)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvdefrag.common import InvalidArgument

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _block_ids(field: str, ids: Iterable[int]) -> list[int]:
    if isinstance(ids, (str, bytes)):
        raise InvalidArgument(f"{field}: expected a sequence of block ids, got {ids!r}")
    try:
        checked = [operator.index(block_id) for block_id in ids]
    except TypeError as err:
        raise InvalidArgument(f"{field}: block ids must be integers ({err})") from err
    for position, block_id in enumerate(checked):
        if not _INT64_MIN <= block_id <= _INT64_MAX:
            raise InvalidArgument(f"{field}[{position}]: block id {block_id} is not an int64")
    return checked


def _request_id(field: str, request_id: object) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgument(f"{field}: request id must be a str, got {request_id!r}")
    return request_id


def _block_lists(field: str, lists: Mapping[str, Sequence[int]] | None) -> dict[str, list[int]]:
    if lists is None:
        return {}
    if not isinstance(lists, Mapping):
        raise InvalidArgument(
            f"{field}: expected a mapping of request id -> block ids, got {type(lists).__name__}"
        )
    return {
        _request_id(field, request_id): _block_ids(f"{field}[{request_id!r}]", ids)
        for request_id, ids in lists.items()
    }


@dataclasses.dataclass(frozen=True)
class StepEvents:
    """One scheduling iteration's block events, as the keywords of ``DefragClient.step``.

    Attributes:
        finished: Request ids whose blocks are released (finished or preempted).
        new_blocks: Request id -> logical block ids appended this step.
        resumed: Request id -> the full new block list of a resumed request (replaces).
        fresh: Logical ids among the new/resumed ones that hold no data yet; None lets
            the server decide (every newly live block without prefix caching, none with).
        evicted: Logical ids dropped from the prefix cache.
    """

    finished: tuple[str, ...] = ()
    new_blocks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    resumed: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    fresh: list[int] | None = None
    evicted: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def build(
        cls,
        *,
        finished: Iterable[str] = (),
        new_blocks: Mapping[str, Sequence[int]] | None = None,
        resumed: Mapping[str, Sequence[int]] | None = None,
        fresh: Iterable[int] | None = None,
        evicted: Iterable[int] = (),
    ) -> StepEvents:
        """Checks types and copies the events (ranges are the server's to check).

        Raises:
            InvalidArgument: A request id is not a str, or a block id not an int64.
        """
        if isinstance(finished, (str, bytes)):
            raise InvalidArgument(
                f"finished: expected a collection of request ids, got {finished!r}"
            )
        return cls(
            finished=tuple(_request_id("finished", request_id) for request_id in finished),
            new_blocks=_block_lists("new_blocks", new_blocks),
            resumed=_block_lists("resumed", resumed),
            fresh=None if fresh is None else _block_ids("fresh", fresh),
            evicted=_block_ids("evicted", evicted),
        )

    def as_kwargs(self) -> dict[str, Any]:
        """Returns the events as ``DefragClient.step`` (or ``Engine.step``) keywords."""
        return {
            "finished": list(self.finished),
            "new_blocks": self.new_blocks,
            "resumed": self.resumed,
            "fresh": self.fresh,
            "evicted": self.evicted,
        }


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """Pool statistics as the server reported them (the engine's ``EngineStats``).

    Attributes:
        num_blocks: Blocks in the pool, null block included.
        num_live: Blocks referenced by at least one request.
        max_live: Highest live physical id (0 when nothing is live).
        holes: ``max_live - num_live``.
        num_requests: Requests holding blocks.
        fragmentation_ratio: ``max_live / num_live``; 1.0 is packed.
        is_healthy: False after a failed KV move, until a reset.
        num_steps: Steps applied in this epoch's engine.
        num_moves: Blocks moved by compaction.
        num_two_way_moves: Moves that swapped contents with a cached free block.
        num_placements: Fresh blocks re-pointed to a lower slot without a copy.
        num_defrag_runs: Compaction passes that moved at least one block.
        num_bytes_moved: Bytes written to the KV tensors by moves.
        num_unknown_finished: Finished request ids the engine did not know.
    """

    num_blocks: int = 0
    num_live: int = 0
    max_live: int = 0
    holes: int = 0
    num_requests: int = 0
    fragmentation_ratio: float = 1.0
    is_healthy: bool = True
    num_steps: int = 0
    num_moves: int = 0
    num_two_way_moves: int = 0
    num_placements: int = 0
    num_defrag_runs: int = 0
    num_bytes_moved: int = 0
    num_unknown_finished: int = 0


@dataclasses.dataclass(frozen=True)
class StepReply:
    """What one step changed, as the client applied it to its mirror.

    Attributes:
        seq: The step's sequence number.
        epoch: The server epoch the step was applied in.
        block_mapping: Logical id -> physical id for every id newly referenced or moved
            by this step (already applied to the client's mirror).
        num_moves: KV blocks moved by compaction in this step.
        num_placed: Fresh blocks re-pointed to a lower slot (no copy).
        num_unknown_finished: Finished request ids the server did not know.
        replayed: True when the server answered from its replay cache (the step had
            been applied before a reconnect; it was not applied twice).
        digest: Digest of the live mapping after the step (checked against the mirror).
        stats: Pool statistics after the step.
    """

    seq: int
    epoch: int
    block_mapping: dict[int, int]
    num_moves: int
    num_placed: int
    num_unknown_finished: int
    replayed: bool
    digest: int
    stats: PoolStats


@dataclasses.dataclass(frozen=True)
class ServiceStats:
    """The server's answer to ``GetStats``.

    Attributes:
        epoch: The server's current epoch.
        next_seq: The seq the server expects next.
        is_session_open: Whether a stream session (a writer) is connected.
        digest: Digest of the server's live mapping.
        stats: Pool statistics.
        unhealthy_reason: Why steps are refused; empty when healthy.
    """

    epoch: int
    next_seq: int
    is_session_open: bool
    digest: int
    stats: PoolStats
    unhealthy_reason: str


@dataclasses.dataclass(frozen=True)
class SessionInfo:
    """The server's answer to opening a stream session."""

    epoch: int
    next_seq: int
    num_blocks: int
    block_size: int
    prefix_caching: bool
    digest: int


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The difference between the client's view of live requests and the server's.

    Attributes:
        epoch: The server epoch the audit compared against.
        client_epoch: The epoch of the client's mirror.
        only_on_client: Requests the client holds that the server does not.
        only_on_server: Requests the server holds that the client does not.
        different_blocks: Request id -> (client's block list, server's block list) for
            requests both hold with different lists.
        client_digest: Digest of the client's mirror.
        server_digest: Digest of the server's live mapping.
    """

    epoch: int
    client_epoch: int
    only_on_client: dict[str, list[int]]
    only_on_server: dict[str, list[int]]
    different_blocks: dict[str, tuple[list[int], list[int]]]
    client_digest: int
    server_digest: int

    @classmethod
    def compare(
        cls,
        *,
        epoch: int,
        client_epoch: int,
        client_requests: Mapping[str, Sequence[int]],
        server_requests: Mapping[str, Sequence[int]],
        client_digest: int,
        server_digest: int,
    ) -> AuditReport:
        """Builds the report of two views of the running requests and their digests."""
        return cls(
            epoch=epoch,
            client_epoch=client_epoch,
            only_on_client={
                rid: list(ids) for rid, ids in client_requests.items() if rid not in server_requests
            },
            only_on_server={
                rid: list(ids) for rid, ids in server_requests.items() if rid not in client_requests
            },
            different_blocks={
                rid: (list(client_requests[rid]), list(ids))
                for rid, ids in server_requests.items()
                if rid in client_requests and list(client_requests[rid]) != list(ids)
            },
            client_digest=client_digest,
            server_digest=server_digest,
        )

    @property
    def is_consistent(self) -> bool:
        """True when both sides agree on the epoch, every request and the digest."""
        return (
            self.epoch == self.client_epoch
            and not self.only_on_client
            and not self.only_on_server
            and not self.different_blocks
            and self.client_digest == self.server_digest
        )

    def describe(self) -> str:
        """Returns a human-readable account of the differences ("consistent" if none)."""
        if self.is_consistent:
            return f"consistent (epoch {self.epoch}, digest {self.server_digest:#018x})"
        lines = []
        if self.epoch != self.client_epoch:
            lines.append(f"epoch: client {self.client_epoch}, server {self.epoch}")
        for request_id, ids in sorted(self.only_on_client.items()):
            lines.append(f"request {request_id!r} only on the client: blocks {ids}")
        for request_id, ids in sorted(self.only_on_server.items()):
            lines.append(f"request {request_id!r} only on the server: blocks {ids}")
        for request_id, (client_ids, server_ids) in sorted(self.different_blocks.items()):
            lines.append(
                f"request {request_id!r}: client blocks {client_ids}, server blocks {server_ids}"
            )
        if self.client_digest != self.server_digest:
            lines.append(
                f"digest: client {self.client_digest:#018x}, server {self.server_digest:#018x}"
            )
        return "; ".join(lines)
