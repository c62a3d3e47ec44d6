"""The scheduler side's private modules, in vLLM's engine-core process.

They never import the worker side (``kvdefrag.vllm._worker``) or the server: the engine
core loads only the client and what both sides share.
"""
