"""Integrity scan of a disk tier folder: every header parsed, every payload checksummed.

Works on the files alone (no store is opened), so it can run beside live engines. With ``fix``,
bad blocks, dead writers' temp files and tail markers whose block is gone are deleted: exactly
what a reader would have rejected anyway, so fixing never removes a servable block.
"""

from __future__ import annotations

import os
from pathlib import Path

from .blockfmt import HEADER_SIZE, FormatError, payload_checksum, unpack_header
from .tiers.disk import _pid_alive


def _check_file(path: Path) -> str | None:
    data = path.read_bytes()
    try:
        meta = unpack_header(data[:HEADER_SIZE], str(path))
    except FormatError as e:
        return str(e)
    if len(data) != HEADER_SIZE + meta.size:
        return f"size {len(data) - HEADER_SIZE} bytes, header says {meta.size}"
    if path.name != meta.key.hex() + ".kvb":
        return "file name does not match the key in its header"
    if payload_checksum(memoryview(data)[HEADER_SIZE:]) != meta.checksum:
        return "payload checksum mismatch"
    return None


def check_disk(root: Path, fix: bool = False, progress: bool = True) -> dict[str, object]:
    blocks = sorted(p for p in (root / "blocks").glob("*/*") if p.is_file())
    report: dict[str, object] = {"files": 0, "ok": 0, "bad": 0, "temp_leftovers": 0,
                                 "orphan_tail_markers": 0, "problems": []}
    problems: list[str] = []
    iterator = blocks
    if progress:
        from rich.progress import track

        iterator = track(blocks, description="checking blocks", transient=True)  # type: ignore[assignment]
    for path in iterator:
        if path.name.endswith(".tmp"):
            parts = path.name.split(".")
            if len(parts) == 5 and parts[2].isdigit() and not _pid_alive(int(parts[2])):
                report["temp_leftovers"] += 1  # type: ignore[operator]
                if fix:
                    path.unlink(missing_ok=True)
            continue
        report["files"] += 1  # type: ignore[operator]
        problem = _check_file(path)
        if problem is None:
            report["ok"] += 1  # type: ignore[operator]
            continue
        report["bad"] += 1  # type: ignore[operator]
        problems.append(f"{path}: {problem}")
        if fix:
            path.unlink(missing_ok=True)
    report["orphan_tail_markers"] = _orphan_markers(root, fix)
    report["problems"] = problems
    return report


def _orphan_markers(root: Path, fix: bool) -> int:
    """Markers ("a partial block of N tokens follows parent") whose block file is gone."""
    parents: set[tuple[str, int]] = set()
    keys: set[str] = set()
    for path in (root / "blocks").glob("*/*.kvb"):
        try:
            with open(path, "rb") as f:
                meta = unpack_header(f.read(HEADER_SIZE), str(path))
        except (OSError, FormatError):
            continue
        if meta.tail:
            parents.add((meta.parent.hex(), meta.ntok))
            keys.add(meta.key.hex())
    orphans = 0
    for marker in (root / "tails").glob("*/*/*"):
        ntok, _, key = marker.name.partition(".")
        alive = key in keys if key else (marker.parent.name, int(ntok) if ntok.isdigit() else -1) in parents
        if not alive:
            orphans += 1
            if fix:
                marker.unlink(missing_ok=True)
                try:
                    os.rmdir(marker.parent)
                except OSError:
                    pass
    return orphans
