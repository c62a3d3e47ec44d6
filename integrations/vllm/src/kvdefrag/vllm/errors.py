"""Why kvdefrag refuses to start in a vLLM engine (one base, ``StartupRefused``), or
refuses a worker's pass once it runs (``PassRefused``).

Every refusal at start-up is raised before the engine serves a request (a worker's
``init_device`` or binding of its KV caches, or the scheduler's construction), and its
message names what to change. Catch ``StartupRefused`` to tell them from vLLM's own errors.

A leaf module: it imports only ``kvdefrag.common``.
"""

from __future__ import annotations

from kvdefrag.common import DefragError

__all__ = [
    "BadSetting",
    "PassRefused",
    "StartupRefused",
    "UnsafeRunDir",
    "UnsupportedByKvdefrag",
]


class StartupRefused(DefragError):
    """kvdefrag will not start in this engine; the message names the fix."""


class UnsupportedByKvdefrag(StartupRefused):
    """The engine's configuration (a model, a feature, a layout, a runner) is one kvdefrag
    cannot serve; the message names it and says what to do instead."""


class BadSetting(StartupRefused):
    """A ``KVDEFRAG_VLLM_*`` variable (or the environment around it) is missing or
    malformed; the message names the variable and a valid value."""


class PassRefused(DefragError):
    """A worker's pass cannot run on block ids it can trust: its rows lost track of the
    moves, or vLLM called the worker out of the order its steps run in. Nothing ran; the
    message names the cause (restart vLLM)."""


class UnsafeRunDir(StartupRefused):
    """The run directory, or a file kvdefrag reads or writes there, is not private.

    It belongs to another user, group or others may reach it, or it is a symlink (or not
    what it should be). Fix: ``chmod 700`` a directory of yours, or choose a new one
    under ``$XDG_RUNTIME_DIR`` (kvdefrag creates it 0700); remove a planted file.
    """
