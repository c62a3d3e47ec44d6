"""``make bench-transfer`` in a few steps: its rows add up (no timings).

The bench itself checks, on every transfer, that its joint-run count equals the groups of
Mooncake's ``group_concurrent_contiguous`` compiled from vLLM 0.33's own source.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"

# NOTE: imported as the bench runs (bench/ on the path), at collection like the harness:
# vLLM's modules warn as they first import.
sys.path.insert(0, str(BENCH))
try:
    bench = importlib.import_module("transfer_bench")
finally:
    sys.path.remove(str(BENCH))


def test_quick_run_rows_add_up(tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = bench.main(
        ["--quick", "--steps", "120", "--json", str(tmp_path / "rows.json")]
    )
    assert [case["prefix_caching"] for case in cases] == [False, True]
    for case in cases:
        layouts = {row["layout"]: row for row in case["layouts"]}
        assert list(layouts) == [name for name, _, _ in bench.LAYOUTS]
        plain = layouts["plain vLLM"]
        assert plain["transfers"] > 0
        assert plain["fewer_mean"] == pytest.approx(1.0)
        for row in layouts.values():
            assert row["transfers"] == plain["transfers"]
            assert row["blocks_mean"] == pytest.approx(plain["blocks_mean"])
            # vLLM 0.33 posts one descriptor per (region, block), one copy per (block, layer)
            assert row["nixl_033_mean"] == pytest.approx(bench.NUM_REGIONS * row["blocks_mean"])
            assert row["offload_033_mean"] == pytest.approx(bench.NUM_LAYERS * row["blocks_mean"])
            # merged: a joint run is no longer than either side's runs allow
            assert 1 <= row["runs_mean"] <= row["joint_mean"] <= row["blocks_mean"]
            assert row["nixl_merged_mean"] == pytest.approx(bench.NUM_REGIONS * row["joint_mean"])
            assert row["offload_merged_mean"] == pytest.approx(bench.NUM_LAYERS * row["runs_mean"])
            assert row["nixl_post_ms_mean"] == pytest.approx(
                row["nixl_merged_mean"] * bench.NIXL_POST_S * 1e3
            )
        # kvdefrag on the prefill side only: the same prefill runs as on both sides
        assert layouts["kvdefrag P only"]["runs_mean"] == layouts["kvdefrag P+D"]["runs_mean"]
        assert layouts["kvdefrag D only"]["runs_mean"] == plain["runs_mean"]
        for instance in case["instances"]:
            assert instance["steps"] == 120
            assert instance["pages_vs_floor_kvdefrag"] >= 1.0
            assert instance["pages_vs_floor_vllm"] >= 1.0
    assert (tmp_path / "rows.json").exists()
