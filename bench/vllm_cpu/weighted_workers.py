"""vLLM CPU workers for engine_run.py, importable by name (``worker_cls`` is a string)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.v1.worker.cpu_worker import CPUWorker

from kvdefrag.vllm._worker.passes import wait_for_planned_step
from kvdefrag.vllm.contract import read_step_stamp
from kvdefrag.vllm.worker import DefragWorkerMixin

# Standard deviations (times 1/sqrt(fan_in)) that make the attention path dominate the
# residual stream: the next token depends on the whole context, hence on every KV block.
SCALES = {"embed_tokens": 0.3, "o_proj": 4.0, "down_proj": 0.5, "lm_head": 2.0}


def draw_weights(model: torch.nn.Module) -> None:
    """Replaces every weight with a seeded draw large enough for attention to matter."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            scale = next((value for key, value in SCALES.items() if key in name), 1.0)
            if "embed_tokens" in name:
                scale *= param.shape[-1] ** 0.5
            drawn = torch.randn(param.shape, generator=generator) * (scale / param.shape[-1] ** 0.5)
            param.copy_(drawn.to(param.dtype))


class WeightedCPUWorker(CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker with ``draw_weights`` in place of the dummy loader's weights."""

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        # NOTE: drawn inside the loader, before vLLM's CPU layers repack their weights
        # (changing the parameters after load_model has no effect on the forward pass).
        original = DummyModelLoader.load_weights

        def load_weights(loader: Any, model: torch.nn.Module, model_config: Any) -> None:
            original(loader, model, model_config)
            draw_weights(model)

        DummyModelLoader.load_weights = load_weights
        try:
            super().load_model(*args, **kwargs)
        finally:
            DummyModelLoader.load_weights = original


WAITS_NAME = "worker{rank}_waits.json"
"""Written into the run directory after each pass whose output carried a step stamp: how
long each pass waited for its step."""


class WeightedDefragWorker(DefragWorkerMixin, WeightedCPUWorker):
    """DefragWorker with drawn weights; when it translates, it times each wait for the step
    planned with the output (the part of the round trip the scheduler no longer waits for)."""

    def execute_model(self, scheduler_output: Any) -> Any:
        handle = self.kvdefrag_handle
        if handle is not None:
            started = time.perf_counter()
            wait_for_planned_step(handle, self.rank, scheduler_output, self.kvdefrag_step_wait_s)
            waits_s = self.__dict__.setdefault("waits_s", [])
            waits_s.append(time.perf_counter() - started)
            if read_step_stamp(scheduler_output) is not None:
                # NOTE: written as it goes: vLLM kills tensor-parallel workers before
                # their shutdown runs. The stamp shows it crossed vLLM's executor.
                path = os.path.join(self.kvdefrag_run_dir(), WAITS_NAME.format(rank=self.rank))
                with open(path, "w") as file:
                    json.dump(waits_s, file)
        return super().execute_model(scheduler_output)  # waits again: returns at once


class CorruptingCPUWorker(WeightedCPUWorker):
    """Overwrites the whole KV cache with noise once, before its 20th forward pass."""

    num_calls = 0

    def execute_model(self, scheduler_output: Any) -> Any:
        self.num_calls += 1
        if self.num_calls == 20:
            for kv in self.model_runner.kv_caches:
                kv.normal_(generator=torch.Generator().manual_seed(5))
        return super().execute_model(scheduler_output)


class UnfollowingDefragWorker(WeightedDefragWorker):
    """Translates its outputs but never moves its rows (a sabotage).

    After a move, the runner's persistent rows still name the old slots: the forward pass
    reads moved blocks where they were.
    """

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        super().initialize_from_config(kv_cache_config)
        translator = self.kvdefrag_translator
        assert translator is not None
        advance = translator.advance
        translator.advance = lambda: (advance()[0], None)  # type: ignore[method-assign]
