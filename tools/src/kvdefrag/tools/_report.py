"""The demo's summary: per-step series, the table it prints, and the PNG plot.

Shared by ``kvdefrag demo``, ``record`` and ``replay``: "without kvdefrag" is the
scheduler's logical ids (what the kernels would read with no defragmenter), "with" the
engine's physical slots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np

from kvdefrag.common import Totals

_MAX_EXAMPLES = 5


@dataclasses.dataclass(frozen=True)
class ModeReport:
    """The summary of one run (one mode of the demo, or one replay)."""

    title: str
    details: tuple[str, ...]
    num_steps: int
    peak_max_live_without: int
    peak_max_live_with: int
    mean_max_live_without: float
    mean_max_live_with: float
    mean_holes_without: float
    mean_holes_with: float
    ratio_mean_without: float
    ratio_mean_with: float
    ratio_p99_without: float
    ratio_p99_with: float
    num_moves: int
    num_two_way_moves: int
    num_bytes_moved: int
    num_placements: int
    num_defrag_runs: int
    latency_label: str
    latency_p50_s: float
    latency_p99_s: float
    num_live_checked: int
    num_cached_checked: int
    num_moved_checked: int
    num_corrupted: int
    corruption_examples: tuple[str, ...]
    # Runs of consecutive ids in each new request's first blocks (what a KV transfer of
    # its prompt posts per region); NaN where the run measured none (a replay).
    mean_prompt_runs_without: float = float("nan")
    mean_prompt_runs_with: float = float("nan")

    @property
    def is_intact(self) -> bool:
        return self.num_corrupted == 0


@dataclasses.dataclass
class RunLog:
    """Per-step series and integrity counts of one run, gathered as it goes."""

    num_live: list[int] = dataclasses.field(default_factory=list)
    max_live_without: list[int] = dataclasses.field(default_factory=list)
    max_live_with: list[int] = dataclasses.field(default_factory=list)
    latency_s: list[float] = dataclasses.field(default_factory=list)
    num_live_checked: int = 0
    num_cached_checked: int = 0
    num_moved_checked: int = 0
    num_corrupted: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)
    num_requests: int = 0
    num_preempted: int = 0
    num_prefix_hits: int = 0
    prompt_runs_without: list[int] = dataclasses.field(default_factory=list)
    prompt_runs_with: list[int] = dataclasses.field(default_factory=list)

    def add_prompt(self, logical_ids: Sequence[int], physical_ids: Sequence[int]) -> None:
        """Counts the runs of a new request's first blocks: consecutive logical ids
        without kvdefrag (the mapping is the identity), physical ids with it."""
        self.prompt_runs_without.append(count_runs(logical_ids))
        self.prompt_runs_with.append(count_runs(physical_ids))

    def add_step(self, num_live: int, max_without: int, max_with: int, latency_s: float) -> None:
        self.num_live.append(num_live)
        self.max_live_without.append(max_without)
        self.max_live_with.append(max_with)
        self.latency_s.append(latency_s)

    def add_check(
        self, what: str, step_index: int, num_checked: int, bad: list[tuple[int, int]]
    ) -> None:
        """Counts one integrity check of ``num_checked`` blocks (``what``: live/cached/moved)."""
        setattr(self, f"num_{what}_checked", getattr(self, f"num_{what}_checked") + num_checked)
        self.num_corrupted += len(bad)
        for logical_id, physical_id in bad[: max(0, _MAX_EXAMPLES - len(self.examples))]:
            self.examples.append(
                f"step {step_index}: {what} logical block {logical_id} at physical slot "
                f"{physical_id} does not hold its data"
            )

    def report(
        self, title: str, details: Sequence[str], totals: Totals, latency_label: str
    ) -> ModeReport:
        num_live = np.asarray(self.num_live, dtype=np.float64)
        live = np.maximum(num_live, 1.0)
        without = np.asarray(self.max_live_without, dtype=np.float64)
        with_ = np.asarray(self.max_live_with, dtype=np.float64)
        # NOTE: an empty pool counts as packed (ratio 1.0), as in PoolStats.
        empty = np.asarray(self.num_live) == 0
        ratio_without = np.where(empty, 1.0, without / live)
        ratio_with = np.where(empty, 1.0, with_ / live)
        latency = np.asarray(self.latency_s)
        return ModeReport(
            title=title,
            details=tuple(details),
            num_steps=len(self.num_live),
            peak_max_live_without=int(without.max(initial=0)),
            peak_max_live_with=int(with_.max(initial=0)),
            mean_max_live_without=float(without.mean()),
            mean_max_live_with=float(with_.mean()),
            mean_holes_without=float((without - num_live).mean()),
            mean_holes_with=float((with_ - num_live).mean()),
            ratio_mean_without=float(ratio_without.mean()),
            ratio_mean_with=float(ratio_with.mean()),
            ratio_p99_without=float(np.percentile(ratio_without, 99)),
            ratio_p99_with=float(np.percentile(ratio_with, 99)),
            num_moves=totals.num_moves,
            num_two_way_moves=totals.num_two_way_moves,
            num_bytes_moved=totals.num_bytes_moved,
            num_placements=totals.num_placements,
            num_defrag_runs=totals.num_defrag_runs,
            latency_label=latency_label,
            latency_p50_s=float(np.percentile(latency, 50)),
            latency_p99_s=float(np.percentile(latency, 99)),
            num_live_checked=self.num_live_checked,
            num_cached_checked=self.num_cached_checked,
            num_moved_checked=self.num_moved_checked,
            num_corrupted=self.num_corrupted,
            corruption_examples=tuple(self.examples),
            mean_prompt_runs_without=_mean(self.prompt_runs_without),
            mean_prompt_runs_with=_mean(self.prompt_runs_with),
        )


def count_runs(block_ids: Sequence[int]) -> int:
    """Maximal runs of consecutive ids, in list order (0 for an empty list)."""
    return sum(index == 0 or block_ids[index - 1] + 1 != block_id
               for index, block_id in enumerate(block_ids))  # fmt: skip


def _mean(values: Sequence[int]) -> float:
    return float(np.mean(values)) if values else float("nan")


class Progress:
    """Prints a progress line at most every ``interval_s`` seconds."""

    def __init__(self, out: TextIO, label: str, total: int, interval_s: float) -> None:
        self._out, self._label, self._total, self._interval_s = out, label, total, interval_s
        self._started = self._last = time.monotonic()

    def update(self, step: int, log: RunLog, num_moves: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._interval_s:
            return
        self._last = now
        print(
            f"  [{self._label}] step {step:>6,}/{self._total:,}  live {log.num_live[-1]:>7,}  "
            f"max live {log.max_live_with[-1]:>7,} (without kvdefrag "
            f"{log.max_live_without[-1]:,})  moves {num_moves:,}  "
            f"{now - self._started:.1f} s",
            file=self._out,
            flush=True,
        )


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def integrity_line(report: ModeReport) -> str:
    """``KV integrity: N live blocks checked, M corrupted`` (and what else was checked)."""
    also = [f"{report.num_moved_checked:,} moved blocks after their step"]
    if report.num_cached_checked:
        also.insert(0, f"{report.num_cached_checked:,} cached free blocks")
    return (
        f"KV integrity: {report.num_live_checked:,} live blocks checked, "
        f"{report.num_corrupted:,} corrupted (also checked: {', '.join(also)})"
    )


def format_report(report: ModeReport) -> str:
    """The summary table of one run."""
    rows = [
        ("highest live block id, peak", f"{report.peak_max_live_without:,}",
         f"{report.peak_max_live_with:,}"),
        ("highest live block id, mean", f"{report.mean_max_live_without:,.0f}",
         f"{report.mean_max_live_with:,.0f}"),
        ("holes below it, mean", f"{report.mean_holes_without:,.0f}",
         f"{report.mean_holes_with:,.0f}"),
        ("fragmentation ratio, mean", f"{report.ratio_mean_without:.3f}",
         f"{report.ratio_mean_with:.3f}"),
        ("fragmentation ratio, p99", f"{report.ratio_p99_without:.3f}",
         f"{report.ratio_p99_with:.3f}"),
        ("runs per new request's blocks, mean", _runs(report.mean_prompt_runs_without),
         _runs(report.mean_prompt_runs_with)),
        ("blocks moved (two-way)", "-",
         f"{report.num_moves:,} ({report.num_two_way_moves:,})"),
        ("bytes moved", "-", format_bytes(report.num_bytes_moved)),
        ("zero-copy placements", "-", f"{report.num_placements:,}"),
        (report.latency_label, "-",
         f"{report.latency_p50_s * 1e3:.2f} / {report.latency_p99_s * 1e3:.2f} ms"),
    ]  # fmt: skip
    width = max(len(row[0]) for row in rows)
    lines = [f"== {report.title} ==", *(f"  {line}" for line in report.details)]
    lines.append(f"  {'':<{width}}  {'without kvdefrag':>16}  {'with kvdefrag':>18}")
    lines += [f"  {name:<{width}}  {without:>16}  {with_:>18}" for name, without, with_ in rows]
    lines.append(f"  {integrity_line(report)}")
    lines += [f"    {example}" for example in report.corruption_examples]
    return "\n".join(lines)


def _runs(mean_runs: float) -> str:
    return "-" if np.isnan(mean_runs) else f"{mean_runs:.2f}"


def write_plot(runs: Sequence[tuple[str, RunLog]], path: Path, num_blocks: int) -> Path:
    """Plots live blocks and the highest live id with and without kvdefrag, per run."""
    # NOTE: imported here, so the package imports without it; the Agg canvas is bound
    # to this figure only (no pyplot, no process-wide backend switch).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.6 * len(runs)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (title, log) in zip(axes, runs, strict=True):
        steps = np.arange(1, len(log.num_live) + 1)
        ax.plot(steps, log.max_live_without, color="tab:red", lw=0.9,
                label="highest live block id without kvdefrag")  # fmt: skip
        ax.plot(steps, log.max_live_with, color="tab:green", lw=2.0,
                label="highest live block id with kvdefrag")  # fmt: skip
        ax.plot(steps, log.num_live, color="black", lw=0.6, ls="--", label="live blocks")
        ax.axhline(num_blocks - 1, color="gray", lw=0.6, ls=":", label="pool size")
        if log.prompt_runs_with:
            title += (
                f" (runs per new request's blocks: {_mean(log.prompt_runs_without):.2f} "
                f"without kvdefrag, {_mean(log.prompt_runs_with):.2f} with)"
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("blocks")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
