"""No import cycles in kvstrata (src/kvstrata), the benchmarks (benchmarks/) and the test harness
(tests/harness), and the shipped package imports nothing that is not shipped.

The graph is read from the source (ast), not from a run: every ``import`` and ``from ... import``
anywhere in a module counts, at module level, inside functions and under ``if TYPE_CHECKING:``
alike. A cycle of imports inside functions does not fail at import time, but two modules that
need each other are one module in two files (or a missing third one), and such a cycle becomes an
import-time failure as soon as one of the imports moves to the top.

Each import is an edge to the module it names: ``import a.b.c`` and ``from a.b.c import x`` to
``a.b.c``; ``from a.b import c`` to the submodule ``a.b.c`` when there is one, else to ``a.b``
(its ``__init__``, where the name ``c`` comes from). Package ``__init__`` modules: importing
``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__`` first, but that implicit step is not an
edge. Python puts a package into ``sys.modules`` with its ``__path__`` before its ``__init__``
runs, so a submodule can be imported while its package's ``__init__`` is still running (the
``__init__`` that re-exports its submodules' names is the usual, working case). What fails is
taking a *name* from an ``__init__`` that has not run yet, and that is an edge: a submodule that
does ``from a.b import Name`` (or ``import a.b``) while ``a/b/__init__`` imports that submodule is
a cycle here, and a real one at import time.

Imports by string (``importlib.import_module``: the command line's tool table) are not read.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder holding the top-level package -> the top-level package's folder
TREES = {ROOT / "src": ROOT / "src" / "kvstrata", ROOT: ROOT / "benchmarks"}
HARNESS = ROOT / "tests" / "harness"
NOT_SHIPPED = ("benchmarks", "tests", "examples")


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the trees."""
    found: dict[str, Path] = {}
    for base, top in [*TREES.items(), (ROOT, HARNESS)]:
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module named, line) for every import in the module ``name``: to a module of ``known`` where
    it is one, else the name as written (a module outside the trees)."""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, node.lineno))
    return out


def _graph() -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The modules, and for each the modules of the trees it imports (-> the first line doing so)."""
    modules = _modules()
    known = set(modules)
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for name, path in modules.items():
        for target, line in _imports(name, path, known):
            if target in known and target != name:
                edges[name].setdefault(target, line)
    return modules, edges


def _cycles(nodes: list[str], edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the longest import chain, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
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
                found.append(sorted(component))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def _loop(component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One shortest cycle through the component's first module (breadth first)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in edges.get(v, {}):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def _describe(loop: list[str], modules: dict[str, Path], edges: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} ({modules[a].relative_to(ROOT)}:{edges[a][b]}) imports {b}" for a, b in zip(loop, loop[1:])]
    return "\n    ".join(steps)


def test_no_import_cycles() -> None:
    modules, edges = _graph()
    assert len(modules) > 100 and edges, "the trees were not found"
    cycles = _cycles(list(modules), edges)
    report = [f"{' <-> '.join(c)}:\n    {_describe(_loop(c, edges), modules, edges)}" for c in cycles]
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(report)


def test_package_imports_nothing_unshipped() -> None:
    """The wheel holds kvstrata alone: none of its modules may import the benchmarks, the tests
    or the examples (anywhere, not only at module level: scripts/check_wheel.sh runs the imports
    at module level only)."""
    modules = _modules()
    known = set(modules)
    found = [f"{path.relative_to(ROOT)}:{line} imports {target}"
             for name, path in modules.items() if name.split(".")[0] == "kvstrata"
             for target, line in _imports(name, path, known) if target.split(".")[0] in NOT_SHIPPED]
    assert not found, "\n".join(found)


def test_cycles_are_found() -> None:
    """The finder itself, on a made-up graph: two cycles, one of three modules, and a chain."""
    edges = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {"e": 1}, "e": {"d": 1}, "f": {"a": 1}}
    assert _cycles(list("abcdef"), edges) == [["d", "e"], ["a", "b", "c"]]
    assert _loop(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
