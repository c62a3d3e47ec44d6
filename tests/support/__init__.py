"""Helpers shared by the tests, imported as ``support`` (pytest puts tests/ on the path).

``kv`` builds real KV caches whose blocks carry signatures, ``reference_model`` is the
naive model the engine is checked against, ``random_workload`` draws valid scheduler
steps over it, ``server`` starts an in-process server on signed caches (the ``serve``
fixture of tests/conftest.py wraps it), ``doubles`` holds the one swap executor double
(a real executor with scripted faults), ``proxy`` the one socket proxy (cuts, stalls,
blackholes, chaos), ``tls`` makes certificates and ``public_api`` checks a pinned
``__all__``. Test modules import from here, never from one another.
"""
