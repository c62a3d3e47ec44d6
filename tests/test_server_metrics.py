"""The server's default metrics: wired to the engine and served on /metrics when asked."""

import urllib.request
from pathlib import Path

import torch

from kvdefrag.server import serve_in_process


def _kv_caches(num_blocks: int = 64, block_size: int = 4) -> list[tuple[torch.Tensor, None]]:
    return [(torch.zeros(num_blocks * block_size, 2), None)]


def test_metrics_endpoint_follows_the_engine(tmp_path: Path) -> None:
    handle = serve_in_process(
        _kv_caches(), 4, f"unix:{tmp_path / 'kv.sock'}", metrics_port=0, threshold=0
    )
    try:
        assert handle.metrics_port is not None
        handle.engine.step(new_blocks={"req-a": [40, 41]}, fresh=[])
        url = f"http://127.0.0.1:{handle.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "kvdefrag_steps_total 1.0" in text
        assert 'kvdefrag_moved_blocks_total{direction="one_way"} 2.0' in text
        assert "kvdefrag_live_blocks 2.0" in text
        assert handle.registry.get_sample_value("kvdefrag_max_live_block_id") == 2.0
    finally:
        handle.stop(1)


def test_no_metrics_endpoint_unless_asked(tmp_path: Path) -> None:
    handle = serve_in_process(_kv_caches(), 4, f"unix:{tmp_path / 'kv.sock'}")
    try:
        assert handle.metrics_port is None
        handle.engine.step(new_blocks={"req-a": [3]})
        assert handle.registry.get_sample_value("kvdefrag_steps_total") == 1.0
    finally:
        handle.stop(1)
