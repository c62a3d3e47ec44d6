"""Old home of kvdefrag's scheduler side in vLLM, kept for one release as an alias.

kvdefrag inside vLLM now lives in one package, ``kvdefrag.vllm`` (the ``kvdefrag-vllm``
distribution, which depends on this one and on ``kvdefrag-server``). The old switch
``--scheduler-cls kvdefrag.client.vllm.scheduler.DefragScheduler`` (and
``DefragAsyncScheduler``) still works, with a ``DeprecationWarning``; use
``kvdefrag.vllm.scheduler`` instead. Nothing else of the old package remains.
"""
