"""Why kvdefrag refuses to start in a vLLM engine: one base, ``StartupRefused``.

Every refusal is raised at start-up (a worker's ``init_device`` or binding of its KV
caches, or the scheduler's construction), before the engine serves a request, and its
message names what to change. Catch ``StartupRefused`` to tell them from vLLM's own errors.

A leaf module: it imports only ``kvdefrag.common``.
"""

from __future__ import annotations

from kvdefrag.common import DefragError

__all__ = ["BadSetting", "StartupRefused", "UnsupportedByKvdefrag"]


class StartupRefused(DefragError):
    """kvdefrag will not start in this engine; the message names the fix."""


class UnsupportedByKvdefrag(StartupRefused):
    """The engine's configuration (a model, a feature, a layout, a runner) is one kvdefrag
    cannot serve; the message names it and says what to do instead."""


class BadSetting(StartupRefused):
    """A ``KVDEFRAG_VLLM_*`` variable (or the environment around it) is missing or
    malformed; the message names the variable and a valid value."""
