"""One step, every rank: the scheduler steps each worker's service and checks they agree.

Every tensor-parallel (and pipeline-parallel) rank owns a slice of the KV cache in the same
block layout, so every rank's engine must apply the same steps and reach the same mapping.
The step is built once, whatever the number of ranks; the one ``StepEvents`` is sent to
all ranks concurrently (each client builds its own message, which carries that rank's seq
and epoch), and the replies must agree on the digest of the live mapping and on the epoch
the session was opened in. Nothing resolves through the scheduler's clients (the workers
translate through their own services), so they keep no mirror: the digests are compared
across ranks instead.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc

from kvdefrag.client import DefragClient, StepReply
from kvdefrag.client._channel import open_channel
from kvdefrag.common import (
    DefragError,
    EpochMismatch,
    ServiceUnavailable,
    StepEvents,
    StepOutcomeUnknown,
)
from kvdefrag.common.events import require_step_events
from kvdefrag.common.identity import identity_proof
from kvdefrag.v1 import identity_pb2, identity_pb2_grpc
from kvdefrag.vllm.common import RANKS_FILE, ClientTls, PublishedRank, StepStamp
from kvdefrag.vllm.config import RUN_DIR_ENV
from kvdefrag.vllm.errors import StartupRefused

# How many times a rank's pending step is resent (each within the client's timeout_s)
# before the scheduler gives up on that rank.
MAX_COMPLETION_ATTEMPTS = 3


class RanksDiverged(DefragError):
    """The ranks' engines no longer agree (digest or epoch): the KV caches are suspect.

    Recovery: stop the engine (the scheduler cannot know which rank is right), restart
    vLLM; every rank's service starts over at an identity mapping with a new epoch.
    """


class RankNotVerified(StartupRefused):
    """The service at a published address cannot prove it is this engine's rank.

    It does not hold the secret that rank published with its address in ``ranks.json``:
    the file is stale (from an earlier run) or shared with another engine, or another
    process serves the address. Recovery: give the engine a run directory of its own
    (``KVDEFRAG_VLLM_RUN_DIR``) and restart vLLM.
    """


# How long the scheduler waits for a rank's proof.
PROOF_TIMEOUT_S = 10.0
_NONCE_BYTES = 32


def verify_rank(
    rank: int, published: PublishedRank, tls: ClientTls, timeout_s: float = PROOF_TIMEOUT_S
) -> None:
    """Checks that the service at ``published.address`` holds rank ``rank``'s secret.

    It sends a fresh nonce to the service's ``IdentityService`` and compares the proof
    (``kvdefrag.common.identity``) with the one the published secret gives.

    Raises:
        RankNotVerified: The service answered, but not with the right proof (no
            ``IdentityService``, another secret).
        ServiceUnavailable: Nobody answered within ``timeout_s``.
    """
    nonce = secrets.token_bytes(_NONCE_BYTES)
    address = published.address
    what = f"rank {rank}'s published address {address} is not served by this engine's rank {rank}"
    fix = (
        f"is {RANKS_FILE} stale, or {RUN_DIR_ENV} shared with another engine? Give every "
        f"engine a run directory of its own and restart vLLM"
    )
    channel = open_channel(
        address,
        max_message_bytes=1 << 16,
        root_certificates=tls.get("root_certificates"),
        private_key=tls.get("private_key"),
        certificate_chain=tls.get("certificate_chain"),
    )
    with channel:
        stub = identity_pb2_grpc.IdentityServiceStub(channel)
        try:
            reply = stub.ProveIdentity(
                identity_pb2.ProveIdentityRequest(nonce=nonce),
                timeout=timeout_s,
                wait_for_ready=True,
            )
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ServiceUnavailable(
                    f"rank {rank}'s service at {address} did not answer within "
                    f"{timeout_s:.0f} s: {err.details() if isinstance(err, grpc.Call) else err}"
                ) from None
            name = code.name if code is not None else "an error"
            raise RankNotVerified(
                f"{what}: it cannot prove the secret rank {rank} published ({name}); {fix}"
            ) from None
    if not hmac.compare_digest(reply.proof, identity_proof(published.secret, nonce)):
        raise RankNotVerified(
            f"{what}: its proof does not match the secret rank {rank} published; {fix}"
        )


def connect_ranks(
    ranks: Sequence[PublishedRank], *, prefix_caching: bool, tls: ClientTls
) -> list[DefragClient]:
    """Verifies every rank (``verify_rank``), then opens its session, rank 0 first.

    Raises:
        RankNotVerified, ServiceUnavailable: As ``verify_rank``; no session is left open.
        DefragError: A rank refused the session.
    """
    for rank, published in enumerate(ranks):
        verify_rank(rank, published, tls)
    clients: list[DefragClient] = []
    try:
        for rank, published in enumerate(ranks):
            clients.append(
                DefragClient(
                    published.address,
                    prefix_caching=prefix_caching,
                    client_name=f"vllm-rank{rank}",
                    keep_mirror=False,
                    **tls,
                )
            )
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients


class RankGroup:
    """The scheduler's clients to every rank's service, stepped in lockstep.

    Each rank has one sending thread, so a rank's steps go out in the order they were
    submitted, one at a time (its client's one pending step), while the caller may submit
    the next step before the last one's replies came back.

    Invariant: after every successful ``step`` every rank's service is at the same digest
    of its live mapping, in the epoch its session was opened in.
    """

    def __init__(self, clients: Sequence[DefragClient]) -> None:
        if not clients:
            raise DefragError("a RankGroup needs at least one rank's client")
        self.clients = list(clients)
        self.epochs = [client.epoch for client in self.clients]
        # Per rank: the seq the last submitted step was stamped with, and its future.
        self._last_seqs = [client.next_seq - 1 for client in self.clients]
        self._last_sent: list[Future[StepReply] | None] = [None] * len(self.clients)
        self._senders = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvdefrag-rank{rank}")
            for rank in range(len(self.clients))
        ]

    def step(self, events: StepEvents) -> StepReply:
        """Sends one step to every rank concurrently and waits for all of them.

        Args:
            events: The step's events (type-checked when they were made; shared by every
                rank, never copied).

        Returns:
            The first rank's reply (the others are equal in digest and mapping).

        Raises:
            InvalidArgument: ``events`` is not a ``StepEvents``; no rank was sent anything.
            RanksDiverged: The ranks' digests differ, or a rank's epoch changed (its
                service restarted, or a forced reset: it refuses the step with
                ``EpochMismatch``).
            StepOutcomeUnknown: A rank did not answer, even after its pending step was
                resent ``MAX_COMPLETION_ATTEMPTS`` times (it stays pending there).
            DefragError: A rank refused the step (the first such error, by rank).
        """
        return self.submit(events).result()

    def submit(self, events: StepEvents) -> InFlightStep:
        """Sends one step to every rank concurrently without waiting for the replies.

        Returns:
            The step in flight: its ``StepStamp`` (each rank's ``(epoch, seq)``, and the
            events, for the output planned with it), and ``result()``, which waits for
            every reply and checks them as ``step`` does. Steps may be submitted before
            the earlier ones' ``result()``; each rank gets them in order. A step that
            failed on a rank fails every later one there too (its client keeps the failed
            step pending, or is unusable), so check the results in submission order.

        Raises:
            InvalidArgument: As ``step``; no rank was sent anything.
        """
        events = require_step_events(events)
        self._last_seqs = [self._next_seq(rank) for rank in range(len(self.clients))]
        stamp = StepStamp(
            tuple(
                (client.epoch, seq)
                for client, seq in zip(self.clients, self._last_seqs, strict=True)
            ),
            events,
        )
        futures = [
            sender.submit(_rank_step, rank, client, events, seq)
            for rank, (sender, client, seq) in enumerate(
                zip(self._senders, self.clients, self._last_seqs, strict=True)
            )
        ]
        self._last_sent = list(futures)
        return InFlightStep(
            stamp, futures, lambda: self._checked(stamp, [f.result() for f in futures])
        )

    def _next_seq(self, rank: int) -> int:
        """The seq rank ``rank``'s next step gets: its client's when nothing is queued for
        it (a step that failed there used none), else one past the last one queued."""
        last = self._last_sent[rank]
        if last is None or last.done():
            return self.clients[rank].next_seq
        return self._last_seqs[rank] + 1

    def _checked(self, stamp: StepStamp, replies: list[StepReply]) -> StepReply:
        for rank, (reply, epoch) in enumerate(zip(replies, self.epochs, strict=True)):
            if reply.seq != stamp.by_rank[rank][1]:
                raise RanksDiverged(
                    f"rank {rank}: answered seq {reply.seq} for the step stamped seq "
                    f"{stamp.by_rank[rank][1]}; restart vLLM"
                )
            if reply.epoch != epoch:
                raise RanksDiverged(
                    f"rank {rank}: epoch changed from {epoch} to {reply.epoch} (its service "
                    "restarted or was reset); restart vLLM to start every rank over"
                )
            if reply.digest != replies[0].digest:
                raise RanksDiverged(
                    f"rank {rank}: digest {reply.digest:#x} differs from rank 0's "
                    f"{replies[0].digest:#x} after seq {reply.seq}; restart vLLM"
                )
        return replies[0]

    def close(self) -> None:
        """Waits for the steps still being sent, then closes every client and thread."""
        for sender in self._senders:
            sender.shutdown(wait=True)
        for client in self.clients:
            client.close()


class InFlightStep:
    """A step sent to every rank whose replies have not been checked yet."""

    def __init__(
        self, stamp: StepStamp, futures: Sequence[Future[StepReply]], wait: Callable[[], StepReply]
    ) -> None:
        self.stamp = stamp
        self._futures = futures
        self._wait = wait

    def done(self) -> bool:
        """True once every rank answered (or failed): ``result()`` will not wait."""
        return all(future.done() for future in self._futures)

    def result(self) -> StepReply:
        """Waits for every rank's reply; raises as ``RankGroup.step`` does."""
        return self._wait()


def _rank_step(rank: int, client: DefragClient, events: StepEvents, seq: int) -> StepReply:
    """One rank's step, stamped ``seq``; a rank at another epoch is a divergence of the group.

    NOTE: a rank's service that restarted, or was reset by force, refuses the step with
    ``EpochMismatch``: its mapping is the identity while its KV data stayed where the
    moves put it, and the other ranks go on with theirs, so the group has diverged.

    Raises:
        DefragError: The client is not at ``seq``: an earlier step failed on this rank
            (refused, or still pending), so this one is not sent, lest it be applied
            under that step's seq.
    """
    if client.next_seq != seq:
        raise DefragError(
            f"rank {rank}: step seq {seq} was not sent: the rank's client is at seq "
            f"{client.next_seq}, so an earlier step failed there (its error comes first)"
        )
    try:
        return step_through_timeouts(client, events)
    except EpochMismatch as err:
        raise RanksDiverged(
            f"rank {rank}: its service is at another epoch (it restarted or was reset by "
            f"force: {err}); restart vLLM to start every rank over"
        ) from err


def step_through_timeouts(client: DefragClient, events: StepEvents) -> StepReply:
    """One rank's step under the client's pending-step contract.

    A step without a reply in time may have been applied (and its KV moved) on that rank,
    so it is completed, never resent as a new step: ``complete_pending_step()`` until it
    answers, at most ``MAX_COMPLETION_ATTEMPTS`` times.

    Args:
        client: The rank's client.
        events: The step's events, shared by every rank (they are only read).
    """
    try:
        return client.step(events)
    except StepOutcomeUnknown:
        for attempt in range(MAX_COMPLETION_ATTEMPTS):
            try:
                reply = client.complete_pending_step()
            except StepOutcomeUnknown:
                if attempt + 1 == MAX_COMPLETION_ATTEMPTS:
                    raise
                continue
            assert reply is not None, "the pending step vanished"
            return reply
        raise
