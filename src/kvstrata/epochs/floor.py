"""epochs/floor.py: epoch values that cannot be replayed, with a secret (``seal_epoch``, ``open_epoch``,
``Floor``).

A MAC proves who wrote a value, not when: without more, an epoch value copied before an
invalidation stays valid forever, and a writer without the secret could write it back. So each
authenticated epoch value carries a *counter* under its MAC, one more than the value it replaced,
and every instance keeps the highest counter it has seen per namespace (the *floor*, with the
epoch that carried it) in memory, in a local file (``<local>/<seed hex>.<domain>.floor``: L2's
epochs folder) and, MAC'd, in the shared tier beside the epoch. An instance that starts with no
local floor takes the highest authenticated one it can see. A value whose counter is below the
floor, or equal to it with another epoch, is a replay: refused (``epoch_replays_refused``) and
replaced by a fresh epoch above the floor, as a retired epoch is.

Freshness (``max_age_s``, ``remote.epoch_max_age_s``): every value also carries the wall-clock
second it was sealed, under its MAC, as TUF's timestamp role does. A floor can be deleted with the
value it guards (a complete old snapshot written back, or the shared floor record deleted), so an
instance that has no floor of its own for a namespace (none in memory, none in its local folder: a
new container) accepts a value only if it was sealed at most ``max_age_s`` ago; an older one is
refused like a replay, and replaced by a fresh epoch (misses, never old KV). Live instances
re-seal the value they use (same epoch, next counter, the time now) once it is ``max_age_s / 4``
old (``stale``), so a fleet in use never sees its own value expire. The window that remains: a
value written back within ``max_age_s`` of its copy, to an instance with no floor of its own.

Formats (``<tag hex>``: 32 hex digits of the tier MAC): an epoch ``<epoch>:<tag>:<counter>:<sealed>``,
the tag over ``<epoch>:<counter>:<sealed>`` (kind ``<epoch kind>+sealed``); before freshness
``<epoch>:<tag>:<counter>``, the tag over ``<epoch>:<counter>`` (kind ``<epoch kind>+counter``),
still read, as sealed at time 0 (too old for an instance with no floor); and before counters
``<epoch>:<tag>`` (the tag over the epoch alone), read as counter 0 and time 0. A floor
``<counter>:<epoch>:<tag>``.

The limit: every copy of the floor is out of this process's hands but the local one. Whoever
deletes the value and every shared copy makes instances start a fresh epoch (misses); whoever
also writes back an older value *and* that value's own floor record (a complete old snapshot) is
refused by every instance that kept a floor (its L2 folder, or memory), and by one that starts
with neither once the value is ``max_age_s`` old.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from kvstrata.epochs.base import generation, parse_epoch, read_head, write_atomic
from kvstrata.format.auth import Auth
from kvstrata.format.block import TAG_SIZE
from kvstrata.metrics import Counters

log = logging.getLogger(__name__)
VALUE_BYTES = 128  # an epoch value is at most 20 + 32 + 19 + 19 digits and 3 colons; a floor record less
_MAX_COUNTER = (1 << 63) - 1
REPLAYS = "epoch_replays_refused"
EXPIRED = "epoch_values_expired"
RESEAL_FRACTION = 4  # a value in use is sealed again once max_age_s / this old


def _counter(raw: bytes) -> int | None:
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        return None
    value = int(raw)
    return value if value <= _MAX_COUNTER else None


def seal_epoch(auth: Auth, kind: bytes, name: str, epoch: int, counter: int, sealed: int | None = None) -> bytes:
    """An epoch value with its counter and the second it was sealed (now, unless given):
    ``<epoch>:<tag>:<counter>:<sealed>``."""
    sealed = int(time.time()) if sealed is None else sealed
    tag = auth.tag(kind + b"+sealed", name, b"%d:%d:%d" % (epoch, counter, sealed))
    return b"%d:%s:%d:%d" % (epoch, tag.hex().encode(), counter, sealed)


def open_epoch(auth: Auth, kind: bytes, name: str, raw: bytes) -> tuple[int, int, int] | None:
    """(epoch, counter, sealed) of a value that passes its MAC, else None. Values of the formats
    before counters and before freshness open with counter 0 and sealed 0 (see the module
    docstring). Any content is answered, never raised on."""
    parts = raw.strip().split(b":")
    if len(parts) == 2:
        text = auth.open_text(kind, name, raw.strip())
        epoch = None if text is None else parse_epoch(text)
        return None if epoch is None else (epoch, 0, 0)
    if len(parts) not in (3, 4) or len(parts[1]) != 2 * TAG_SIZE:
        return None
    epoch, counter = parse_epoch(parts[0]), _counter(parts[2])
    sealed = _counter(parts[3]) if len(parts) == 4 else 0
    try:
        tag = bytes.fromhex(parts[1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if epoch is None or counter is None or sealed is None:
        return None
    signed, suffix = (b"%d:%d:%d" % (epoch, counter, sealed), b"+sealed") if len(parts) == 4 else (
        b"%d:%d" % (epoch, counter), b"+counter")
    return (epoch, counter, sealed) if auth.check(kind + suffix, name, signed, tag) else None


class Floor:
    """Per namespace, the highest (counter, epoch) seen authenticated (see the module docstring).

    ``read_shared(seed)``: the shared copy's bytes (None: none), raising what the epoch read
    raises; ``write_shared(seed, old, new)``: replace it by ``new`` if it still holds ``old``
    (None: nothing). ``name(seed)`` and ``kind``: what the floor's MAC is bound to. ``max_age_s``:
    how old a value an instance with no floor of its own accepts (see the module docstring); None: any
    (one host's L2 folder, where the floor record lies on the same disk as the value)."""

    def __init__(self, auth: Auth, kind: bytes, name: Callable[[bytes], str], domain: str, local: Path | None,
                 read_shared: Callable[[bytes], bytes | None],
                 write_shared: Callable[[bytes, bytes | None, bytes], object], counters: Counters | None,
                 max_age_s: float | None = None) -> None:
        self._auth, self._kind, self._name, self._domain, self._local = auth, kind + b"+floor", name, domain, local
        self._read_shared, self._write_shared, self._counters = read_shared, write_shared, counters
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._floors: dict[bytes, tuple[int, int]] = {}  # seed -> (counter, epoch)
        self._own: set[bytes] = set()  # seeds with a floor of this instance's own: its local file, or a value it took

    def _file(self, ns_seed: bytes) -> Path | None:
        return None if self._local is None else self._local / f"{ns_seed.hex()}.{self._domain}.floor"

    def _open(self, ns_seed: bytes, raw: bytes | None) -> tuple[int, int] | None:
        text = None if not raw else self._auth.open_text(self._kind, self._name(ns_seed), raw.strip())
        parts = [] if text is None else text.split(b":")
        if len(parts) != 2:
            return None
        counter, epoch = _counter(parts[0]), parse_epoch(parts[1])
        return None if counter is None or epoch is None else (counter, epoch)

    def _seal(self, ns_seed: bytes, floor: tuple[int, int]) -> bytes:
        return self._auth.seal_text(self._kind, self._name(ns_seed), b"%d:%d" % floor)

    def _get(self, ns_seed: bytes) -> tuple[int, int] | None:
        """The floor, loaded at first use from the local file and the shared copy (the higher)."""
        with self._lock:
            if ns_seed in self._floors:
                return self._floors[ns_seed]
        local = None
        path = self._file(ns_seed)
        if path is not None:
            try:
                local = self._open(ns_seed, read_head(path, VALUE_BYTES))
            except OSError:  # none yet (a new disk), or planted: the shared copy still counts
                pass
        shared = self._open(ns_seed, self._read_shared(ns_seed))
        best = max((f for f in (local, shared) if f is not None), default=None)
        with self._lock:
            if local is not None:
                self._own.add(ns_seed)
            if best is not None and (ns_seed not in self._floors or self._floors[ns_seed] < best):
                self._floors[ns_seed] = best
            return self._floors.get(ns_seed)

    def next(self, ns_seed: bytes, replaced: int = 0) -> int:
        """The counter of a value that replaces one of counter ``replaced``: above both it and the floor,
        the shared copy re-read (writes are rare; an instance that read nothing for a while must not
        write a counter that the others, further on, would refuse)."""
        floor = self._get(ns_seed)
        shared = self._open(ns_seed, self._read_shared(ns_seed))
        return max(replaced, -1 if floor is None else floor[0], -1 if shared is None else shared[0]) + 1

    def generation(self, ns_seed: bytes) -> int:
        """The weights generation of the newest epoch this floor knows (the shared copy re-read): what
        an epoch made after the value was lost carries, so that losing the value cannot put an instance
        that missed a reset back among those that hold the new weights (0: none known)."""
        floor = self._get(ns_seed)
        shared = self._open(ns_seed, self._read_shared(ns_seed))
        best = max((f for f in (floor, shared) if f is not None), default=None)
        return 0 if best is None else generation(best[1])

    def allows(self, ns_seed: bytes, epoch: int, counter: int, sealed: int) -> bool:
        """Whether a value read back may be used: its counter above the floor, or the floor's own
        value; and, while this instance has no floor of its own, sealed at most ``max_age_s`` ago.
        A refused one is counted and logged here; the caller replaces it."""
        floor = self._get(ns_seed)
        if floor is not None and not (counter > floor[0] or floor == (counter, epoch)):
            if self._counters is not None:
                self._counters.inc(REPLAYS)
            log.warning("kvstrata epochs: namespace %s: an epoch value of counter %d came back after counter %d was "
                        "seen (a value copied earlier and written back?); refused, starting a new epoch",
                        ns_seed[:8].hex(), counter, floor[0])
            return False
        with self._lock:
            own = ns_seed in self._own
        age = time.time() - sealed
        if own or self.max_age_s is None or age <= self.max_age_s:
            return True
        if self._counters is not None:
            self._counters.inc(EXPIRED)
        log.warning("kvstrata epochs: namespace %s: the epoch value was sealed %.0f s ago, more than "
                    "remote.epoch_max_age_s (%g s), and this instance has no floor of its own to vouch for it (a value "
                    "written back, or every instance idle that long); refused, starting a new epoch",
                    ns_seed[:8].hex(), age, self.max_age_s)
        return False

    def stale(self, sealed: int) -> bool:
        """Whether a value in use should be sealed again (same epoch, next counter, the time now)."""
        return self.max_age_s is not None and time.time() - sealed > self.max_age_s / RESEAL_FRACTION

    def raise_to(self, ns_seed: bytes, epoch: int, counter: int) -> None:
        """An accepted (or written) value: the floor rises to it, here, on disk and in the shared tier.
        Never raises: a copy not written is logged (the others still hold)."""
        floor = self._get(ns_seed)
        with self._lock:
            self._own.add(ns_seed)  # a value this instance took or wrote: its floor vouches from now on
        if floor is not None and counter <= floor[0]:
            return
        with self._lock:
            if self._floors.get(ns_seed, (-1, 0)) >= (counter, epoch):
                return
            self._floors[ns_seed] = (counter, epoch)
        sealed = self._seal(ns_seed, (counter, epoch))
        path = self._file(ns_seed)
        try:
            if path is not None:
                write_atomic(path, sealed.decode("ascii") + "\n")
            raw = self._read_shared(ns_seed)
            shared = self._open(ns_seed, raw)
            if shared is None or shared[0] < counter:
                self._write_shared(ns_seed, raw, sealed)
        except Exception as e:  # the I/O edge: a copy not written costs protection, never a lookup
            log.warning("kvstrata epochs: cannot record the epoch floor of namespace %s: %s", ns_seed[:8].hex(), e)
