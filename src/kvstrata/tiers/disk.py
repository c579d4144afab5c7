"""tiers/disk.py: L2, ``DiskTier``: local disk, one file per block in sharded folders, published
by rename: the write, read, probe, tail-marker and recovery paths of one folder format, which
``sharedfs`` reuses whole.

Layout under ``root`` (the names: ``folder``)::

    blocks/ab/<key hex>.kvb             128-byte header (format/block.py) + payload, mode 0600
    blocks/ab/.<key hex>.<pid>.<n>.tmp  a write in progress (never read)
    tails/ab/<parent hex>/<ntok>.<key hex>  marker: partial block <key> of ntok tokens follows parent
                                        (one per block: two tails of one length under one parent
                                        are two markers, and evicting one leaves the other)

256 shard folders, created at start-up (the write path never calls mkdir), keep folders at a few
thousand files for a terabyte of 256 KiB blocks.

Why one file per block and not a slab: publication is a single ``rename`` (atomic on POSIX, and
the same on the shared filesystems of ``sharedfs``), several processes can share the folder with
no lock and no shared index, and a reader that already opened a file keeps its bytes even if GC
unlinks it. The header carries everything the index needs, so another process's blocks are
discovered by reading 128 bytes (``probe``), never the payload.

Crash safety: a crash before the rename leaves only a temp file, deleted once its writer is gone
(``temp_is_stale``); after it the block is complete. ``fsync: true`` survives power loss too.

The folder is input kvstrata does not control, so nothing in it is trusted (the rules: ``folder``);
the background recovery scan and ``kvstrata check`` are one function (``scan``). A shard folder
that is not a real folder at start-up is not used. Modes are set only on folders kvstrata creates;
an existing root others can write to gets a warning, never a ``chmod``.

``l2.size`` holds at every instant: a write first takes its bytes from the capacity (the store
evicts before a batch) and is refused when they are not there; until the background recovery has
counted the folder, the bytes it holds are an upper bound (``ledger``). A full filesystem (ENOSPC, EDQUOT)
drops the blocks that do not fit, logged once per burst.

``write_views``/``read_views`` move a payload given as runs (one page of SGLang's host pool: a
run per layer and K/V) with one ``pwritev``/``preadv`` and a streaming checksum, no intermediate
copy; the file is byte-identical to one written from a contiguous payload.

With ``auth`` (the shared folder with a secret; L2 with ``l2.authenticate``) a block's header
carries its MAC; with ``seal`` too (``remote.encrypt``, ``l2.encrypt``) its payload is AES-256-GCM
ciphertext, staged in a per-thread buffer (``format.seal``). A block that fails either is a miss,
counted (``<tier>_auth_blocks``, ``<tier>_auth_failures``) and deleted. ``probe`` reads the header
only, so a forged file can still be *found*; its load fails (the engine recomputes), never serves it.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from kvstrata.format.auth import Auth
from kvstrata.format.block import HEADER_SIZE, FormatError, pack_header, unpack_header, verify_block
from kvstrata.format.seal import Seal
from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters
from kvstrata.tiers.base import BlockTier, pid_alive
from kvstrata.tiers.folder import (FULL_ERRNOS, IOV_MAX, OPEN_DIR, FullDisk, block_name, check_runs, make_folder, marker_name, marker_ntok,
                                   open_regular, prepare_shards, temp_name, warn_if_open, write_all)
from kvstrata.tiers.ledger import Ledger, usage_bound, write_summary
from kvstrata.tiers.scan import BLOCK, DAMAGED, OTHER_VERSION, SKIPPED, TEMP, Tally, scan_folder

log = logging.getLogger(__name__)
__all__ = ["IOV_MAX", "TEMP_MAX_AGE_S", "DiskTier"]  # IOV_MAX: the bound on runs (``folder``), for callers
TEMP_MAX_AGE_S = 3600.0  # a temp file this old is a leftover whoever wrote it: no write lasts an hour


# ------------------------------------------------------------------------------ the tier
class DiskTier(BlockTier):
    name = "l2"
    bit = 2
    label = "L2"
    bounded = True  # writes take their bytes from ``capacity`` (a shared folder's sweep bounds it instead)
    open_mode_bits = 0o022  # an existing root writable by these bits gets a warning (others can plant blocks)

    def __init__(self, counters: Counters, root: Path, capacity: int, fsync: bool = False,
                 auth: Auth | None = None, seal: Seal | None = None) -> None:
        super().__init__(counters)
        assert seal is None or auth is not None, "a sealed tier is an authenticated one"
        self.auth = auth
        self.seal = seal
        self._domain = self.name.encode()  # a block's MAC is bound to its tier
        self.root = Path(root)
        self._capacity = capacity
        self._fsync = fsync
        self._blocks = self.root / "blocks"
        self._tails = self.root / "tails"
        self._created = make_folder(self.root, 0o700)
        if not self._created:
            warn_if_open(self.root, self.open_mode_bits, self.label)
        self._dir_mode, self._file_mode = self.modes()
        self._bad = (prepare_shards(self._blocks, self._dir_mode, self.label)
                     | prepare_shards(self._tails, self._dir_mode, self.label))
        self._prefix = str(self._blocks) + os.sep
        self.ledger = Ledger()
        self._summarize = False  # a store's L2 (``begin_recovery``): leave a usage summary at close
        self._seq = itertools.count()
        self._made: set[Path] = set()
        self._full = FullDisk(self.label, self.root, counters, f"{self.name}_full_drops")

    # ------------------------------------------------------------ folders
    def modes(self) -> tuple[int, int]:
        """Modes of the folders and files this tier creates: private (0700/0600)."""
        return 0o700, 0o600

    def _usable(self, top: str, h: str) -> bool:
        return not self._bad or f"{top}/{h[:2]}" not in self._bad

    # ------------------------------------------------------------------ paths
    def path(self, key: bytes) -> Path:
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        h = key.hex()
        return f"{self._prefix}{h[:2]}/{block_name(h)}"

    def _tail_dir(self, parent: bytes) -> Path:
        h = parent.hex()
        return self._tails / h[:2] / h

    def stored_bytes(self, size: int) -> int:
        return HEADER_SIZE + size

    def _take(self, n: int) -> bool:
        """Take ``n`` bytes of the capacity for a write (False: they are not there)."""
        return self.ledger.take(n, self._capacity, self.bounded)

    # -------------------------------------------------------------- interface
    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool:
        return self.write_views(meta, [memoryview(payload[: meta.size].numpy())])

    def write_views(self, meta: EntryMeta, parts: Sequence[memoryview]) -> bool:
        """``write`` of a payload given as consecutive runs (``parts`` total ``meta.size`` bytes):
        one ``pwritev`` of header + runs to a temp file, then the same rename publication, so the
        file is byte-identical to one written from a contiguous payload. Refused (False, counted)
        when ``l2.size`` has no room for it."""
        if not meta.checksum:
            raise ValueError("disk writes need the payload checksum in meta")
        check_runs(parts, "pwritev")
        h = meta.key.hex()
        final = self._file(meta.key)
        cost = HEADER_SIZE + meta.size
        if not self._usable("blocks", h) or (meta.tail and not self._usable("tails", meta.parent.hex())):
            self.counters.inc(f"{self.name}_unusable_shard")
            return False
        if not self._take(cost):
            self.counters.inc(f"{self.name}_no_room")
            return False
        tmp = f"{self._prefix}{h[:2]}/{temp_name(h, os.getpid(), next(self._seq))}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, self._file_mode)
            try:
                write_all(fd, self._stored(meta, parts), cost)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self.ledger.shard_locks[meta.key[0]]:  # the recovery scan counts a shard under it
                os.replace(tmp, final)  # publish: same key means same bytes, so last rename wins
                self.ledger.published(meta.key[0], cost)
            if meta.tail:
                self._mark_tail(meta)
        except OSError as e:
            self.ledger.give_back(cost)
            self.counters.inc(f"{self.name}_write_errors")
            if e.errno in FULL_ERRNOS:
                self._full.dropped(e, final, meta.size)
            else:
                log.warning("kvstrata %s: write of %s failed: %s", self.label, final, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self._full.resumed()
        self.counters.inc(f"{self.name}_bytes_written", meta.size)
        return True

    def _mark_tail(self, meta: EntryMeta) -> None:
        """Create the marker of a partial block, never through a symlink."""
        tail = self._tail_dir(meta.parent)
        if tail not in self._made:
            make_folder(tail, self._dir_mode)  # its shard folder exists since start-up
            self._made.add(tail)
        try:
            dfd = os.open(tail, OPEN_DIR)
        except FileNotFoundError:  # removed meanwhile (``kvstrata check --fix`` drops empty ones)
            make_folder(tail, self._dir_mode)
            dfd = os.open(tail, OPEN_DIR)
        try:
            os.close(os.open(marker_name(meta.ntok, meta.key), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                             | os.O_NONBLOCK | os.O_CLOEXEC, self._file_mode, dir_fd=dfd))
        finally:
            os.close(dfd)

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        return self.read_views(meta, [memoryview(out[: meta.size].numpy())])

    def _open_block(self, key: bytes) -> tuple[int, os.stat_result] | None:
        """The block file of ``key``, opened safely; None if absent, not usable or not a regular
        file (counted, never deleted: it is not kvstrata's)."""
        h = key.hex()
        if not self._usable("blocks", h):
            return None
        path = self._file(key)
        try:
            return open_regular(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.debug("kvstrata %s: not opening %s: %s", self.label, path, e)
            self.counters.inc(f"{self.name}_skipped_entries")
            return None

    def read_views(self, meta: EntryMeta, parts: Sequence[memoryview]) -> bool:
        """``read`` into consecutive runs (writable, ``meta.size`` bytes in all): one ``preadv``
        and a streaming checksum over the runs. On failure the runs hold garbage: never use them."""
        check_runs(parts, "preadv")
        path = self._file(meta.key)
        header = bytearray(HEADER_SIZE)
        into = parts if self.seal is None else [self.seal.scratch(meta.size)]  # the ciphertext, then parts
        opened = self._open_block(meta.key)
        if opened is None:
            self.counters.inc(f"{self.name}_missing")
            return False
        fd = opened[0]
        try:
            got = os.preadv(fd, [header, *into], 0)
        except OSError as e:
            log.warning("kvstrata %s: read of %s failed: %s", self.label, path, e)
            self.counters.inc(f"{self.name}_read_errors")
            return False
        finally:
            os.close(fd)
        size = got - HEADER_SIZE  # sealed: decrypted from ``into`` to ``parts`` by the check
        bad = (self.seal.open(self._domain, meta, header, size, into[0], parts, path) if self.seal is not None
               else verify_block(meta, header, size, parts, path) if self.auth is None
               else self.auth.verify_block(self._domain, meta, header, size, parts, path))
        if bad is None:
            self.counters.inc(f"{self.name}_bytes_read", meta.size)
            return True
        log.warning("kvstrata %s: dropping %s: %s", self.label, path, bad.why)
        if bad.kind == "auth":
            self.counters.inc(f"{self.name}_auth_blocks")
            self.counters.inc(f"{self.name}_auth_failures")
        else:
            self.counters.inc("checksum_failures")
        if bad.corrupt:  # another format version's block is not ours to delete
            self.delete(meta.key)
        return False

    def _stored(self, meta: EntryMeta, parts: Sequence[memoryview]) -> list[bytes | memoryview]:
        """A block file's contents: its header (sealed, MAC'd or plain), then the payload runs
        (sealed: their ciphertext, in the per-thread staging buffer)."""
        if self.seal is not None:
            return [self.seal.seal(self._domain, meta, parts, out := self.seal.scratch(meta.size)), out]
        return [pack_header(meta) if self.auth is None else self.auth.seal_header(self._domain, meta, parts), *parts]

    def probe(self, key: bytes) -> EntryMeta | None:
        path = self._file(key)
        opened = self._open_block(key)
        if opened is None:
            return None
        fd, st = opened
        try:
            meta = unpack_header(os.pread(fd, HEADER_SIZE, 0), path)
        except OSError as e:
            log.warning("kvstrata %s: unreadable block %s: %s", self.label, path, e)
            self.counters.inc(f"{self.name}_read_errors")
            return None
        except FormatError as e:
            self._drop_damaged(key, e)
            return None
        finally:
            os.close(fd)
        if meta.key != key or st.st_size != HEADER_SIZE + meta.size:
            self._drop_damaged(key, FormatError(f"{path}: header does not match its name or size"))
            return None
        return meta

    def _drop_damaged(self, key: bytes, err: FormatError) -> None:
        """A committed file that can never be served: delete it (it is counted once, here)."""
        if not err.corrupt:
            log.debug("kvstrata %s: ignoring foreign block: %s", self.label, err)
            return
        log.warning("kvstrata %s: dropping damaged block: %s", self.label, err)
        self.counters.inc("checksum_failures")
        self.counters.inc(f"{self.name}_bad_headers")
        self.delete(key)

    def tail_lengths(self, parent: bytes) -> list[int]:
        if not self._usable("tails", parent.hex()):
            return []
        try:
            fd = os.open(self._tail_dir(parent), OPEN_DIR)
        except OSError:  # absent, or not a real folder
            return []
        try:
            names = os.listdir(fd)
        finally:
            os.close(fd)
        return sorted({n for n in map(marker_ntok, names) if n is not None}, reverse=True)

    def delete(self, key: bytes) -> None:
        """Delete the block file of ``key`` if it is a regular file (never a link's target)."""
        if not self._usable("blocks", key.hex()):
            return
        path = self._file(key)
        with self.ledger.shard_locks[key[0]]:
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    return
                os.unlink(path)
            except OSError:
                return
            self.ledger.deleted(key[0], key, st.st_size)

    def delete_tail_marker(self, parent: bytes, ntok: int, key: bytes) -> None:
        if not self._usable("tails", parent.hex()):
            return
        try:
            fd = os.open(self._tail_dir(parent), OPEN_DIR)
        except OSError:
            return
        try:
            st = os.stat(marker_name(ntok, key), dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                os.unlink(marker_name(ntok, key), dir_fd=fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    @staticmethod
    def temp_is_stale(pid: int, mtime: float) -> bool:
        """Whether a temp file of writer ``pid`` is a leftover: its writer is gone (a local folder:
        the pid is not alive on this host), or it is older than any write (``TEMP_MAX_AGE_S``)."""
        return (pid != os.getpid() and not pid_alive(pid)) or time.time() - mtime > TEMP_MAX_AGE_S

    def scan_files(self) -> Iterator[tuple[EntryMeta, str, float]]:
        """Every committed block with its path and mtime (``scan_folder`` with ``fix``: removes
        leftover temp files and damaged blocks of this format; everything else is left alone,
        counted and logged once). Also recomputes used bytes."""
        used, tally = 0, Tally()
        for found in scan_folder(self.root, fix=True, stale_temp=self.temp_is_stale):
            tally.add(found)
            if found.kind == BLOCK:
                assert found.meta is not None
                used += found.size
                yield found.meta, found.path, found.mtime
        self.ledger.reset(used)
        self.report_scan(tally)

    # ------------------------------------------------------- background recovery
    def begin_recovery(self) -> None:
        """From now on ``used_bytes`` is an upper bound until the recovery scan (``recover.py``)
        has counted the folder (``ledger.py``); ``close`` leaves a usage summary for the next store."""
        bound, source = usage_bound(self.root, self._capacity, self._created)
        log.debug("kvstrata %s: until %s is counted it holds at most %d bytes (%s)", self.label, self.root, bound, source)
        self.ledger.begin(bound)
        self._summarize = True

    def close(self) -> None:
        if self._summarize:
            write_summary(self.root, max(self.ledger.used(), 0))

    def report_scan(self, tally: Tally) -> None:
        """Count what a scan found besides blocks, and log each kind once."""
        counts, first = tally.counts, tally.first
        for counter, n in (("bad_headers", counts[DAMAGED]), ("temp_removed", counts["removed_" + TEMP]),
                           ("skipped_entries", counts[SKIPPED]), ("other_versions", counts[OTHER_VERSION])):
            if n:
                self.counters.inc(f"{self.name}_{counter}", n)
        if DAMAGED in first:
            log.warning("kvstrata %s: deleted %d damaged block files in %s (first: %s: %s)", self.label,
                        counts["removed_" + DAMAGED], self.root, first[DAMAGED].path, first[DAMAGED].why)
        odd = first.get(SKIPPED) or first.get(OTHER_VERSION)
        if odd is not None:
            log.warning("kvstrata %s: %s holds %d entries kvstrata does not write or cannot open safely and %d "
                        "blocks of other format versions; left alone (first: %s: %s; `kvstrata check` lists them)",
                        self.label, self.root, counts[SKIPPED], counts[OTHER_VERSION], odd.path, odd.why)

    @property
    def used_bytes(self) -> int:
        return self.ledger.used()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

