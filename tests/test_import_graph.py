"""The import graph of our packages (``connectors``, ``trainer``, ``pipeline``) is what
``docs/architecture.md`` says it is, with no exemptions:

- no module imports itself back through others (no cycle of modules);
- no room imports itself back (a *room* is a subpackage such as ``trainer.rollout`` or
  ``pipeline.serving``, or a module at a package's top such as ``trainer.config``);
- every import goes down the layer table of the architecture page's "Layers" block
  (a room imports only rooms of lower layers), and the rooms it names "imported only by"
  are imported by nobody else.

The graph is read from the source with :mod:`ast`, so it sees every import: at module level,
inside functions (a lazy import still ties two modules together) and under
``if TYPE_CHECKING:`` (an annotation is a dependency of the reader too).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import REPO

PACKAGES = ("connectors", "trainer", "pipeline")
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its body (``TYPE_CHECKING`` blocks included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
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
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules of ours it imports}`` over every ``.py`` file of the three packages."""
    paths = {_module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    modules = set(paths)
    return {name: _imports(name, path, modules) for name, path in paths.items()}


def room(module: str) -> str:
    """``trainer.rollout.vllm`` -> ``trainer.rollout``; ``trainer.config`` -> itself; ``trainer`` -> itself."""
    return ".".join(module.split(".")[:2])


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of rooms: an arrow where some module of one room imports a module of another."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))
    return rooms


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of more than one node (Tarjan, iterative)."""
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def stated_layers(text: str) -> tuple[dict[str, int], dict[str, set[str]]]:
    """The architecture page's "Layers" block: ``{room: layer}`` and ``{room: the only rooms that may import it}``.

    Block lines: ``<layer number>  <room> <room> ...`` and ``<room>  is imported only by  <room> ... | nothing``.
    """
    match = re.search(r"^### Layers\n.*?```text\n(.*?)```", text, flags=re.S | re.M)
    assert match, "docs/architecture.md has no '### Layers' section with a ```text block"
    layers: dict[str, int] = {}
    only: dict[str, set[str]] = {}
    for line in match.group(1).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if "imported only by" in line:
            target, _, importers = line.partition("is imported only by")
            only[target.strip()] = set() if importers.split() == ["nothing"] else set(importers.split())
        else:
            assert words[0].isdigit(), f"a layer line starts with its number: {line!r}"
            for name in words[1:]:
                assert name not in layers, f"room {name} is in two layers"
                layers[name] = int(words[0])
    return layers, only


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.fixture(scope="module")
def layers() -> tuple[dict[str, int], dict[str, set[str]]]:
    return stated_layers(ARCHITECTURE.read_text())


def test_the_graph_sees_lazy_and_type_only_imports(graph: dict[str, set[str]]) -> None:
    assert "pipeline.api" in graph["pipeline.service"]  # imported inside run_service
    assert "pipeline.ops_service" in graph["pipeline.api"]  # imported under TYPE_CHECKING only
    assert "pipeline.service" not in graph["pipeline.api"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
    assert room("trainer.rollout.vllm") == "trainer.rollout" and room("trainer.config") == "trainer.config"


def test_no_module_cycles(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_no_room_cycles(graph: dict[str, set[str]]) -> None:
    found = cycles(room_graph(graph))
    assert not found, "rooms importing each other: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_every_room_has_its_layer_on_the_architecture_page(graph: dict[str, set[str]], layers) -> None:
    stated, only = layers
    rooms = set(room_graph(graph))
    assert not rooms - set(stated), f"rooms missing from the Layers block: {sorted(rooms - set(stated))}"
    assert not set(stated) - rooms, f"the Layers block names rooms that do not exist: {sorted(set(stated) - rooms)}"
    assert set(only) <= rooms


def test_imports_go_down_the_stated_layers(graph: dict[str, set[str]], layers) -> None:
    stated, _ = layers
    wrong = sorted(
        f"{module} (layer {stated[room(module)]}) -> {target} (layer {stated[room(target)]})"
        for module, targets in graph.items()
        for target in targets
        if room(target) != room(module) and stated[room(target)] >= stated[room(module)]
    )
    assert not wrong, "imports up or across the layers of docs/architecture.md: " + ", ".join(wrong)


def test_rooms_imported_only_by_whom_the_page_says(graph: dict[str, set[str]], layers) -> None:
    _, only = layers
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if room(target) in only and room(module) != room(target) and room(module) not in only[room(target)]
    )
    assert not wrong, "imports the architecture page rules out: " + ", ".join(wrong)


def test_a_planted_upward_import_fails_the_layer_check(graph: dict[str, set[str]], layers) -> None:
    """The checks can fail: a connectors module importing the trainer, or a rounds module importing the
    service, is caught."""
    stated, only = layers
    planted = {**graph, "connectors.buffer": graph["connectors.buffer"] | {"trainer.config"}}
    assert stated[room("trainer.config")] >= stated[room("connectors.buffer")]
    assert any(stated[room(t)] >= stated[room(m)] for m, ts in planted.items() for t in ts if room(t) != room(m))
    assert "pipeline.rounds" not in only["pipeline.service"]


ROUND = REPO / "trainer" / "round.py"
ROUND_FILES = 10
"""A reader follows one round through at most this many files: ``trainer/round.py`` and the modules whose
functions and records it calls (its ``TYPE_CHECKING`` imports are the components' types, not steps)."""


def _runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules ``path`` imports outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
    return {m for m in found if m in modules}


def test_a_round_reads_through_at_most_ten_files(graph: dict[str, set[str]]) -> None:
    steps = _runtime_imports(ROUND, set(graph))
    assert len(steps) + 1 <= ROUND_FILES, f"trainer/round.py calls into {len(steps)} modules: {sorted(steps)}"
    # no jump back: nothing the round calls imports the round
    assert not [m for m in steps if "trainer.round" in graph[m]]


def test_the_round_file_count_sees_a_planted_import(graph: dict[str, set[str]], tmp_path: Path) -> None:
    planted = tmp_path / "round.py"
    planted.write_text(ROUND.read_text() + "\nfrom trainer import errors\nfrom connectors import atomic\n")
    before, after = _runtime_imports(ROUND, set(graph)), _runtime_imports(planted, set(graph))
    assert after - before == {"trainer.errors", "connectors.atomic"}
