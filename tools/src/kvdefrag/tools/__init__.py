"""kvdefrag tools: what a developer or operator runs, never the scheduler or the worker.

- ``kvdefrag.tools.workload``: a synthetic vLLM scheduler and block pool (events only).

Nothing here is imported by ``kvdefrag.client`` or ``kvdefrag.server``.
"""
