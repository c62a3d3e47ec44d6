"""PoolStats and Totals: the snapshot of a pool both sides of the wire report."""

from __future__ import annotations

import dataclasses

from kvdefrag.common import PoolStats, Totals


def test_gauge_names_are_every_field_but_the_totals_in_order() -> None:
    fields = [field.name for field in dataclasses.fields(PoolStats)]

    assert PoolStats.gauge_names() == tuple(fields[:-1])
    assert fields[-1] == "totals"


def test_an_empty_pool_is_packed_healthy_and_has_done_nothing() -> None:
    stats = PoolStats()

    assert (stats.num_live, stats.holes, stats.fragmentation_ratio) == (0, 0, 1.0)
    assert stats.is_healthy
    assert stats.totals == Totals()
    assert all(value == 0 for value in dataclasses.astuple(stats.totals))
