"""tiers/scan.py: the one scan of a tier folder, trusting nothing it finds: ``scan_folder``
(blocks and temp files: ``kvstrata check``, the shared tier's sweep), ``scan_shards`` (the same,
one shard folder at a time: the store's background recovery, ``kvstrata check``), ``scan_tails``
(tail markers: ``kvstrata check``) and ``examine_block`` (one block by its key, as a scan would
find it). Each entry comes back as a ``Found``.

Shard folders are read in chunks of ``LIST_CHUNK`` entries, never listed whole (unless a caller's
lister asks for it): a scan's memory does not grow with the folder's size.

The rules of ``folder``, applied to a whole folder:

- never follow a symlink: folders are opened with ``O_NOFOLLOW | O_DIRECTORY`` and walked by
  descriptor (``scandir(fd)``, ``openat``, ``unlinkat``), entries are classified with
  ``follow_symlinks=False``, so a folder swapped for a link mid-scan is not entered either;
- open only regular files, with ``O_NONBLOCK`` (a FIFO opens at once), then ``fstat``;
- delete only regular files whose names kvstrata writes (a block in the shard of its key, a temp
  file, a marker), only blocks of this format version, and only if still the file examined (same
  inode);
- everything else is left alone, and reported (``Found`` of kind ``skipped``).
"""

from __future__ import annotations

import os
import re
import stat
from collections import Counter
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from kvstrata.format.block import HEADER_SIZE, FormatError, payload_hasher, unpack_header
from kvstrata.index import EntryMeta
from kvstrata.tiers.folder import OPEN_DIR, PARENT_RE, SHARD_RE, block_name, kind_of, open_regular, parse_block_entry, parse_marker, shown

LIST_CHUNK = 4096  # folder entries listed at a time (``stream_entries``)
BLOCK, DAMAGED, OTHER_VERSION, TEMP, WRITING, SKIPPED, MARKER, ORPHAN = (
    "block", "damaged", "other_version", "temp", "writing", "skipped", "marker", "orphan_marker")


class Found(NamedTuple):
    """One entry of a tier folder, as ``scan_folder`` or ``scan_tails`` classified it.

    ``kind``: ``block`` (servable, ``meta`` set), ``damaged`` (a kvstrata block of this format
    that can never be served), ``other_version`` (a well-formed block of another format version:
    left alone), ``temp`` (a dead writer's leftover), ``writing`` (a write in progress),
    ``skipped`` (not a regular file kvstrata writes: a symlink, FIFO, socket, folder or foreign
    file; left alone), ``marker`` / ``orphan_marker`` (tail markers whose block is there / gone).
    ``why`` says what is wrong; ``removed``: whether this scan deleted it."""

    kind: str
    path: str
    meta: EntryMeta | None = None
    size: int = 0
    mtime: float = 0.0
    why: str = ""
    removed: bool = False


class Tally:
    """What a scan found, by kind: ``counts[kind]`` and ``counts["removed_" + kind]``, and the
    first entry of each kind but ``block`` (``first``), for one log line per kind. The disk tier's
    two scans (``DiskTier.scan_files``, the background ``recover_shards``) count through it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.first: dict[str, Found] = {}

    def add(self, found: Found) -> None:
        self.counts[found.kind] += 1
        self.counts["removed_" + found.kind] += found.removed
        if found.kind != BLOCK:
            self.first.setdefault(found.kind, found)


def _skipped(folder: str, entry: os.DirEntry, named_like_ours: bool) -> Found:
    try:
        what = kind_of(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        what = "entry"
    why = (f"a {what} named like a kvstrata entry, not a regular file of its own: never followed, "
           "opened or deleted" if named_like_ours else f"a {what} kvstrata does not write: left alone")
    return Found(SKIPPED, f"{folder}/{shown(entry.name)}", why=why)


def _subfolders(folder: str, pattern: re.Pattern[str], parent_fd: int | None,
                prefix: str = "", ordered: bool = True) -> Iterator[tuple[str, int] | Found]:
    """Open each real subfolder of ``folder`` whose name matches ``pattern`` (and starts with
    ``prefix``), never through a symlink; yields ``(name, fd)`` (closed when the caller asks for
    the next one) or a ``skipped`` Found for everything else. ``ordered``: by name (the listing is
    then held whole: for the 256 shard folders), else as the folder streams them."""
    with os.scandir(parent_fd if parent_fd is not None else folder) as it:
        yield from _open_subfolders(folder, pattern, parent_fd, prefix,
                                    sorted(it, key=lambda e: e.name) if ordered else it)


def _open_subfolders(folder: str, pattern: re.Pattern[str], parent_fd: int | None, prefix: str,
                     entries: Iterable[os.DirEntry]) -> Iterator[tuple[str, int] | Found]:
    for entry in entries:
        if not (pattern.fullmatch(entry.name) and entry.name.startswith(prefix)
                and entry.is_dir(follow_symlinks=False)):
            yield _skipped(folder, entry, bool(pattern.fullmatch(entry.name)))
            continue
        try:
            fd = os.open(entry.name, OPEN_DIR, dir_fd=parent_fd)
        except OSError as e:  # replaced by a symlink meanwhile (ELOOP), or gone
            yield Found(SKIPPED, f"{folder}/{shown(entry.name)}", why=f"cannot open safely: {e.strerror}")
            continue
        try:
            yield entry.name, fd
        finally:
            os.close(fd)


def _shards(root: Path | str, name: str) -> Iterator[tuple[str, str, int] | Found]:
    """Each real shard folder of ``root/name`` as ``(path, shard, fd)`` (the fd is closed when the
    caller asks for the next one), or a ``skipped`` Found: ``root/name`` itself a symlink or not a
    folder, or an entry of it that is not a shard folder. Nothing if ``root/name`` is missing."""
    top_path = os.path.join(root, name)
    try:
        top = os.open(top_path, OPEN_DIR)
    except FileNotFoundError:
        return
    except OSError as e:  # a symlink (ELOOP) or not a folder: never scanned through
        yield Found(SKIPPED, top_path, why=f"not a real folder ({e.strerror}): not scanned")
        return
    try:
        for item in _subfolders(top_path, SHARD_RE, top):
            yield item if isinstance(item, Found) else (f"{top_path}/{item[0]}", item[0], item[1])
    finally:
        os.close(top)


def scan_folder(root: Path | str, *, fix: bool, stale_temp: Callable[[int, float], bool],
                verify: bool = False) -> Iterator[Found]:
    """Every entry of ``root/blocks``, classified; the one scan of a tier folder (start-up
    recovery, ``kvstrata check``, the shared tier's sweep).

    Never follows a symlink and opens only regular files (non-blocking). Each block file's header
    is parsed and checked against the file's name and size; with ``verify`` its payload checksum
    too. With ``fix``, deletes only regular files with kvstrata's names: ``damaged`` blocks of
    this format version, and ``temp`` files for which ``stale_temp(pid, mtime)`` holds."""
    for item in _shards(root, "blocks"):
        if isinstance(item, Found):
            yield item
        else:
            yield from _scan_shard(*item, fix, stale_temp, verify, stream_entries)


Lister = Callable[[str, int], Iterable[os.DirEntry]]


def scan_shards(root: Path | str, *, fix: bool, stale_temp: Callable[[int, float], bool],
                lister: Lister, verify: bool = False) -> Iterator[Iterator[Found]]:
    """``scan_folder``, one shard folder at a time: an iterator over each shard's entries (an
    entry outside the shard folders: one of its own), to be run through before the next.
    ``lister(shard, dir_fd)`` lists each shard folder (the disk tier counts its bytes there,
    under a lock; ``stream_entries`` streams it); the entries it returns are examined."""
    for item in _shards(root, "blocks"):
        yield iter([item]) if isinstance(item, Found) else _scan_shard(*item, fix, stale_temp, verify, lister)


def stream_entries(shard: str, dir_fd: int) -> Iterator[os.DirEntry]:
    """A shard folder's entries, read ``LIST_CHUNK`` at a time: a whole shard of a million-block
    tier (about 4,000 entries) in one listing, a larger one in pieces, so memory stays bounded.
    (Listing before examining keeps the folder's reads in one run, as the whole-shard listing
    did; entry by entry measured slower at 1M blocks, on a busy machine.) Deleting an entry
    meanwhile is safe:
    ``readdir`` may or may not return entries added or removed since it started, and a scan only
    deletes an entry it has examined."""
    with os.scandir(dir_fd) as it:
        while batch := list(islice(it, LIST_CHUNK)):
            yield from batch


def _scan_shard(folder: str, shard: str, dir_fd: int, fix: bool,
                stale_temp: Callable[[int, float], bool], verify: bool, lister: Lister) -> Iterator[Found]:
    for entry in lister(shard, dir_fd):
        name = entry.name
        parsed = parse_block_entry(name)
        if parsed is None or not parsed[0].startswith(shard) or not entry.is_file(follow_symlinks=False):
            yield _skipped(folder, entry, parsed is not None)
            continue
        path = f"{folder}/{name}"
        if parsed[1] is not None:  # a temp file of writer parsed[1]
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            stale = stale_temp(parsed[1], st.st_mtime)
            removed = fix and stale and _unlink_same(name, dir_fd, st)
            yield Found(TEMP if stale else WRITING, path, size=st.st_size, mtime=st.st_mtime, removed=removed)
            continue
        try:
            fd, st = open_regular(name, dir_fd)
        except FileNotFoundError:
            continue
        except OSError as e:  # replaced by a symlink (ELOOP) or a FIFO meanwhile
            yield Found(SKIPPED, path, why=f"cannot open safely: {e.strerror}")
            continue
        try:
            found = _examine(fd, st, name, path, verify)
        finally:
            os.close(fd)
        if found.kind == DAMAGED and fix:
            found = found._replace(removed=_unlink_same(name, dir_fd, st))
        yield found


def _examine(fd: int, st: os.stat_result, name: str, path: str, verify: bool) -> Found:
    """A block file's header (and payload, with ``verify``) checked against its name and size."""
    found = Found(BLOCK, path, size=st.st_size, mtime=st.st_mtime)
    try:
        meta = unpack_header(os.pread(fd, HEADER_SIZE, 0), path)
    except FormatError as e:
        return found._replace(kind=DAMAGED if e.corrupt else OTHER_VERSION, why=str(e).removeprefix(f"{path}: "))
    except OSError as e:
        return found._replace(kind=SKIPPED, why=f"unreadable: {e.strerror}")
    if st.st_size != HEADER_SIZE + meta.size:
        why = f"size {st.st_size - HEADER_SIZE} bytes, header says {meta.size}"
    elif name != block_name(meta.key.hex()):
        why = "file name does not match the key in its header"
    elif verify and _payload_checksum(fd, meta.size) != meta.checksum:
        why = "payload checksum mismatch"
    else:
        return found._replace(meta=meta)
    return found._replace(kind=DAMAGED, why=why)


def examine_block(root: Path | str, key_hex: str, *, verify: bool) -> Found | None:
    """The block file of ``key_hex`` (32 hex digits) examined as a scan examines it, under the
    same rules (no symlink followed, only a regular file opened): its ``Found``, or None if there
    is no such file or it cannot be opened safely. ``kvstrata check`` asks it whether a tail
    marker's block is servable, instead of holding every tail block's key."""
    name, where = block_name(key_hex), os.path.join(root, "blocks")
    fds: list[int] = []
    try:
        fds.append(os.open(where, OPEN_DIR))
        fds.append(os.open(key_hex[:2], OPEN_DIR, dir_fd=fds[0]))
        fd, st = open_regular(name, fds[1])
        fds.append(fd)
        return _examine(fd, st, name, f"{where}/{key_hex[:2]}/{name}", verify)
    except OSError:  # missing, a symlink (ELOOP), not a regular file
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _payload_checksum(fd: int, size: int, chunk: int = 8 << 20) -> int:
    h = payload_hasher()
    offset, end = HEADER_SIZE, HEADER_SIZE + size
    while offset < end:
        data = os.pread(fd, min(chunk, end - offset), offset)
        if not data:
            break
        h.update(data)
        offset += len(data)
    return h.intdigest()


def _unlink_same(name: str, dir_fd: int, seen: os.stat_result) -> bool:
    """Delete ``name`` in ``dir_fd`` only if it is still the regular file that was examined (a
    writer may have published a fresh copy under the name since)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or (st.st_ino, st.st_dev) != (seen.st_ino, seen.st_dev):
            return False
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def scan_tails(root: Path | str, *, fix: bool, is_orphan: Callable[[str, int, str | None], bool],
               on_shard: Callable[[str], None] | None = None) -> Iterator[Found]:
    """Every entry of ``root/tails``: markers (``marker`` / ``orphan_marker`` per
    ``is_orphan(parent hex, ntok, key hex or None)``) and ``skipped`` entries. With ``fix``,
    orphan markers are deleted, then their parent folder if it is empty. Same rules as
    ``scan_folder``: no symlink followed, only kvstrata's names touched. ``on_shard(shard)`` is
    called as each shard folder is entered (progress)."""
    for item in _shards(root, "tails"):
        if isinstance(item, Found):
            yield item
            continue
        folder, shard, shard_fd = item
        if on_shard is not None:
            on_shard(shard)
        for sub in _subfolders(folder, PARENT_RE, shard_fd, shard, ordered=False):
            if isinstance(sub, Found):
                yield sub
                continue
            parent, fd = sub
            yield from _scan_markers(f"{folder}/{parent}", parent, fd, fix, is_orphan)
            if fix:
                try:
                    os.rmdir(parent, dir_fd=shard_fd)  # only if empty
                except OSError:
                    pass


def _scan_markers(folder: str, parent: str, dir_fd: int, fix: bool,
                  is_orphan: Callable[[str, int, str | None], bool]) -> Iterator[Found]:
    for entry in stream_entries(parent, dir_fd):
        marker = parse_marker(entry.name)
        if not marker or not entry.is_file(follow_symlinks=False):
            yield _skipped(folder, entry, bool(marker))
            continue
        path = f"{folder}/{entry.name}"
        if not is_orphan(parent, *marker):
            yield Found(MARKER, path)
            continue
        removed = False
        if fix:
            try:
                removed = _unlink_same(entry.name, dir_fd, entry.stat(follow_symlinks=False))
            except OSError:
                pass
        yield Found(ORPHAN, path, why="its block is gone", removed=removed)
