"""polled_epochs.py: ``PolledEpochs``, the rules of namespace epochs that other processes
change (L2's epochs folder, the shared folder, Redis): an epoch is used by lookups only while
confirmed, and a bump that could not be written serves nothing until it is. ``FileEpochs``
(``tiers/file_epochs.py``) and ``RedisEpochs`` (``tiers/redis_epochs.py``) say how to read and
write; see ``epochs`` for what an epoch is.
"""

from __future__ import annotations

import math
import threading
import time
from abc import abstractmethod
from typing import Callable, TypeVar

from .epochs import EpochStore, Retired, new_epoch

T = TypeVar("T")


class PolledEpochs(EpochStore):
    """Epochs kept where other processes change them (a folder, Redis), each used by
    lookups only while *confirmed*: read back from there recently enough.

    ``get`` re-reads a namespace's epoch when the last read is ``refresh_s`` old (or an
    announcement said it changed). Each read is stamped with the monotonic time at which it was
    *sent*: what it returns was current at some moment after that. A lookup that started at
    ``since`` may use the epoch only if ``since - sent <= bound_s``; an epoch retired at
    time T is therefore never used by a lookup that starts after ``T + bound_s``, however slow
    the reply was or however long this process was descheduled (a late reply carries its early
    stamp). While the shared state cannot be read (down, hung, timing out) lookups miss once the
    last confirmation is ``bound_s`` old: an unreachable tier costs hits, never a retired
    epoch. ``bound_s`` None is the lenient policy: the last known epoch is used however
    old its confirmation (it risks serving an epoch retired elsewhere meanwhile).

    A bump retires the old epoch here at once and marks the namespace *pending* until the
    new one is written: until then lookups miss, and every ``get`` retries the write. Saves meanwhile
    go under the new epoch, computed after the reset, so they become valid when the write
    lands.

    Subclasses say how the epoch is read (``_read``: creating or repairing it as needed),
    written (``_write``) and announced (``_announce``), and which failures are the service's
    (``_attempt``: the call's result, or ``default`` after a failure it has logged).
    """

    def __init__(self, retired: Retired, refresh_s: float, bound_s: float | None) -> None:
        self.retired = retired
        self._refresh_s, self._bound_s = refresh_s, bound_s
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one read or write of the shared state at a time
        self._known: dict[bytes, tuple[int, float]] = {}  # seed -> (epoch, when its read was sent)
        self._pending: dict[bytes, int] = {}  # seed -> a bumped epoch not written yet
        self._recheck: set[bytes] = set()  # announced changes: re-read at the next use
        self._private: dict[bytes, int] = {}  # never read (see ``_unread``)

    @abstractmethod
    def _read(self, ns_seed: bytes) -> int | None:
        """The stored epoch (created if missing, replaced if bad or retired); None if no
        stable value could be read. Raises what ``_attempt`` turns into a failure."""

    @abstractmethod
    def _write(self, ns_seed: bytes, epoch: int) -> None:
        """Store ``epoch`` as the namespace's epoch. Raises what ``_attempt`` turns into a failure."""

    def _announce(self, ns_seed: bytes) -> None:
        """Tell the other processes at once (best effort: they re-read within ``refresh_s``)."""

    @abstractmethod
    def _attempt(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` when the service failed (logged and counted here)."""

    def _remember(self, ns_seed: bytes, epoch: int, sent: float) -> None:
        if (ns_seed, epoch) in self.retired:  # a read that raced a bump of this process
            return
        with self._lock:
            previous = self._known.get(ns_seed)
            if ns_seed in self._pending or (previous is not None and previous[1] > sent):
                return  # a bump in flight, or a read sent later, wins
            self._known[ns_seed] = (epoch, sent)
            self._private.pop(ns_seed, None)
        if previous is not None and previous[0] != epoch:
            self.retired.add(ns_seed, previous[0])

    def _due(self, ns_seed: bytes, fresh_since: float) -> tuple[bool, int | None]:
        """Whether the namespace must be re-read now (its last read was sent before
        ``fresh_since``, or an announcement came), and its pending bump if any."""
        with self._lock:
            known = self._known.get(ns_seed)
            due = known is None or known[1] < fresh_since or ns_seed in self._recheck
            return due, self._pending.get(ns_seed)

    def _current(self, ns_seed: bytes) -> tuple[int, float] | None:
        """(epoch, when its confirming read was sent), re-read or its pending bump written
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
                    epoch = self._attempt(lambda: self._read(ns_seed), None)
                    if epoch is not None:
                        self._remember(ns_seed, epoch, sent)
        with self._lock:
            return self._known.get(ns_seed)

    def _unread(self, ns_seed: bytes) -> int:
        """The epoch of a namespace never read: private to this process (its saves are
        seen by nobody, and it is never served)."""
        with self._lock:
            return self._private.setdefault(ns_seed, new_epoch())

    def get(self, ns_seed: bytes) -> int:
        current = self._current(ns_seed)
        return self._unread(ns_seed) if current is None else current[0]

    def lookup_epoch(self, ns_seed: bytes, since: float) -> tuple[int, bool]:
        current = self._current(ns_seed)
        if current is None:
            return self._unread(ns_seed), False
        epoch, sent = current
        if sent == -math.inf:  # a bump not written yet: nothing of the namespace is served
            return epoch, False
        return epoch, self._bound_s is None or since - sent <= self._bound_s

    def bump(self, ns_seed: bytes) -> int | None:
        with self._lock:
            old = self._known.get(ns_seed)
        if old is None:  # learn what is being retired, so that a restore of it is refused too
            old = self._current(ns_seed)
        epoch = new_epoch()
        with self._lock:
            self._pending[ns_seed] = epoch
            self._known[ns_seed] = (epoch, -math.inf)  # not confirmed until written
        if old is not None:
            self.retired.add(ns_seed, old[0])
        return epoch if self._complete(ns_seed, epoch) else None

    def _complete(self, ns_seed: bytes, epoch: int) -> bool:
        """Write a pending bump; True once it is written (by this call or an earlier one)."""
        sent = time.monotonic()
        if not self._attempt(lambda: self._write(ns_seed, epoch) or True, False):
            return False
        with self._lock:
            if self._pending.get(ns_seed) != epoch:
                return True  # written meanwhile by another thread, or bumped again
            del self._pending[ns_seed]
            self._known[ns_seed] = (epoch, sent)
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
        """An announcement: re-read that namespace at its next use. It never sets an epoch,
        so a forged or late one costs a read, nothing more."""
        with self._lock:
            self._recheck.add(ns_seed)

    def changed_all(self) -> None:
        """Announcements may have been missed (a subscriber (re)connected): re-read every
        namespace at its next use instead of waiting for ``refresh_s``."""
        with self._lock:
            self._recheck.update(self._known)
