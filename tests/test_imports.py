"""The package's import structure: every module imports on its own, and no module imports itself through others.

The cycle check reads the source (a small AST walk) and counts every ``import`` of a vlfit module, function-local
ones included: a cycle hidden behind an import inside a function is still a cycle between the two modules. Only
imports under ``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
import sys
import traceback
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "vlfit"


def module_names() -> list[str]:
    names = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it is ``python -m vlfit``, not an import
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, tree: ast.AST, known: set[str]) -> set[str]:
    """The vlfit modules ``module`` imports (resolving ``from package import submodule`` to the submodule)."""
    found: set[str] = set()
    package = module if (SRC / Path(*module.split(".")) / "__init__.py").exists() else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] == PACKAGE:
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    found.add(candidate if candidate in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    known = set(module_names())
    graph = {}
    for name in known:
        path = SRC / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        graph[name] = _imported(name, ast.parse(path.read_text(encoding="utf-8")), known)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    tree = ast.parse("import vlfit.x\nif TYPE_CHECKING:\n    import vlfit.y\ndef f():\n    from vlfit import z\n")
    assert _imported("vlfit.w", tree, {"vlfit.x", "vlfit.y", "vlfit.z"}) == {"vlfit.x", "vlfit.z"}


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    assert len(graph) > 30 and "vlfit.training.trainer" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _vlfit_modules() -> list[str]:
    return [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]


@pytest.mark.slow
def test_every_module_imports_on_its_own() -> None:
    """Each module imported with no vlfit module loaded: a module that only imports when another was imported
    first fails here. Everything is imported once first and only vlfit's modules are dropped before each import,
    so the third-party packages stay loaded and each import runs vlfit's own module code alone."""
    import importlib

    names = module_names()
    for name in names:
        importlib.import_module(name)
    loaded = {m: sys.modules.pop(m) for m in _vlfit_modules()}
    failures = []
    try:
        for name in names:
            for module in _vlfit_modules():
                del sys.modules[module]
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - every failure is reported below
                failures.append((name, traceback.format_exc(limit=3)))
    finally:
        for module in _vlfit_modules():
            del sys.modules[module]
        sys.modules.update(loaded)
    assert not failures, "\n\n".join(f"{name}:\n{trace}" for name, trace in failures)
