"""epochs.py: namespace epochs (``EpochStore``: ``get``, ``lookup_generation``, ``bump``;
``MemoryEpochs``; ``PolledEpochs``, the rules of generations other processes change) and
``Retired``, the generations seen replaced. Bumping an epoch hides every older entry of that
namespace at once. Each store also keeps the namespaces' descriptors (``describe``, ``descriptor``;
see ``describe.py``) beside the generations.

An epoch is a *generation*: a random non-zero 64-bit id, not a counter. The current generation is
part of block -1's key (see keys.root_key), so after a bump no key of an older generation is ever
computed again, and the index also rejects any entry whose generation differs. Generations are
compared for equality only; they have no order.

Why random ids and not a counter: epoch state can be lost (an evicted or deleted Redis key, a Redis
restart without persistence, ``FLUSHDB``, a deleted ``epochs/`` folder). A counter then restarts at
0 and hands out values that already had blocks, which makes invalidated blocks valid again. A lost
generation is replaced by a fresh random one (created with an atomic create-if-absent, so every
process sharing the state agrees on it): state loss costs hits, never correctness. A 64-bit random
id recurs with probability 2^-64 per bump.

The remaining way back is a *restore* of old state (a backup of the epochs folder, a Redis snapshot
taken before a bump). Every store therefore remembers the generations it has seen replaced
(``retired``, bounded, and kept on disk where the store has a folder: the local floor) and treats a
retired generation read back as lost state: it is replaced by a fresh one.

Where the generation lives decides who sees a bump: ``MemoryEpochs`` (this process),
``FileEpochs`` in ``tiers/file_epochs.py`` (every process sharing a folder: one small file per
namespace, replaced atomically), ``RedisEpochs`` in ``tiers/redis_epochs.py`` (every instance
sharing the Redis). The last two are ``PolledEpochs``: an instance that cannot read the shared
state cannot know of a bump made elsewhere, so a generation is used by lookups only within a bound
of its last confirmation, and a bump that could not be written serves nothing until it is.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import stat
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import Callable, TypeVar

from .describe import MAX_BYTES as _MAX_DESCRIPTOR, SUFFIX as _DESCRIPTOR_SUFFIX

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_GENERATION = (1 << 64) - 1
_MAX_GENERATION_TEXT = 64  # a generation is at most 20 digits; whitespace around it is allowed
_KEEP_RETIRED = 64  # generations remembered per namespace; a restore older than that goes unseen


def new_generation() -> int:
    """A fresh random generation id in [1, 2^64)."""
    return int.from_bytes(os.urandom(8), "little") or 1


def parse_generation(raw: object) -> int | None:
    """A stored generation (bytes or str of ASCII decimal digits, surrounding whitespace allowed)
    as an int in [1, 2^64), None for anything else: any type, length or content is answered, never
    raised on, since the value comes from a file or a server other hosts write."""
    if isinstance(raw, (bytes, bytearray)):
        if len(raw) > _MAX_GENERATION_TEXT:  # checked before decoding: a huge value costs nothing
            return None
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(raw, str) or len(raw) > _MAX_GENERATION_TEXT:
        return None
    text = raw.strip()
    # isascii: str.isdigit() also accepts digits int() refuses ("²") or reads (Arabic-Indic)
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        return None
    value = int(text)
    return value if 0 < value <= MAX_GENERATION else None


def read_head(path: Path, limit: int) -> bytes:
    """The first ``limit`` bytes of a regular file, never following a symlink or waiting on a
    FIFO (a planted one would hang the engine's start); anything else raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


class Retired:
    """Generations seen replaced, per namespace (bounded), optionally persisted in a folder.

    The persisted file (``<root>/<seed hex>.retired``, one id per line) is the local floor: it
    survives a restart and the loss of the shared state, so a restored old generation is refused
    even by a freshly started process that shares this folder.
    """

    def __init__(self, root: Path | None = None, file_mode: int = 0o600) -> None:
        self._root = root
        self._mode = file_mode
        self._lock = threading.Lock()
        self._ids: dict[bytes, deque[int]] = {}

    def _file(self, ns_seed: bytes) -> Path | None:
        return None if self._root is None else self._root / f"{ns_seed.hex()}.retired"

    def _load(self, ns_seed: bytes) -> deque[int]:
        ids = self._ids.get(ns_seed)
        if ids is None:
            ids = self._ids[ns_seed] = deque(maxlen=_KEEP_RETIRED)
            path = self._file(ns_seed)
            if path is not None:
                try:
                    text = read_head(path, 32 * _KEEP_RETIRED).decode("ascii", errors="replace")
                except OSError:
                    text = ""
                for line in text.splitlines()[-_KEEP_RETIRED:]:
                    value = parse_generation(line)
                    if value is not None:
                        ids.append(value)
        return ids

    def __contains__(self, item: tuple[bytes, int]) -> bool:
        ns_seed, gen = item
        with self._lock:
            return gen in self._load(ns_seed)

    def add(self, ns_seed: bytes, gen: int) -> None:
        with self._lock:
            ids = self._load(ns_seed)
            if gen in ids:
                return
            ids.append(gen)
            path = self._file(ns_seed)
            if path is None:
                return
            text = "".join(f"{g}\n" for g in ids)
        try:
            write_atomic(path, text, self._mode)
        except OSError as e:  # the floor is a second line of defence: never fail a lookup on it
            log.warning("kvstrata epochs: cannot record retired generation in %s: %s", path, e)


def temp_name(path: Path, suffix: str) -> Path:
    # random part: hosts sharing the folder may run writers with the same pid and thread id
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


def write_new(tmp: Path, text: str, mode: int) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # exact bits, whatever the umask
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = temp_name(path, "tmp")
    try:
        write_new(tmp, text, mode)
        os.replace(tmp, path)  # replaces a planted link or FIFO itself, never what it points to
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_descriptor(root: Path, ns_seed: bytes) -> bytes | None:
    """A namespace's descriptor file in ``root`` as stored (untrusted, at most one byte over the
    limit, so that an oversized one shows): None if there is none, ``b""`` if what is there is
    not a readable regular file (a planted link, FIFO or folder)."""
    try:
        return read_head(root / f"{ns_seed.hex()}{_DESCRIPTOR_SUFFIX}", _MAX_DESCRIPTOR + 1)
    except FileNotFoundError:
        return None
    except OSError:
        return b""


def write_descriptor(root: Path, ns_seed: bytes, blob: bytes, mode: int) -> None:
    """Replace the descriptor file atomically, unless it already holds ``blob``. Raises OSError."""
    if read_descriptor(root, ns_seed) != blob:  # every instance describes at start: write once
        write_atomic(root / f"{ns_seed.hex()}{_DESCRIPTOR_SUFFIX}", blob.decode("ascii"), mode)


class EpochStore(ABC):
    """Current generation per namespace. ``get`` never returns a retired generation."""

    @abstractmethod
    def get(self, ns_seed: bytes) -> int:
        """Current generation of a namespace, created (atomically) if there is none: the one
        saves are keyed under."""

    def lookup_generation(self, ns_seed: bytes, since: float) -> tuple[int, bool]:
        """The generation for a lookup that started at ``since`` (``time.monotonic()``), and
        whether the lookup may use it: False when this store cannot vouch that it was still
        current ``bound`` before ``since`` (see ``PolledEpochs``); the lookup is then a miss.
        Stores only this process changes always vouch."""
        return self.get(ns_seed), True

    @abstractmethod
    def bump(self, ns_seed: bytes) -> int | None:
        """Replace the generation by a fresh one; returns it, or None when it could not be
        written where the other processes read it. After a failed bump the namespace serves
        nothing (``lookup_generation`` says False) until the new generation is written, which
        is retried at every use."""

    def known(self) -> list[bytes]:
        """Namespace seeds this store has a generation for."""
        return []

    @abstractmethod
    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        """Keep a namespace's descriptor (``describe.encode``) beside its generation. Best
        effort: a failure is logged, never raised (it costs names in ``stats``, not hits)."""

    @abstractmethod
    def descriptor(self, ns_seed: bytes) -> bytes | None:
        """The descriptor kept for a namespace, as stored: untrusted, ``describe.decode`` it."""

    def close(self) -> None:
        """Stop background work (subscribers); generations already written stay."""


class PolledEpochs(EpochStore):
    """Generations kept where other processes change them (a folder, Redis), each used by
    lookups only while *confirmed*: read back from there recently enough.

    ``get`` re-reads a namespace's generation when the last read is ``refresh_s`` old (or an
    announcement said it changed). Each read is stamped with the monotonic time at which it was
    *sent*: what it returns was current at some moment after that. A lookup that started at
    ``since`` may use the generation only if ``since - sent <= bound_s``; a generation retired at
    time T is therefore never used by a lookup that starts after ``T + bound_s``, however slow
    the reply was or however long this process was descheduled (a late reply carries its early
    stamp). While the shared state cannot be read (down, hung, timing out) lookups miss once the
    last confirmation is ``bound_s`` old: an unreachable tier costs hits, never a retired
    generation. ``bound_s`` None is the lenient policy: the last known generation is used however
    old its confirmation (it risks serving a generation retired elsewhere meanwhile).

    A bump retires the old generation here at once and marks the namespace *pending* until the
    new one is written: until then lookups miss, and every ``get`` retries the write. Saves meanwhile
    go under the new generation, computed after the reset, so they become valid when the write
    lands.

    Subclasses say how the generation is read (``_read``: creating or repairing it as needed),
    written (``_write``) and announced (``_announce``), and which failures are the service's
    (``_attempt``: the call's result, or ``default`` after a failure it has logged).
    """

    def __init__(self, retired: Retired, refresh_s: float, bound_s: float | None) -> None:
        self.retired = retired
        self._refresh_s, self._bound_s = refresh_s, bound_s
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one read or write of the shared state at a time
        self._known: dict[bytes, tuple[int, float]] = {}  # seed -> (generation, when its read was sent)
        self._pending: dict[bytes, int] = {}  # seed -> a bumped generation not written yet
        self._recheck: set[bytes] = set()  # announced changes: re-read at the next use
        self._private: dict[bytes, int] = {}  # never read (see ``_unread``)

    @abstractmethod
    def _read(self, ns_seed: bytes) -> int | None:
        """The stored generation (created if missing, replaced if bad or retired); None if no
        stable value could be read. Raises what ``_attempt`` turns into a failure."""

    @abstractmethod
    def _write(self, ns_seed: bytes, gen: int) -> None:
        """Store ``gen`` as the namespace's generation. Raises what ``_attempt`` turns into a failure."""

    def _announce(self, ns_seed: bytes) -> None:
        """Tell the other processes at once (best effort: they re-read within ``refresh_s``)."""

    @abstractmethod
    def _attempt(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` when the service failed (logged and counted here)."""

    def _remember(self, ns_seed: bytes, gen: int, sent: float) -> None:
        if (ns_seed, gen) in self.retired:  # a read that raced a bump of this process
            return
        with self._lock:
            previous = self._known.get(ns_seed)
            if ns_seed in self._pending or (previous is not None and previous[1] > sent):
                return  # a bump in flight, or a read sent later, wins
            self._known[ns_seed] = (gen, sent)
            self._private.pop(ns_seed, None)
        if previous is not None and previous[0] != gen:
            self.retired.add(ns_seed, previous[0])

    def _due(self, ns_seed: bytes, fresh_since: float) -> tuple[bool, int | None]:
        """Whether the namespace must be re-read now (its last read was sent before
        ``fresh_since``, or an announcement came), and its pending bump if any."""
        with self._lock:
            known = self._known.get(ns_seed)
            due = known is None or known[1] < fresh_since or ns_seed in self._recheck
            return due, self._pending.get(ns_seed)

    def _current(self, ns_seed: bytes) -> tuple[int, float] | None:
        """(generation, when its confirming read was sent), re-read or its pending bump written
        when due; None if it was never read. One thread reads at a time: the others wait for its
        answer, and take it if it is fresh for them (sent at most ``refresh_s`` before they came)
        instead of sending the same read (a slow tier sees one read, not one per thread)."""
        came = time.monotonic()
        due, pending = self._due(ns_seed, came - self._refresh_s)
        if due or pending is not None:
            with self._reading:
                due, pending = self._due(ns_seed, came - self._refresh_s)  # read meanwhile by another thread?
                if pending is not None:
                    self._complete(ns_seed, pending)
                elif due:
                    with self._lock:
                        self._recheck.discard(ns_seed)
                    sent = time.monotonic()
                    gen = self._attempt(lambda: self._read(ns_seed), None)
                    if gen is not None:
                        self._remember(ns_seed, gen, sent)
        with self._lock:
            return self._known.get(ns_seed)

    def _unread(self, ns_seed: bytes) -> int:
        """The generation of a namespace never read: private to this process (its saves are
        seen by nobody, and it is never served)."""
        with self._lock:
            return self._private.setdefault(ns_seed, new_generation())

    def get(self, ns_seed: bytes) -> int:
        current = self._current(ns_seed)
        return self._unread(ns_seed) if current is None else current[0]

    def lookup_generation(self, ns_seed: bytes, since: float) -> tuple[int, bool]:
        current = self._current(ns_seed)
        if current is None:
            return self._unread(ns_seed), False
        gen, sent = current
        if sent == -math.inf:  # a bump not written yet: nothing of the namespace is served
            return gen, False
        return gen, self._bound_s is None or since - sent <= self._bound_s

    def bump(self, ns_seed: bytes) -> int | None:
        with self._lock:
            old = self._known.get(ns_seed)
        if old is None:  # learn what is being retired, so that a restore of it is refused too
            old = self._current(ns_seed)
        gen = new_generation()
        with self._lock:
            self._pending[ns_seed] = gen
            self._known[ns_seed] = (gen, -math.inf)  # not confirmed until written
        if old is not None:
            self.retired.add(ns_seed, old[0])
        return gen if self._complete(ns_seed, gen) else None

    def _complete(self, ns_seed: bytes, gen: int) -> bool:
        """Write a pending bump; True once it is written (by this call or an earlier one)."""
        sent = time.monotonic()
        if not self._attempt(lambda: self._write(ns_seed, gen) or True, False):
            return False
        with self._lock:
            if self._pending.get(ns_seed) != gen:
                return True  # written meanwhile by another thread, or bumped again
            del self._pending[ns_seed]
            self._known[ns_seed] = (gen, sent)
        self._announce(ns_seed)
        return True

    def write_pending(self) -> None:
        """Try again to write the bumps that could not be written (a thread that watches the
        shared tier calls it, so that a reset lands when the tier is back, requests or not)."""
        with self._lock:
            pending = list(self._pending)
        for ns_seed in pending:
            self._current(ns_seed)

    def changed(self, ns_seed: bytes) -> None:
        """An announcement: re-read that namespace at its next use. It never sets a generation,
        so a forged or late one costs a read, nothing more."""
        with self._lock:
            self._recheck.add(ns_seed)


class MemoryEpochs(EpochStore):
    """Generations of this process only (no tier outlives it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: dict[bytes, int] = {}
        self._descriptors: dict[bytes, bytes] = {}

    def get(self, ns_seed: bytes) -> int:
        with self._lock:
            gen = self._epochs.get(ns_seed)
            if gen is None:
                gen = self._epochs[ns_seed] = new_generation()
            return gen

    def bump(self, ns_seed: bytes) -> int:
        with self._lock:
            gen = self._epochs[ns_seed] = new_generation()
            return gen

    def known(self) -> list[bytes]:
        with self._lock:
            return list(self._epochs)

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        with self._lock:
            self._descriptors[ns_seed] = blob

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        with self._lock:
            return self._descriptors.get(ns_seed)
