"""kvdefrag tools: what a developer or operator runs, never the scheduler or the worker.

- ``kvdefrag.tools.demo``: ``make demo``, a realistic workload through a real server and
  client, KV data checked (``python -m kvdefrag.tools.demo``).
- ``kvdefrag.tools.cli``: the ``kvdefrag`` command (``demo``, ``record``, ``replay``).
- ``kvdefrag.tools.workload``: a synthetic vLLM scheduler and block pool (events only).

Nothing here is imported by ``kvdefrag.client`` or ``kvdefrag.server``.
"""
