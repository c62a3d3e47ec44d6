"""The move log: numbered batches a reader follows, and which moves it logs."""

from __future__ import annotations

from kvdefrag.server._move_log import MoveLog, moves_of_blocks_live_before
from kvdefrag.server._moves import Move, MoveBatch


def _batch(*pairs: tuple[int, int]) -> MoveBatch:
    return MoveBatch([src for src, _ in pairs], [dst for _, dst in pairs])


def test_a_reader_gets_the_batches_logged_after_its_version_oldest_first() -> None:
    log = MoveLog()
    assert log.since(None) == (0, [])
    log.record(_batch((9, 1)))
    log.record(_batch())  # nothing moved: not logged
    log.record(_batch((8, 2), (7, 3)))
    assert log.version == 2
    assert log.since(0) == (2, [_batch((9, 1)), _batch((8, 2), (7, 3))])
    assert log.since(1) == (2, [_batch((8, 2), (7, 3))])
    assert log.since(2) == (2, [])


def test_a_reader_further_behind_than_the_log_reaches_is_told_so() -> None:
    log = MoveLog(length=2)
    for src in (9, 8, 7):
        log.record(_batch((src, 1)))
    assert log.since(0) is None
    assert log.since(1) == (3, [_batch((8, 1)), _batch((7, 1))])


def test_a_restart_reports_nothing_from_before_it() -> None:
    log = MoveLog()
    log.record(_batch((9, 1)))
    log.restart()
    assert log.since(0) == (2, [])
    log.record(_batch((5, 2)))
    assert log.since(0) == (3, [_batch((5, 2))])
    assert log.since(2) == (3, [_batch((5, 2))])


def test_only_blocks_live_before_the_step_are_followed_one_way() -> None:
    fwd = list(range(16))  # identity: logical id == physical slot before the moves
    moves = MoveBatch([12, 13, 14], [1, 2, 3], [True, False, False])
    # 13 became live in this step; 14 was released and taken again in it (live before).
    followed = moves_of_blocks_live_before(fwd, moves, newly_live=[13, 14], released=[14])
    assert list(followed) == [Move(12, 1, False), Move(14, 3, False)]
    assert list(moves_of_blocks_live_before(fwd, moves, [], [])) == [
        Move(12, 1, False),
        Move(13, 2, False),
        Move(14, 3, False),
    ]
