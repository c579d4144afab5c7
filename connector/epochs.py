"""epochs.py: namespace epochs (``EpochStore``: ``get``, ``bump``; ``MemoryEpochs``, ``FileEpochs``)
and ``Retired``, the generations seen replaced. Bumping an epoch hides every older entry of that
namespace at once. Each store also keeps the namespaces' descriptors (``describe``, ``descriptor``;
see ``describe.py``) beside the generations. (Over 300 lines: the rules below and the two stores
here that follow them, most of it ``FileEpochs`` on a folder other processes write too.)

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
``FileEpochs`` (every process sharing a folder: one small file per namespace, replaced atomically,
checked with one stat() per lookup), ``RedisEpochs`` in ``tiers/redis_epochs.py`` (every instance sharing
the Redis).
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

from .describe import MAX_BYTES as _MAX_DESCRIPTOR, SUFFIX as _DESCRIPTOR_SUFFIX

log = logging.getLogger(__name__)
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


def _read_head(path: Path, limit: int) -> bytes:
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
                    text = _read_head(path, 32 * _KEEP_RETIRED).decode("ascii", errors="replace")
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
            _write_atomic(path, text, self._mode)
        except OSError as e:  # the floor is a second line of defence: never fail a lookup on it
            log.warning("kvstrata epochs: cannot record retired generation in %s: %s", path, e)


def _temp_name(path: Path, suffix: str) -> Path:
    # random part: hosts sharing the folder may run writers with the same pid and thread id
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


def _write_new(tmp: Path, text: str, mode: int) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # exact bits, whatever the umask
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = _temp_name(path, "tmp")
    try:
        _write_new(tmp, text, mode)
        os.replace(tmp, path)  # replaces a planted link or FIFO itself, never what it points to
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_descriptor(root: Path, ns_seed: bytes) -> bytes | None:
    """A namespace's descriptor file in ``root`` as stored (untrusted, at most one byte over the
    limit, so that an oversized one shows): None if there is none, ``b""`` if what is there is
    not a readable regular file (a planted link, FIFO or folder)."""
    try:
        return _read_head(root / f"{ns_seed.hex()}{_DESCRIPTOR_SUFFIX}", _MAX_DESCRIPTOR + 1)
    except FileNotFoundError:
        return None
    except OSError:
        return b""


def write_descriptor(root: Path, ns_seed: bytes, blob: bytes, mode: int) -> None:
    """Replace the descriptor file atomically, unless it already holds ``blob``. Raises OSError."""
    if read_descriptor(root, ns_seed) != blob:  # every instance describes at start: write once
        _write_atomic(root / f"{ns_seed.hex()}{_DESCRIPTOR_SUFFIX}", blob.decode("ascii"), mode)


class EpochStore(ABC):
    """Current generation per namespace. ``get`` never returns a retired generation."""

    @abstractmethod
    def get(self, ns_seed: bytes) -> int:
        """Current generation of a namespace, created (atomically) if there is none."""

    @abstractmethod
    def bump(self, ns_seed: bytes) -> int:
        """Replace the generation by a fresh one; returns it."""

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


class FileEpochs(EpochStore):
    """``<root>/<seed hex>``: the generation as decimal text, re-read only when stat() changes.

    A missing file is created with ``link()`` of a complete temp file, which fails if another
    process created it first (no locks: NFS has none), so concurrent creators agree. Two
    concurrent bumps both replace the file; the last one wins, and both hide every older entry,
    which is all a bump has to do. A file that does not hold a valid generation, or holds a
    retired one, is lost state and is replaced by a fresh generation.
    """

    def __init__(self, root: Path, modes: tuple[int, int] = (0o700, 0o600)) -> None:
        """``modes``: of the folder (if created here) and of the files written; a shared folder
        passes its group bits so that every instance of the group can read and replace them."""
        self._root = root
        self._file_mode = modes[1]
        from .tiers.folder import make_folder  # here: the tiers package imports this module

        make_folder(root, modes[0])  # concurrent creators are fine; an existing folder keeps its mode
        self._lock = threading.Lock()
        self._cache: dict[bytes, tuple[tuple[int, int, int], int]] = {}
        self._private: dict[bytes, int] = {}
        self.retired = Retired(root, modes[1])

    def _path(self, ns_seed: bytes) -> Path:
        return self._root / ns_seed.hex()

    def get(self, ns_seed: bytes) -> int:
        """Never raises: a namespace whose file cannot be read or written (a planted folder, a
        read-only or full disk) gets a generation private to this process, so its blocks are
        misses for everyone else and nothing older becomes valid."""
        try:
            gen = self._get(ns_seed)
        except OSError as e:
            with self._lock:
                private = self._private.get(ns_seed)
                if private is None:
                    private = self._private[ns_seed] = new_generation()
                    log.warning("kvstrata epochs: %s; namespace %s uses a generation private to this "
                                "process (no sharing of its blocks until this is fixed)", e, ns_seed.hex())
            return private
        with self._lock:
            self._private.pop(ns_seed, None)
        return gen

    def _get(self, ns_seed: bytes) -> int:
        path = self._path(ns_seed)
        for _ in range(8):  # a concurrent create or replace: read again
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._create(path)
                continue
            if not stat.S_ISREG(st.st_mode):  # a planted link, FIFO or folder is lost state
                log.warning("kvstrata epochs: %s is not a regular file; starting a new generation", path)
                self._replace(ns_seed, None)
                continue
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._cache.get(ns_seed)
            if cached and cached[0] == stamp:
                return cached[1]
            try:
                raw = _read_head(path, 64)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("kvstrata epochs: cannot read %s: %s", path, e)
                return cached[1] if cached else self._replace(ns_seed, None)
            gen = parse_generation(raw)
            if gen is None or (ns_seed, gen) in self.retired:
                what = "a retired generation" if gen is not None else f"no valid generation ({raw[:32]!r})"
                log.warning("kvstrata epochs: %s holds %s; starting a new generation "
                            "(older blocks of this namespace become misses)", path, what)
                self._replace(ns_seed, gen)
                continue
            with self._lock:
                previous = self._cache.get(ns_seed)
                self._cache[ns_seed] = (stamp, gen)
            if previous and previous[1] != gen:
                self.retired.add(ns_seed, previous[1])
            return gen
        raise OSError(f"kvstrata epochs: {path} keeps changing; cannot read a stable generation")

    def _create(self, path: Path) -> None:
        tmp = _temp_name(path, "new")
        _write_new(tmp, f"{new_generation()}\n", self._file_mode)
        try:
            os.link(tmp, path)  # atomic create-if-absent: the first creator wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def _replace(self, ns_seed: bytes, old: int | None) -> int:
        if old is not None:
            self.retired.add(ns_seed, old)
        gen = new_generation()
        _write_atomic(self._path(ns_seed), f"{gen}\n", self._file_mode)
        return gen

    def bump(self, ns_seed: bytes) -> int:
        old = self.get(ns_seed)
        gen = self._replace(ns_seed, old)
        with self._lock:
            self._cache.pop(ns_seed, None)
        return gen

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        try:
            write_descriptor(self._root, ns_seed, blob, self._file_mode)
        except OSError as e:
            log.warning("kvstrata epochs: cannot record what namespace %s is in %s: %s", ns_seed.hex(), self._root, e)

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        return read_descriptor(self._root, ns_seed)

    def known(self) -> list[bytes]:
        out = []
        for p in self._root.iterdir():
            if len(p.name) == 32 and not p.name.startswith("."):
                try:
                    out.append(bytes.fromhex(p.name))
                except ValueError:
                    pass
        return out
