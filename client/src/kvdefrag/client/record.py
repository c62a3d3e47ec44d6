"""Step traces: record what a scheduler sends as JSON lines, and read them back for replay.

A trace is one header line, then one line per step with the fields of ``StepEvents``,
the argument of ``DefragClient.step`` / ``Engine.step`` (``unpinned`` and ``pins`` only
in steps that set them)::

    {"kvdefrag_trace": 1, "num_blocks": 8000, "block_size": 16, "prefix_caching": false}
    {"finished": [], "new_blocks": {"req-0": [1, 2]}, "resumed": {}, "fresh": [1, 2], "evicted": []}
    {"finished": ["req-0"], "new_blocks": {}, "resumed": {}, "fresh": null, "evicted": []}

``kvdefrag replay TRACE --threshold ... --max-moves-per-step ... --no-placement`` runs a
trace through an engine with other settings, so an operator can tune offline from a
production trace. Torch-free: a scheduler records with the client package alone.

Example:
    >>> import io
    >>> from kvdefrag.common import StepEvents
    >>> buffer = io.StringIO()
    >>> with StepRecorder(buffer, num_blocks=64, block_size=16, close_file=False) as rec:
    ...     rec.record(StepEvents(new_blocks={"req-a": [5, 9]}, fresh=[5, 9]))
    >>> trace = parse_trace(buffer.getvalue().splitlines())
    >>> trace.header.num_blocks, trace.steps[0].new_blocks
    (64, {'req-a': [5, 9]})
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, TextIO

from kvdefrag.common import InvalidArgument, StepEvents

__all__ = [
    "STEP_KEYS",
    "TRACE_VERSION",
    "StepRecorder",
    "Trace",
    "TraceHeader",
    "load_trace",
    "parse_trace",
]

TRACE_VERSION = 1
STEP_KEYS = StepEvents.field_names()
_HEADER_KEY = "kvdefrag_trace"


@dataclasses.dataclass(frozen=True)
class TraceHeader:
    """The first line of a trace: the pool the steps were sent to.

    Attributes:
        num_blocks: Blocks in the pool, null block included.
        block_size: Token slots per block.
        prefix_caching: The scheduler's prefix caching mode.
        metadata: Any other header fields (informational, e.g. the workload's settings).
    """

    num_blocks: int
    block_size: int
    prefix_caching: bool
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            _HEADER_KEY: TRACE_VERSION,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "prefix_caching": self.prefix_caching,
            **self.metadata,
        }


@dataclasses.dataclass(frozen=True)
class Trace:
    """A parsed trace: its header and its steps, in order.

    Attributes:
        header: The pool the steps were sent to.
        steps: The steps, in order.
        line_numbers: The file line of each step (for error messages).
    """

    header: TraceHeader
    steps: list[StepEvents]
    line_numbers: list[int] = dataclasses.field(default_factory=list)


class StepRecorder:
    """Writes the steps a scheduler sends to a JSON-lines trace.

    Wrap it around the client's calls: record the events, then send them::

        recorder = StepRecorder("trace.jsonl", num_blocks=client.num_blocks,
                                block_size=client.block_size, prefix_caching=False)
        recorder.record(events)
        client.step(events)

    Lines are buffered; ``flush()`` or ``close()`` writes them out (a crash may lose the
    last buffered steps, never corrupt earlier lines).

    Invariants: the file holds the header, then one complete line per recorded step.
    """

    def __init__(
        self,
        file: str | os.PathLike[str] | TextIO,
        *,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        metadata: Mapping[str, Any] | None = None,
        close_file: bool = True,
    ) -> None:
        """Opens (truncates) the trace and writes its header.

        Args:
            file: A path, or an open text file.
            num_blocks: Blocks in the pool (``DefragClient.num_blocks``).
            block_size: Token slots per block (``DefragClient.block_size``).
            prefix_caching: The scheduler's prefix caching mode.
            metadata: Extra JSON-serialisable header fields.
            close_file: When ``file`` is an open file: close it on ``close()``.

        Raises:
            InvalidArgument: A header value is out of range, or metadata reuses a key.
        """
        header = TraceHeader(num_blocks, block_size, prefix_caching, dict(metadata or {}))
        _check_header_values(header, "StepRecorder")
        clash = set(header.metadata) & {_HEADER_KEY, "num_blocks", "block_size", "prefix_caching"}
        if clash:
            raise InvalidArgument(f"metadata: key {sorted(clash)[0]!r} is reserved for the header")
        if isinstance(file, (str, os.PathLike)):
            self._file: TextIO = open(file, "w", encoding="utf-8")  # noqa: SIM115
            self._close_file = True
        else:
            self._file = file
            self._close_file = close_file
        self.header = header
        self.num_steps = 0
        self._is_closed = False
        self._write(header.to_json())

    def _write(self, value: Mapping[str, Any]) -> None:
        if self._is_closed:
            raise InvalidArgument("StepRecorder is closed")
        self._file.write(json.dumps(value, separators=(",", ":")) + "\n")

    def record(self, events: StepEvents) -> None:
        """Appends one step."""
        self._write(events.as_kwargs())
        self.num_steps += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        """Flushes, and closes the file if the recorder owns it (idempotent)."""
        if self._is_closed:
            return
        self._is_closed = True
        self._file.flush()
        if self._close_file:
            self._file.close()

    def __enter__(self) -> StepRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


# --- reading ---------------------------------------------------------------------------
def _check_header_values(header: TraceHeader, where: str) -> None:
    if type(header.num_blocks) is not int or header.num_blocks < 2:
        raise InvalidArgument(
            f"{where}: num_blocks must be an integer >= 2, got {header.num_blocks!r}"
        )
    if type(header.block_size) is not int or header.block_size < 1:
        raise InvalidArgument(
            f"{where}: block_size must be an integer >= 1, got {header.block_size!r}"
        )
    if type(header.prefix_caching) is not bool:
        raise InvalidArgument(
            f"{where}: prefix_caching must be true or false, got {header.prefix_caching!r}"
        )


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidArgument(
            f"{where}: not valid JSON ({err.msg} at column {err.colno})"
        ) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _parse_header(text: str, where: str) -> TraceHeader:
    fields = _json_object(text, where)
    version = fields.pop(_HEADER_KEY, None)
    if version != TRACE_VERSION:
        raise InvalidArgument(
            f"{where}: not a kvdefrag trace header: expected {_HEADER_KEY!r}: {TRACE_VERSION}, "
            f"got {version!r}"
        )
    missing = [key for key in ("num_blocks", "block_size", "prefix_caching") if key not in fields]
    if missing:
        raise InvalidArgument(f"{where}: the header lacks {missing[0]!r}")
    header = TraceHeader(
        fields.pop("num_blocks"), fields.pop("block_size"), fields.pop("prefix_caching"), fields
    )
    _check_header_values(header, where)
    return header


def _ids(value: object, field: str) -> list[int]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{field}: expected a list of block ids, got {value!r}")
    for block_id in value:
        if type(block_id) is not int:
            raise InvalidArgument(f"{field}: block id {block_id!r} is not an integer")
    return value


def _lists(value: object, field: str) -> dict[str, list[int]]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{field}: expected an object of request id -> block ids")
    return {request_id: _ids(ids, f"{field}[{request_id!r}]") for request_id, ids in value.items()}


def _keys(value: object, field: str) -> list[str]:
    """A list of strings (request ids, pin keys) read from a trace line."""
    if not isinstance(value, list) or not all(isinstance(key, str) for key in value):
        raise InvalidArgument(f"{field}: expected a list of strings, got {value!r}")
    return value


def _parse_step(text: str, where: str) -> StepEvents:
    fields = _json_object(text, where)
    unknown = sorted(set(fields) - set(STEP_KEYS))
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown key {unknown[0]!r} (a step has {', '.join(STEP_KEYS)})"
        )
    try:
        finished = _keys(fields.get("finished", []), "finished")
        fresh = fields.get("fresh")
        return StepEvents(
            finished=tuple(finished),
            new_blocks=_lists(fields.get("new_blocks", {}), "new_blocks"),
            resumed=_lists(fields.get("resumed", {}), "resumed"),
            fresh=None if fresh is None else _ids(fresh, "fresh"),
            evicted=_ids(fields.get("evicted", []), "evicted"),
            unpinned=tuple(_keys(fields.get("unpinned", []), "unpinned")),
            pins=_lists(fields.get("pins", {}), "pins"),
        )
    except InvalidArgument as err:
        raise InvalidArgument(f"{where}: {err}") from None


def parse_trace(lines: Iterable[str], name: str = "<trace>") -> Trace:
    """Parses a trace's lines (blank lines are skipped).

    Raises:
        InvalidArgument: A line is malformed; the message names ``name`` and the line.
    """
    header: TraceHeader | None = None
    steps: list[StepEvents] = []
    line_numbers: list[int] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {line_number}"
        if header is None:
            header = _parse_header(line, where)
        else:
            steps.append(_parse_step(line, where))
            line_numbers.append(line_number)
    if header is None:
        raise InvalidArgument(f"{name}: empty trace, expected a header line")
    return Trace(header, steps, line_numbers)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Reads and checks a whole trace file.

    Raises:
        InvalidArgument: The file cannot be read, or a line is malformed (the message
            names the file and the line).
    """
    try:
        with open(path, encoding="utf-8") as file:
            return parse_trace(file, os.fspath(path))
    except OSError as err:
        raise InvalidArgument(f"trace {os.fspath(path)!r} cannot be read: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise InvalidArgument(f"trace {os.fspath(path)!r} is not UTF-8 text: {err}") from err
