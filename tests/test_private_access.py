"""No module of the adapters reads another object's private members.

A ``_name`` is its class's own: read as ``self._name`` or ``cls._name`` only. This test fails when a
module under ``src/kvstrata/adapters`` reads ``other._name`` (or ``getattr(other, "_name")``), or
imports a ``_name`` from another module: the state a class keeps is used through its public methods
(the vLLM scheduler side's ops, for one, through ``pending.Ops``).

The exceptions, each listed below with why: the public API of named tuples, whose names start with an
underscore so as not to clash with field names, and the engines' and torch's private members that
the adapters have to read, there being no public way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = sorted((ROOT / "src" / "kvstrata" / "adapters").rglob("*.py"))

# Named tuples' public methods (``Hit._replace``, ``Figures._asdict``).
NAMEDTUPLE_API = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}

# path relative to src/kvstrata/adapters -> the private members it reads there, as written
ALLOWED = {
    # vLLM has no public way to ask whether a connector name is registered; ``register`` reads
    # ``KVConnectorFactory._registry`` so that a second call does not raise.
    "vllm/__init__.py": {"KVConnectorFactory._registry"},
    # The CPU features vLLM's CPU attention kernels choose by, part of the namespace: torch tests
    # them only privately (``torch.backends.cpu.get_cpu_capability`` names the highest ISA alone).
    "vllm/namespace.py": {"torch.cpu._is_amx_tile_supported", "torch.cpu._is_avx512_supported"},
    # How vLLM's CPU attention packs a block (its ISA, the kernel that writes the cache) decides which
    # values of a block are which token's; vLLM chooses it with a private function only. Verified
    # hits read a tail's tokens off that kernel (``tails.py``).
    "vllm/tails.py": {"vllm.v1.attention.backends.cpu_attn._get_attn_isa"},
    # SGLang keeps the metric classes a stat logger was configured with (Ray's) on private class
    # attributes of its collector; read with getattr so that another SGLang version falls back.
    "sglang/metrics.py": {"collector._counter_cls", "collector._gauge_cls", "collector._histogram_cls"},
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Reads(ast.NodeVisitor):
    """See ``private_reads``. ``own``: the first parameter (``self``/``cls``) of each method the
    walk is in (a closure or lambda in a method reads its method's ``self``)."""

    def __init__(self) -> None:
        self.own: list[str | None] = []
        self.in_class = [False]  # whether the walk is directly in a class body
        self.found: set[str] = set()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.in_class.append(True)
        self.generic_visit(node)
        self.in_class.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = [*node.args.posonlyargs, *node.args.args]
        method = self.in_class[-1] and args and args[0].arg in ("self", "cls")
        self.own.append(args[0].arg if method else None)
        self.in_class.append(False)
        self.generic_visit(node)
        self.in_class.pop()
        self.own.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def owned(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self.own

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if private(node.attr) and node.attr not in NAMEDTUPLE_API and not self.owned(node.value):
            self.found.add(ast.unparse(node))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and private(node.args[1].value)
                and not self.owned(node.args[0])):
            self.found.add(f"{ast.unparse(node.args[0])}.{node.args[1].value}")
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.update(f"{node.module}.{a.name}" for a in node.names if private(a.name))


def private_reads(source: str) -> set[str]:
    """Every private member read of an object other than the enclosing method's ``self``/``cls``
    (``obj._x``, ``getattr(obj, "_x")``) and every private name imported, as written."""
    walk = _Reads()
    walk.visit(ast.parse(source))
    return walk.found


def test_the_walk_sees_what_it_looks_for():
    found = private_reads("from m import _helper, public\n"
                          "class A:\n"
                          "    def f(self, other):\n"
                          "        self._mine, other.__dict__, hit._replace(lease=None)\n"
                          "        other._theirs.x\n"
                          "        getattr(other, '_hidden', None), getattr(self, '_own'), getattr(other, 'shown')\n"
                          "        return lambda: self._in_a_closure\n"
                          "    @classmethod\n"
                          "    def g(cls):\n"
                          "        return cls._also\n"
                          "def h(cls, self):\n"
                          "    return cls._not_a_method, self._nor_this\n")
    assert found == {"m._helper", "other._theirs", "other._hidden", "cls._not_a_method", "self._nor_this"}


def test_no_adapter_module_reads_another_objects_private_members():
    seen, unused = {}, {}
    for path in ADAPTERS:
        rel = path.relative_to(ROOT / "src" / "kvstrata" / "adapters").as_posix()
        reads = private_reads(path.read_text())
        allowed = ALLOWED.get(rel, set())
        if reads - allowed:
            seen[rel] = sorted(reads - allowed)
        if allowed - reads:
            unused[rel] = sorted(allowed - reads)
    assert not seen, seen
    assert not unused, f"exceptions no longer needed, remove them from ALLOWED: {unused}"
