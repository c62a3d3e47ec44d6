"""``kvdefrag record`` / ``kvdefrag replay``: traces of what the client sends, replayed
through an engine with other settings, integrity checked on real KV data."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdefrag.client import StepEvents
from kvdefrag.client.record import STEP_KEYS, StepRecorder, load_trace, parse_trace
from kvdefrag.common import InvalidArgument
from kvdefrag.server import EngineConfig
from kvdefrag.tools.cli import ReplaySettings, record_workload, replay_trace
from kvdefrag.tools.demo import DemoOptions, ModeReport

KVDEFRAG = Path(sys.executable).parent / "kvdefrag"


def tiny_options() -> DemoOptions:
    return DemoOptions(num_steps=250, num_blocks=400, check_every=50, progress_interval_s=60.0)


@dataclasses.dataclass(frozen=True)
class Recorded:
    path: Path
    prefix_caching: bool
    report: ModeReport
    num_steps: int


@pytest.fixture(scope="module", params=[False, True], ids=["prefix-caching-off", "on"])
def recorded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """A trace of the tiny demo workload, recorded through a real server and client."""
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    run, num_steps = record_workload(path, tiny_options(), request.param, out=io.StringIO())
    return Recorded(path, request.param, run.report, num_steps)


def replay(recorded: Recorded, **settings: object) -> ModeReport:
    trace = load_trace(recorded.path)
    engine = EngineConfig(**settings)  # type: ignore[arg-type]
    run = replay_trace(trace, ReplaySettings(engine=engine), out=io.StringIO())
    return run.report


def test_trace_is_a_header_and_one_line_of_step_keywords_per_step(recorded: Recorded) -> None:
    lines = recorded.path.read_text().splitlines()
    header = json.loads(lines[0])

    assert recorded.num_steps == 250 == len(lines) - 1
    assert header["kvdefrag_trace"] == 1
    assert (header["num_blocks"], header["block_size"]) == (400, 16)
    assert header["prefix_caching"] is recorded.prefix_caching
    # A step without pins writes the five event fields, no pin keys.
    assert all(tuple(json.loads(line)) == STEP_KEYS[:5] for line in lines[1:])
    assert STEP_KEYS[5:] == ("unpinned", "pins")
    assert sum(len(json.loads(line)["fresh"]) for line in lines[1:]) > 0


def test_replay_with_the_recorded_settings_reproduces_the_run(recorded: Recorded) -> None:
    report = replay(recorded)

    for field in (
        "num_moves",
        "num_two_way_moves",
        "num_placements",
        "num_bytes_moved",
        "peak_max_live_with",
        "mean_max_live_with",
        "mean_max_live_without",
        "ratio_p99_with",
    ):
        assert getattr(report, field) == getattr(recorded.report, field), field
    assert report.num_corrupted == 0 and report.num_live_checked > 0
    assert report.latency_label == "step latency p50 / p99 (engine, in-process)"


def test_threshold_decides_how_much_is_compacted(recorded: Recorded) -> None:
    eager = replay(recorded, threshold=0)
    never = replay(recorded, threshold=1_000_000)

    assert never.num_moves == 0 and never.num_bytes_moved == 0
    assert eager.num_moves > 0
    assert eager.mean_max_live_with < never.mean_max_live_with
    assert eager.ratio_mean_with < never.ratio_mean_with
    assert eager.num_corrupted == never.num_corrupted == 0


def test_placement_off_means_no_placements_and_copies_instead(recorded: Recorded) -> None:
    placed = replay(recorded, threshold=0)
    copied = replay(recorded, threshold=0, enable_placement=False)

    assert copied.num_placements == 0
    assert copied.num_corrupted == 0
    # Prefix caching or not, a fresh block can take a free slot that holds nothing (the
    # workload reports a freed block that was never full as evicted at once).
    assert placed.num_placements > 0
    if not recorded.prefix_caching:
        # NOTE: with prefix caching a placed block can leave a cached block higher up,
        # so placement does not always save copies there.
        assert copied.num_moves > placed.num_moves


def test_move_cap_leaves_holes_behind(recorded: Recorded) -> None:
    capped = replay(recorded, threshold=0, max_moves_per_step=1)
    free = replay(recorded, threshold=0)

    assert capped.mean_holes_with > free.mean_holes_with
    assert capped.num_corrupted == 0


def test_prefix_caching_replay_checks_cached_free_blocks(recorded: Recorded) -> None:
    report = replay(recorded)

    if recorded.prefix_caching:
        assert report.num_cached_checked > 0 and report.num_two_way_moves > 0
    else:
        assert report.num_cached_checked == 0 and report.num_two_way_moves == 0


# --- the recorder ---------------------------------------------------------------------
def test_recorder_keeps_fresh_none_apart_from_empty(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    with StepRecorder(path, num_blocks=64, block_size=4, metadata={"note": "x"}) as recorder:
        recorder.record(StepEvents(new_blocks={"a": [5, 9]}, fresh=[5, 9]))
        recorder.record(StepEvents(finished=["a"], new_blocks={"b": [5]}, fresh=[]))
        recorder.record(StepEvents(finished=("b",)))

    trace = load_trace(path)

    assert trace.header.metadata == {"note": "x"}
    assert trace.steps == [
        StepEvents(new_blocks={"a": [5, 9]}, fresh=[5, 9]),
        StepEvents(finished=("a",), new_blocks={"b": [5]}, fresh=[]),
        StepEvents(finished=("b",)),
    ]
    assert trace.line_numbers == [2, 3, 4]


def test_recorder_refuses_what_the_client_would_refuse(tmp_path: Path) -> None:
    with StepRecorder(tmp_path / "t.jsonl", num_blocks=64, block_size=4) as recorder:
        with pytest.raises(InvalidArgument, match="new_blocks"):
            recorder.record(StepEvents(new_blocks={"a": ["5"]}))  # type: ignore[list-item]
        assert recorder.num_steps == 0
    with pytest.raises(InvalidArgument, match="num_blocks"):
        StepRecorder(tmp_path / "u.jsonl", num_blocks=1, block_size=4)


# --- malformed traces -----------------------------------------------------------------
HEADER = '{"kvdefrag_trace": 1, "num_blocks": 64, "block_size": 4, "prefix_caching": false}'
GOOD_STEP = '{"finished": [], "new_blocks": {"a": [1]}, "resumed": {}, "fresh": [1], "evicted": []}'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty trace"),
        (['{"num_blocks": 64}'], "line 1: not a kvdefrag trace header"),
        (
            ['{"kvdefrag_trace": 1, "block_size": 4, "prefix_caching": false}'],
            "line 1: .*num_blocks",
        ),
        ([HEADER.replace("false", '"no"')], "line 1: prefix_caching must be true or false"),
        ([HEADER, GOOD_STEP, "{not json"], "line 3: not valid JSON"),
        ([HEADER, GOOD_STEP, "[1, 2]"], "line 3: expected a JSON object"),
        ([HEADER, '{"finished": [], "blocks": {}}'], "line 2: unknown key 'blocks'"),
        ([HEADER, '{"new_blocks": {"a": ["1"]}}'], r"line 2: new_blocks\['a'\]: block id '1'"),
        ([HEADER, '{"finished": "a"}'], "line 2: finished: expected a list"),
        ([HEADER, '{"fresh": [1.5]}'], "line 2: fresh: block id 1.5 is not an integer"),
        ([HEADER, "", '{"evicted": true}'], "line 3: evicted: expected a list"),
    ],
)
def test_malformed_trace_names_the_line(lines: list[str], message: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")

    with pytest.raises(InvalidArgument, match=message) as caught:
        load_trace(path)
    assert str(path) in str(caught.value)


def test_a_step_the_engine_refuses_names_its_line() -> None:
    lines = [HEADER, GOOD_STEP, "", '{"new_blocks": {"b": [64]}}']
    trace = parse_trace(lines, "prod.jsonl")

    with pytest.raises(InvalidArgument, match=r"prod.jsonl line 4: .*block id 64 is outside"):
        replay_trace(trace, ReplaySettings(), name="prod.jsonl", out=io.StringIO())


def test_a_trace_without_steps_is_refused() -> None:
    trace = parse_trace([HEADER], "empty.jsonl")

    with pytest.raises(InvalidArgument, match=r"empty\.jsonl: the trace has a header but no steps"):
        replay_trace(trace, ReplaySettings(), name="empty.jsonl", out=io.StringIO())


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot be read"):
        load_trace(tmp_path / "missing.jsonl")


# --- the console script ---------------------------------------------------------------
def run_kvdefrag(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KVDEFRAG), *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_kvdefrag_record_then_replay_with_other_settings(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"

    recorded = run_kvdefrag(
        "record", str(trace), "--steps", "120", "--num-blocks", "300", "--prefix-caching"
    )
    replayed = run_kvdefrag("replay", str(trace), "--threshold", "0", "--no-placement")

    assert recorded.returncode == 0, recorded.stderr
    assert f"recorded 120 steps to {trace.resolve()}" in recorded.stdout
    assert replayed.returncode == 0, replayed.stderr
    assert "threshold 0, up to 512 moves/step, placement off" in replayed.stdout
    assert "zero-copy placements" in replayed.stdout
    assert " live blocks checked, 0 corrupted" in replayed.stdout


@pytest.mark.slow
def test_kvdefrag_replay_of_a_malformed_trace_exits_2_naming_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(f"{HEADER}\n{GOOD_STEP}\n{{broken\n")

    done = run_kvdefrag("replay", str(trace))

    assert done.returncode == 2
    assert f"{trace} line 3: not valid JSON" in done.stderr


def test_pins_are_recorded_only_where_set_and_read_back() -> None:
    buffer = io.StringIO()
    steps = [
        StepEvents(new_blocks={"a": [1, 2]}, pins={"send/a": [1, 2]}),
        StepEvents(finished=("a",)),
        StepEvents(unpinned=("send/a",)),
    ]
    with StepRecorder(buffer, num_blocks=64, block_size=16, close_file=False) as recorder:
        for step in steps:
            recorder.record(step)
    lines = buffer.getvalue().splitlines()
    assert ['"pins"' in line for line in lines[1:]] == [True, False, False]
    assert parse_trace(lines).steps == steps
    with pytest.raises(InvalidArgument, match="line 2: unpinned: expected a list of strings"):
        parse_trace([HEADER, '{"unpinned": "send/a"}'], "t")
