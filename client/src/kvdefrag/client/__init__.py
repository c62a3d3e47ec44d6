"""kvdefrag client side (torch-free): talks to the sidecar from the vLLM scheduler."""

__all__: list[str] = []
