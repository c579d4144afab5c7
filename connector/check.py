"""check.py: ``check_disk``, the integrity scan of a disk tier folder (``kvstrata check``): every
header parsed, every payload checksummed.

Works on the files alone (no store is opened), so it can run beside live engines. It is the
engine's start-up scan (``tiers.scan.scan_folder``) with payload checksums: no symlink is followed
and only regular files are opened. With ``fix``, bad blocks of this format version, dead writers'
temp files and tail markers whose block is gone are deleted: exactly what a reader would have
rejected anyway, so fixing never removes a servable block. Blocks of other format versions,
foreign files, symlinks, FIFOs, sockets and folders are never deleted: they are counted and listed
(``skipped_entries``, the first 100).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from .tiers.disk import DiskTier
from .tiers.scan import BLOCK, DAMAGED, ORPHAN, OTHER_VERSION, SKIPPED, TEMP, Found, scan_folder, scan_tails

LISTED = 100  # skipped entries listed in the report (all are counted)


def check_disk(root: Path, fix: bool = False, progress: bool = True) -> dict[str, object]:
    report: dict[str, object] = {"files": 0, "ok": 0, "bad": 0, "other_versions": 0, "temp_leftovers": 0,
                                 "orphan_tail_markers": 0, "skipped": 0, "problems": [], "skipped_entries": []}
    problems: list[str] = []
    skipped: list[str] = []
    tails: set[str] = set()  # key hex of every servable partial block
    tail_parents: set[tuple[str, int]] = set()  # (parent hex, ntok): markers of older versions name no key
    found: Iterable[Found] = scan_folder(root, fix=fix, stale_temp=DiskTier.temp_is_stale, verify=True)
    if progress:
        from rich.progress import track

        found = track(found, description="checking blocks", transient=True)
    counts = {kind: 0 for kind in (BLOCK, DAMAGED, OTHER_VERSION, TEMP, SKIPPED, ORPHAN)}
    for f in found:
        if f.kind not in counts:
            continue  # a write in progress
        counts[f.kind] += 1
        if f.kind == BLOCK and f.meta is not None and f.meta.tail:
            tails.add(f.meta.key.hex())
            tail_parents.add((f.meta.parent.hex(), f.meta.ntok))
        elif f.kind == DAMAGED:
            problems.append(f"{f.path}: {f.why}")
        elif f.kind == SKIPPED and len(skipped) < LISTED:
            skipped.append(f"{f.path}: {f.why}")

    def is_orphan(parent: str, ntok: int, key: str | None) -> bool:
        return key not in tails if key else (parent, ntok) not in tail_parents

    for f in scan_tails(root, fix=fix, is_orphan=is_orphan):
        if f.kind in counts:
            counts[f.kind] += 1
        if f.kind == SKIPPED and len(skipped) < LISTED:
            skipped.append(f"{f.path}: {f.why}")
    report.update(files=counts[BLOCK] + counts[DAMAGED] + counts[OTHER_VERSION], ok=counts[BLOCK],
                  bad=counts[DAMAGED], other_versions=counts[OTHER_VERSION], temp_leftovers=counts[TEMP],
                  orphan_tail_markers=counts[ORPHAN], skipped=counts[SKIPPED], problems=problems,
                  skipped_entries=skipped)
    return report
