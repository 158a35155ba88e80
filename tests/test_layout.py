"""The import graph follows the layout: kernels at the bottom, then runtime and passes, builder on top,
and no import cycle between the project's modules (function-level imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("builder", "passes", "runtime", "kernels")
# What each package may import from the project (besides itself).
ALLOWED = {
    "kernels": set(),
    "runtime": {"kernels"},
    "passes": {"kernels", "runtime"},
    "builder": {"kernels", "runtime", "passes"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(f): f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific project module ``name`` refers to (``a.b.c`` may be attribute c of module a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), ignoring a package's edges to
    its own ``__init__`` (re-exports of a package's API are not layering)."""
    def edges(m: str) -> set[str]:
        return {t for t in graph[m] if not m.startswith(t + ".")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_layers_import_only_downwards():
    wrong = [f"{m} imports {t}" for m, targets in import_graph().items() for t in targets
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not wrong, "imports against the layering: " + "; ".join(sorted(wrong))


def test_no_import_cycles():
    assert not _cycles(import_graph()), f"import cycles: {_cycles(import_graph())}"


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"p.x": {"p"}, "p": {"p.x"}}, []),  # a package re-exporting its module's API
])
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected
