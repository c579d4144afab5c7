"""tiers/ledger.py: ``Ledger``, the bytes a disk tier's folder holds, as one process knows them,
exact once the folder has been counted and an upper bound until then.

A store opens without reading its L2 folder: the blocks are found by the background recovery scan
(``store/recovery.py``, ``recover.py``), one shard folder at a time, while the store already writes and deletes.
``l2.size`` must hold from the first write, so the ledger keeps three figures:

- ``net``: bytes this process reserved or published since open, minus those it deleted (it can
  go below zero while the blocks it deletes have not been counted yet);
- ``known``: the bytes the folder held at open, for the shards counted so far;
- ``bound``: an upper bound on the bytes the folder held at open, used until every shard is
  counted (``usage_bound``): 0 for a folder created now; else the usage summary the last store to
  close there left (``usage``, consumed at open, trusted only if the mtimes of the shard folders
  are those it recorded: no write or delete since, by anyone); else ``min(l2.size, bytes in use on its filesystem)``.

``used = net + max(bound, known)`` while counting, ``net + known`` after: never below what the
folder holds (other processes' writes aside, as before). While the folder is not yet counted a
tier that was not full may evict before writing: conservative, never over the bound.

Counting a shard races with this process's writes and deletes in it, so each shard has a lock:
publishing a file (rename) and deleting one record their bytes in the shard's ``delta`` under it,
and the scan lists the shard and reads ``delta`` under it too. The sizes of the listed files are
read after (not holding the lock); a listed file this process deleted meanwhile is counted with
the size its deletion recorded (``gone``). What the folder held at open is then ``listed - delta``
exactly, whatever the order of the writes, deletes and listing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import threading
from pathlib import Path

from kvstrata.tiers.folder import OPEN_DIR, open_regular

log = logging.getLogger(__name__)
SHARDS = 256
SUMMARY = "usage"  # {"used": bytes} in the tier's root, written at close, consumed at open


def usage_bound(root: Path, capacity: int, created: bool) -> tuple[int, str]:
    """An upper bound on the bytes ``root/blocks`` holds, and where it comes from (for the log):
    nothing in a folder created now; the usage summary if one is there and still true; else at
    most ``capacity`` (a tier kvstrata kept to ``l2.size``) and at most what its filesystem has in
    use. (If ``l2.size`` was lowered since the folder was filled, the excess is only evicted once
    the folder is counted; the folder never grows meanwhile.)"""
    if created:
        return 0, "a new folder"
    summary = _take_summary(root)
    if summary is not None:
        return summary, "the usage summary of the last store to close"
    try:
        st = os.statvfs(root)
    except OSError:
        return capacity, "l2.size"
    return min(capacity, (st.f_blocks - st.f_bfree) * st.f_frsize), "l2.size and the filesystem's usage"


def _take_summary(root: Path) -> int | None:
    """The summary's figure, if it is well formed and no shard folder changed after it was
    written (a write or delete by anyone since updates its folder's mtime); removed either way,
    so that a store that crashes leaves none behind."""
    path = root / SUMMARY
    try:
        fd, st = open_regular(str(path))
    except OSError:
        return None
    try:
        raw = os.read(fd, 256)
    except OSError:
        raw = b""
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except OSError:
        return None  # another store took it: its figure is that store's
    try:
        data = json.loads(raw)
        used, seen = data["used"], data["folders"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(used, int) or used < 0 or seen != _folders_state(root / "blocks"):
        return None
    return used


def _folders_state(blocks: Path) -> str | None:
    """A digest of the mtimes of ``blocks`` and its shard folders (a few hundred ``stat`` calls):
    any write or delete there since changes it. None if a folder cannot be read."""
    h = hashlib.sha256()
    try:
        fd = os.open(blocks, OPEN_DIR)
    except OSError:
        return None
    try:
        h.update(b"%d" % os.fstat(fd).st_mtime_ns)
        for i in range(SHARDS):
            try:
                st = os.stat(f"{i:02x}", dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                h.update(b"-")
                continue
            if not stat.S_ISDIR(st.st_mode):
                return None
            h.update(b",%d" % st.st_mtime_ns)
    except OSError:
        return None
    finally:
        os.close(fd)
    return h.hexdigest()


def write_summary(root: Path, used: int) -> None:
    """Leave ``used`` for the next store to open ``root``, with the state of the shard folders
    now (temp file + rename; failures only logged)."""
    tmp = root / f".{SUMMARY}.{os.getpid()}.tmp"
    folders = _folders_state(root / "blocks")
    if folders is None:
        return
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps({"used": used, "folders": folders}).encode())
        finally:
            os.close(fd)
        os.replace(tmp, root / SUMMARY)
    except OSError as e:
        log.debug("kvstrata: no usage summary in %s: %s", root, e)


class Ledger:
    """Byte accounting of one disk tier folder; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.shard_locks = [threading.Lock() for _ in range(SHARDS)]
        self._delta = [0] * SHARDS  # bytes published minus deleted per shard since open (shard's lock)
        self._net = 0
        self._known = 0
        self._bound: int | None = None  # None: exact (nothing left to count)
        self._watched = -1  # the shard being recovered: its deleted keys are noted in ``gone``
        self._listed_delta = 0
        self.gone: dict[bytes, int] = {}  # key -> bytes, deleted from the watched shard since its listing

    def begin(self, bound: int) -> None:
        """The folder's blocks will be counted shard by shard; until then it holds at most ``bound``."""
        with self._lock:
            self._bound = bound

    @property
    def counting(self) -> bool:
        """Whether the folder is still being counted (``used`` is an upper bound)."""
        return self._bound is not None

    def used(self) -> int:
        base = self._known if self._bound is None else max(self._bound, self._known)
        return self._net + base

    def take(self, n: int, capacity: int, bounded: bool) -> bool:
        """Reserve ``n`` bytes for a write; False when ``capacity`` has no room for them."""
        with self._lock:
            if bounded and self.used() + n > capacity:
                return False
            self._net += n
        return True

    def give_back(self, n: int) -> None:
        """A reserved write failed: its bytes were never published."""
        with self._lock:
            self._net -= n

    def published(self, shard: int, n: int) -> None:
        """A reserved file of ``n`` bytes was renamed into ``shard`` (hold the shard's lock)."""
        self._delta[shard] += n

    def deleted(self, shard: int, key: bytes, n: int) -> None:
        """A file of ``n`` bytes was deleted from ``shard`` (hold the shard's lock)."""
        self._delta[shard] -= n
        if shard == self._watched:
            self.gone[key] = n
        with self._lock:
            self._net -= n

    def listing(self, shard: int) -> None:
        """The recovery scan lists ``shard`` now (hold the shard's lock)."""
        self._watched = shard
        self._listed_delta = self._delta[shard]
        self.gone = {}

    def listed(self, nbytes: int) -> None:
        """The files listed in the watched shard hold ``nbytes`` (those deleted since counted from
        ``gone``): what it held at open is that minus what this process changed there before."""
        with self._lock:
            self._known += nbytes - self._listed_delta

    def not_blocks(self, nbytes: int) -> None:
        """Listed files the scan found are not servable blocks (damaged, other versions): out of
        the count, as a full scan never counted them."""
        with self._lock:
            self._known -= nbytes

    def shard_done(self) -> None:
        """The listed shard's blocks are in the index (hold its lock)."""
        self._watched = -1
        self.gone = {}

    def counted_all(self) -> None:
        """Every shard is counted: ``used`` is exact from now on."""
        with self._lock:
            self._bound = None

    def reset(self, nbytes: int) -> None:
        """A full synchronous scan found ``nbytes`` (the shared folder's sweep): start over."""
        with self._lock:
            self._net, self._known, self._bound = 0, nbytes, None
