"""epochs/base.py: namespace epochs (``EpochStore``: ``get``, ``lookup_epoch``, ``bump``, ``reset``,
``joined``; ``MemoryEpochs``; ``PolledEpochs`` in ``epochs/polled.py``, the rules of epochs other
processes change) and ``Retired``, the epochs seen replaced. Bumping an epoch hides every older
entry of that namespace at once. Each store also keeps the namespaces' descriptors (``describe``,
``descriptor``; see ``epochs/descriptors.py``) and verification records (``record_verify``,
``verify_record``; see ``verify/record.py``) beside the epochs.

An epoch is a random non-zero 64-bit id, not a counter. The current epoch is part of block -1's
key (see keys.root_key), so after a bump no key of an older epoch is ever computed again, and the
index also rejects any entry whose epoch differs. Epochs are compared for equality only; they
have no order.

An epoch's high 32 bits are its *generation*, the weights its blocks were computed with (inside
the id, every backend and MAC'd value carries it unchanged). A flush (``bump``) keeps it; an engine
reset after a weight update (``reset``) starts a new one, which the other instances serve only
once they have joined it (``joins``); an epoch made after state loss is of generation 0.

Why random ids and not a counter alone: epoch state can be lost (an evicted Redis key, a restart
without persistence, ``FLUSHDB``, a deleted ``epochs/`` folder); a counter would restart at 0 and
revalidate invalidated blocks. A lost epoch is replaced by a fresh random one (an atomic
create-if-absent: every process agrees on it), so state loss costs hits, never correctness. A new
epoch repeats one of its generation (or a new generation an old one) with probability 2^-32.

A *restore* of old state (a backup, a Redis snapshot taken before a bump) is the way back: every
store remembers the epochs it has seen replaced (``retired``, bounded, on disk where it has a
folder) and replaces a retired epoch read back by a fresh one. With a secret, an epoch value also
carries a counter under its MAC and every store keeps the highest seen (the floor, ``epochs/floor.py``,
also MAC'd in the shared tier): an older value written back is refused.

Where the epoch lives decides who sees a bump: ``MemoryEpochs`` (this process),
``FileEpochs`` in ``epochs/folder.py`` (every process sharing a folder: one small file per
namespace, replaced atomically), ``RedisEpochs`` in ``epochs/redis.py`` (every instance
sharing the Redis). The last two are ``PolledEpochs``: an instance that cannot read the shared
state cannot know of a bump made elsewhere, so an epoch is used by lookups only within a bound
of its last confirmation, and a bump that could not be written serves nothing until it is.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import threading
from abc import ABC, abstractmethod
from collections import deque
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
MAX_EPOCH = (1 << 64) - 1
_MAX_EPOCH_TEXT = 64  # an epoch is at most 20 digits; whitespace around it is allowed
_KEEP_RETIRED = 64  # epochs remembered per namespace; a restore older than that goes unseen
_GENERATION_SHIFT = 32


def new_epoch(generation: int = 0) -> int:
    """A fresh epoch of ``generation`` (0: made after state loss) with 32 random non-zero bits."""
    assert 0 <= generation < 1 << _GENERATION_SHIFT, generation
    return generation << _GENERATION_SHIFT | (int.from_bytes(os.urandom(4), "little") or 1)


def new_generation() -> int:
    """A fresh random non-zero generation (an engine reset: new weights)."""
    return int.from_bytes(os.urandom(4), "little") or 1


def generation(epoch: int) -> int:
    """The generation of an epoch: its high 32 bits (0: made after the stored epoch was lost)."""
    return epoch >> _GENERATION_SHIFT


def parse_epoch(raw: object) -> int | None:
    """A stored epoch (bytes or str of ASCII decimal digits, surrounding whitespace allowed)
    as an int in [1, 2^64), None for anything else: any type, length or content is answered, never
    raised on, since the value comes from a file or a server other hosts write."""
    if isinstance(raw, (bytes, bytearray)):
        if len(raw) > _MAX_EPOCH_TEXT:  # checked before decoding: a huge value costs nothing
            return None
        try:
            raw = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(raw, str) or len(raw) > _MAX_EPOCH_TEXT:
        return None
    text = raw.strip()
    # isascii: str.isdigit() also accepts digits int() refuses ("²") or reads (Arabic-Indic)
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        return None
    value = int(text)
    return value if 0 < value <= MAX_EPOCH else None


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
    """Epochs seen replaced, per namespace (bounded), optionally persisted in a folder.

    The persisted file (``<root>/<seed hex>.retired``, one id per line) is the local floor: it
    survives a restart and the loss of the shared state, so a restored old epoch is refused
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
                    value = parse_epoch(line)
                    if value is not None:
                        ids.append(value)
        return ids

    def __contains__(self, item: tuple[bytes, int]) -> bool:
        ns_seed, epoch = item
        with self._lock:
            return epoch in self._load(ns_seed)

    def add(self, ns_seed: bytes, epoch: int) -> None:
        with self._lock:
            ids = self._load(ns_seed)
            if epoch in ids:
                return
            ids.append(epoch)
            path = self._file(ns_seed)
            if path is None:
                return
            text = "".join(f"{g}\n" for g in ids)
        try:
            write_atomic(path, text, self._mode)
        except OSError as e:  # the floor is a second line of defence: never fail a lookup on it
            log.warning("kvstrata epochs: cannot record retired epoch in %s: %s", path, e)


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


class Reset(NamedTuple):
    """What an engine reset did (``EpochStore.reset``)."""

    epoch: int | None  # the epoch now joined; None: not written where the others read it (retried at every use)
    joined: bool  # True: it joined the epoch of another instance's reset (nothing written); False: a new generation


class EpochStore(ABC):
    """Current epoch per namespace. ``get`` never returns a retired epoch."""

    @abstractmethod
    def get(self, ns_seed: bytes) -> int:
        """Current epoch of a namespace, created (atomically) if there is none: the one
        saves are keyed under."""

    def lookup_epoch(self, ns_seed: bytes, since: float) -> tuple[int, bool]:
        """The epoch for a lookup that started at ``since`` (``time.monotonic()``), and
        whether the lookup may use it: False when this store cannot vouch that it was still
        current ``bound`` before ``since`` (see ``PolledEpochs``); the lookup is then a miss.
        Stores only this process changes always vouch."""
        return self.get(ns_seed), True

    @abstractmethod
    def bump(self, ns_seed: bytes) -> int | None:
        """A flush: replace the epoch by a fresh one of the same generation (every instance
        adopts it); returns it, or None when it could not be written where the other processes
        read it. After a failed bump the namespace serves nothing (``lookup_epoch`` says False)
        until the new epoch is written, which is retried at every use."""

    @abstractmethod
    def reset(self, ns_seed: bytes) -> Reset:
        """An engine reset after a weight update: join the current epoch if another instance's reset
        made it after this one last joined (``joins``), else replace it by an epoch of a new
        generation, which the others serve once they have reset too. Fails as ``bump``."""

    def joined(self, ns_seed: bytes) -> bool:
        """Whether this instance has joined the namespace's current epoch (False: it serves and saves
        nothing of it until it resets itself). Stores only this process changes always have."""
        return True

    def not_joined(self) -> list[bytes]:
        """The namespaces this instance has not joined."""
        return []

    def known(self) -> list[bytes]:
        """Namespace seeds this store has an epoch for."""
        return []

    @abstractmethod
    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        """Keep a namespace's descriptor (``describe.encode``) beside its epoch. Best
        effort: a failure is logged, never raised (it costs names in ``stats``, not hits)."""

    @abstractmethod
    def descriptor(self, ns_seed: bytes) -> bytes | None:
        """The descriptor kept for a namespace, as stored: untrusted, ``describe.decode`` it."""

    def record_verify(self, ns_seed: bytes, blob: bytes) -> bool:
        """Replace a namespace's verification record (``verify.record.encode``) beside its epoch.
        Never raises: False when not written (logged; it costs the record, not hits)."""
        return False

    def verify_record(self, ns_seed: bytes) -> bytes | None:
        """The verification record kept for a namespace, as stored (None: none): untrusted, decode it.
        Raises ``OSError`` when unreadable: whoever adds to it must not replace unread totals."""
        return None

    def close(self) -> None:
        """Stop background work (subscribers); epochs already written stay."""


class MemoryEpochs(EpochStore):
    """Epochs of this process only (no tier outlives it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: dict[bytes, int] = {}
        self._descriptors: dict[bytes, bytes] = {}
        self._records: dict[bytes, bytes] = {}

    def get(self, ns_seed: bytes) -> int:
        with self._lock:
            epoch = self._epochs.get(ns_seed)
            if epoch is None:
                epoch = self._epochs[ns_seed] = new_epoch()
            return epoch

    def bump(self, ns_seed: bytes) -> int:
        with self._lock:
            epoch = self._epochs[ns_seed] = new_epoch(generation(self._epochs.get(ns_seed, 0)))
            return epoch

    def reset(self, ns_seed: bytes) -> Reset:
        with self._lock:
            epoch = self._epochs[ns_seed] = new_epoch(new_generation())
            return Reset(epoch, False)

    def known(self) -> list[bytes]:
        with self._lock:
            return list(self._epochs)

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        with self._lock:
            self._descriptors[ns_seed] = blob

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        with self._lock:
            return self._descriptors.get(ns_seed)

    def record_verify(self, ns_seed: bytes, blob: bytes) -> bool:
        with self._lock:
            self._records[ns_seed] = blob
            return True

    def verify_record(self, ns_seed: bytes) -> bytes | None:
        with self._lock:
            return self._records.get(ns_seed)
