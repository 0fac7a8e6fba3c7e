"""The import graph of our packages (``connectors``, ``trainer``, ``pipeline``) has no
cycles and keeps its direction: ``connectors`` imports no other package of ours,
``trainer`` never imports ``pipeline``, and nothing outside the demo imports
``pipeline.demo``.

The graph is read from the source with :mod:`ast`, so it sees every import: at module
level and inside functions (a lazy import still ties two modules together). Imports
under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import REPO

PACKAGES = ("connectors", "trainer", "pipeline")

# Cycles tolerated for now; each entry is one strongly connected set of modules.
KNOWN_CYCLES: list[frozenset[str]] = []  # none: every circle is cut


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its body, outside ``if TYPE_CHECKING:``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import module` imports the module, else the names' module
                full = f"{source}.{alias.name}"
                found.add(full if full in modules else source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules of ours it imports}`` over every ``.py`` file of the three packages."""
    paths = {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    modules = set(paths)
    return {name: _imports(name, path, modules) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_lazy_imports_and_skips_type_only_ones(graph: dict[str, set[str]]) -> None:
    # pipeline.service imports the ops API inside run_service; the API types the service through a Protocol
    assert "pipeline.api" in graph["pipeline.service"]
    assert "pipeline.service" not in graph["pipeline.api"]
    assert "pipeline.ops_service" not in graph["pipeline.api"]  # imported under TYPE_CHECKING only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    found = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_lower_packages_never_import_higher_ones(graph: dict[str, set[str]]) -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if (module.startswith("connectors") and not target.startswith("connectors"))
        or (module.startswith("trainer") and target.startswith("pipeline"))
    )
    assert not wrong, "connectors imports only connectors; trainer never imports pipeline: " + ", ".join(wrong)


def test_nothing_in_the_library_imports_the_demo(graph: dict[str, set[str]]) -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if (target == "pipeline.demo" or target.startswith("pipeline.demo.")) and not module.startswith("pipeline.demo")
    )
    assert not wrong, "the demo may import the library, never the other way: " + ", ".join(wrong)
