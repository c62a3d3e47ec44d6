"""The check behind every pinned ``__all__``: exact, sorted, star-importable, documented."""

from __future__ import annotations

import importlib
from types import ModuleType


def assert_public_names(module_name: str, names: set[str]) -> None:
    """Fails unless ``module_name`` exports exactly ``names``, in ruff's order, documented.

    Adding or removing a public name is an API change: the caller pins the set on purpose.
    """
    module: ModuleType = importlib.import_module(module_name)
    assert set(module.__all__) == names
    # isort-style order (as ruff keeps it): constants, then classes, then functions
    assert list(module.__all__) == sorted(module.__all__, key=lambda n: (not n.isupper(), n))
    star: dict[str, object] = {}
    exec(f"from {module_name} import *", star)
    assert set(star) - {"__builtins__"} == names
    for name in names:
        if name.isupper():  # a constant: documented where it is defined
            continue
        assert getattr(module, name).__doc__, f"{module_name}.{name} has no docstring"


def assert_public_members(cls: type, names: set[str]) -> None:
    """Fails unless ``cls`` has exactly the public members ``names``, each documented.

    Adding a public member widens what callers may rely on: the caller pins the set on
    purpose (and names what must stay private by leaving it out).
    """
    public = {name for name in dir(cls) if not name.startswith("_")}
    assert public == names
    for name in names:
        assert getattr(cls, name).__doc__, f"{cls.__qualname__}.{name} has no docstring"
