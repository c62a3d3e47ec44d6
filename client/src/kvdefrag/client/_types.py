"""The client's value types: what its calls return (plain frozen dataclasses, no protobuf).

The step (``StepEvents``) and pool statistics (``PoolStats``) are ``kvdefrag.common``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvdefrag.common import PoolStats


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
    """The server's answer to opening a stream session (``supports_pins``: the server
    applies ``StepEvents.pins``; an older one would drop them)."""

    epoch: int
    next_seq: int
    num_blocks: int
    block_size: int
    prefix_caching: bool
    digest: int
    supports_pins: bool = False


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
