"""docs/architecture.md's module map is the tree: every module is named there, every name there
is a module (or a folder of them), and the modules over 300 lines are exactly those it lists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = {"kvstrata/adapters/": ROOT / "adapters", "kvstrata/": ROOT / "connector"}


def source(name: str) -> Path:
    """The file or folder a ``kvstrata/...`` name of the map stands for."""
    for prefix, folder in PACKAGES.items():
        if name.startswith(prefix):
            return folder / name[len(prefix):]
    raise AssertionError(f"{name} is not under kvstrata/")


def mapped() -> set[Path]:
    """Every path the module table's first column names: `kvstrata/a/b.py`, then names relative
    to its folder (`c.py`, `data/`)."""
    out = set()
    for row in re.findall(r"^\| (`kvstrata/[^|]+) \|", DOC, re.M):
        names = re.findall(r"`([^`]+)`", row)
        first = source(names[0])
        out.add(first)
        out.update(first.parent / n for n in names[1:])
    return out


def modules() -> set[Path]:
    found = set()
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or (path.name == "__init__.py" and path.parent != ROOT / "adapters" / "vllm"
                                               and path.stat().st_size < 1500):
                continue  # an __init__ that only re-exports: its package's row covers it
            found.add(path)
    return found


def test_every_module_is_on_the_map_and_every_name_on_it_exists():
    names = mapped()
    assert len(names) > 40
    missing = [p for p in names if not p.exists()]
    assert not missing, sorted(str(p.relative_to(ROOT)) for p in missing)
    folders = [p for p in names if p.is_dir()]
    unmapped = [p for p in modules() if p not in names and not any(f in p.parents for f in folders)]
    assert not unmapped, sorted(str(p.relative_to(ROOT)) for p in unmapped)


def test_the_modules_over_300_lines_are_the_ones_the_map_lists():
    paragraph = DOC.split("Modules stay under about 300 lines", 1)[1].split("\n\n")[0]
    listed = {n for n in re.findall(r"`([\w/.]+\.py)`", paragraph) if not n.startswith("tests/")}
    long = {str(p.relative_to(ROOT)) for folder in PACKAGES.values() for p in folder.rglob("*.py")
            if len(p.read_text().splitlines()) > 300}
    assert {source(f"kvstrata/{n}" if not n.startswith("kvstrata/") else n).relative_to(ROOT).as_posix()
            for n in listed} == long
    assert all(len((ROOT / p).read_text().splitlines()) <= 400 for p in long if "/bench/" not in p), long
