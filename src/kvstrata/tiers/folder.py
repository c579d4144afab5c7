"""tiers/folder.py: a tier folder's names and its safe file operations, for a folder kvstrata
does not control (L2, and even more a shared folder every host writes to).

Anyone who can write there can plant symlinks into other folders, FIFOs that block an ``open``,
sockets, folders named like blocks, or files of other programs and other kvstrata versions. So:
never follow a symlink (``O_NOFOLLOW``, ``openat`` and ``unlinkat`` on folder descriptors), open
only regular files, with ``O_NONBLOCK`` so that a FIFO opens at once (``open_regular``), and
delete only regular files with kvstrata's own names (``scan``). The names, written and parsed
here only::

    blocks/ab/<key hex>.kvb                 a block (``block_name``)
    blocks/ab/.<key hex>.<pid>.<n>.tmp      a write in progress (``temp_name``, ``parse_block_entry``)
    tails/ab/<parent hex>/<ntok>.<key hex>  a partial block's marker (``marker_name``, ``parse_marker``)

Also the folder's creation (``make_folder``, ``prepare_shards``, ``warn_if_open``), a write that
reports the real error of a full disk (``write_all``) and the log of one (``FullDisk``), and the
bound on runs per vectored call (``check_runs``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Sequence

from kvstrata.metrics import Counters

log = logging.getLogger(__name__)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv/pwritev

SUFFIX = ".kvb"
SHARDS = tuple(f"{i:02x}" for i in range(256))
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
SHARD_RE = re.compile(r"[0-9a-f]{2}")
PARENT_RE = re.compile(r"[0-9a-f]{32}")
_BLOCK_RE = re.compile(r"([0-9a-f]{32})\.kvb")
_TEMP_RE = re.compile(r"\.([0-9a-f]{32})\.([1-9][0-9]{0,6})\.[0-9]{1,20}\.tmp")
_MARKER_RE = re.compile(r"([0-9]{1,8})(?:\.([0-9a-f]{32}))?")
_SHOWN = 80  # characters of a foreign name shown in messages
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem (or quota)


# ------------------------------------------------------------------------------ names
def block_name(key_hex: str) -> str:
    return key_hex + SUFFIX


def temp_name(key_hex: str, pid: int, n: int) -> str:
    """The temp file a writer (``pid``, its ``n``-th write) fills before renaming it to the block."""
    return f".{key_hex}.{pid}.{n}.tmp"


def parse_block_entry(name: str) -> tuple[str, int | None] | None:
    """An entry of a shard folder: ``(key hex, None)`` for a block's name, ``(key hex, writer
    pid)`` for a temp file's, None for a name kvstrata does not write."""
    if temp := _TEMP_RE.fullmatch(name):
        return temp.group(1), int(temp.group(2))
    if block := _BLOCK_RE.fullmatch(name):
        return block.group(1), None
    return None


def marker_name(ntok: int, key: bytes) -> str:
    return f"{ntok}.{key.hex()}"


def parse_marker(name: str) -> tuple[int, str | None] | None:
    """A tail marker's ``(ntok, key hex)``; the key is None in a bare ``<ntok>``, as older
    versions wrote. None for anything else."""
    m = _MARKER_RE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def marker_ntok(name: str) -> int | None:
    """Token count of a tail marker's name; None for anything else."""
    parsed = parse_marker(name)
    return parsed[0] if parsed else None


def shown(name: str) -> str:
    """A name read from a folder, fit for a message: odd characters escaped, cut to ~80."""
    text = name if name.isprintable() else ascii(name)[1:-1]
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words (for messages)."""
    for test, word in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "folder"), (stat.S_ISREG, "file")):
        if test(mode):
            return word
    return "device or special file"


def open_regular(name: str, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """Open a regular file for reading without following a symlink and without blocking (a FIFO);
    raise OSError (EINVAL for anything that is not a regular file) otherwise."""
    fd = os.open(name, OPEN_FILE, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"a {kind_of(st.st_mode)}, not a regular file")
    return fd, st


def make_folder(path: Path | str, mode: int) -> bool:
    """Create ``path`` (and missing parents) with ``mode``; True if this call created it.
    Another process creating it at the same time is not an error. Only a created folder gets
    ``mode`` set (``fchmod``, so the umask does not narrow it)."""
    for attempt in range(2):
        try:
            os.mkdir(path, mode)
            break
        except FileExistsError:
            return False
        except FileNotFoundError as e:
            # A missing parent: create it, once. If the folder still cannot be made (a filesystem
            # that refuses it, such as /proc, or a parent removed again at once), say so.
            if attempt:
                raise FileNotFoundError(e.errno, f"cannot create the folder {path}: its parent exists, "
                                                 f"but creating it fails with '{e.strerror}'") from e
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fd = os.open(path, OPEN_DIR)
    except OSError:  # replaced by something else meanwhile: leave it to the checks that follow
        return True
    try:
        os.fchmod(fd, mode | (os.fstat(fd).st_mode & stat.S_ISGID))  # keep a setgid folder's group
    finally:
        os.close(fd)
    return True


_warned_modes: set[str] = set()


def warn_if_open(root: Path, open_bits: int, label: str) -> None:
    """An existing tier root keeps its mode (it is the owner's choice, never changed); warn, once
    per process, if ``open_bits`` of it let users other than its owner write there."""
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if mode & open_bits and str(root) not in _warned_modes:
        _warned_modes.add(str(root))
        log.warning("kvstrata %s: %s has mode %s: other users can write there, and whoever writes there "
                    "decides which KV this engine serves; kvstrata leaves the mode of a folder it did not "
                    "create as it is (give it mode 0700, or let kvstrata create a new folder)",
                    label, root, oct(mode))


def prepare_shards(top: Path, dir_mode: int, label: str) -> set[str]:
    """Create ``top`` and its 256 shards (tolerating concurrent creators); the shards that are
    not real folders (a planted symlink, a file) are returned (``<top name>/<shard>``), never to
    be used."""
    make_folder(top, dir_mode)
    try:
        present = {e.name: e for e in os.scandir(top) if e.name in SHARDS}
    except OSError:  # not a folder, or a dangling link: found out just below
        present = {}
    if not stat.S_ISDIR(os.lstat(top).st_mode):
        log.warning("kvstrata %s: %s is not a real folder; this tier stores nothing", label, top)
        return {f"{top.name}/{s}" for s in SHARDS}
    bad = set()
    for shard in SHARDS:
        entry = present.get(shard)
        if entry is None:
            make_folder(top / shard, dir_mode)
        elif not entry.is_dir(follow_symlinks=False):
            bad.add(f"{top.name}/{shard}")
    if bad:
        log.warning("kvstrata %s: %d shard folders under %s are not real folders (e.g. symlinks) and are "
                    "not used; blocks hashed to them are not stored: %s", label, len(bad), top,
                    ", ".join(sorted(bad)[:8]))
    return bad


def write_all(fd: int, bufs: list[bytes | memoryview], total: int) -> None:
    """Write ``bufs`` at offset 0 with one ``pwritev``. A nearly full disk returns a short count
    before it fails with ENOSPC: the rest is then written on, so the caller sees the real error."""
    done = os.pwritev(fd, bufs, 0)
    if done == total:
        return
    skip, offset = done, done
    for buf in bufs:
        view = memoryview(buf).cast("B")
        if skip >= len(view):
            skip -= len(view)
            continue
        view, skip = view[skip:], 0
        while len(view):
            n = os.pwrite(fd, view, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at offset {offset}")
            offset += n
            view = view[n:]


class FullDisk:
    """A full filesystem (ENOSPC, EDQUOT) is logged once per burst, not once per block: the first
    dropped block names the folder; the first write that succeeds afterwards says how much was
    dropped meanwhile. Every drop is counted (``<tier>_full_drops``)."""

    def __init__(self, label: str, folder: Path, counters: Counters, counter: str) -> None:
        self._label, self._folder, self._counters, self._counter = label, folder, counters, counter
        self._lock = threading.Lock()
        self._blocks = self._bytes = 0

    def dropped(self, err: OSError, path: str, size: int) -> None:
        self._counters.inc(self._counter)
        with self._lock:
            first = self._blocks == 0
            self._blocks += 1
            self._bytes += size
        if first:
            log.warning("kvstrata %s: %s is full (%s): block %s (%d bytes) was not saved, nor will be any "
                        "block until space returns; requests are served and recompute what is missing",
                        self._label, self._folder, os.strerror(err.errno), os.path.basename(path), size)

    def resumed(self) -> None:
        if not self._blocks:  # the common case: no lock
            return
        with self._lock:
            blocks, size = self._blocks, self._bytes
            self._blocks = self._bytes = 0
        if blocks:
            log.warning("kvstrata %s: space is back in %s: saving again (%d blocks, %d bytes were dropped "
                        "while it was full)", self._label, self._folder, blocks, size)


def check_runs(parts: Sequence[memoryview], call: str) -> None:
    """Refuse more payload runs than one ``preadv``/``pwritev`` (``call``) takes with the header."""
    if len(parts) >= IOV_MAX:  # the header takes one buffer of the call too
        raise ValueError(f"{len(parts)} runs: one {call} takes at most {IOV_MAX - 1} besides the header")
