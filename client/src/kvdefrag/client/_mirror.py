"""The client's local mirror of the server's logical->physical mapping.

The server sends, per step, only the mapping entries that changed; the mirror keeps the
whole permutation so that ``resolve`` never needs a round trip. It also replays the
step's events on its own reference counts (the engine's rules: finished releases,
resumed replaces, new blocks append, block 0 never counted, a request holding no other
block not kept) so it can keep the digest of
the live mapping incrementally and compare it with the one in every reply::

    events (sent)  --refs-->  live set ┐
                                       ├─> digest = XOR pair_digest(l, fwd[l]), l live
    deltas (reply) --fwd--->  mapping  ┘
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

from kvdefrag.common import NULL_BLOCK_ID, InvalidArgument, StepEvents, pair_digest
from kvdefrag.common.digest import pair_digests


class Mirror:
    """A copy of one epoch's mapping, request lists and live-mapping digest.

    Invariants (while it matches the server): ``fwd`` is a permutation of
    ``[0, num_blocks)`` with ``fwd[0] == 0``; ``refs[l]`` counts the references the
    requests in ``requests`` hold to logical ``l`` (block 0 never counted); ``digest``
    is the XOR of ``pair_digest(l, fwd[l])`` over logical ids with ``refs[l] > 0``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise InvalidArgument(f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.fwd: list[int] = list(range(num_blocks))
        self.refs: list[int] = [0] * num_blocks
        self.requests: dict[str, list[int]] = {}
        self.digest = 0
        # pair_digest(l, fwd[l]) as of when l became live or last moved (stale while free):
        # releases and moves XOR the stored value out instead of recomputing it.
        self._live_digests: list[int] = [0] * num_blocks

    @classmethod
    def from_tables(cls, fwd: Sequence[int], requests: Mapping[str, Sequence[int]]) -> Mirror:
        """Builds a mirror from the server's full mapping and its running requests.

        Raises:
            InvalidArgument: ``fwd`` is not a permutation with ``fwd[0] == 0``, or a
                request holds an id outside the pool.
        """
        mirror = cls(len(fwd))
        if sorted(fwd) != mirror.fwd or fwd[0] != NULL_BLOCK_ID:
            raise InvalidArgument("fwd: the server's mapping is not a permutation fixing 0")
        mirror.fwd = list(fwd)
        for request_id, logical_ids in requests.items():
            for logical_id in logical_ids:
                if not 0 <= logical_id < mirror.num_blocks:
                    raise InvalidArgument(
                        f"requests[{request_id!r}]: block id {logical_id} is outside "
                        f"[0, {mirror.num_blocks})"
                    )
            mirror._append(request_id, list(logical_ids))
        return mirror

    # --- reads ------------------------------------------------------------------------
    def resolve(self, logical_ids: Iterable[int]) -> list[int]:
        """Maps logical ids to physical ids.

        Raises:
            InvalidArgument: An id is not an integer or is outside ``[0, num_blocks)``.
        """
        ids = logical_ids if isinstance(logical_ids, (list, tuple)) else list(logical_ids)
        if not ids:
            return []
        fwd = self.fwd
        try:
            if min(ids) >= 0:
                return [fwd[logical_id] for logical_id in ids]
        except (IndexError, TypeError):
            pass
        raise self._bad_id(ids)

    def _bad_id(self, ids: Sequence[object]) -> InvalidArgument:
        for position, logical_id in enumerate(ids):
            try:
                value = operator.index(logical_id)  # type: ignore[arg-type]
            except TypeError:
                return InvalidArgument(
                    f"resolve: logical_ids[{position}] = {logical_id!r} is not an integer"
                )
            if not 0 <= value < self.num_blocks:
                return InvalidArgument(
                    f"resolve: logical_ids[{position}] = {value} is outside [0, {self.num_blocks})"
                )
        raise AssertionError(f"resolve failed on valid ids {ids!r}")

    def resolve_tables(self, tables: Iterable[Iterable[int]]) -> list[list[int]]:
        """Maps every block table (one list of logical ids per request) to physical ids."""
        return [self.resolve(table) for table in tables]

    def live_pairs(self) -> list[tuple[int, int]]:
        """Every live (logical, physical) pair (an O(pool) audit helper)."""
        return [(i, self.fwd[i]) for i, refs in enumerate(self.refs) if refs]

    # --- updates ----------------------------------------------------------------------
    def apply_step(
        self, events: StepEvents, logical_ids: Sequence[int], physical_ids: Sequence[int]
    ) -> int:
        """Applies one acknowledged step: its events, then the reply's mapping deltas.

        Args:
            events: The step's events, exactly as sent (and accepted by the server).
            logical_ids: The reply's logical ids whose physical location is new or moved.
            physical_ids: Their physical ids, position by position.

        Returns:
            The digest of the live mapping after the step.

        Raises:
            InvalidArgument: The deltas are malformed (lengths differ or ids out of range).
        """
        if len(logical_ids) != len(physical_ids):
            raise InvalidArgument(
                f"reply: {len(logical_ids)} logical ids but {len(physical_ids)} physical ids"
            )
        num_blocks = self.num_blocks
        if logical_ids and (
            min(logical_ids) < 1
            or max(logical_ids) >= num_blocks
            or min(physical_ids) < 1
            or max(physical_ids) >= num_blocks
        ):
            for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True):
                if not (0 < logical_id < num_blocks and 0 < physical_id < num_blocks):
                    raise InvalidArgument(
                        f"reply: mapping {logical_id} -> {physical_id} is outside [1, {num_blocks})"
                    )
        # NOTE: the engine's order: finished, resumed (drop, then append), new blocks.
        for request_id in events.finished:
            self._drop(request_id)
        for request_id in events.resumed:
            self._drop(request_id)
        became_live: list[int] = []
        for lists in (events.resumed, events.new_blocks):
            for request_id, block_ids in lists.items():
                self._append(request_id, block_ids, became_live)
        fwd = self.fwd
        refs = self.refs
        live_digests = self._live_digests
        digest = self.digest
        # NOTE: plain loops, not map() of a bound __getitem__/__setitem__: in CPython 3.11
        # the loops' specialised list opcodes are ~1.5-2x faster per id.
        # Blocks live before this step that moved are re-mixed, one delta after the other
        # (an id listed twice ends as it would). Blocks that became live are mixed once,
        # after the deltas: most of them were placed in this very step.
        newly_live = set(became_live) if became_live else ()
        moved = [
            index
            for index, logical_id in enumerate(logical_ids)
            if refs[logical_id] and logical_id not in newly_live
        ]
        if moved:
            moved_ids = [logical_ids[index] for index in moved]
            moved_to = [physical_ids[index] for index in moved]
            for logical_id, mixed_id in zip(
                moved_ids, pair_digests(moved_ids, moved_to), strict=True
            ):
                digest ^= live_digests[logical_id] ^ mixed_id
                live_digests[logical_id] = mixed_id
        for logical_id, physical_id in zip(logical_ids, physical_ids, strict=True):
            fwd[logical_id] = physical_id
        if became_live:
            mixed = pair_digests(became_live, [fwd[logical_id] for logical_id in became_live])
            for logical_id, mixed_id in zip(became_live, mixed, strict=True):
                live_digests[logical_id] = mixed_id
                digest ^= mixed_id
        self.digest = digest
        return digest

    def _drop(self, request_id: str) -> None:
        logical_ids = self.requests.pop(request_id, None)
        if logical_ids is None:
            return
        refs = self.refs
        live_digests = self._live_digests
        digest = self.digest
        for logical_id in logical_ids:
            if logical_id == NULL_BLOCK_ID:
                continue
            count = refs[logical_id] - 1
            assert count >= 0, f"mirror: block {logical_id} released twice"
            refs[logical_id] = count
            if not count:
                digest ^= live_digests[logical_id]
        self.digest = digest

    def _append(
        self, request_id: str, logical_ids: list[int], became_live: list[int] | None = None
    ) -> None:
        """Adds a request's references. Blocks that become live are mixed into the digest
        here, or listed in ``became_live`` for the caller to mix in (with the mapping as
        it is now)."""
        held = self.requests.get(request_id)
        if held is None:
            if all(logical_id == NULL_BLOCK_ID for logical_id in logical_ids):
                return  # the engine keeps no request without a block but the null one
            held = self.requests[request_id] = []
        held.extend(logical_ids)
        refs = self.refs
        fwd = self.fwd
        for logical_id in logical_ids:
            if logical_id == NULL_BLOCK_ID:
                continue
            if not refs[logical_id]:
                if became_live is not None:
                    became_live.append(logical_id)
                else:
                    mixed = pair_digest(logical_id, fwd[logical_id])
                    self._live_digests[logical_id] = mixed
                    self.digest ^= mixed
            refs[logical_id] += 1


class ServerDigest:
    """What a client that keeps no mirror (``keep_mirror=False``) remembers of its server:
    the pool's size and the digest of the live mapping as of the last acknowledged step,
    so that a reopened session is still checked against it.

    For a writer whose replies are checked elsewhere (the vLLM scheduler compares every
    rank's digest) and that never resolves through the client.
    """

    def __init__(self, num_blocks: int, digest: int) -> None:
        self.num_blocks = num_blocks
        self.digest = digest
