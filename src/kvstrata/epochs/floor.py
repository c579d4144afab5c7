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

Formats (``<tag hex>``: 32 hex digits of the tier MAC): an epoch ``<epoch>:<tag>:<counter>``,
the tag over ``<epoch>:<counter>`` (kind ``<epoch kind>+counter``), so its first two fields read
as the format before counters (``<epoch>:<tag>``, the tag over the epoch alone), which is still
accepted, as counter 0; a floor ``<counter>:<epoch>:<tag>``.

The limit: every copy of the floor is out of this process's hands but the local one. Whoever
deletes the value and every shared copy makes instances start a fresh epoch (misses); whoever
also writes back an older value *and* that value's own floor record (a complete old snapshot) is
refused by every instance that kept a floor (its L2 folder, or memory), not by one that starts
with neither.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from kvstrata.epochs.base import parse_epoch, read_head, write_atomic
from kvstrata.format.auth import Auth
from kvstrata.format.block import TAG_SIZE
from kvstrata.metrics import Counters

log = logging.getLogger(__name__)
VALUE_BYTES = 128  # an epoch value or a floor record is at most 20 + 32 + 19 digits and 2 colons
_MAX_COUNTER = (1 << 63) - 1
REPLAYS = "epoch_replays_refused"


def _counter(raw: bytes) -> int | None:
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:
        return None
    value = int(raw)
    return value if value <= _MAX_COUNTER else None


def seal_epoch(auth: Auth, kind: bytes, name: str, epoch: int, counter: int) -> bytes:
    """An epoch value with its counter: ``<epoch>:<tag>:<counter>``."""
    tag = auth.tag(kind + b"+counter", name, b"%d:%d" % (epoch, counter))
    return b"%d:%s:%d" % (epoch, tag.hex().encode(), counter)


def open_epoch(auth: Auth, kind: bytes, name: str, raw: bytes) -> tuple[int, int] | None:
    """(epoch, counter) of a value that passes its MAC (one of the format before counters:
    counter 0), else None. Any content is answered, never raised on."""
    parts = raw.strip().split(b":")
    if len(parts) == 2:
        text = auth.open_text(kind, name, raw.strip())
        epoch = None if text is None else parse_epoch(text)
        return None if epoch is None else (epoch, 0)
    if len(parts) != 3 or len(parts[1]) != 2 * TAG_SIZE:
        return None
    epoch, counter = parse_epoch(parts[0]), _counter(parts[2])
    try:
        tag = bytes.fromhex(parts[1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    if epoch is None or counter is None or not auth.check(kind + b"+counter", name, b"%d:%d" % (epoch, counter),
                                                          tag):
        return None
    return epoch, counter


class Floor:
    """Per namespace, the highest (counter, epoch) seen authenticated (see the module docstring).

    ``read_shared(seed)``: the shared copy's bytes (None: none), raising what the epoch read
    raises; ``write_shared(seed, old, new)``: replace it by ``new`` if it still holds ``old``
    (None: nothing). ``name(seed)`` and ``kind``: what the floor's MAC is bound to."""

    def __init__(self, auth: Auth, kind: bytes, name: Callable[[bytes], str], domain: str, local: Path | None,
                 read_shared: Callable[[bytes], bytes | None],
                 write_shared: Callable[[bytes, bytes | None, bytes], object], counters: Counters | None) -> None:
        self._auth, self._kind, self._name, self._domain, self._local = auth, kind + b"+floor", name, domain, local
        self._read_shared, self._write_shared, self._counters = read_shared, write_shared, counters
        self._lock = threading.Lock()
        self._floors: dict[bytes, tuple[int, int]] = {}  # seed -> (counter, epoch)

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
        found = []
        path = self._file(ns_seed)
        if path is not None:
            try:
                found.append(self._open(ns_seed, read_head(path, VALUE_BYTES)))
            except OSError:  # none yet (a new disk), or planted: the shared copy still counts
                pass
        found.append(self._open(ns_seed, self._read_shared(ns_seed)))
        best = max((f for f in found if f is not None), default=None)
        with self._lock:
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

    def allows(self, ns_seed: bytes, epoch: int, counter: int) -> bool:
        """Whether a value read back may be used: its counter above the floor, or the floor's own
        value. A refused one is counted and logged here; the caller replaces it."""
        floor = self._get(ns_seed)
        if floor is None or counter > floor[0] or floor == (counter, epoch):
            return True
        if self._counters is not None:
            self._counters.inc(REPLAYS)
        log.warning("kvstrata epochs: namespace %s: an epoch value of counter %d came back after counter %d was "
                    "seen (a value copied earlier and written back?); refused, starting a new epoch",
                    ns_seed[:8].hex(), counter, floor[0])
        return False

    def raise_to(self, ns_seed: bytes, epoch: int, counter: int) -> None:
        """An accepted (or written) value: the floor rises to it, here, on disk and in the shared tier.
        Never raises: a copy not written is logged (the others still hold)."""
        floor = self._get(ns_seed)
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
