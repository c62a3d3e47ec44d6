"""The house drawn from the source: which module imports which.

Every ``kvdefrag`` module's imports are read with ``ast`` (nothing is imported), and the
graph must have no loop, and no arrow that runs back up the layers::

    kvdefrag.common, kvdefrag.v1   <-   kvdefrag.client, kvdefrag.server
                                   <-   kvdefrag.vllm, kvdefrag.tools

Inside ``kvdefrag.vllm`` the scheduler side (in vLLM's engine-core process) and the worker
side (in each rank's process) share only a few modules, and the scheduler side reaches
nothing of the worker side or of the server.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("client/src", "server/src", "integrations/vllm/src", "tools/src")

# Which packages each package may import (besides itself).
ALLOWED = {
    "kvdefrag.v1": set(),
    "kvdefrag.common": {"kvdefrag.v1"},
    "kvdefrag.client": {"kvdefrag.common", "kvdefrag.v1"},
    "kvdefrag.server": {"kvdefrag.common", "kvdefrag.v1"},
    "kvdefrag.vllm": {"kvdefrag.common", "kvdefrag.v1", "kvdefrag.client", "kvdefrag.server"},
    "kvdefrag.tools": {"kvdefrag.common", "kvdefrag.v1", "kvdefrag.client", "kvdefrag.server"},
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for source in SOURCES:
        base = ROOT / source
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The kvdefrag modules ``name`` imports: ``from pkg import sub`` names ``pkg.sub``
    when that is a module, ``pkg`` otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in modules else module)
    return {module for module in found if module in modules and module != name}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    assert len(modules) > 50, sorted(modules)  # the sources were found
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_arrow_runs_down_the_layers(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        if _package(dep) != _package(name) and _package(dep) not in ALLOWED[_package(name)]
    )
    assert not upward


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first walk meets (each as the modules along it)."""
    loops: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                loops.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, path)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return loops


def test_no_module_imports_itself_through_others(graph: dict[str, set[str]]) -> None:
    assert not _loops(graph)


def test_the_leaves_of_the_server_import_nothing_of_it(graph: dict[str, set[str]]) -> None:
    assert {dep for dep in graph["kvdefrag.server._moves"] if dep.startswith("kvdefrag.")} == set()
    assert graph["kvdefrag.server._move_log"] == {"kvdefrag.server._moves"}


# The vLLM integration's rooms: each side's modules, and what both share.
SCHEDULER_SIDE = ("kvdefrag.vllm.scheduler", "kvdefrag.vllm._scheduler")
WORKER_SIDE = ("kvdefrag.vllm.worker", "kvdefrag.vllm._worker")
SHARED = (
    "kvdefrag.vllm.config",
    "kvdefrag.vllm.contract",
    "kvdefrag.vllm.errors",
    "kvdefrag.vllm.output_blocks",
    "kvdefrag.vllm.refusals",
    "kvdefrag.vllm._discovery",
    "kvdefrag.vllm._run_dir",
)


def _in(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(f"{room}.") for room in rooms)


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_vllm_integrations_rooms_cover_it(graph: dict[str, set[str]]) -> None:
    vllm_modules = {name for name in graph if name.startswith("kvdefrag.vllm.")}
    rooms = SCHEDULER_SIDE + WORKER_SIDE + SHARED + ("kvdefrag.vllm.gaudi",)
    assert {name for name in vllm_modules if not _in(name, rooms)} == set()


def test_the_scheduler_side_reaches_neither_the_worker_side_nor_the_server(
    graph: dict[str, set[str]],
) -> None:
    for name in (name for name in graph if _in(name, SCHEDULER_SIDE)):
        reached = _reached(graph, name)
        assert not {dep for dep in reached if _in(dep, WORKER_SIDE)}, name
        assert not {dep for dep in reached if dep.startswith("kvdefrag.server")}, name


def test_what_both_sides_share_reaches_neither_side_nor_the_server(
    graph: dict[str, set[str]],
) -> None:
    for name in (name for name in graph if _in(name, SHARED)):
        reached = _reached(graph, name)
        assert not {dep for dep in reached if _in(dep, SCHEDULER_SIDE + WORKER_SIDE)}, name
        assert not {dep for dep in reached if dep.startswith("kvdefrag.server")}, name


def test_the_worker_side_reaches_nothing_of_the_scheduler_side(
    graph: dict[str, set[str]],
) -> None:
    for name in (name for name in graph if _in(name, WORKER_SIDE)):
        assert not {dep for dep in _reached(graph, name) if _in(dep, SCHEDULER_SIDE)}, name


def test_the_drawing_sees_an_upward_arrow_and_a_loop(tmp_path: pathlib.Path) -> None:
    """The checks themselves: an upward import is read as one, a loop is found."""
    modules = {"kvdefrag.server._x": tmp_path, "kvdefrag.vllm.worker": tmp_path}
    path = tmp_path / "_x.py"
    path.write_text("from kvdefrag.vllm import worker\n")
    assert _imports("kvdefrag.server._x", path, modules) == {"kvdefrag.vllm.worker"}
    assert "kvdefrag.vllm" not in ALLOWED[_package("kvdefrag.server._x")]
    assert _loops({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
