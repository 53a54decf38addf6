"""The modules of ``rmq_async.consumer`` import each other without a circle.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a reader
following a message from the pull loop to its offset never has to go back up to ``push.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import rmq_async.consumer

PACKAGE = "rmq_async.consumer"


def consumer_import_graph() -> dict[str, set[str]]:
    root = Path(rmq_async.consumer.__file__).parent
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PACKAGE:
                    deps.update(a.name for a in node.names if a.name in modules)
                elif node.module.startswith(PACKAGE + "."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names
                            if a.name.startswith(PACKAGE + "."))
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_circle_among_consumer_modules() -> None:
    graph = consumer_import_graph()
    assert "push" in graph and "sink_service" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_only_the_consumer_facade_imports_push() -> None:
    graph = consumer_import_graph()
    assert [name for name, deps in graph.items() if "push" in deps] == []


def test_the_consumption_services_are_peers() -> None:
    graph = consumer_import_graph()
    services = {"consume", "orderly", "sink_service"}
    for name in services:
        assert not graph[name] & services, f"{name} imports {graph[name] & services}"
    assert not graph["pull"] & services  # the pull loop knows the interface, not the services
