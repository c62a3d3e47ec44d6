"""kvdefrag server side: the defragmentation engine and its gRPC service.

Runs inside the vLLM worker process, next to the KV tensors it moves.
"""

from kvdefrag.server._engine import Engine, EngineStats, StepObserver, StepResult
from kvdefrag.server._executor import MoveReport, SwapExecutor, make_executor
from kvdefrag.server._planner import Move
from kvdefrag.server._server import ServerHandle, serve_in_process
from kvdefrag.server.config import Config, load_config

__all__ = [
    "Config",
    "Engine",
    "EngineStats",
    "Move",
    "MoveReport",
    "ServerHandle",
    "StepObserver",
    "StepResult",
    "SwapExecutor",
    "load_config",
    "make_executor",
    "serve_in_process",
]
