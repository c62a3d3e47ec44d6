"""Run by every process of the P/D pair's ``vllm serve`` (this folder is on their PYTHONPATH
only, put there by ``pd_pair/conftest.py``), before vLLM is imported.

vLLM 0.32's MooncakeConnector worker takes its device from
``torch.accelerator.current_device_index()`` (``MooncakeConnectorWorker.__init__``), which
raises on a CPU-only torch ("Cannot access accelerator device when none is available").
Here it answers 0, the device the CPU platform's ``set_device`` then receives.
"""

import torch

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0
