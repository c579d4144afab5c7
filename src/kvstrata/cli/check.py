"""cli/check.py: ``check_disk``, the integrity scan of a disk tier folder (``kvstrata check``): every
header parsed, every payload checksummed.

Works on the files alone (no store is opened), so it can run beside live engines. It is the
engine's start-up scan (``tiers.scan``) with payload checksums: no symlink is followed and only
regular files are opened. With ``fix``, bad blocks of this format version, dead writers' temp
files and tail markers whose block is gone are deleted: exactly what a reader would have rejected
anyway, so fixing never removes a servable block. Blocks of other format versions, foreign files,
symlinks, FIFOs, sockets and folders are never deleted: they are counted and listed
(``skipped_entries``, the first 100).

Memory does not grow with the tier: folders are streamed one entry at a time, every kind of entry
is counted but only the first 100 bad blocks (``problems``) and skipped entries are listed, and no
set of blocks is kept. A tail marker (``tails/ab/<parent>/<ntok>.<key>``) names its block, whose
file lies in another shard (``blocks/<key[:2]>/``): its block is examined again by name
(``examine_block``), so a marker is an orphan exactly when the block scan did not find that block
servable and partial. Markers of older versions name no key (``<ntok>``): they are listed first,
and the block scan notes which of them a servable partial block of that parent and length keeps;
memory for them grows with their number only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from kvstrata.cli.progress import ShardBar, shard_bar
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.scan import (BLOCK, DAMAGED, ORPHAN, OTHER_VERSION, SKIPPED, TEMP, Found, Tally, examine_block,
                         scan_shards, scan_tails, stream_entries)

LISTED = 100  # bad blocks and skipped entries listed in the report (all are counted)
_DRAW_EVERY = 256  # blocks between progress updates


class _Tally(Tally):
    """The scan's counts of each kind of entry, and the first ``LISTED`` problems and skipped entries."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self.skipped: list[str] = []

    def add(self, f: Found) -> None:
        super().add(f)
        listed = self.problems if f.kind == DAMAGED else self.skipped if f.kind == SKIPPED else None
        if listed is not None and len(listed) < LISTED:
            listed.append(f"{f.path}: {f.why}")

    def report(self) -> dict[str, object]:
        c = self.counts
        return {"files": c[BLOCK] + c[DAMAGED] + c[OTHER_VERSION], "ok": c[BLOCK], "bad": c[DAMAGED],
                "other_versions": c[OTHER_VERSION], "temp_leftovers": c[TEMP], "orphan_tail_markers": c[ORPHAN],
                "skipped": c[SKIPPED], "problems": self.problems, "skipped_entries": self.skipped}


def check_disk(root: Path, fix: bool = False, progress: bool = True) -> dict[str, object]:
    """Check (and with ``fix`` clean) the disk tier folder ``root``; the report: counts of each
    kind of entry, the first ``LISTED`` bad blocks (``problems``) and skipped entries. With
    ``progress``, a bar on stderr when it is a terminal."""
    tally = _Tally()
    legacy = _keyless_markers(root)  # (parent hex, ntok) of markers that name no key
    kept: set[tuple[str, int]] = set()  # those of them a servable partial block keeps
    with shard_bar(progress) as bar:
        bar.stage("checking blocks")
        _check_blocks(root, fix, tally, legacy, kept, bar)
        bar.stage("checking tail markers")

        def is_orphan(parent: str, ntok: int, key: str | None) -> bool:
            if key is None:
                return (parent, ntok) not in kept
            found = examine_block(root, key, verify=True)
            return found is None or found.kind != BLOCK or found.meta is None or not found.meta.tail

        shards = markers = 0

        def entered(_shard: str) -> None:
            nonlocal shards
            bar.update(shards, markers, "markers")
            shards += 1

        for f in scan_tails(root, fix=fix, is_orphan=is_orphan, on_shard=entered):
            tally.add(f)
            markers += 1
        bar.update(shards, markers, "markers")
    return tally.report()


def _check_blocks(root: Path, fix: bool, tally: _Tally, legacy: set[tuple[str, int]],
                  kept: set[tuple[str, int]], bar: ShardBar) -> None:
    """Every entry of ``root/blocks``, payloads checksummed, one shard folder at a time (the bar
    counts every file there: blocks, temp files, foreign files)."""
    shards = blocks = 0

    def lister(shard: str, dir_fd: int) -> Iterator[os.DirEntry]:
        nonlocal shards
        shards += 1
        return stream_entries(shard, dir_fd)

    for found in scan_shards(root, fix=fix, stale_temp=DiskTier.temp_is_stale, lister=lister, verify=True):
        for f in found:
            tally.add(f)
            if f.kind == BLOCK and f.meta is not None and f.meta.tail and legacy:
                if (pair := (f.meta.parent.hex(), f.meta.ntok)) in legacy:
                    kept.add(pair)
            blocks += 1
            if blocks % _DRAW_EVERY == 0:
                bar.update(shards - 1, blocks, "files")
        bar.update(shards, blocks, "files")


def _keyless_markers(root: Path) -> set[tuple[str, int]]:
    """``(parent hex, ntok)`` of every tail marker that names no key (older versions wrote
    ``<ntok>``): a listing of ``root/tails``, nothing opened or deleted."""
    found: set[tuple[str, int]] = set()

    def note(parent: str, ntok: int, key: str | None) -> bool:
        if key is None:
            found.add((parent, ntok))
        return False

    for _ in scan_tails(root, fix=False, is_orphan=note):
        pass
    return found
