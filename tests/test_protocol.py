"""The store protocol is the only door between the engine glue and the store.

``kvstrata.store.protocol.StoreProtocol`` is the contract. These tests fail when an adapter
imports any other part of kvstrata, touches a ``store.<name>`` the contract does not have, or when
``BlockStore`` drifts from the contract."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kvstrata.store import BlockStore
from kvstrata.store.protocol import StoreProtocol

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = sorted((ROOT / "src" / "kvstrata" / "adapters").rglob("*.py"))
# The protocol's modules: the store and its handles, the keys and namespaces it is asked about,
# the config it is built from, and the engine-neutral pieces beside it (metric names and
# collectors, model and adapter identity, the block copy kernels the workers run).
ALLOWED = {"kvstrata.store", "kvstrata.keys", "kvstrata.config", "kvstrata.metrics", "kvstrata.identity",
           "kvstrata.adapter_versions", "kvstrata.worker.copy", "kvstrata.worker.arena"}
MEMBERS = {name for name in dir(StoreProtocol) if not name.startswith("_")}


def kvstrata_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m.split(".")[0] == "kvstrata" and not m.startswith("kvstrata.adapters")}


def test_adapters_import_only_the_protocols_modules():
    found = {f"{path.relative_to(ROOT)}: {module}" for path in ADAPTERS for module in kvstrata_imports(path)
             if module not in ALLOWED}
    assert not found, sorted(found)
    assert any(kvstrata_imports(path) for path in ADAPTERS)  # the walk sees imports at all


def store_uses(path: Path) -> set[str]:
    """The names an adapter reads off a store: ``self.store.X`` and ``store.X``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id == "store") or (
                isinstance(value, ast.Attribute) and value.attr == "store"
                and isinstance(value.value, ast.Name) and value.value.id == "self"):
            out.add(node.attr)
    return out


def test_the_walkers_see_what_they_look_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from kvstrata.tiers.disk import x\nimport kvstrata.index\n"
                     "def f(self, store):\n    self.store.counters.inc('a')\n    store.parts.index\n")
    assert kvstrata_imports(probe) == {"kvstrata.tiers.disk", "kvstrata.index"}
    assert store_uses(probe) == {"counters", "parts"}


def test_adapters_use_only_the_protocols_members():
    used = {name: path.relative_to(ROOT) for path in ADAPTERS for name in store_uses(path)}
    assert len(used) > 15  # the walk sees the adapters' calls
    outside = {f"{path}: store.{name}" for name, path in used.items() if name not in MEMBERS}
    assert not outside, sorted(outside)


def test_blockstore_implements_the_protocol_signature_by_signature():
    assert len(MEMBERS) >= 12
    for name in sorted(MEMBERS):
        want = inspect.getattr_static(StoreProtocol, name)
        have = inspect.getattr_static(BlockStore, name, None)
        assert have is not None, f"BlockStore has no {name}"
        assert isinstance(have, property) == isinstance(want, property), name
        if callable(want):
            params = [(p.name, p.kind) for p in inspect.signature(want).parameters.values()]
            assert params == [(p.name, p.kind) for p in inspect.signature(have).parameters.values()], name
