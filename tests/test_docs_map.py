"""docs/architecture.md's module map is the tree: every module is named there, every name there
is a module (or a folder of them), and the modules over 300 lines are exactly those it lists.

The map names modules as they are imported or run: ``kvstrata/...`` is ``src/kvstrata/...``,
``benchmarks/...`` and ``tests/harness/...`` are the folders of that name at the repository root."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = {"kvstrata/": ROOT / "src" / "kvstrata", "benchmarks/": ROOT / "benchmarks",
            "tests/harness/": ROOT / "tests" / "harness"}


def source(name: str) -> Path:
    """The file or folder a name of the map stands for."""
    for prefix, folder in PACKAGES.items():
        if name.startswith(prefix):
            return folder / name[len(prefix):]
    raise AssertionError(f"{name} is not under {', '.join(PACKAGES)}")


def mapped() -> set[Path]:
    """Every path the module table's first column names: `kvstrata/a/b.py` (or `benchmarks/...`,
    `tests/harness/...`), then names relative to its folder (`c.py`, `data/`)."""
    out = set()
    prefixes = "|".join(re.escape(p) for p in PACKAGES)
    for row in re.findall(rf"^\| (`(?:{prefixes})[^|]+) \|", DOC, re.M):
        names = re.findall(r"`([^`]+)`", row)
        first = source(names[0])
        out.add(first)
        out.update(first.parent / n for n in names[1:])
    return out


def modules() -> set[Path]:
    found = set()
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or (path.name == "__init__.py" and path.stat().st_size < 1500):
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
    """The paragraph names them relative to `kvstrata/` (`tiers/disk.py`), or from the root for the
    other folders (`benchmarks/ttft.py`)."""
    paragraph = DOC.split("Modules stay under about 300 lines", 1)[1].split("\n\n")[0]
    listed = {n for n in re.findall(r"`([\w/.]+\.py)`", paragraph)
              if not n.startswith("tests/") or n.startswith("tests/harness/")}  # not the tests it names
    named = {source(n if n.startswith(tuple(PACKAGES)) else f"kvstrata/{n}") for n in listed}
    long = {p for folder in PACKAGES.values() for p in folder.rglob("*.py")
            if len(p.read_text().splitlines()) > 300}
    assert named == long, (sorted(str(p.relative_to(ROOT)) for p in named - long),
                           sorted(str(p.relative_to(ROOT)) for p in long - named))
    over = [p for p in long if PACKAGES["benchmarks/"] not in p.parents and len(p.read_text().splitlines()) > 400]
    assert not over, sorted(str(p.relative_to(ROOT)) for p in over)
