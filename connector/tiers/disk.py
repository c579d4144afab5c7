"""L2: local disk, one file per block in sharded folders, published by rename.

Layout under ``root``::

    blocks/ab/<key hex>.kvb             128-byte header (blockfmt) + payload, mode 0600
    blocks/ab/.<key hex>.<pid>.<n>.tmp  a write in progress (never read)
    tails/ab/<parent hex>/<ntok>.<key hex>  marker: partial block <key> of ntok tokens follows parent
                                        (one per block: two tails of one length under one parent
                                        are two markers, and evicting one leaves the other)

The 256 shard folders are created once at start-up, so the write path never calls mkdir; 256
shards keep folders at a few thousand files for a terabyte of 256 KiB blocks.

Why one file per block and not a slab: publication is a single ``rename`` (atomic on POSIX, and
the same on the shared filesystems a later tier uses), several processes can share the folder with
no lock and no shared index, and a reader that already opened a file keeps its bytes even if GC
unlinks it. The header carries everything the index needs, so another process's blocks are
discovered by reading 128 bytes (``probe``), never the payload.

Crash safety: a crash before the rename leaves only a temp file, which recovery deletes once its
writer pid is gone; after the rename the block is complete. ``fsync: true`` adds durability across
power loss at the cost of write bandwidth.

``write_views``/``read_views`` take the payload as a list of runs (e.g. one page of SGLang's host
pool, one run per layer and K/V) and move it with one ``pwritev``/``preadv`` and a streaming
checksum, so a page goes between the engine's memory and the file with no intermediate copy;
the file is byte-identical to one written from a contiguous payload.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..blockfmt import HEADER_SIZE, FormatError, pack_header, payload_checksum_of, unpack_header
from ..index import EntryMeta
from ..metrics import Counters
from .base import BlockTier

log = logging.getLogger(__name__)
_SUFFIX = ".kvb"
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv/pwritev


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _marker(ntok: int, key: bytes) -> str:
    return f"{ntok}.{key.hex()}"


def _marker_ntok(name: str) -> int | None:
    """Token count of a tail marker's name (``<ntok>.<key hex>``, or a bare ``<ntok>`` as older
    versions wrote); None for anything else."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() and len(head) < 9 else None


class DiskTier(BlockTier):
    name = "l2"
    bit = 2

    def __init__(self, counters: Counters, root: Path, capacity: int, fsync: bool = False,
                 delay_s: float = 0.0) -> None:
        super().__init__(counters)
        self._delay_s = delay_s  # test-only slow disk (testing.l2_write_delay_ms)
        self.root = Path(root)
        self._capacity = capacity
        self._fsync = fsync
        self._blocks = self.root / "blocks"
        self._tails = self.root / "tails"
        for d in (self.root, self._blocks, self._tails):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        for top in (self._blocks, self._tails):
            present = set(os.listdir(top))
            for shard in (f"{i:02x}" for i in range(256)):
                if shard not in present:
                    try:
                        os.mkdir(top / shard, 0o700)
                    except FileExistsError:  # another process opening a fresh folder made it
                        pass
        self._prefix = str(self._blocks) + os.sep
        self._lock = threading.Lock()
        self._used = 0
        self._seq = itertools.count()
        self._made: set[Path] = set()

    # ------------------------------------------------------------------ paths
    def path(self, key: bytes) -> Path:
        return Path(self._file(key))

    def _file(self, key: bytes) -> str:
        h = key.hex()
        return f"{self._prefix}{h[:2]}/{h}{_SUFFIX}"

    def _tail_dir(self, parent: bytes) -> Path:
        h = parent.hex()
        return self._tails / h[:2] / h

    def _ensure_dir(self, d: Path) -> None:
        if d not in self._made:
            d.mkdir(mode=0o700, exist_ok=True)  # its shard folder exists since start-up
            self._made.add(d)

    # -------------------------------------------------------------- interface
    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool:
        return self.write_views(meta, [memoryview(payload[: meta.size].numpy())])

    def write_views(self, meta: EntryMeta, parts: Sequence[memoryview]) -> bool:
        """``write`` of a payload given as consecutive runs (``parts`` total ``meta.size`` bytes):
        one ``pwritev`` of header + runs to a temp file, then the same rename publication, so the
        file is byte-identical to one written from a contiguous payload."""
        if not meta.checksum:
            raise ValueError("disk writes need the payload checksum in meta")
        assert len(parts) < IOV_MAX, "more runs than one pwritev takes"
        h = meta.key.hex()
        final = f"{self._prefix}{h[:2]}/{h}{_SUFFIX}"
        tmp = f"{self._prefix}{h[:2]}/.{h}.{os.getpid()}.{next(self._seq)}.tmp"
        header = pack_header(meta)
        if self._delay_s:
            time.sleep(self._delay_s)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                written = os.pwritev(fd, [header, *parts], 0)
                if written != HEADER_SIZE + meta.size:
                    raise OSError(errno.EIO, f"short write {written}")
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)  # publish: same key means same bytes, so last rename wins
            if meta.tail:
                tail = self._tail_dir(meta.parent)
                self._ensure_dir(tail)
                (tail / _marker(meta.ntok, meta.key)).touch(mode=0o600)
        except OSError as e:
            self.counters.inc(f"{self.name}_write_errors")
            log.warning("kvstrata L2: write of %s failed: %s", final, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            self._used += HEADER_SIZE + meta.size
        self.counters.inc(f"{self.name}_bytes_written", meta.size)
        return True

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        return self.read_views(meta, [memoryview(out[: meta.size].numpy())])

    def read_views(self, meta: EntryMeta, parts: Sequence[memoryview]) -> bool:
        """``read`` into consecutive runs (writable, ``meta.size`` bytes in all): one ``preadv``
        and a streaming checksum over the runs. On failure the runs hold garbage: never use them."""
        assert len(parts) < IOV_MAX, "more runs than one preadv takes"
        path = self._file(meta.key)
        header = bytearray(HEADER_SIZE)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.counters.inc(f"{self.name}_missing")
            return False
        except OSError as e:
            log.warning("kvstrata L2: cannot open %s: %s", path, e)
            self.counters.inc(f"{self.name}_read_errors")
            return False
        try:
            got = os.preadv(fd, [header, *parts], 0)
        except OSError as e:
            log.warning("kvstrata L2: read of %s failed: %s", path, e)
            self.counters.inc(f"{self.name}_read_errors")
            return False
        finally:
            os.close(fd)
        problem = self._verify(path, meta, header, got, parts)
        if problem is None:
            self.counters.inc(f"{self.name}_bytes_read", meta.size)
            return True
        log.warning("kvstrata L2: dropping %s: %s", path, problem)
        self.counters.inc("checksum_failures")
        self.delete(meta.key)
        return False

    def _verify(self, path: str, meta: EntryMeta, header: bytearray, got: int,
                parts: Sequence[memoryview]) -> str | None:
        if got != HEADER_SIZE + meta.size:
            return f"size {got - HEADER_SIZE} bytes, expected {meta.size}"
        if not meta.checksum or header != pack_header(meta):
            # Slow path, only to say what is wrong (or to learn an unknown checksum).
            try:
                stored = unpack_header(header, path)
            except FormatError as e:
                return str(e)
            if (stored.key, stored.parent, stored.fp, stored.size) != (meta.key, meta.parent, meta.fp, meta.size):
                return "header does not match the index entry"
            meta = stored
        if payload_checksum_of(parts) != meta.checksum:
            return "payload checksum mismatch"
        return None

    def probe(self, key: bytes) -> EntryMeta | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER_SIZE)
                size = os.fstat(f.fileno()).st_size
            meta = unpack_header(header, path)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("kvstrata L2: unreadable block %s: %s", path, e)
            self.counters.inc(f"{self.name}_read_errors")
            return None
        except FormatError as e:
            self._drop_damaged(key, e)
            return None
        if meta.key != key or size != HEADER_SIZE + meta.size:
            self._drop_damaged(key, FormatError(f"{path}: header does not match its name or size"))
            return None
        return meta

    def _drop_damaged(self, key: bytes, err: FormatError) -> None:
        """A committed file that can never be served: delete it (it is counted once, here)."""
        if not err.corrupt:
            log.debug("kvstrata L2: ignoring foreign block: %s", err)
            return
        log.warning("kvstrata L2: dropping damaged block: %s", err)
        self.counters.inc("checksum_failures")
        self.counters.inc(f"{self.name}_bad_headers")
        self.delete(key)

    def tail_lengths(self, parent: bytes) -> list[int]:
        try:
            names = os.listdir(self._tail_dir(parent))
        except FileNotFoundError:
            return []
        return sorted({n for n in map(_marker_ntok, names) if n is not None}, reverse=True)

    def delete(self, key: bytes) -> None:
        path = self.path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self._used -= size

    def delete_tail_marker(self, parent: bytes, ntok: int, key: bytes) -> None:
        (self._tail_dir(parent) / _marker(ntok, key)).unlink(missing_ok=True)

    def scan(self) -> Iterator[EntryMeta]:
        for meta, _path, _mtime in self.scan_files():
            yield meta

    def scan_files(self) -> Iterator[tuple[EntryMeta, Path, float]]:
        """Every committed block with its path and mtime; removes dead writers' temp files and
        damaged blocks (foreign format versions are left alone). Also recomputes used bytes."""
        used = 0
        for path in self._blocks.glob("*/*"):
            name = path.name
            if name.endswith(".tmp"):
                self._maybe_remove_temp(path)
                continue
            if not name.endswith(_SUFFIX):
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    meta = unpack_header(f.read(HEADER_SIZE), str(path))
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("kvstrata L2: unreadable block file %s: %s", path, e)
                continue
            except FormatError as e:
                if e.corrupt:
                    log.warning("kvstrata L2: deleting damaged block file: %s", e)
                    self.counters.inc(f"{self.name}_bad_headers")
                    path.unlink(missing_ok=True)
                continue
            if st.st_size != HEADER_SIZE + meta.size:
                log.warning("kvstrata L2: deleting truncated block file %s", path)
                self.counters.inc(f"{self.name}_bad_headers")
                path.unlink(missing_ok=True)
                continue
            used += st.st_size
            yield meta, path, st.st_mtime
        with self._lock:
            self._used = used

    def _maybe_remove_temp(self, path: Path) -> None:
        parts = path.name.split(".")  # "", key, pid, seq, "tmp"
        pid = int(parts[2]) if len(parts) == 5 and parts[2].isdigit() else -1
        if pid != os.getpid() and not _pid_alive(pid):
            path.unlink(missing_ok=True)
            self.counters.inc(f"{self.name}_temp_removed")

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
