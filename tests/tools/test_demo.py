"""The demo (``make demo``): real server, real client, real KV data, both modes.

Also the worker's signature checks and the event-derived live set it relies on.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvdefrag.common import StepEvents
from kvdefrag.server import EngineConfig
from kvdefrag.tools import demo
from kvdefrag.tools._demo_worker import KvSignatures, LogicalPool, make_kv_caches
from kvdefrag.tools._report import format_report
from kvdefrag.tools.demo import DemoOptions, run_demo, run_mode

from support.doubles import ScriptedExecutor

KVDEFRAG = Path(sys.executable).parent / "kvdefrag"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INTEGRITY = re.compile(r"KV integrity: ([\d,]+) live blocks checked, ([\d,]+) corrupted")


def tiny_options(**overrides: object) -> DemoOptions:
    """A few hundred steps on a 400-block pool: fills up, preempts, compacts."""
    options: dict[str, object] = {
        "num_steps": 300,
        "num_blocks": 400,
        "check_every": 50,
        "progress_interval_s": 0.0,
    }
    options.update(overrides)
    return DemoOptions(**options)  # type: ignore[arg-type]


def integrity_counts(text: str) -> list[tuple[int, int]]:
    return [
        (int(checked.replace(",", "")), int(bad.replace(",", "")))
        for checked, bad in INTEGRITY.findall(text)
    ]


# --- the demo end to end -------------------------------------------------------------
@pytest.mark.slow
def test_demo_packs_the_pool_and_keeps_every_block_in_both_modes(tmp_path: Path) -> None:
    out = io.StringIO()
    plot = tmp_path / "plots" / "demo.png"

    result = run_demo(tiny_options(), "both", plot, out=out)

    text = out.getvalue()
    off, on = result.reports
    assert (off.title, on.title) == ("prefix caching off", "prefix caching on")
    assert integrity_counts(text) == [(off.num_live_checked, 0), (on.num_live_checked, 0)]
    for report in (off, on):
        assert report.num_corrupted == 0
        assert report.num_live_checked > 0 and report.num_moved_checked > 0
        assert report.peak_max_live_with <= report.peak_max_live_without
        assert report.mean_max_live_with < report.mean_max_live_without
        assert report.ratio_mean_with < report.ratio_mean_without
        assert report.num_moves > 0 and report.num_bytes_moved > 0
        assert report.num_steps == 300
    assert off.num_placements > 0 and off.num_two_way_moves == 0
    assert on.num_two_way_moves > 0 and on.num_cached_checked > 0
    assert result.exit_code == 0
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert f"plot: {plot.resolve()}" in text
    assert "[prefix caching off] step    300/300" in text, "progress lines"


def test_one_mode_only(tmp_path: Path) -> None:
    out = io.StringIO()

    result = run_demo(tiny_options(num_steps=120), "on", tmp_path / "on.png", out=out)

    assert [report.title for report in result.reports] == ["prefix caching on"]
    assert "prefix caching off" not in out.getvalue()


def test_demo_sees_blocks_whose_data_did_not_move() -> None:
    options = tiny_options(num_steps=150)
    executor = ScriptedExecutor.without_kv(400)
    executor.drops_moves = True  # claims every move succeeded, copies nothing

    run = run_mode(options, False, out=io.StringIO(), executor=executor)

    report = run.report
    assert report.num_moves > 0
    assert report.num_corrupted > 0
    assert report.corruption_examples
    assert not report.is_intact
    checked, bad = integrity_counts(format_report(report))[0]
    assert bad == report.num_corrupted and checked == report.num_live_checked


@pytest.mark.slow
def test_demo_module_runs_as_make_demo_does(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    argv = ["--steps", "150", "--num-blocks", "300", "--mode", "off", "--out", str(plot)]

    done = subprocess.run(
        [sys.executable, "-m", "kvdefrag.tools.demo", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert [bad for _, bad in integrity_counts(done.stdout)] == [0]
    assert "highest live block id, mean" in done.stdout
    assert plot.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_kvdefrag_demo_console_script_writes_its_plot(tmp_path: Path) -> None:
    """``kvdefrag demo``: the script kvdefrag-tools installs, as ``make install`` puts it."""
    plot = tmp_path / "plots" / "demo.png"

    done = subprocess.run(
        [str(KVDEFRAG), "demo", "--steps", "300", "--out", str(plot)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )

    assert done.returncode == 0, done.stderr
    assert [bad for _, bad in integrity_counts(done.stdout)] == [0, 0]
    assert f"plot: {plot.resolve()}" in done.stdout
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_demo_exports_only_its_public_api() -> None:
    assert demo.__all__ == [
        "DemoOptions",
        "DemoResult",
        "ModeReport",
        "ModeRun",
        "main",
        "run_demo",
        "run_mode",
        "use_one_torch_thread",
        "workload_config",
    ]
    for name in demo.__all__:
        assert getattr(demo, name).__module__.startswith("kvdefrag.tools."), name


@pytest.mark.slow
def test_bad_options_are_refused_naming_the_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvdefrag.tools.demo", "--num-blocks", "10"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 2
    assert "num_blocks must be >= 64, got 10" in done.stderr


def test_engine_flags_reach_the_engine_config_and_its_summary_line() -> None:
    parser = argparse.ArgumentParser()
    demo.add_engine_arguments(parser)
    config = demo.engine_config_from_args(parser.parse_args([]))
    assert config == EngineConfig()
    assert demo.engine_settings(config) == "threshold 32, up to 512 moves/step, placement on"
    args = parser.parse_args(["--decode-buckets", "1,128,256", "--max-moves-per-step", "64"])
    config = demo.engine_config_from_args(args)
    assert config.decode_buckets == (1, 128, 256)
    assert demo.engine_settings(config) == (
        "decode buckets 1,128,256, up to 64 moves/step, placement on"
    )


# --- the worker's signatures ---------------------------------------------------------
def signed_blocks(
    num_blocks: int = 16,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], KvSignatures]:
    caches = make_kv_caches(num_blocks, 4)
    kv = KvSignatures(caches, 4, threading.Lock())
    kv.write([1, 2, 3, 4], [1, 2, 3, 4])
    return caches, kv


def test_signatures_read_back_where_they_were_written() -> None:
    _, kv = signed_blocks()

    assert kv.corrupted([1, 2, 3, 4], [1, 2, 3, 4]) == []
    assert kv.corrupted([1, 2], [2, 1]) == [(1, 2), (2, 1)]
    assert kv.corrupted([5], [5]) == [(5, 5)], "a block never written holds nothing"


def test_signatures_see_a_block_copied_to_another_tensor_or_offset() -> None:
    caches, kv = signed_blocks()
    key, value = caches[0]
    value.view(16, -1)[1] = key.view(16, -1)[1]  # key data in the value tensor
    key.view(16, -1)[2] = torch.roll(key.view(16, -1)[2], 1)  # shifted by one element

    assert kv.corrupted([1, 2, 3], [1, 2, 3]) == [(1, 1), (2, 2)]


def test_a_rewritten_block_has_a_new_signature() -> None:
    caches, kv = signed_blocks()
    old = caches[0][0].view(16, -1)[3].clone()

    kv.write([3], [7])

    assert kv.corrupted([3], [7]) == []
    caches[0][0].view(16, -1)[7] = old
    assert kv.corrupted([3], [7]) == [(3, 7)], "the old version is not the new one"


def test_logical_pool_follows_the_engine_order() -> None:
    pool = LogicalPool(16)
    assert pool.apply(StepEvents(new_blocks={"a": [0, 3, 5], "b": [5]})) == ([3, 5], [])
    # finished first: "a" re-admitted in the same step keeps block 3 live
    became_live, became_free = pool.apply(StepEvents(finished=("a",), new_blocks={"a": [3, 9]}))
    assert (became_live, became_free) == ([9], [])
    assert pool.apply(StepEvents(resumed={"b": [7]})) == ([7], [5])
    assert (pool.num_live, pool.max_live(), pool.live_ids()) == (3, 9, [3, 7, 9])
