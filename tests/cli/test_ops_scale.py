"""Operations over a large disk tier: ``kvstrata check`` streams the folder in a memory that does
not grow with the number of blocks (every bad block and orphan marker counted, the first 100
listed), ``check --fix`` deletes exactly what a reader would reject, and ``check``/``gc`` show a
progress bar with a total on a terminal (and nothing when stderr is not one), ``gc`` giving the
same result either way.

Folders are built straight in the disk format with sparse payloads (a header, then a hole), so
tens of thousands of blocks take seconds."""

from __future__ import annotations

import json
import os
import pty
import random
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from tests.builders import make_config, make_namespace
from kvstrata.format.block import HEADER, HEADER_SIZE, pack_header, payload_checksum
from kvstrata.cli.check import LISTED
from kvstrata.index import EntryMeta
from kvstrata.store import BlockStore
from kvstrata.tiers.folder import block_name, marker_name

SIZE = 4096  # payload bytes per block on paper (a hole on disk)
CHECKSUM = payload_checksum(bytes(SIZE))
SEED = bytes(range(16))
DEAD_PID = 9_999_999  # above any pid_max: never alive


@dataclass
class Folder:
    """What was planted in a tier folder: the paths ``check --fix`` must delete, and those it
    must keep."""

    root: Path
    doomed: set[Path] = field(default_factory=set)
    kept: set[Path] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "bad": 0, "orphan_tail_markers": 0,
                                                           "temp_leftovers": 0, "other_versions": 0})


def _block(folder: Folder, key: bytes, *, parent: bytes | None = None, ntok: int = 16, epoch: int = 1,
           seed: bytes = SEED, damaged: bool = False, version: int | None = None) -> Path:
    """A sparse block file (``damaged``: one payload byte changed, so its checksum fails)."""
    meta = EntryMeta(key, parent or os.urandom(16), 0, ntok, seed, epoch, SIZE, CHECKSUM, tail=ntok < 16)
    header = pack_header(meta)
    if version is not None:  # another format version (the field after the magic), header checksum redone
        body = header[:4] + struct.pack("<H", version) + header[6:HEADER.size]
        header = body + xxhash.xxh3_64_digest(body)
    h = key.hex()
    path = folder.root / "blocks" / h[:2] / block_name(h)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(HEADER_SIZE + SIZE)
        if damaged:
            f.seek(HEADER_SIZE + SIZE // 2)
            f.write(b"\x01")
    return path


def _marker(folder: Folder, parent: bytes, ntok: int, key: bytes | None) -> Path:
    path = folder.root / "tails" / parent.hex()[:2] / parent.hex() / (marker_name(ntok, key) if key else str(ntok))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def build(root: Path, n: int, seed: int = 0) -> Folder:
    """``n`` good full blocks plus, in proportion to ``n``: 2% damaged blocks, 4% good partial
    blocks with their markers, 1% damaged partial blocks with theirs (orphans), 2% markers of
    missing blocks (orphans); and a few of each other kind: stale temp files, blocks of another
    format version, markers of an older version (no key) kept or orphaned."""
    rng = random.Random(seed)
    key = lambda: rng.randbytes(16)  # noqa: E731
    f = Folder(root)
    for _ in range(n):
        _block(f, key())
    f.counts["ok"] += n
    for _ in range(n // 50):
        f.doomed.add(_block(f, key(), damaged=True))
    f.counts["bad"] += n // 50
    for _ in range(n // 25):
        k, p = key(), key()
        f.kept |= {_block(f, k, parent=p, ntok=7), _marker(f, p, 7, k)}
    f.counts["ok"] += n // 25
    for _ in range(n // 100):
        k, p = key(), key()
        f.doomed |= {_block(f, k, parent=p, ntok=5, damaged=True), _marker(f, p, 5, k)}
    f.counts["bad"] += n // 100
    for _ in range(n // 50):
        f.doomed.add(_marker(f, key(), 3, key()))
    f.counts["orphan_tail_markers"] += n // 100 + n // 50
    full_key, full_parent = key(), key()  # a full block is no tail: its marker is an orphan
    f.kept.add(_block(f, full_key, parent=full_parent))
    f.doomed.add(_marker(f, full_parent, 16, full_key))
    p = key()  # older markers: "<ntok>" under the parent, kept by a servable tail of that length
    f.kept |= {_block(f, key(), parent=p, ntok=9), _marker(f, p, 9, None)}
    f.doomed |= {_marker(f, p, 4, None), _marker(f, key(), 9, None)}
    f.counts["ok"] += 2
    f.counts["orphan_tail_markers"] += 3
    for _ in range(3):
        k = key().hex()
        temp = root / "blocks" / k[:2] / f".{k}.{DEAD_PID}.1.tmp"
        temp.parent.mkdir(parents=True, exist_ok=True)
        temp.write_bytes(b"partial")
        f.doomed.add(temp)
    f.counts["temp_leftovers"] += 3
    for _ in range(2):
        f.kept.add(_block(f, key(), version=99))
    f.counts["other_versions"] += 2
    return f


PEAK = """
import json, sys, tracemalloc
from pathlib import Path
from kvstrata.cli.check import check_disk
tracemalloc.start()
report = check_disk(Path(sys.argv[1]), fix=False, progress=False)
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "report": report}))
"""


def _peak_check(root: Path) -> tuple[int, dict[str, object]]:
    res = subprocess.run([sys.executable, "-c", PEAK, str(root)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    return out["peak"], out["report"]


def test_check_memory_does_not_grow_with_blocks(tmp_path: Path) -> None:
    """Scenario: the same mix of good, damaged and orphaned entries at 10,000 and 50,000 blocks.
    The check's peak Python memory stays flat (a list of problems or a set of tail keys would grow
    5x), and every item is counted while only the first 100 are listed."""
    peaks = {}
    for n in (10_000, 50_000):
        folder = build(tmp_path / str(n), n, seed=n)
        peaks[n], report = _peak_check(folder.root)
        for name, count in folder.counts.items():
            assert report[name] == count, (n, name, report[name], count)
        assert report["files"] == folder.counts["ok"] + folder.counts["bad"] + folder.counts["other_versions"]
        assert report["bad"] > LISTED and len(report["problems"]) == LISTED  # type: ignore[arg-type]
        assert all("checksum" in p for p in report["problems"])  # type: ignore[union-attr]
    assert peaks[50_000] < 1.5 * peaks[10_000] + (64 << 10), peaks


def _tree(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_check_fix_removes_exactly_what_readers_reject(tmp_path: Path) -> None:
    """Scenario: damaged blocks, orphan markers (block missing, damaged, or not partial), older
    keyless markers with and without a partial block of their length, dead writers' temp files
    and blocks of another format version. ``--fix`` deletes the first kinds and nothing else; a
    second check finds nothing more to fix."""
    from kvstrata.cli.check import check_disk

    folder = build(tmp_path / "l2", 2_000)
    before = _tree(folder.root)
    report = check_disk(folder.root, fix=True, progress=False)
    assert {k: report[k] for k in folder.counts} == folder.counts
    after = _tree(folder.root)
    assert before - after == folder.doomed
    assert folder.kept <= after
    again = check_disk(folder.root, fix=True, progress=False)
    assert (again["bad"], again["orphan_tail_markers"], again["temp_leftovers"]) == (0, 0, 0)
    assert again["ok"] == report["ok"] and _tree(folder.root) == after


def _on_terminal(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``kvstrata`` with stderr on a pseudo-terminal: (exit code, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=slave, env=env, text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = proc.communicate(timeout=120)
    reader.join(10)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def _write_config(tmp_path: Path, root: Path) -> Path:
    path = tmp_path / f"{root.parent.name}.yaml"
    path.write_text(f"l1:\n  size: 1MiB\n  pin_memory: false\nl2:\n  path: {json.dumps(str(root))}\n  size: 1GiB\n")
    return path


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200"}


def test_check_shows_a_bar_with_a_total_on_a_terminal_only(tmp_path: Path, env: dict[str, str]) -> None:
    """On a terminal, ``check`` draws shard folders of 256 and blocks checked on stderr; with
    ``--json`` (or stderr not a terminal) nothing but the report is printed."""
    folder = build(tmp_path / "a" / "l2", 3_000)
    cfg = _write_config(tmp_path, folder.root)
    rc, out, term = _on_terminal(["check", "--config", str(cfg)], env)
    assert rc == 1 and f"ok: {folder.counts['ok']}" in out  # bad blocks: exit 1
    assert "checking blocks" in term and "256/256 shard folders" in term
    assert f"{folder.counts['ok'] + folder.counts['bad'] + 2 + 3:,} files" in term  # every entry of blocks/
    assert "checking tail markers" in term
    rc, out, term = _on_terminal(["check", "--config", str(cfg), "--json"], env)
    assert rc == 1 and json.loads(out)["ok"] == folder.counts["ok"] and "shard folders" not in term
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "check", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "shard folders" not in res.stderr


def _gc_folder(root: Path, n: int, stale: int) -> set[Path]:
    """``n`` blocks of a namespace's current epoch and ``stale`` of an older one; returns the
    stale files."""
    ns = make_namespace()
    with BlockStore(make_config(root.parent, **{"l2.size": 1 << 30})) as store:
        epoch = store.current_epoch(ns)
    rng = random.Random(n)
    f = Folder(root)
    for _ in range(n):
        _block(f, rng.randbytes(16), seed=ns.seed, epoch=epoch)
    return {_block(f, rng.randbytes(16), seed=ns.seed, epoch=epoch ^ 1) for _ in range(stale)}


def test_gc_shows_progress_and_removes_the_same(tmp_path: Path, env: dict[str, str]) -> None:
    """Scenario: two identical folders of 20,000 blocks, 500 of an older epoch. ``gc`` on a
    terminal shows the count of the disk tier (256 shard folders, every block) and its own stage;
    with stderr not a terminal it prints nothing there. Both print the same result and leave the
    same blocks: the current epoch's, every one."""
    results = []
    for name, terminal in (("tty", True), ("pipe", False)):
        root = tmp_path / name / "l2"
        stale = _gc_folder(root, 20_000, 500)
        cfg = _write_config(tmp_path, root)
        before = _tree(root / "blocks")
        if terminal:
            rc, out, term = _on_terminal(["gc", "--config", str(cfg)], env)
            assert "counting the disk tier" in term and "256/256 shard folders, 20,500 blocks" in term, term[-2000:]
            assert "gc: dropping older epochs" in term
        else:
            res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "gc", "--config", str(cfg)],
                                 capture_output=True, text=True, timeout=120, env=env)
            rc, out = res.returncode, res.stdout
            assert res.stderr == ""
        assert rc == 0
        assert before - _tree(root / "blocks") == stale
        results.append(json.loads(out))
    assert results[0] == results[1]


def test_stats_shows_the_count_of_the_disk_tier_on_a_terminal(tmp_path: Path, env: dict[str, str]) -> None:
    """``stats`` on a terminal shows the background count of L2 (shard folders of 256, blocks so
    far) on stderr before its tables; with ``--json`` stderr stays empty of it."""
    root = tmp_path / "s" / "l2"
    _gc_folder(root, 20_000, 0)
    cfg = _write_config(tmp_path, root)
    rc, out, term = _on_terminal(["stats", "--config", str(cfg), "--wait", "60"], env)
    assert rc == 0 and "kvstrata tiers" in out
    assert "counting the disk tier" in term and "256/256 shard folders, 20,000 blocks" in term, term[-2000:]
    rc, out, term = _on_terminal(["stats", "--config", str(cfg), "--json", "--wait", "60"], env)
    assert rc == 0 and json.loads(out)["tiers"]["l2"]["blocks"] == 20_000 and "shard folders" not in term
