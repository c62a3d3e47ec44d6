"""The steps applied in the current epoch: what each carried, how it reached the engine,
what it did, and its reply for resends.

A step reaches the engine by one of two paths: a Step or StepStream call (``rpc``), or a
vLLM worker that was handed the step with its output and applied it before the call came
(``in_process``). Either way the writer's own call for that seq comes later or not at
all, and must be answered with the reply of the step as applied, once; a later call for
the same seq is a resend (counted, and its events must match).

Each entry keeps the domain result and builds the gRPC reply only when a call needs it:
the worker that applied a step in process builds no message before its forward pass.

A leaf of the servicer: it imports only ``_convert`` and the engine's result type.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from kvdefrag.common import StepEvents
from kvdefrag.server import _convert
from kvdefrag.server._engine import StepResult

__all__ = ["APPLIED_BY_RPC", "APPLIED_IN_PROCESS", "AppliedStep", "StepLedger"]

APPLIED_BY_RPC = "rpc"
APPLIED_IN_PROCESS = "in_process"
"""How a step reached the engine first (``kvdefrag_applied_steps_total{path}``)."""

Message = Any


@dataclasses.dataclass
class AppliedStep:
    """One applied step of the epoch.

    Attributes:
        seq: Its number.
        epoch: The epoch it was applied in.
        events: What it carried (a resend must carry the same).
        result: What the engine did.
        path: ``APPLIED_BY_RPC`` or ``APPLIED_IN_PROCESS``.
        awaits_call: Applied in process, and the writer's call for it has not come yet:
            that call is its first copy, not a resend.
    """

    seq: int
    epoch: int
    events: StepEvents
    result: StepResult
    path: str
    awaits_call: bool
    _response: Message = None

    def response(self) -> Message:
        """The step's reply (a StepStreamResponse), built on first use."""
        if self._response is None:
            self._response = _convert.step_response(self.result, self.seq, self.epoch)
        return self._response


class StepLedger:
    """The last ``size`` steps applied in the epoch, by seq.

    Invariants: seqs are recorded in increasing order, each once; at most ``size`` are
    kept (the oldest go first); ``clear`` forgets them all (a new epoch).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._steps: collections.OrderedDict[int, AppliedStep] = collections.OrderedDict()

    def record(
        self, seq: int, epoch: int, events: StepEvents, result: StepResult, path: str
    ) -> AppliedStep:
        """Records step ``seq`` as applied by ``path``."""
        applied = AppliedStep(
            seq, epoch, events, result, path, awaits_call=path == APPLIED_IN_PROCESS
        )
        self._steps[seq] = applied
        while len(self._steps) > self.size:
            self._steps.popitem(last=False)
        return applied

    def get(self, seq: int) -> AppliedStep | None:
        """The step ``seq`` if it is still kept."""
        return self._steps.get(seq)

    def answer_call(self, applied: AppliedStep) -> bool:
        """Marks the writer's call for ``applied`` as come.

        Returns:
            True when it is the step's first call (applied in process before it came);
            False when it is a resend.
        """
        is_first = applied.awaits_call
        applied.awaits_call = False
        return is_first

    def clear(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)
