"""The store protocol is the only door between the engine glue and the store.

``kvstrata.store.protocol.StoreProtocol`` is the contract. These tests fail when an adapter
imports any other part of kvstrata, touches a ``store.<name>`` the contract does not have, names
``BlockStore`` (adapters open their store with ``open_store``), or when ``BlockStore`` drifts from
the contract (``tests/test_import_cycles.py`` holds the imports to no cycle)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from kvstrata.adapters.figures import FigureCollector
from kvstrata.store import BlockStore
from kvstrata.store.protocol import StoreProtocol

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = sorted((ROOT / "src" / "kvstrata" / "adapters").rglob("*.py"))
# The protocol's modules: the store and its handles, the keys and namespaces it is asked about,
# the config it is built from, and the engine-neutral pieces beside it (metric names and
# export helpers, model and adapter identity, the block copy kernels the workers run).
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


def names_blockstore(path: Path) -> bool:
    """Whether the module names ``BlockStore``: a name, an attribute or an import of it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Name) and node.id == "BlockStore"
                or isinstance(node, ast.Attribute) and node.attr == "BlockStore"
                or isinstance(node, ast.alias) and node.name.split(".")[-1] == "BlockStore"):
            return True
    return False


def test_no_adapter_names_blockstore(tmp_path):
    probe = tmp_path / "probe.py"
    for text in ("from kvstrata.store import BlockStore\n", "import kvstrata.store\nkvstrata.store.BlockStore()\n",
                 "def f():\n    return BlockStore\n"):
        probe.write_text(text)
        assert names_blockstore(probe), text
    probe.write_text("from kvstrata.store import open_store\nBlockStored = 1  # BlockStore\n")
    assert not names_blockstore(probe)
    found = [str(path.relative_to(ROOT)) for path in ADAPTERS if names_blockstore(path)]
    assert not found, found


def test_the_collectors_figures_come_through_the_protocol(store_factory, ns):
    """``figures(last)``: every counter, the samples since the previous call, and the resident
    gauges only when a counter moved since ``last``; ``FigureCollector`` turns them into one
    interval's deltas, samples and (in an interval where a counter moved) gauges."""
    store = store_factory()
    store.wait_recovered(30)
    collector = FigureCollector(store)
    collector.collect()
    before = store.snapshot()
    store.lookup(ns, list(range(3 * ns.block_size)))
    figures = collector.collect()
    assert figures is not None
    assert figures.counters["lookups"] == 1 == store.snapshot()["lookups"] - before.get("lookups", 0)
    assert len(figures.samples["lookup_seconds"]) == 1
    assert figures.gauges == store.resident() and "l1_resident_blocks" in figures.gauges
    assert collector.collect() is None  # nothing moved, no sample
    assert store.figures(store.snapshot()).gauges == {}  # not read: no counter moved
    assert store.figures().gauges == store.resident()
