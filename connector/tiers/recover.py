"""tiers/recover.py: ``recover_shards``, the background recovery scan of a disk tier's folder:
``scan.scan_shards`` (the one folder scan, trusting nothing, deleting dead writers' temp files and
damaged blocks) with each shard's bytes counted into the tier's ledger as it is listed.

The store's ``Recovery`` thread (``store/recovery.py``) drives it and commits what it yields.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Iterator

from .disk import DiskTier
from .folder import parse_block_entry
from .scan import BLOCK, DAMAGED, OTHER_VERSION, SKIPPED, Found, scan_shards


def recover_shards(tier: DiskTier) -> Iterator[tuple[int, list[Found]]]:
    """``(shard, its servable blocks)`` for each shard folder of ``tier`` (shard -1: an entry
    outside the shard folders). The caller commits a shard's blocks under
    ``ledger.shard_locks[shard]``, leaving out ``ledger.gone`` (blocks this process deleted since
    the listing), then calls ``ledger.shard_done``. After the last shard the ledger is exact, and
    what was found besides blocks is counted and logged (``DiskTier.report_scan``)."""
    counts: Counter[str] = Counter()
    first: dict[str, Found] = {}
    current = [-1]

    def lister(shard: str, dir_fd: int) -> list[os.DirEntry]:
        current[0] = int(shard, 16)
        return _list_counted(tier, shard, dir_fd)

    for found in scan_shards(tier.root, fix=True, stale_temp=tier.temp_is_stale, lister=lister):
        blocks, odd = [], 0
        for f in found:
            counts[f.kind] += 1
            counts["removed_" + f.kind] += f.removed
            if f.kind == BLOCK:
                blocks.append(f)
            else:
                first.setdefault(f.kind, f)
                odd += f.size if f.kind in (DAMAGED, OTHER_VERSION, SKIPPED) else 0
        tier.ledger.not_blocks(odd)
        yield current[0], blocks
        current[0] = -1
    tier.ledger.counted_all()
    tier.report_scan(counts, first)


def _list_counted(tier: DiskTier, shard: str, dir_fd: int) -> list[os.DirEntry]:
    """List a shard folder and count its block files' bytes in the ledger, under the shard's lock
    (so that no write or delete of this process falls between the two)."""
    i = int(shard, 16)
    with tier.ledger.shard_locks[i]:
        with os.scandir(dir_fd) as it:
            entries = list(it)
        nbytes = 0
        for entry in entries:  # the entries ``scan._scan_shard`` examines as blocks
            parsed = parse_block_entry(entry.name)
            if parsed and parsed[1] is None and parsed[0].startswith(shard) and entry.is_file(follow_symlinks=False):
                try:
                    nbytes += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
        tier.ledger.listed(i, nbytes)
    return entries
