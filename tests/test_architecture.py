"""The package's import graph keeps the house walkable (issue 18): no import circles, at most five floors.

Read from the source with `ast`, every import counted: those inside functions, so an import made late to dodge
a circle at import time still counts, and those under `if TYPE_CHECKING:`, which never run but send a reader
to the module they name just the same. A lower module that needs a higher one's class in an annotation names a
protocol of what it uses instead (runtime/interface.py: what the runtime's helpers use of the `Runtime`).

A *room* is a subpackage (`runtime/`, `passes/`, ...) or a top-level module (`config.py`, `fit.py`, ...). A room's
*floor* is 1 for a room that imports no other room, else one above the highest room it imports. The package's
`__init__` is the public facade, on no floor: it re-exports names, and nothing in the package imports a name
from it (a submodule is imported through it, `from .. import config`, which is an import of `config`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "dtr_compile"
MAX_FLOORS = 5


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, anywhere in the file (TYPE_CHECKING blocks and functions included)."""
    return (node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom))


def module_graph() -> nx.DiGraph:
    """module -> modules of the package it imports."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from . import config` imports the module config; `from .errors import X` the module errors.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph.add_edges_from((name, target) for target in targets if target in modules and target != name)
    return graph


def room_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def room_graph(modules: nx.DiGraph) -> nx.DiGraph:
    rooms = nx.DiGraph()
    for module in modules:
        if module != PACKAGE.name:
            rooms.add_node(room_of(module))
    for source, target in modules.edges:
        if PACKAGE.name in (source, target):
            continue
        if room_of(source) != room_of(target):
            rooms.add_edge(room_of(source), room_of(target))
    return rooms


def floors(rooms: nx.DiGraph) -> dict[str, int]:
    floor: dict[str, int] = {}
    for room in reversed(list(nx.topological_sort(rooms))):
        floor[room] = 1 + max((floor[below] for below in rooms.successors(room)), default=0)
    return floor


def test_no_import_circles_between_modules() -> None:
    cycles = sorted(sorted(cycle) for cycle in nx.simple_cycles(module_graph()))
    assert not cycles, "import circles (each: modules that import each other round a loop):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles
    )


def test_nothing_imports_a_name_from_the_facade() -> None:
    importers = sorted(source for source, target in module_graph().edges if target == PACKAGE.name)
    assert not importers, f"these modules import from dtr_compile/__init__ itself; import the submodule: {importers}"


def test_at_most_five_floors() -> None:
    rooms = room_graph(module_graph())
    assert nx.is_directed_acyclic_graph(rooms), list(nx.simple_cycles(rooms))
    floor = floors(rooms)
    top = max(floor.values())
    listing = "\n".join(f"{f}: {room}" for room, f in sorted(floor.items(), key=lambda item: (-item[1], item[0])))
    assert top <= MAX_FLOORS, f"{top} floors, at most {MAX_FLOORS}:\n{listing}"


def test_the_checker_sees_a_circle_and_a_tall_house() -> None:
    """The rules above can fail: a made-up graph with a circle and six floors trips both."""
    modules = nx.DiGraph([("p.a", "p.b"), ("p.b", "p.a")])
    assert list(nx.simple_cycles(modules))
    chain = nx.DiGraph([(f"r{i}", f"r{i + 1}") for i in range(5)])
    assert max(floors(chain).values()) == 6


def test_the_checker_counts_an_import_made_only_for_annotations() -> None:
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runtime import Runtime\n")
    assert [node.module for node in _imports(tree)] == ["typing", "runtime"]


def test_the_engine_and_the_ground_floor_stay_low() -> None:
    """The engine imports no room but errors; config, errors and compat import nothing above the ground."""
    rooms = room_graph(module_graph())
    assert set(rooms.successors("dtr_compile.engine")) <= {"dtr_compile.errors"}
    for ground in ("dtr_compile.errors", "dtr_compile.compat"):
        assert not list(rooms.successors(ground)), (ground, list(rooms.successors(ground)))
    assert set(rooms.successors("dtr_compile.config")) <= {"dtr_compile.errors"}


def test_rooms_are_loaded_by_name_only_where_declared() -> None:
    """An import by name (`importlib.import_module`) is invisible to the graph above, so it may stand only where it
    is the point: the facade's lazy submodules, the bench's one declared seam to the rooms it measures
    (bench/upstairs.py: the bench runs the runtime and the backend in its children), and fit's loading of a
    user's `module:function`."""
    allowed = {"dtr_compile/__init__.py", "dtr_compile/bench/upstairs.py", "dtr_compile/fit.py"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "import_module":
                found.add(str(path.relative_to(PACKAGE.parent)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                found.add(str(path.relative_to(PACKAGE.parent)))
    assert found <= allowed, f"imports by name outside the declared places: {sorted(found - allowed)}"
