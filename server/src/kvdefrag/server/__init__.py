"""kvdefrag server side: the defragmentation engine and its gRPC service.

Runs inside the vLLM worker process, next to the KV tensors it moves.
"""

from kvdefrag.common import PoolStats, StepEvents, Totals
from kvdefrag.server._backends import make_executor
from kvdefrag.server._engine import Engine, StepObserver, StepResult
from kvdefrag.server._executor import SwapExecutor
from kvdefrag.server._moves import Move, MoveBatch, MoveReport
from kvdefrag.server._server import ServerHandle, serve_in_process
from kvdefrag.server.config import EngineConfig, ServiceConfig, load_config

__all__ = [
    "Engine",
    "EngineConfig",
    "Move",
    "MoveBatch",
    "MoveReport",
    "PoolStats",
    "ServerHandle",
    "ServiceConfig",
    "StepEvents",
    "StepObserver",
    "StepResult",
    "SwapExecutor",
    "Totals",
    "load_config",
    "make_executor",
    "serve_in_process",
]
