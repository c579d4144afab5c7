"""tiers/recover.py: ``recover_shards``, the background recovery scan of a disk tier's folder:
``scan.scan_shards`` (the one folder scan, trusting nothing, deleting dead writers' temp files and
damaged blocks) with each shard's bytes counted into the tier's ledger as it is listed.

The store's ``Recovery`` thread (``store/recovery.py``) drives it and commits what it yields.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.folder import parse_block_entry
from kvstrata.tiers.scan import BLOCK, DAMAGED, OTHER_VERSION, SKIPPED, Found, Tally, scan_shards


def recover_shards(tier: DiskTier, pace: Callable[[], None]) -> Iterator[tuple[int, list[Found]]]:
    """``(shard, its servable blocks)`` for each shard folder of ``tier`` (shard -1: an entry
    outside the shard folders); ``pace()`` is called before each entry is examined (the caller
    sleeps there while requests are being served). The caller commits a shard's blocks under
    ``ledger.shard_locks[shard]``, leaving out ``ledger.gone`` (blocks this process deleted since
    the listing), then calls ``ledger.shard_done``. After the last shard the ledger is exact, and
    what was found besides blocks is counted and logged (``DiskTier.report_scan``)."""
    tally = Tally()
    current = [-1]

    def lister(shard: str, dir_fd: int) -> list[os.DirEntry]:
        current[0] = int(shard, 16)
        return _list_counted(tier, shard, dir_fd, pace)

    for found in scan_shards(tier.root, fix=True, stale_temp=tier.temp_is_stale, lister=lister):
        blocks, odd = [], 0
        for f in found:
            pace()
            tally.add(f)
            if f.kind == BLOCK:
                blocks.append(f)
            elif f.kind in (DAMAGED, OTHER_VERSION, SKIPPED):
                odd += f.size
        tier.ledger.not_blocks(odd)
        yield current[0], blocks
        current[0] = -1
    tier.ledger.counted_all()
    tier.report_scan(tally)


def _list_counted(tier: DiskTier, shard: str, dir_fd: int, pace: Callable[[], None]) -> list[os.DirEntry]:
    """List a shard folder under the shard's lock (no write or delete of this process falls
    between the listing and the ledger's note of it), then count its block files' bytes."""
    ledger, lock = tier.ledger, tier.ledger.shard_locks[int(shard, 16)]
    with lock:
        with os.scandir(dir_fd) as it:
            entries = list(it)
        ledger.listing(int(shard, 16))
    nbytes = 0
    for entry in entries:  # the entries ``scan._scan_shard`` examines as blocks
        parsed = parse_block_entry(entry.name)
        if parsed and parsed[1] is None and parsed[0].startswith(shard) and entry.is_file(follow_symlinks=False):
            pace()
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted since the listing: by this process, its size is known
                with lock:  # a delete in progress has recorded it once the lock is free
                    nbytes += ledger.gone.get(bytes.fromhex(parsed[0]), 0)
            except OSError:
                pass
    ledger.listed(nbytes)
    return entries
