"""tiers/sharedfs.py: L3 on a shared POSIX folder (NFS, CephFS, 3FS, JuiceFS, Lustre mounts),
``SharedFsTier``: the disk tier's format, seen by every instance that mounts the folder.

It is the L2 code on another path: one file per block published by rename (atomic on these
filesystems, no locks needed, which NFS lacks), headers probed for discovery, and the namespace
epochs in one small file each, replaced atomically and checked with one ``stat()`` per lookup.
A read touches the file's mtime: that is the block's lease, and ``kvstrata gc`` (LRU beyond
``remote.size``; tenant by tenant with ``tenants.shares.remote``) never deletes a block read within
``lease_seconds``.

Every host writes here, so the folder is treated like L2's, only more so: no symlink is followed,
nothing but kvstrata's own regular files is deleted, and a temp file is a leftover only once it is
older than any write (``TEMP_MAX_AGE_S``): its pid means nothing on this host. The folder's mode is
its owner's choice; folders and files created here take the group bits of its root, so that
instances running as different users of one group can share it.

With a secret (``auth``) the tier lives in ``<remote.path>/auth-<key id>`` (the secret's own
space: deployments with different secrets never read, count or delete each other's files), and
every block and epoch file carries a MAC (see ``disk`` and ``epochs/folder.py``). With
``remote.encrypt`` (``seal``) every block file's payload is AES-256-GCM ciphertext as well: the
folder's files reveal no payload byte to a host without the secret (``format.seal``).
"""

from __future__ import annotations

import os
import stat
import time

from typing import Callable

import torch

from kvstrata.format.auth import Auth
from kvstrata.format.seal import Seal
from kvstrata.format.block import HEADER_SIZE
from kvstrata.config import RemoteConfig
from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters
from kvstrata.tiers.disk import TEMP_MAX_AGE_S, DiskTier
from kvstrata.tiers.folder import make_folder
from kvstrata.tenants import LRU, TierShares, fair_order


class SharedFsTier(DiskTier):
    name = "remote"
    bit = 4
    label = "shared folder"
    bounded = False  # other instances write here too: only the folder-wide sweep enforces the bound
    open_mode_bits = 0o002  # group-writable is how a shared folder is shared; world-writable gets a warning

    def __init__(self, counters: Counters, cfg: RemoteConfig, auth: Auth | None = None,
                 seal: Seal | None = None, shares: TierShares | None = None,
                 tenant_of: Callable[[bytes], str] | None = None) -> None:
        self.shares, self.tenant_of = shares, tenant_of  # ``tenants.shares.remote``: the sweep's order
        if cfg.path is None:
            raise ValueError("remote.backend fs needs remote.path (the shared folder)")
        root = cfg.path
        if auth is not None:  # the secret's own space, with the shared root's group bits
            make_folder(root, 0o700)
            root = root / f"auth-{auth.key_id}"
            make_folder(root, 0o700 | (stat.S_IMODE(os.stat(cfg.path).st_mode) & 0o070))
        super().__init__(counters, root, cfg.size, auth=auth, seal=seal)

    def modes(self) -> tuple[int, int]:
        """The root's group bits carried to the folders (rwx) and files (r) created here."""
        group = stat.S_IMODE(os.stat(self.root).st_mode) & 0o070
        return 0o700 | group, 0o600 | (group & 0o040)

    @staticmethod
    def temp_is_stale(pid: int, mtime: float) -> bool:
        """Another host may own ``pid``: only age tells a leftover from a write in progress."""
        return time.time() - mtime > TEMP_MAX_AGE_S

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        ok = super().read(meta, out)
        if ok:
            try:
                os.utime(self._file(meta.key), (time.time(), time.time()), follow_symlinks=False)  # renew the lease
            except OSError:
                pass
        return ok

    @property
    def used_bytes(self) -> int:
        return 0  # other instances write here too: only the folder-wide sweep enforces the bound

    def sweep(self, lease_s: float) -> int:
        """Delete least recently read blocks beyond ``remote.size``, never one read or written
        within ``lease_s`` (its lease), tenant by tenant where the tier has shares (the headers
        name each block's namespace: ``fair_order``). Returns how many were deleted."""
        files = [(mtime, meta) for meta, _path, mtime in self.scan_files()]
        total = sum(HEADER_SIZE + m.size for _, m in files)
        fresh = time.time() - lease_s
        old = sorted(((mtime, m) for mtime, m in files if mtime < fresh), key=lambda f: f[0])
        if self.shares is None or self.tenant_of is None:
            order = [(m, LRU) for _, m in old]
        else:
            usage: dict[str, int] = {}
            for _, m in files:
                t = self.tenant_of(m.ns_seed)
                usage[t] = usage.get(t, 0) + HEADER_SIZE + m.size
            order = fair_order(self.shares, usage, self.capacity_bytes,
                               [(self.tenant_of(m.ns_seed), HEADER_SIZE + m.size, m) for _, m in old])
        removed = 0
        for meta, cause in order:
            if total <= self.capacity_bytes:
                break
            self.delete(meta.key)
            if meta.tail:
                self.delete_tail_marker(meta.parent, meta.ntok, meta.key)
            total -= HEADER_SIZE + meta.size
            removed += 1
            self.counters.inc(f"remote_evicted_{cause}")
        return removed
