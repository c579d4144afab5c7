"""epochs/polled.py: ``PolledEpochs``, the rules of namespace epochs that other processes
change (L2's epochs folder, the shared folder, Redis): an epoch is used by lookups only while
confirmed, a bump that could not be written serves nothing until it is, every bump is a
compare-and-set against the epoch it replaces, and a reset made elsewhere is joined, not caught
(``joins``). ``FileEpochs`` (``epochs/folder.py``) and ``RedisEpochs``
(``epochs/redis.py``) say how to read and write; see ``epochs/base.py`` for what an epoch is.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import abstractmethod
from typing import Callable, NamedTuple, TypeVar

from kvstrata.epochs.base import EpochStore, Reset, Retired, generation, new_epoch, new_generation
from kvstrata.epochs.joins import Joins, warn_behind

T = TypeVar("T")
log = logging.getLogger(__name__)
_TRIES = 8  # compare-and-set rounds a bump makes while other instances keep changing the epoch


class _Bump(NamedTuple):
    """A change of this instance's not written yet."""

    epoch: int  # the epoch to write
    expected: int | None  # the epoch it replaces (compare-and-set); None: never read, written whatever is there
    reset: bool  # an engine reset (a new generation), not a flush


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
    lands. The write replaces the epoch only if it is still the one the bump replaced: if another
    instance changed it meanwhile, a flush is made again on top of what is there now (keeping its
    generation), and a reset joins another instance's reset (two instances resetting at once end
    on one generation, both joined) or is made again on top of a flush or a lost epoch.

    Which epochs this instance serves and saves: ``Joins`` (``joined``), updated under the same
    lock as the current epoch.

    Subclasses say how the epoch is read (``_read``: creating or repairing it as needed),
    written (``_write``: a compare-and-set) and announced (``_announce``), and which failures are
    the service's (``_attempt``: the call's result, or ``default`` after a failure it has logged).
    """

    def __init__(self, retired: Retired, refresh_s: float, bound_s: float | None) -> None:
        self.retired = retired
        self._refresh_s, self._bound_s = refresh_s, bound_s
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one read or write of the shared state at a time
        self._known: dict[bytes, tuple[int, float]] = {}  # seed -> (epoch, when its read was sent)
        self._pending: dict[bytes, _Bump] = {}  # seed -> a change not written yet
        self._recheck: set[bytes] = set()  # announced changes: re-read at the next use
        self._private: dict[bytes, int] = {}  # never read (see ``_unread``)
        self._done: dict[bytes, Reset] = {}  # how the last change written was settled (another thread may write it)
        self._joins = Joins()

    @abstractmethod
    def _read(self, ns_seed: bytes) -> int | None:
        """The stored epoch (created if missing, replaced if bad or retired); None if no
        stable value could be read. Raises what ``_attempt`` turns into a failure."""

    @abstractmethod
    def _write(self, ns_seed: bytes, epoch: int, expected: int | None) -> bool:
        """Store ``epoch`` as the namespace's epoch if the stored one is still ``expected``
        (None: whatever is there); False, and nothing written, if it is not (another value, or
        none). Raises what ``_attempt`` turns into a failure."""

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
            behind = self._joins.seen(ns_seed, epoch)
        if previous is not None and previous[0] != epoch:
            self.retired.add(ns_seed, previous[0])
        if behind:
            warn_behind(ns_seed, epoch)

    def _due(self, ns_seed: bytes, fresh_since: float) -> tuple[bool, bool]:
        """Whether the namespace must be re-read now (its last read was sent before
        ``fresh_since``, or an announcement came), and whether a change of it is pending."""
        with self._lock:
            known = self._known.get(ns_seed)
            due = known is None or known[1] < fresh_since or ns_seed in self._recheck
            return due, ns_seed in self._pending

    def _current(self, ns_seed: bytes) -> tuple[int, float] | None:
        """(epoch, when its confirming read was sent), re-read or its pending bump written
        when due; None if it was never read. One thread reads at a time: the others wait for its
        answer, and take it if it is fresh for them (sent at most ``refresh_s`` before they came)
        instead of sending the same read (a slow tier sees one read, not one per thread)."""
        came = time.monotonic()
        due, pending = self._due(ns_seed, came - self._refresh_s)
        if due or pending:
            with self._reading:
                due, pending = self._due(ns_seed, came - self._refresh_s)  # read meanwhile by another thread?
                if pending:
                    self._complete(ns_seed)
                elif due:
                    self._read_now(ns_seed)
        with self._lock:
            return self._known.get(ns_seed)

    def _read_now(self, ns_seed: bytes) -> int | None:
        """Read the stored epoch and remember it (holding ``_reading``); None if that failed."""
        with self._lock:
            self._recheck.discard(ns_seed)
        sent = time.monotonic()
        epoch = self._attempt(lambda: self._read(ns_seed), None)
        if epoch is not None:
            self._remember(ns_seed, epoch, sent)
        return epoch

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

    def joined(self, ns_seed: bytes) -> bool:
        with self._lock:
            return self._joins.joined(ns_seed)

    def not_joined(self) -> list[bytes]:
        with self._lock:
            return self._joins.behind()

    # ------------------------------------------------------------------ changes
    def bump(self, ns_seed: bytes) -> int | None:
        return self._change(ns_seed, reset=False).epoch

    def reset(self, ns_seed: bytes) -> Reset:
        self.changed(ns_seed)  # read what is there now: a reset made elsewhere shows as not joined
        current = self._current(ns_seed)
        with self._lock:
            if current is not None and not self._joins.joined(ns_seed) and ns_seed not in self._pending:
                self._joins.join(ns_seed, current[0])
                return Reset(current[0], True)
        return self._change(ns_seed, reset=True)

    def _change(self, ns_seed: bytes, reset: bool) -> Reset:
        """Make a flush or a reset pending, then write it (see the class docstring)."""
        with self._lock:
            prior = self._pending.get(ns_seed)
            old = self._known.get(ns_seed)
        if prior is None and old is None:  # learn what is being retired, so that a restore of it is refused too
            old = self._current(ns_seed)
        if prior is not None:  # a change not written yet: this one replaces it, against what it replaced
            expected, base, reset = prior.expected, prior.epoch, reset or prior.reset
        else:
            expected = base = None if old is None else old[0]
        epoch = new_epoch(new_generation() if reset and (prior is None or not prior.reset)
                          else 0 if base is None else generation(base))
        with self._lock:
            self._pending[ns_seed] = _Bump(epoch, expected, reset)
            self._known[ns_seed] = (epoch, -math.inf)  # not confirmed until written
            if reset:
                self._joins.join(ns_seed, epoch)  # its saves go under the new epoch from now on
        if old is not None:
            self.retired.add(ns_seed, old[0])
        with self._reading:
            return self._complete(ns_seed)

    def _complete(self, ns_seed: bytes) -> Reset:
        """Write the pending change (holding ``_reading``): the epoch now current here, or None
        while it cannot be written; ``joined`` if another instance's reset was joined instead."""
        for _ in range(_TRIES):
            with self._lock:
                bump = self._pending.get(ns_seed)
                known = self._known.get(ns_seed)
            if bump is None:  # settled meanwhile by another thread (the subscriber's ``write_pending``)
                return self._done.get(ns_seed) or Reset(None if known is None else known[0], False)
            sent = time.monotonic()
            written = self._attempt(lambda: self._write(ns_seed, bump.epoch, bump.expected), None)
            if written is None:
                return Reset(None, False)
            if written:
                with self._lock:
                    if self._pending.get(ns_seed) is not bump:
                        continue  # changed again meanwhile: write that
                    del self._pending[ns_seed]
                    self._known[ns_seed] = (bump.epoch, sent)
                    self._done[ns_seed] = Reset(bump.epoch, False)
                    behind = False if bump.reset else self._joins.seen(ns_seed, bump.epoch)
                self._announce(ns_seed)
                if behind:
                    warn_behind(ns_seed, bump.epoch)
                return Reset(bump.epoch, False)
            # another instance changed the epoch since this one read it: see what is there now
            sent = time.monotonic()
            current = self._attempt(lambda: self._read(ns_seed), None)
            if current is None:
                return Reset(None, False)
            assert bump.expected is not None  # an unconditional write is never refused
            if bump.reset and generation(current) not in (0, generation(bump.expected)):
                with self._lock:  # another instance's reset came first: join it rather than replace it
                    if self._pending.get(ns_seed) is not bump:
                        continue
                    del self._pending[ns_seed]
                    self._known[ns_seed] = (current, sent)
                    self._done[ns_seed] = Reset(current, True)
                    self._joins.join(ns_seed, current)
                log.info("kvstrata: namespace %s was reset by another instance at the same time; joined its epoch "
                         "%016x", ns_seed[:8].hex(), current)
                return Reset(current, True)
            again = _Bump(new_epoch(generation(bump.epoch) if bump.reset else generation(current)), current,
                          bump.reset)
            with self._lock:
                if self._pending.get(ns_seed) is not bump:
                    continue
                self._pending[ns_seed] = again
                self._known[ns_seed] = (again.epoch, -math.inf)
                if bump.reset:
                    self._joins.join(ns_seed, again.epoch)
            self.retired.add(ns_seed, current)
        log.warning("kvstrata: namespace %s: the epoch kept changing under %d compare-and-set rounds; the change "
                    "stays pending, retried at the next use", ns_seed[:8].hex(), _TRIES)
        return Reset(None, False)

    def write_pending(self) -> None:
        """Try again to write the bumps that could not be written (a thread that watches the
        shared tier calls it, so that a reset lands when the tier is back, requests or not)."""
        with self._lock:
            pending = list(self._pending)
        for ns_seed in pending:
            self._current(ns_seed)

    def refresh(self, ns_seed: bytes) -> None:
        """Read a namespace this instance uses now if it is due (an announcement came): a background
        thread's read, so that an idle instance learns of a reset made elsewhere as it is made, not
        at its next lookup (by then the epoch state may be lost: ``joins``)."""
        with self._lock:
            known = ns_seed in self._known
        if known:
            self._current(ns_seed)

    def refresh_idle(self, every_s: float = 1.0) -> None:
        """Read, from a background thread, every namespace this instance uses that was announced or
        that no read confirmed for ``every_s`` (no lookup used it: an idle instance)."""
        old = time.monotonic() - max(every_s, self._refresh_s)
        with self._lock:
            due = [seed for seed, (_, sent) in self._known.items() if seed in self._recheck or -math.inf < sent < old]
        for ns_seed in due:
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
