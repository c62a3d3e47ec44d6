"""Every docstring example of the five packages runs and shows what it promises.

Each module of kvdefrag.client, kvdefrag.common, kvdefrag.server, kvdefrag.vllm and
kvdefrag.tools (private ones included) is searched for examples; examples that need a live server or
worker carry ``# doctest: +SKIP``, every other one runs here, so an example that drifts
from the code fails the suite.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import types

import pytest

PACKAGES = (
    "kvdefrag.client",
    "kvdefrag.common",
    "kvdefrag.server",
    "kvdefrag.vllm",
    "kvdefrag.tools",
)
# Modules known to hold examples: finding none there means the search itself broke.
KNOWN = {
    "kvdefrag.client.record",
    "kvdefrag.common.events",
    "kvdefrag.server._engine",
    "kvdefrag.server.metrics",
    "kvdefrag.tools.workload",
}


def module_names() -> list[str]:
    """Every module and package of ``PACKAGES``, sorted."""
    names = list(PACKAGES)
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"{package_name}.")]
    return sorted(names)


def examples(module: types.ModuleType) -> list[doctest.DocTest]:
    """The module's docstrings that hold at least one example (its own objects only)."""
    return [test for test in doctest.DocTestFinder().find(module) if test.examples]


def run_examples(module: types.ModuleType) -> tuple[doctest.TestResults, str]:
    """Runs the module's examples; returns the counts and the failure report."""
    runner = doctest.DocTestRunner()
    report: list[str] = []
    for test in examples(module):
        runner.run(test, out=report.append)
    return runner.summarize(verbose=False), "".join(report)


# Modules that import vLLM itself: they load only in .venv-vllm (``make test-vllm`` imports
# and exercises them there). Any other module that fails to import fails this file.
NEEDS_VLLM = {"kvdefrag.vllm.scheduler"}


def importable(name: str) -> bool:
    """True when the module imports here; False only for the modules that need vLLM."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if name in NEEDS_VLLM and (err.name or "").split(".")[0] == "vllm":
            return False
        raise
    return True


MODULES = [name for name in module_names() if importable(name)]
WITH_EXAMPLES = [name for name in MODULES if examples(importlib.import_module(name))]


def test_only_the_vllm_bound_modules_are_left_out() -> None:
    assert set(module_names()) - set(MODULES) <= NEEDS_VLLM


@pytest.mark.parametrize("module_name", WITH_EXAMPLES)
def test_docstring_examples_run(module_name: str) -> None:
    results, report = run_examples(importlib.import_module(module_name))

    assert results.failed == 0, report
    assert results.attempted > 0 or module_name not in KNOWN


def test_the_search_covers_every_package_and_finds_the_known_examples() -> None:
    for package_name in PACKAGES:
        assert [name for name in MODULES if name.startswith(f"{package_name}.")], package_name
    assert {"kvdefrag.server._engine", "kvdefrag.server.__main__"} <= set(MODULES)
    assert set(WITH_EXAMPLES) >= KNOWN


def test_a_wrong_example_fails() -> None:
    """The runner above would pass vacuously if a wrong example did not count as failed."""
    module = types.ModuleType("wrong_example", "Example:\n    >>> 1 + 1\n    3\n")

    results, report = run_examples(module)

    assert (results.failed, results.attempted) == (1, 1)
    assert "Expected:\n    3\nGot:\n    2" in report
