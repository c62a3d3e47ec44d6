"""kvdefrag wired into the CPU model of vllm-gaudi's HPU worker: the subject under test.

``support.hpu_runner_model`` models vllm-gaudi alone; here ``DefragHPUWorkerMixin`` goes in
front of its worker, as ``kvdefrag.vllm.gaudi.DefragHPUWorker`` goes in front of
vllm-gaudi's ``HPUWorker``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvdefrag.server import ServerHandle
from kvdefrag.vllm.gaudi import DefragHPUWorkerMixin

from support.hpu_runner_model import HPUWorkerModel


class HPUModelWorker(DefragHPUWorkerMixin, HPUWorkerModel):
    """``DefragHPUWorkerMixin`` in front of the model: what ``DefragHPUWorker`` is on
    Gaudi. With a rank's ``handle`` it installs the switch; without, it runs plain.
    ``runner`` goes to ``HPURunnerModel`` (the Eagle draft layer and its token count)."""

    def __init__(
        self,
        kv: torch.Tensor,
        num_blocks: int,
        handle: ServerHandle | None = None,
        rank: int = 0,
        **runner: Any,
    ) -> None:
        super().__init__(kv, num_blocks, rank, **runner)
        if handle is not None:
            self.kvdefrag_attach(handle, num_blocks)
            self.model_runner.kv_lock = handle.kv_lock

    def rank_service(self) -> ServerHandle | None:
        return self.kvdefrag_handle
