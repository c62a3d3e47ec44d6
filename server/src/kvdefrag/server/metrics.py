"""Prometheus metrics of kvdefrag (docs/design/metrics.md), declared against an injected registry.

Two kinds of metric, fed two ways::

    engine.step() ──on_step()──────────▶ counters, histograms   (events, as they happen)
    servicer ──record_error/_replay()──▶ counters
    Prometheus scrape ──collect()──────▶ engine.stats() ──▶ pool gauges  (read when asked)

A ``Metrics`` is built once its engine exists and is complete from then on: it registers
every metric and subscribes to the engine's steps in its constructor. The pool gauges are
never stored: they are read from that engine at scrape time, so they cannot go stale and
cost nothing between scrapes. Nothing here touches prometheus_client's global registry.

Constant labels (``labels=``) go on every series of one ``Metrics``: the vLLM worker sets
``rank`` (its global rank), so the ranks of a tensor-parallel engine stay apart however
they are scraped; the standalone server sets none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from kvdefrag.common import InvalidArgument, PoolStats
from kvdefrag.server._engine import StepObserver, StepResult
from kvdefrag.server._metrics_http import MetricsServer as MetricsServer
from kvdefrag.server.config import ServiceConfig

# 50 µs .. 10 s in 1-2-5 steps: a swap of a few blocks or an idle step takes well under a
# millisecond, a full 512-block pass on a large model tens of milliseconds.
DURATION_BUCKETS_S = (
    50e-6, 100e-6, 200e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 200e-3, 500e-3,
    1.0, 2.0, 5.0, 10.0,
)  # fmt: skip

# Runs per transferred block list: 1 is one contiguous range; a scattered 256-block
# prompt is hundreds.
RUN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 256)


class ObservedEngine(Protocol):
    """What ``Metrics`` watches (an ``Engine``): its steps, and its pool when scraped."""

    def stats(self) -> PoolStats: ...

    def add_observer(self, observer: StepObserver) -> None: ...


# name, help, how to read it from a stats snapshot
_POOL_GAUGES: tuple[tuple[str, str, Callable[[PoolStats], float]], ...] = (
    ("kvdefrag_live_blocks", "Blocks referenced by at least one running request.",
     lambda stats: stats.num_live),
    ("kvdefrag_max_live_block_id",
     "Highest live physical block id (0 when none is live); decode on contiguous "
     "paged attention reads every block up to it.",
     lambda stats: stats.max_live),
    ("kvdefrag_hole_blocks",
     "Free blocks below the highest live one: max_live_block_id - live_blocks.",
     lambda stats: stats.holes),
    ("kvdefrag_fragmentation_ratio",
     "max_live_block_id / live_blocks; 1.0 is packed (and when nothing is live).",
     lambda stats: stats.fragmentation_ratio),
    ("kvdefrag_capacity_blocks", "Blocks in the KV pool, the null block included.",
     lambda stats: stats.num_blocks),
    ("kvdefrag_running_requests", "Requests holding KV blocks.",
     lambda stats: stats.num_requests),
    ("kvdefrag_pinned_blocks",
     "Blocks pinned by a KV transfer in flight (live or free): they keep their slot.",
     lambda stats: stats.num_pinned),
    ("kvdefrag_healthy",
     "1 while KV moves succeed; 0 after a failed move, until the engine is reset.",
     lambda stats: float(stats.is_healthy)),
)  # fmt: skip


class _PoolCollector:
    """Reads the pool gauges from its engine whenever the registry is collected."""

    def __init__(self, engine: ObservedEngine, labels: Mapping[str, str]) -> None:
        self._engine = engine
        self._label_names = list(labels)
        self._label_values = list(labels.values())

    def describe(self) -> list[Metric]:
        """Names the gauges (the registry uses this to refuse duplicate names)."""
        return [GaugeMetricFamily(name, doc) for name, doc, _ in _POOL_GAUGES]

    def collect(self) -> list[Metric]:
        stats = self._engine.stats()  # one consistent snapshot for every gauge
        families: list[Metric] = []
        for name, doc, read in _POOL_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=self._label_names)
            family.add_metric(self._label_values, read(stats))
            families.append(family)
        return families


# Label names kvdefrag's own metrics use: a constant label may not take one.
_RESERVED_LABELS = frozenset({"result", "direction", "method", "code", "le"})
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _checked_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    labels = dict(labels or {})
    for name, value in labels.items():
        if (
            not isinstance(name, str)
            or not _LABEL_NAME.match(name)
            or name.startswith("__")
            or name in _RESERVED_LABELS
        ):
            raise InvalidArgument(
                f"metrics label {name!r} is not a Prometheus label name kvdefrag leaves "
                f"free (not one of {sorted(_RESERVED_LABELS)}, nor starting with __)"
            )
        if not isinstance(value, str):
            raise InvalidArgument(f"metrics label {name!r} must be a str, got {value!r}")
    return labels


class Metrics:
    """Every kvdefrag metric of one engine, registered on one injected registry.

    Built once the engine exists, in one step: the constructor registers every metric on
    ``registry`` and adds itself to the engine's observers (it implements
    ``StepObserver``), so the counters follow every later step and the pool gauges read
    ``engine.stats()`` at scrape time. It also takes the servicer's error and replay
    events (``record_error``, ``record_replay``). Counters only grow (an engine reset does
    not clear them, as Prometheus expects).

    Args:
        registry: Where every metric is registered (never prometheus_client's global one
            unless passed).
        engine: The engine whose steps are counted and whose pool the gauges show.
        labels: Constant labels on every series (the vLLM worker: ``{"rank": "N"}``);
            metric names never change.

    Raises:
        InvalidArgument: A label name that is not a Prometheus name, or that kvdefrag's
            own labels use.
        ValueError: ``registry`` already holds kvdefrag's metrics (one ``Metrics`` per
            registry); the engine is then left without this observer.

    Example:
        >>> import torch
        >>> from prometheus_client import CollectorRegistry
        >>> from kvdefrag.server import Engine
        >>> engine = Engine([(torch.zeros(64 * 16, 8), torch.zeros(64 * 16, 8))], block_size=16)
        >>> registry = CollectorRegistry()
        >>> metrics = Metrics(registry, engine)
        >>> registry.get_sample_value("kvdefrag_capacity_blocks")  # read from the engine
        64
        >>> metrics.record_error("Step", "INVALID_ARGUMENT")
        >>> registry.get_sample_value(
        ...     "kvdefrag_errors_total", {"method": "Step", "code": "INVALID_ARGUMENT"})
        1.0
        >>> ranked = CollectorRegistry()
        >>> _ = Metrics(ranked, engine, labels={"rank": "1"})
        >>> ranked.get_sample_value("kvdefrag_capacity_blocks", {"rank": "1"})
        64
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        engine: ObservedEngine,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        constant = _checked_labels(labels)
        self.registry = registry
        self.labels = constant
        registry.register(_PoolCollector(engine, constant))

        def family(name: str, documentation: str, labels: tuple[str, ...]) -> Counter:
            """A counter with the constant labels and ``labels`` (children per value)."""
            return Counter(name, documentation, (*constant, *labels), registry=registry)

        def counter(name: str, documentation: str) -> Counter:
            """A counter whose one series carries the constant labels."""
            metric = family(name, documentation, ())
            return metric.labels(**constant) if constant else metric

        def histogram(
            name: str, documentation: str, buckets: Sequence[float] = DURATION_BUCKETS_S
        ) -> Histogram:
            metric = Histogram(
                name, documentation, tuple(constant), buckets=buckets, registry=registry
            )
            return metric.labels(**constant) if constant else metric

        self._steps = counter("kvdefrag_steps", "Steps applied by the engine.")
        self._defrag_runs = family(
            "kvdefrag_defrag_runs",
            "Compaction passes, by result: moved (at least one block moved) or failed "
            "(the KV move raised; the engine turns unhealthy).",
            ("result",),
        )
        self._moved_blocks = family(
            "kvdefrag_moved_blocks",
            "Blocks moved by compaction, by direction: one_way (copied into an empty "
            "slot) or two_way (swapped with a cached block, prefix caching).",
            ("direction",),
        )
        self._placements = counter(
            "kvdefrag_placements",
            "Fresh blocks re-pointed to a lower free slot without copying any KV data.",
        )
        self._moved_bytes = counter(
            "kvdefrag_moved_bytes", "Bytes written to the KV tensors by block moves."
        )
        self._padded_slots = counter(
            "kvdefrag_padded_slots",
            "Pad pairs added to move batches to reach a static batch size (HPU).",
        )
        self._replayed_steps = counter(
            "kvdefrag_replayed_steps",
            "Steps resent by a client and answered from the replay cache (not applied).",
        )
        self._applied_steps = family(
            "kvdefrag_applied_steps",
            "Steps applied, by the path that brought them first: rpc (a Step or StepStream "
            "call) or in_process (a vLLM worker applied the step its output carried before "
            "the scheduler's call arrived; that call is then answered from the replay cache).",
            ("path",),
        )
        self._unknown_finished = counter(
            "kvdefrag_unknown_finished_requests",
            "Finished request ids the engine did not know (tolerated: e.g. cancelled "
            "before getting blocks).",
        )
        self._errors = family(
            "kvdefrag_errors",
            "RPCs that failed, by gRPC method and status code.",
            ("method", "code"),
        )
        self._swap_duration = histogram(
            "kvdefrag_swap_duration_seconds",
            "Time the swap executor took to move one step's blocks.",
        )
        self._step_duration = histogram(
            "kvdefrag_step_duration_seconds",
            "Time the engine took to handle one step, moves included.",
        )
        self._transfer_runs = histogram(
            "kvdefrag_transfer_runs",
            "Runs of consecutive physical ids in each block list a KV transfer pins (a "
            "request a connector sends or loads): about the descriptors or copies it posts "
            "per KV region; 1 is one contiguous range.",
            RUN_BUCKETS,
        )
        self._step_wait = histogram(
            "kvdefrag_step_wait_seconds",
            "Time a worker waited for its step to be applied before its pass (the vLLM "
            "integration's wait_applied; 0 when the step was applied already).",
        )
        # NOTE: children with known label values exist from the start, so rate() and
        # alerts see a 0 before the first event instead of a missing series.
        self._runs_moved = self._defrag_runs.labels(**constant, result="moved")
        self._runs_failed = self._defrag_runs.labels(**constant, result="failed")
        self._moved_one_way = self._moved_blocks.labels(**constant, direction="one_way")
        self._moved_two_way = self._moved_blocks.labels(**constant, direction="two_way")
        self._applied_by_path = {
            path: self._applied_steps.labels(**constant, path=path)
            for path in ("rpc", "in_process")
        }
        # NOTE: last, once every metric is registered: a registry that refuses one
        # (duplicate names) leaves the engine without a half-built observer.
        engine.add_observer(self)

    # --- StepObserver -----------------------------------------------------------------
    def on_step(self, result: StepResult, duration_s: float) -> None:
        """Counts what one applied step did."""
        self._steps.inc()
        self._step_duration.observe(duration_s)
        self._placements.inc(result.num_placed)
        for num_runs in result.transfer_runs:
            self._transfer_runs.observe(num_runs)
        self._unknown_finished.inc(result.num_unknown_finished)
        if result.moves:
            num_two_way = result.moves.num_two_way
            self._runs_moved.inc()
            self._moved_one_way.inc(len(result.moves) - num_two_way)
            self._moved_two_way.inc(num_two_way)
            self._moved_bytes.inc(result.num_bytes_moved)
            self._padded_slots.inc(result.num_padded)
            self._swap_duration.observe(result.swap_duration_s)

    def on_move_failure(self) -> None:
        """Counts a compaction pass whose KV move raised, and its step (applied without it)."""
        self._steps.inc()
        self._runs_failed.inc()

    def on_reset(self) -> None:
        """Nothing to do: counters only grow, and the pool gauges are read when scraped."""

    # --- service events ---------------------------------------------------------------
    def record_error(self, method: str, code: str) -> None:
        """Counts a failed RPC.

        Args:
            method: The RPC's short name, e.g. ``"Step"`` (a fixed set: low cardinality).
            code: The gRPC status code's name, e.g. ``"INVALID_ARGUMENT"``.
        """
        self._errors.labels(**self.labels, method=method, code=code).inc()

    def record_step_wait(self, duration_s: float) -> None:
        """Records how long a worker waited for its step (``wait_applied``)."""
        self._step_wait.observe(duration_s)

    def record_applied(self, path: str) -> None:
        """Counts a step applied, by the path that brought it first (``"rpc"`` or
        ``"in_process"``)."""
        self._applied_by_path[path].inc()

    def record_replay(self) -> None:
        """Counts a resent step answered from the replay cache."""
        self._replayed_steps.inc()


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    host: str = "127.0.0.1",
    *,
    max_connections: int = ServiceConfig.metrics_max_connections,
    idle_timeout_s: float = ServiceConfig.metrics_idle_timeout_s,
) -> MetricsServer:
    """Serves ``registry`` on ``http://host:port/metrics`` from one daemon thread.

    The output is prometheus_client's (``start_http_server``'s: content negotiation,
    gzip), from a server whose threads and connections are bounded (``_metrics_http``).

    Args:
        registry: The registry a ``Metrics`` registered on.
        port: TCP port; 0 picks a free one (read it from the result's ``port``).
        host: Listen address; loopback by default. Use ``0.0.0.0`` in a container or pod
            so Prometheus can reach it.
        max_connections: Connections held at once; a newcomer past it closes the oldest.
        idle_timeout_s: Seconds a connection has to send its request, and again to take
            its reply, before it is closed.

    Returns:
        The running server: ``.port`` and ``.stop()``.

    Raises:
        OSError: The port is taken (the message names it and ``metrics_port``).
        InvalidArgument: ``max_connections`` under 1 or ``idle_timeout_s`` not positive.
    """
    return MetricsServer(
        registry, port, host, max_connections=max_connections, idle_timeout_s=idle_timeout_s
    )
