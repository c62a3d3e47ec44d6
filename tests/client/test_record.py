"""DefragClient(record_to=...): a production client records what the server applied."""

from pathlib import Path

import pytest
import torch

from kvdefrag.client import DefragClient, InvalidArgument
from kvdefrag.client.record import load_trace
from kvdefrag.common import StepEvents
from kvdefrag.server import Engine
from kvdefrag.tools.workload import SyntheticWorkload, WorkloadConfig

from support.server import Serve


def test_recorded_trace_replays_to_the_same_mapping(serve: Serve, tmp_path: Path) -> None:
    num_blocks, block_size = 512, 16
    trace_path = tmp_path / "trace.jsonl"
    workload = SyntheticWorkload(
        WorkloadConfig(
            num_blocks=num_blocks, num_steps=120, seed=5, prompt_len_max=2048, output_len_max=1024
        )
    )
    handle = serve(num_blocks=num_blocks, block_size=block_size)
    with DefragClient(handle.address, record_to=trace_path) as client:
        for step in workload:
            client.step(step.events)
        with pytest.raises(InvalidArgument):  # refused: changes nothing, not recorded
            client.step(StepEvents(new_blocks={"bad": [num_blocks]}))
        served_mapping = client.resolve(range(num_blocks))

    trace = load_trace(trace_path)
    assert len(trace.steps) == 120
    assert (trace.header.num_blocks, trace.header.block_size) == (num_blocks, block_size)
    engine = Engine([(torch.zeros(num_blocks * block_size, 4), None)], block_size)
    for step_events in trace.steps:
        engine.step(step_events)
    assert engine.resolve(list(range(num_blocks))).tolist() == served_mapping
