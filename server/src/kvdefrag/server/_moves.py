"""Block moves in physical space: what the policy plans, the executors carry out and the
engine reports.

A leaf module (no other kvdefrag server module is imported here), so the policy, the
engine, the metrics and every executor backend share these types without importing each
other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, repeat
from typing import NamedTuple, overload


class Move(NamedTuple):
    """One block move in physical space.

    Attributes:
        src_physical_id: A live slot high in the pool; or, copied up out of the way of a
            fresh block that compaction moves down (``_policy.plan_copies``), the slot of
            a free block's cached data.
        dst_physical_id: A free slot below it; or that fresh block's slot.
        is_two_way: The destination holds cached data, so the two slots swap contents;
            otherwise the source is copied one way and the destination's content dropped.
    """

    src_physical_id: int
    dst_physical_id: int
    is_two_way: bool


class MoveBatch(Sequence[Move]):
    """A step's moves as three columns, and the sequence of ``Move`` they stand for.

    The engine and the executors read the columns; a ``Move`` is built only when one is
    read (iterating, indexing), so a step of 512 moves builds none on the hot path
    (~0.18 µs each: ~90 µs for 512, a tenth of such a step's bookkeeping).
    Equal to a tuple or list of the same moves.

    Attributes:
        src_ids: The source slot of each move.
        dst_ids: The destination slot of each move, position by position.
        is_two_way: Whether each move is a swap (the destination holds cached data).
        num_two_way: How many moves are swaps.
    """

    __slots__ = ("dst_ids", "is_two_way", "num_two_way", "src_ids")

    def __init__(
        self, src_ids: list[int], dst_ids: list[int], is_two_way: list[bool] | None = None
    ) -> None:
        """Takes the columns as they are (not copied); ``is_two_way`` None: all one way."""
        if is_two_way is None:
            is_two_way = [False] * len(src_ids)
        assert len(src_ids) == len(dst_ids) == len(is_two_way), "columns of one length"
        self.src_ids = src_ids
        self.dst_ids = dst_ids
        self.is_two_way = is_two_way
        self.num_two_way: int = sum(is_two_way)

    @classmethod
    def of(cls, moves: Iterable[Move]) -> MoveBatch:
        """The batch of ``moves`` (itself when it already is one)."""
        if isinstance(moves, MoveBatch):
            return moves
        moves = list(moves)
        return cls(
            [move.src_physical_id for move in moves],
            [move.dst_physical_id for move in moves],
            [bool(move.is_two_way) for move in moves],
        )

    def pairs(self, *, two_way: bool) -> list[tuple[int, int]]:
        """The (source, destination) slots of the swaps, or of the one-way moves."""
        num_selected = self.num_two_way if two_way else len(self.src_ids) - self.num_two_way
        if not num_selected:
            return []
        if num_selected == len(self.src_ids):
            return list(zip(self.src_ids, self.dst_ids, strict=True))
        selected = self.is_two_way if two_way else [not flag for flag in self.is_two_way]
        return list(compress(zip(self.src_ids, self.dst_ids, strict=True), selected))

    def __len__(self) -> int:
        return len(self.src_ids)

    @overload
    def __getitem__(self, index: int) -> Move: ...

    @overload
    def __getitem__(self, index: slice) -> MoveBatch: ...

    def __getitem__(self, index: int | slice) -> Move | MoveBatch:
        if isinstance(index, slice):
            return MoveBatch(self.src_ids[index], self.dst_ids[index], self.is_two_way[index])
        return Move(self.src_ids[index], self.dst_ids[index], self.is_two_way[index])

    def __iter__(self) -> Iterator[Move]:
        # NOTE: tuple.__new__ builds each Move in C (Move(...) runs a Python __new__).
        return map(
            tuple.__new__,
            repeat(Move),
            zip(self.src_ids, self.dst_ids, self.is_two_way, strict=True),
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MoveBatch):
            return (self.src_ids, self.dst_ids, self.is_two_way) == (
                other.src_ids,
                other.dst_ids,
                other.is_two_way,
            )
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # the columns are lists

    def __repr__(self) -> str:
        return f"MoveBatch({list(self)!r})"


@dataclasses.dataclass(frozen=True)
class MoveReport:
    """What one executed batch did.

    Attributes:
        num_moves: Real moves executed.
        num_padded: Pad pairs added to reach a static batch size (static-shape backends).
        num_bytes: Bytes written to the KV tensors by real moves.
    """

    num_moves: int
    num_padded: int
    num_bytes: int
