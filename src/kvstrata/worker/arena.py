"""worker/arena.py: the shared L1 arena, one file in ``/dev/shm`` that the store and the engine's
workers map (``create_shared_arena``, ``attach_shared_arena``, ``release_shared_arena``,
``remove_dead_arenas``), and ``Prefaulter``, which maps an arena's pages ahead of use.

The file lives until it is deleted, and holds its memory until then: its creator holds a lock on it
for its whole life, and an arena whose creator is gone (however it ended) is deleted by the next
start (``remove_dead_arenas``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import time

import torch

from kvstrata.tiers.base import pid_alive

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python < 3.13 lacks the name
ARENA_GRACE_S = 10.0  # an arena younger than this is never removed (its creator may not hold its lock yet)
_ARENA_RE = re.compile(r"kvstrata-([1-9][0-9]{0,6})-[0-9a-f]{8}")
_arena_locks: dict[str, int] = {}  # path -> fd holding the flock of an arena this process created
_arena_locks_guard = threading.Lock()


def create_shared_arena(path: str, num_slots: int, slot_bytes: int) -> tuple[torch.Tensor, "Prefaulter"]:
    """A file-backed arena other processes on this host can map (the engine's worker does).

    The file's pages are allocated up front (``posix_fallocate``): a full tmpfs (``/dev/shm`` by
    default) then fails here with a clear message instead of killing the process with SIGBUS on a
    later write, and no block copy pays for allocating and zeroing pages.

    The creating process holds an exclusive ``flock`` on the file until ``release_shared_arena``
    (the kernel drops it when the process ends, however it ends): that lock, not the pid in the
    name, is what tells ``remove_dead_arenas`` in another process that the arena is alive (that
    process may be in another PID namespace sharing the folder, where the pid means nothing).
    """
    size = num_slots * slot_bytes
    folder = os.path.dirname(path) or "."
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ValueError(f"l1.size: the shared L1 arena needs {size} bytes but {folder} has only "
                         f"{free} free; lower l1.size or enlarge {folder}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise ValueError(f"l1.size: cannot allocate the {size}-byte shared L1 arena in {folder}: {e}; "
                         f"lower l1.size or enlarge {folder}") from None
    with _arena_locks_guard:
        _arena_locks[path] = fd
    return attach_shared_arena(path, num_slots, slot_bytes)


def release_shared_arena(path: str) -> None:
    """Unlink an arena this process created and drop its lock (mappings stay valid until their
    processes drop them). Idempotent."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _arena_locks_guard:
        fd = _arena_locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_dead_arenas(folder: str) -> list[str]:
    """Delete the arenas in ``folder`` (``kvstrata-<pid>-<hex>``) whose creator is gone, and
    return their names. A file in /dev/shm lives until deleted, and holds its memory until then.

    An arena is removed only if all of these hold: it is a regular file (nothing is followed);
    it is older than ``ARENA_GRACE_S``; the pid in its name is not alive here; and its creator's
    lock can be taken, i.e. no process anywhere holds it (a live peer in another PID namespace
    sharing the folder does, whatever its pid looks like here). The lock is held while unlinking."""
    removed: list[str] = []
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        with os.scandir(dfd) as it:
            entries = [e for e in it if _ARENA_RE.fullmatch(e.name)]
        for entry in entries:
            if _dead_arena(entry, dfd):
                removed.append(entry.name)
    finally:
        os.close(dfd)
    return removed


def _dead_arena(entry: os.DirEntry, dfd: int) -> bool:
    pid = int(entry.name.split("-")[1])
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < ARENA_GRACE_S or pid_alive(pid):
        return False
    try:
        fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return False
    try:
        now = os.fstat(fd)
        if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):  # replaced since it was listed
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its creator is alive, wherever it runs
            return False
        os.unlink(entry.name, dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def attach_shared_arena(path: str, num_slots: int, slot_bytes: int) -> tuple[torch.Tensor, "Prefaulter"]:
    """Map an arena created by ``create_shared_arena`` (possibly in another process).

    Returns the ``[num_slots, slot_bytes]`` tensor and the mapping's ``Prefaulter``: call its
    ``ahead_of(offset)`` as slots get used, so that pages are mapped before the copies touch them.
    """
    size = num_slots * slot_bytes
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    tensor = torch.frombuffer(mm, dtype=torch.uint8).view(num_slots, slot_bytes)  # holds a reference to mm
    return tensor, Prefaulter(mm, size)


class Prefaulter:
    """Maps an arena's pages into this process ahead of use, on a background thread.

    A copy into a freshly mapped page takes a page fault per 4 KiB, which makes staging a hit into
    an untouched part of the arena several times slower. ``MADV_POPULATE_WRITE`` maps pages
    without touching their bytes (a few MiB per call, so the GIL is never held long), but only
    ``AHEAD`` bytes beyond the highest slot in use: populating a whole multi-GiB arena at start-up
    competes with the engine for the CPU for seconds. Slots are handed out lowest first.

    The mapped range is topped up only once less than half of ``AHEAD`` is left, and the thread
    runs at the lowest CPU priority: topping up a little on every new slot would put the page
    faults of each hit's worth of pages (in the store's mapping and the worker's) inside that very
    request, competing with it for the CPU.
    """

    AHEAD = 256 << 20
    CHUNK = 2 << 20

    def __init__(self, mm: mmap.mmap, size: int) -> None:
        self._mm, self._size = mm, size
        self._lock = threading.Lock()
        self._target = self._done = 0
        self._running = False
        self.ahead_of(0)

    def ahead_of(self, offset: int) -> None:
        if self._target >= self._size or self._target - offset > self.AHEAD // 2:
            return  # the common case: enough is mapped ahead; no lock
        want = min(self._size, offset + self.AHEAD)
        with self._lock:
            self._target = max(self._target, want)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="kvstrata-l1-prefault", daemon=True).start()

    def _run(self) -> None:
        try:  # Linux: a thread id sets that thread's niceness only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._lock:
                if self._done >= self._target:
                    self._running = False  # the thread ends: nothing keeps the mapping alive
                    return
                lo, hi = self._done, min(self._done + self.CHUNK, self._target)
            try:
                self._mm.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
            except (OSError, ValueError) as e:  # kernel < 5.14 (EINVAL), map closed: fault on use
                log.debug("kvstrata L1: arena not prefaulted: %s", e)
                with self._lock:
                    self._done = self._target = self._size
                    self._running = False
                return
            with self._lock:
                self._done = hi
            time.sleep(0)  # let the engine's threads run between chunks
