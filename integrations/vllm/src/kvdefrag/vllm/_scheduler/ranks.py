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

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypedDict

from kvdefrag.client import DefragClient, StepReply, identity_refusal
from kvdefrag.common import (
    DefragError,
    EpochMismatch,
    ServiceUnavailable,
    StepEvents,
    StepOutcomeUnknown,
)
from kvdefrag.common.events import require_step_events
from kvdefrag.vllm._discovery import PublishedRank
from kvdefrag.vllm.config import CLIENT_TLS_ENV, IntegrationConfig
from kvdefrag.vllm.contract import StepStamp
from kvdefrag.vllm.errors import BadSetting, StartupRefused

# How many times a rank's pending step is resent (each within the client's timeout_s)
# before the scheduler gives up on that rank.
MAX_COMPLETION_ATTEMPTS = 3
# While closing, how often the group looks again whether a rank it waits for still serves.
CLOSE_POLL_S = 0.2

_LOGGER = logging.getLogger(__name__)


class RanksDiverged(DefragError):
    """The ranks' engines no longer agree (digest or epoch): the KV caches are suspect.

    Recovery: stop the engine (the scheduler cannot know which rank is right), restart
    vLLM; every rank's service starts over at an identity mapping with a new epoch.
    """


class RankNotVerified(StartupRefused):
    """The service at a published address cannot prove it is this engine's rank.

    It does not hold the secret that rank published with its address: the record names
    this engine (a stale or another engine's record is refused before, as
    ``RanksOfAnotherEngine``), so another process serves the address (a port that rank
    published and lost). Recovery: restart vLLM, with ports nobody else takes.
    """


# How long the scheduler waits for a rank's proof.
PROOF_TIMEOUT_S = 10.0


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
    address = published.address
    try:
        refusal = identity_refusal(
            address,
            published.secret,
            timeout_s=timeout_s,
            root_certificates=tls.get("root_certificates"),
            private_key=tls.get("private_key"),
            certificate_chain=tls.get("certificate_chain"),
        )
    except ServiceUnavailable as err:
        raise ServiceUnavailable(f"rank {rank}'s {err}") from None
    if refusal is None:
        return
    what = f"rank {rank}'s published address {address} is not served by this engine's rank {rank}"
    fix = (
        "the rank record is this engine's, so another process serves that address; "
        "restart vLLM with ports nobody else takes"
    )
    if refusal == "mismatch":
        raise RankNotVerified(
            f"{what}: its proof does not match the secret rank {rank} published; {fix}"
        )
    raise RankNotVerified(
        f"{what}: it cannot prove the secret rank {rank} published ({refusal}); {fix}"
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
        self._last_step: InFlightStep | None = None
        # Set by ``close``: from then on no rank's pending step is resent.
        self._is_closing = threading.Event()
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
            sender.submit(_rank_step, rank, client, events, seq, self._is_closing)
            for rank, (sender, client, seq) in enumerate(
                zip(self._senders, self.clients, self._last_seqs, strict=True)
            )
        ]
        self._last_sent = list(futures)
        self._last_step = InFlightStep(
            stamp,
            futures,
            lambda: self._checked(stamp, {rank: f.result() for rank, f in enumerate(futures)}),
        )
        return self._last_step

    def _next_seq(self, rank: int) -> int:
        """The seq rank ``rank``'s next step gets: its client's once the last step is done
        there and its outcome was taken (``result()``: a step refused there used no seq),
        else one past the last one stamped.

        NOTE: a step that failed while nobody has taken its result yet (it failed after
        the bridge's last look at it) must not lend its seq to the next one: the output
        planned with the failed step carries that seq too, with other events, so a
        worker could find the seq applied and run that output on the next step's
        mapping. The next step, one seq further, is not sent there (``_rank_step``).
        """
        last = self._last_step
        if last is None or (last.is_taken and last.futures[rank].done()):
            return self.clients[rank].next_seq
        return self._last_seqs[rank] + 1

    def _checked(self, stamp: StepStamp, replies: Mapping[int, StepReply]) -> StepReply:
        """Checks the replies of ``replies``' ranks to one step (the first rank's is the
        reference) and returns the first one."""
        first = replies[min(replies)]
        for rank, reply in sorted(replies.items()):
            epoch = self.epochs[rank]
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
            if reply.digest != first.digest:
                raise RanksDiverged(
                    f"rank {rank}: digest {reply.digest:#x} differs from rank {min(replies)}'s "
                    f"{first.digest:#x} after seq {reply.seq}; restart vLLM"
                )
        return first

    def close(self, steps: Sequence[InFlightStep] = ()) -> StepReply | None:
        """Checks the replies to ``steps`` within one timeout, then closes every client and
        thread: the scheduler's shutdown.

        From the call on no rank's pending step is resent (a step being sent gets its one
        try). The group waits once, for every rank at once, at most the longest
        ``timeout_s`` of its clients, and not for a rank whose service is gone (its address
        refuses connections or names no socket): vLLM stops the workers, and so their
        services, before the scheduler. A warning names each rank gone ("rank 1 at
        unix:... is gone: ...") or silent until the deadline; their steps are left
        unchecked and their clients closed under any step still being sent.

        Args:
            steps: The steps in flight, in submission order.

        Returns:
            The last step's first reply among the ranks that answered it, or None.

        Raises:
            RanksDiverged, DefragError: The ranks that answered disagree, or one refused a
                step (the first such error, in submission order); every client and
                thread is closed all the same.
        """
        if self._is_closing.is_set():
            self._close_clients()
            return None
        self._is_closing.set()
        timeout_s = max(client.timeout_s for client in self.clients)
        deadline = time.monotonic() + timeout_s
        gone: dict[int, str] = {}
        while True:
            busy = {
                rank: last
                for rank, last in enumerate(self._last_sent)
                if last is not None and not last.done() and rank not in gone
            }
            remaining_s = deadline - time.monotonic()
            if not busy or remaining_s <= 0:
                break
            for rank in busy:
                reason = self.clients[rank].probe_connection(min(CLOSE_POLL_S, remaining_s))
                if reason is not None:
                    gone[rank] = reason
            waited = [last for rank, last in busy.items() if rank not in gone]
            remaining_s = deadline - time.monotonic()
            concurrent.futures.wait(waited, timeout=max(min(CLOSE_POLL_S, remaining_s), 0.0))
        silent: dict[int, str] = {}
        try:
            return self._checked_at_close(steps, gone, silent, timeout_s)
        finally:
            for rank, reason in sorted(gone.items()):
                _LOGGER.warning(
                    "rank %d at %s is gone: %s; shutting down without its replies",
                    rank,
                    self.clients[rank].address,
                    reason,
                )
            for rank, reason in sorted(silent.items()):
                _LOGGER.warning(
                    "rank %d at %s did not answer by the shutdown's deadline: %s; shutting "
                    "down without its replies",
                    rank,
                    self.clients[rank].address,
                    reason,
                )
            self._close_clients()

    def _checked_at_close(
        self,
        steps: Sequence[InFlightStep],
        gone: dict[int, str],
        silent: dict[int, str],
        timeout_s: float,
    ) -> StepReply | None:
        """``_checked`` for every step, over the ranks that answered; a rank without an
        answer joins ``gone`` (its service refuses connections) or ``silent``."""
        reply = None
        for step in steps:
            step.is_taken = True
            replies: dict[int, StepReply] = {}
            for rank, future in enumerate(step.futures):
                if rank in gone or rank in silent:
                    continue
                if not future.done():
                    silent[rank] = f"no answer within {timeout_s} s"
                    continue
                err = future.exception()
                if err is None:
                    replies[rank] = future.result()
                    continue
                if not isinstance(err, ServiceUnavailable):
                    raise err
                reason = self.clients[rank].probe_connection(CLOSE_POLL_S)
                if reason is not None:
                    gone[rank] = reason
                else:
                    silent[rank] = str(err)
            if replies:
                reply = self._checked(step.stamp, replies)
        return reply

    def _close_clients(self) -> None:
        """Closes every client and thread, waiting for nothing: a step still being sent
        to a rank has its call cancelled, and the steps queued behind it are dropped."""
        is_idle = [last is None or last.done() for last in self._last_sent]
        for sender in self._senders:
            sender.shutdown(wait=False, cancel_futures=True)
        for client, is_rank_idle in zip(self.clients, is_idle, strict=True):
            client.close(wait_s=None if is_rank_idle else 0.0)


class InFlightStep:
    """A step sent to every rank whose replies have not been checked yet."""

    def __init__(
        self, stamp: StepStamp, futures: Sequence[Future[StepReply]], wait: Callable[[], StepReply]
    ) -> None:
        self.stamp = stamp
        self.futures = futures
        # Whether the caller asked for the outcome (``result()``), a failure included.
        self.is_taken = False
        self._wait = wait

    def done(self) -> bool:
        """True once every rank answered (or failed): ``result()`` will not wait."""
        return all(future.done() for future in self.futures)

    def result(self) -> StepReply:
        """Waits for every rank's reply; raises as ``RankGroup.step`` does."""
        self.is_taken = True
        return self._wait()


def _rank_step(
    rank: int, client: DefragClient, events: StepEvents, seq: int, is_closing: threading.Event
) -> StepReply:
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
        return step_through_timeouts(client, events, is_closing)
    except EpochMismatch as err:
        raise RanksDiverged(
            f"rank {rank}: its service is at another epoch (it restarted or was reset by "
            f"force: {err}); restart vLLM to start every rank over"
        ) from err


def step_through_timeouts(
    client: DefragClient, events: StepEvents, is_closing: threading.Event | None = None
) -> StepReply:
    """One rank's step under the client's pending-step contract.

    A step without a reply in time may have been applied (and its KV moved) on that rank,
    so it is completed, never resent as a new step: ``complete_pending_step()`` until it
    answers, at most ``MAX_COMPLETION_ATTEMPTS`` times, and not once ``is_closing`` is set.

    Args:
        client: The rank's client.
        events: The step's events, shared by every rank (they are only read).
        is_closing: Set when the scheduler shuts down (``RankGroup.close``).
    """
    try:
        return client.step(events)
    except StepOutcomeUnknown as err:
        unknown = err
    for _ in range(MAX_COMPLETION_ATTEMPTS):
        if is_closing is not None and is_closing.is_set():
            break
        try:
            reply = client.complete_pending_step()
        except StepOutcomeUnknown as err:
            unknown = err
            continue
        assert reply is not None, "the pending step vanished"
        return reply
    raise unknown


class ClientTls(TypedDict, total=False):
    """``DefragClient``'s TLS keyword arguments."""

    root_certificates: bytes
    certificate_chain: bytes
    private_key: bytes


def client_tls(config: IntegrationConfig) -> ClientTls:
    """The scheduler's TLS arguments for ``DefragClient``, read from the files the
    ``KVDEFRAG_VLLM_TLS_{CA,CERT,KEY}_FILE`` variables name (none set: no TLS).

    Raises:
        BadSetting: A named file cannot be read.
    """
    tls = ClientTls()
    for argument, path in config.client_tls_files.items():
        try:
            with open(path, "rb") as file:
                tls[argument] = file.read()  # type: ignore[literal-required]
        except OSError as err:
            variable = CLIENT_TLS_ENV[argument]
            raise BadSetting(f"kvdefrag: cannot read {variable}={path!r}: {err}") from err
    return tls
