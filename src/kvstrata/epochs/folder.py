"""epochs/folder.py: ``FileEpochs``, namespace epochs (see ``epochs/base.py``) in a folder every
process that shares it reads and writes: L2's ``epochs/`` (the processes of one host) or the
shared folder's (``remote.backend: fs``, every host that mounts it).

Beside each epoch file ``<seed hex>``: ``<seed hex>.json``, the namespace's descriptor, and
``<seed hex>.verify``, its verification record (``verify/record.py``).

With a secret (``auth``: the shared folder's always, L2's with ``l2.authenticate``), an epoch
file holds ``<epoch>:<tag hex>``, a descriptor or a record ``<json>\n<tag hex>``, each MAC bound to
the namespace and the folder's kind (``domain``). An epoch that fails is lost state (a fresh epoch),
a descriptor or a record that fails is absent; each is counted (``<counter_prefix>_auth_epochs``,
``_auth_descriptors``, records among the descriptors, and ``_auth_failures``). An epoch file then also
carries a counter, and ``<seed hex>.floor`` the highest one seen (``epochs/floor.py``): a value
written back from an older copy is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

from kvstrata.format.auth import Auth
from kvstrata.format.block import TAG_SIZE
from kvstrata.epochs.base import Retired, new_epoch, parse_epoch, read_head, temp_name, write_atomic, write_new
from kvstrata.epochs.descriptors import read_descriptor, write_descriptor
from kvstrata.epochs.floor import VALUE_BYTES, Floor, open_epoch, seal_epoch
from kvstrata.epochs.polled import PolledEpochs, T
from kvstrata.metrics import Counters
from kvstrata.tiers.folder import make_folder
from kvstrata.verify.record import MAX_BYTES as _MAX_RECORD

log = logging.getLogger(__name__)
_LOCK_WAIT_S = 2.0  # a change that cannot take the lock this long fails (it stays pending, retried)
_LOCK_STALE_S = 10.0  # a lock this old (by its mtime) was left by a process that died holding it


class FileEpochs(PolledEpochs):
    """``<root>/<seed hex>``: the epoch as decimal text.

    A missing file is created with ``link()`` of a complete temp file, which fails if another
    process created it first, so concurrent creators agree. Every other change (a bump, a reset,
    the repair of a bad value) is a compare-and-set: made while holding ``<seed hex>.lock``,
    created with ``O_EXCL`` (atomic on NFS too, where ``flock`` may be local only), and only if the
    file still holds what the writer read; the file itself is replaced atomically, so readers take
    no lock. A lock older than ``_LOCK_STALE_S`` is taken to be a dead holder's and is broken. A
    file that does not hold a valid epoch, or holds a retired one, is lost state and is replaced
    by a fresh epoch.

    Two ways to read it (``shared``):

    - local (L2's folder, one host): at every use, re-read only when ``stat()`` changes. A lookup
      uses the epoch it has just read, so a bump by any process of the host is seen at once.
    - shared (a network filesystem): every ``refresh_s`` at most, by ``open()`` and ``read()``,
      never by a cached ``stat()``: NFS caches attributes for up to a minute, while an ``open()``
      revalidates them (close-to-open consistency). A lookup uses an epoch read at most
      ``bound_s`` before it started (see ``PolledEpochs``).

    A file that cannot be read or written (a planted folder, a read-only, full or unmounted disk)
    is a failure: lookups miss once the last confirmation is too old, and saves go under an
    epoch nobody else uses until the file can be read again.
    """

    def __init__(self, root: Path, modes: tuple[int, int] = (0o700, 0o600), *, shared: bool = False,
                 refresh_s: float = 0.0, bound_s: float | None = 0.0, auth: Auth | None = None,
                 counters: Counters | None = None, counter_prefix: str = "l2", local_floor: Path | None = None,
                 max_age_s: float | None = None) -> None:
        """``modes``: of the folder (if created here) and of the files written; a shared folder
        passes its group bits so that every instance of the group can read and replace them.
        ``local_floor``: a folder of this host's where the epoch floor is kept too (with ``auth``).
        ``max_age_s``: how old a value an instance with no floor of its own accepts (``epochs/floor.py``);
        None (L2's own folder): any, since its floor record lies on the same disk as the value."""
        self._root = root
        self._auth, self._counters, self._cp = auth, counters, counter_prefix
        self._domain = counter_prefix
        self._file_mode = modes[1]
        self._shared = shared
        make_folder(root, modes[0])  # concurrent creators are fine; an existing folder keeps its mode
        super().__init__(Retired(root, modes[1]), refresh_s if shared else 0.0, bound_s if shared else 0.0)
        self._cache: dict[bytes, tuple[tuple[int, int, int], int]] = {}
        self._failing = False
        self._floor = None if auth is None else Floor(
            auth, b"epoch:" + self._domain.encode(), bytes.hex, self._domain, local_floor, self._read_floor,
            self._write_floor, counters, max_age_s)

    def _path(self, ns_seed: bytes) -> Path:
        return self._root / ns_seed.hex()

    def _attempt(self, fn: Callable[[], T], default: T) -> T:
        try:
            result = fn()
        except OSError as e:
            if not self._failing:  # once per failing spell, not per lookup
                log.warning("kvstrata epochs: %s; lookups in %s miss until it can be read and written again",
                            e, self._root)
            self._failing = True
            return default
        if self._failing:
            log.warning("kvstrata epochs: %s can be read again", self._root)
            self._failing = False
        return result

    def _read(self, ns_seed: bytes) -> int | None:
        path = self._path(ns_seed)
        for _ in range(8):  # a concurrent create or replace: read again
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._create(path)
                continue
            if not stat.S_ISREG(st.st_mode):  # a planted link, FIFO or folder is lost state
                log.warning("kvstrata epochs: %s is not a regular file; starting a new epoch", path)
                self._replace(ns_seed, None, None)
                continue
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._cache.get(ns_seed)
            if cached and cached[0] == stamp and not self._shared:
                return cached[1]
            try:
                raw = read_head(path, VALUE_BYTES)
            except FileNotFoundError:
                continue
            epoch, counter, sealed, forged = self._parse(ns_seed, raw)
            if forged:
                self._count("auth_epochs")
            replayed = epoch is not None and self._floor is not None and not self._floor.allows(
                ns_seed, epoch, counter, sealed)
            if epoch is None or replayed or (ns_seed, epoch) in self.retired:
                what = "a retired epoch" if epoch is not None else f"no valid epoch ({raw[:32]!r})"
                if forged:
                    what = f"a value that fails its MAC ({raw[:32]!r})"
                log.warning("kvstrata epochs: %s holds %s; starting a new epoch "
                            "(older blocks of this namespace become misses)", path, what)
                self._replace(ns_seed, epoch, raw)
                continue
            if self._floor is not None:
                self._floor.raise_to(ns_seed, epoch, counter)
                if self._floor.stale(sealed):
                    self._reseal(ns_seed, epoch, counter, raw)
            self._cache[ns_seed] = (stamp, epoch)
            return epoch
        raise OSError(f"kvstrata epochs: {path} keeps changing; cannot read a stable epoch")

    def _parse(self, ns_seed: bytes, raw: bytes) -> tuple[int | None, int, int, bool]:
        """The epoch an epoch file's bytes hold (None: none), its counter and the second it was
        sealed (0 and 0 without a secret), and whether they failed their MAC."""
        if self._auth is None:
            return parse_epoch(raw[:64]), 0, 0, False
        opened = open_epoch(self._auth, b"epoch:" + self._domain.encode(), ns_seed.hex(), raw)
        return (None, 0, 0, True) if opened is None else (*opened, False)

    def _fresh(self, ns_seed: bytes) -> int:
        """A new epoch for a value lost or refused, of the newest weights generation the floor knows
        (see ``RedisEpochs._fresh``)."""
        return new_epoch(0 if self._floor is None else self._floor.generation(ns_seed))

    def _reseal(self, ns_seed: bytes, epoch: int, counter: int, raw: bytes) -> None:
        """Seal the value in use again (same epoch, next counter, the time now) if the file still
        holds ``raw`` (best effort: see ``RedisEpochs._reseal``)."""
        path = self._path(ns_seed)
        try:
            with self._locked(ns_seed):
                if not self._holds(path, raw):
                    return
                text = self._text(ns_seed, epoch, counter)
                write_atomic(path, text, self._file_mode)
            assert self._floor is not None
            self._floor.raise_to(ns_seed, epoch, self._parse(ns_seed, text.encode())[1])
        except OSError as e:  # the value stays as it was, still valid
            log.debug("kvstrata epochs: could not seal %s again: %s", path, e)

    def _count(self, kind: str) -> None:
        if self._counters is not None:
            self._counters.inc(f"{self._cp}_{kind}")
            self._counters.inc(f"{self._cp}_auth_failures")

    def _text(self, ns_seed: bytes, epoch: int, replaced: int = 0) -> str:
        """An epoch file's text: the epoch, with a secret followed by its MAC and its counter (above
        ``replaced``, the counter of the value it replaces, and the floor)."""
        if self._auth is None or self._floor is None:
            return f"{epoch}\n"
        counter = self._floor.next(ns_seed, replaced)
        return seal_epoch(self._auth, b"epoch:" + self._domain.encode(), ns_seed.hex(), epoch, counter).decode() + "\n"

    def _read_floor(self, ns_seed: bytes) -> bytes | None:
        try:
            return read_head(self._root / f"{ns_seed.hex()}.floor", VALUE_BYTES)
        except OSError:  # none, or planted (a FIFO, a link): no floor here, the local one still counts
            return None

    def _write_floor(self, ns_seed: bytes, old: bytes | None, new: bytes) -> None:
        with self._locked(ns_seed):
            if self._read_floor(ns_seed) == old:
                write_atomic(self._root / f"{ns_seed.hex()}.floor", new.decode("ascii") + "\n", self._file_mode)

    def _create(self, path: Path) -> None:
        tmp = temp_name(path, "new")
        ns_seed = bytes.fromhex(path.name)
        write_new(tmp, self._text(ns_seed, self._fresh(ns_seed)), self._file_mode)
        try:
            os.link(tmp, path)  # atomic create-if-absent: the first creator wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)

    def _replace(self, ns_seed: bytes, old: int | None, raw: bytes | None) -> None:
        """Repair a bad value (``raw``; None: not a regular file) with a fresh epoch, unless
        another process changed the file meanwhile (it repaired it, or bumped it)."""
        if old is not None:
            self.retired.add(ns_seed, old)
        path = self._path(ns_seed)
        with self._locked(ns_seed):
            if self._holds(path, raw):
                write_atomic(path, self._text(ns_seed, self._fresh(ns_seed)), self._file_mode)

    @staticmethod
    def _holds(path: Path, raw: bytes | None) -> bool:
        """Whether ``path`` still holds ``raw`` (None: something that is not a regular file)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return raw is None
        try:
            return raw is not None and read_head(path, VALUE_BYTES) == raw
        except OSError:
            return False

    def _write(self, ns_seed: bytes, epoch: int, expected: int | None) -> bool:
        path = self._path(ns_seed)
        with self._locked(ns_seed):
            counter = 0
            if expected is not None:
                try:
                    stored, counter, _, _ = self._parse(ns_seed, read_head(path, VALUE_BYTES))
                except OSError:  # missing, or not a regular file: the next read repairs it
                    stored = None
                if stored != expected:
                    return False
            text = self._text(ns_seed, epoch, counter)
            write_atomic(path, text, self._file_mode)
        if self._floor is not None:  # outside the lock: the shared floor's write takes it
            self._floor.raise_to(ns_seed, epoch, self._parse(ns_seed, text.encode())[1])
        return True

    @contextlib.contextmanager
    def _locked(self, ns_seed: bytes) -> Iterator[None]:
        """Hold the namespace's lock file, the one way to change its epoch file but creating it.
        Raises ``OSError`` when another process holds it for ``_LOCK_WAIT_S``."""
        path = self._root / f"{ns_seed.hex()}.lock"
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 self._file_mode))
                break
            except FileExistsError:
                pass
            try:
                age = time.time() - os.lstat(path).st_mtime
            except FileNotFoundError:
                continue  # released meanwhile
            if age > _LOCK_STALE_S:  # renamed first: of two processes breaking it, one does
                stale = temp_name(path, "stale")
                with contextlib.suppress(OSError):
                    os.rename(path, stale)
                    log.warning("kvstrata epochs: broke %s, left %.0f s ago by a process that did not release it",
                                path, age)
                    stale.unlink()
                continue
            if time.monotonic() > deadline:
                raise OSError(f"kvstrata epochs: {path} is held by another process ({age:.1f} s old); cannot change "
                              "the epoch now")
            time.sleep(0.002)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        if self._auth is not None:
            blob = self._auth.seal_text(b"descriptor:" + self._domain.encode(), ns_seed.hex(), blob, b"\n")
        try:
            write_descriptor(self._root, ns_seed, blob, self._file_mode)
        except OSError as e:
            log.warning("kvstrata epochs: cannot record what namespace %s is in %s: %s", ns_seed.hex(), self._root, e)

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        raw = read_descriptor(self._root, ns_seed)
        if raw is None or self._auth is None:
            return raw
        blob = self._auth.open_text(b"descriptor:" + self._domain.encode(), ns_seed.hex(), raw, b"\n")
        if blob is None:
            self._count("auth_descriptors")
            log.warning("kvstrata epochs: the descriptor of namespace %s in %s fails its MAC; ignored",
                        ns_seed.hex(), self._root)
        return blob

    def record_verify(self, ns_seed: bytes, blob: bytes) -> bool:
        if self._auth is not None:
            blob = self._auth.seal_text(b"verify:" + self._domain.encode(), ns_seed.hex(), blob, b"\n")
        try:  # replaces a planted link or FIFO itself, never what it points to
            write_atomic(self._root / f"{ns_seed.hex()}.verify", blob.decode("ascii"), self._file_mode)
        except OSError as e:
            log.warning("kvstrata epochs: cannot record the verified hits of namespace %s in %s: %s", ns_seed.hex(),
                        self._root, e)
            return False
        return True

    def verify_record(self, ns_seed: bytes) -> bytes | None:
        """``b""`` for what is not a regular file (a planted link, FIFO or folder): not a record."""
        path = self._root / f"{ns_seed.hex()}.verify"
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                return b""
        except FileNotFoundError:
            return None
        raw = read_head(path, _MAX_RECORD + 2 + 2 * TAG_SIZE)  # one byte over a sealed record's limit
        if self._auth is None:
            return raw
        blob = self._auth.open_text(b"verify:" + self._domain.encode(), ns_seed.hex(), raw, b"\n")
        if blob is None:
            self._count("auth_descriptors")
            log.warning("kvstrata epochs: the verification record of namespace %s in %s fails its MAC; ignored",
                        ns_seed.hex(), self._root)
        return blob

    def known(self) -> list[bytes]:
        out = []
        try:
            names = list(self._root.iterdir())
        except OSError as e:
            log.warning("kvstrata epochs: cannot list %s: %s", self._root, e)
            return []
        for p in names:
            if len(p.name) == 32 and not p.name.startswith("."):
                try:
                    out.append(bytes.fromhex(p.name))
                except ValueError:
                    pass
        return out
