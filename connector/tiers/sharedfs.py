"""L3 on a shared POSIX folder (NFS, CephFS, 3FS, JuiceFS, Lustre mounts): the disk tier's format,
seen by every instance that mounts the folder.

It is the L2 code on another path: one file per block published by rename (atomic on these
filesystems, no locks needed, which NFS lacks), headers probed for discovery, and the namespace
epochs in one small file each, replaced atomically and checked with one ``stat()`` per lookup.
A read touches the file's mtime: that is the block's lease, and ``kvstrata gc`` (LRU beyond
``remote.size``) never deletes a block read within ``lease_seconds``.
"""

from __future__ import annotations

import os
import time

import torch

from ..blockfmt import HEADER_SIZE
from ..config import RemoteConfig
from ..index import EntryMeta
from ..metrics import Counters
from .disk import DiskTier


class SharedFsTier(DiskTier):
    name = "remote"
    bit = 4

    def __init__(self, counters: Counters, cfg: RemoteConfig) -> None:
        assert cfg.path is not None
        super().__init__(counters, cfg.path, cfg.size)

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        ok = super().read(meta, out)
        if ok:
            try:
                os.utime(self._file(meta.key), (time.time(), time.time()))  # renew the lease
            except OSError:
                pass
        return ok

    @property
    def used_bytes(self) -> int:
        return 0  # other instances write here too: only the folder-wide sweep enforces the bound

    def sweep(self, lease_s: float) -> int:
        """Delete least recently read blocks beyond ``remote.size``, never one read or written
        within ``lease_s`` (its lease). Returns how many were deleted."""
        files = []
        for meta, path, mtime in self.scan_files():
            files.append((mtime, path, meta))
        total = sum(HEADER_SIZE + m.size for _, _, m in files)
        removed = 0
        fresh = time.time() - lease_s
        for mtime, path, meta in sorted(files, key=lambda f: f[0]):
            if total <= self.capacity_bytes:
                break
            if mtime >= fresh:
                continue
            path.unlink(missing_ok=True)
            if meta.tail:
                self.delete_tail_marker(meta.parent, meta.ntok, meta.key)
            total -= HEADER_SIZE + meta.size
            removed += 1
        return removed
