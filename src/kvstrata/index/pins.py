"""index/pins.py: who holds a pin, and when it ends. ``Lease`` is a pin's owner token, ``Pins``
the leases of one ``BlockIndex`` (which rows each pins, since when), ``PinCensus`` what
``BlockIndex.pins`` reports. ``Pins`` takes no lock and touches no row: the index calls it under
its own lock and changes its rows' pin counts itself.

A pin lives in the process of its index (the index is never shared) and is held through its
``Lease``. The holders:
- the vLLM scheduler, in EngineCore (``adapters/vllm/scheduler.py``, ``hybrid.py``): a lookup's
  hit until its load op takes it over, then the op until every worker rank has reported its copy
  out of the L1 slots. Workers never pin: they copy under the scheduler's pin, and vLLM stops the
  engine when any of them dies;
- the SGLang backend (``StrataStorage.batch_get_v1`` / ``batch_get``), for one call;
- the store itself (loads, staging, write-through and demotion reads of a slot) and the tools
  (CLI, replay, torture, benchmarks), for one call, given back in ``finally``.

A held pin has no deadline: it lasts until ``BlockIndex.unpin``, however long the copy under it
takes (a deadline that ran out under a slow copy let the slot be refilled with another block,
and the engine copied that block's bytes). A pin whose holder is gone does not protect blocks
forever: the holder is gone when nothing references its ``Lease`` any more (a caller that raised
between pin and unpin, a thread that died, a request's state dropped without giving its pin
back). The lease's finalizer queues its id, and the index releases it at its next pin, claim or
victim pick, counted as ``abandoned``. When the process dies, the index and its pins die with
it. A pin held longer than ``overdue_s`` (config ``lease_seconds``) is logged as overdue, once,
and kept: a live holder that forgot it is a bug to see, and an engine that did not forget must
never be served another block's bytes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)


class Lease:
    """A pin's owner token, returned by ``pin_keys`` and ``match_pinned``: hold it for as long as
    the blocks are read, give it back with ``BlockIndex.unpin``. Dropped without that (collected),
    it tells its index that its holder is gone. It cannot be copied or pickled: a copy, once
    collected, would release the pin its original still holds."""

    __slots__ = ("id", "_abandoned")

    def __init__(self, lease_id: int, abandoned: deque[int]) -> None:
        self.id = lease_id
        self._abandoned: deque[int] | None = abandoned  # None once given back

    def __del__(self) -> None:
        # Runs wherever the last reference goes (any thread, even inside an index call): it only
        # queues the id (deque.append is atomic); the index releases the rows under its lock.
        abandoned = getattr(self, "_abandoned", None)
        if abandoned is not None:
            abandoned.append(self.id)

    def __reduce__(self) -> tuple:
        raise TypeError("a kvstrata Lease is an owner token: it cannot be copied or pickled")

    def __repr__(self) -> str:
        return f"Lease({self.id})"


class PinCensus(NamedTuple):
    """Pins held now and the age of the oldest (seconds); since the index was made, pins released
    because their holder dropped them, and pins reported as overdue."""

    held: int
    oldest_s: float
    abandoned: int
    overdue: int


class _Held(NamedTuple):
    rows: np.ndarray
    since: float  # time.monotonic() at the pin


class Pins:
    """The leases of one index. See the module docstring."""

    def __init__(self, overdue_s: float) -> None:
        self.overdue_s = overdue_s
        self._held: dict[int, _Held] = {}  # lease id -> its rows; ids grow, so oldest first
        self._abandoned: deque[int] = deque()  # ids of leases collected without a give-back
        self._next_id = 1
        self._next_audit = 0.0
        self._told: set[int] = set()  # overdue leases already logged
        self.abandoned = 0
        self.overdue = 0

    def add(self, rows: np.ndarray) -> Lease:
        """A new lease on ``rows`` (whose pin counts the caller has raised)."""
        lease = Lease(self._next_id, self._abandoned)
        self._next_id += 1
        self._held[lease.id] = _Held(rows, time.monotonic())
        return lease

    def give_back(self, lease: Lease) -> np.ndarray | None:
        """The rows whose pin counts the caller must lower; None if given back already (or the
        lease is another index's: its id may name one of these)."""
        if lease._abandoned is not self._abandoned:
            return None
        lease._abandoned = None  # given back: its collection is no longer news
        self._told.discard(lease.id)
        held = self._held.pop(lease.id, None)
        return None if held is None else held.rows

    def take_abandoned(self) -> list[np.ndarray] | tuple[()]:
        """The rows of each lease dropped without a give-back since the last call, whose pin
        counts the caller must lower (nothing allocated when there are none: the common case)."""
        if not self._abandoned:
            return ()
        out = []
        while self._abandoned:
            lease_id = self._abandoned.popleft()
            held = self._held.pop(lease_id, None)
            if held is not None:
                self._told.discard(lease_id)
                self.abandoned += 1
                (log.warning if self.abandoned == 1 else log.debug)(
                    "kvstrata index: released a pin of %d rows whose holder dropped it without giving it "
                    "back (a caller that raised or forgot)", len(held.rows))
                out.append(held.rows)
        return out

    def audit(self) -> None:
        """At most once per ``overdue_s`` (and per second), log the pins held longer than that."""
        if self._held and (now := time.monotonic()) >= self._next_audit:
            self._audit(now)

    def _audit(self, now: float) -> None:
        """Log each pin held longer than ``overdue_s``, once (a warning for this index's first,
        then debug): one pass over the held leases, oldest first, to the first one young enough."""
        self._next_audit = now + max(self.overdue_s, 1.0)
        for lease_id, held in self._held.items():
            age = now - held.since
            if age <= self.overdue_s:
                break
            if lease_id in self._told:
                continue
            self._told.add(lease_id)
            self.overdue += 1
            (log.warning if self.overdue == 1 else log.debug)(
                "kvstrata index: a pin of %d rows has been held for %.3g s (lease_seconds %.3g); it stays "
                "until its holder gives it back or drops it: a holder that never does keeps those blocks "
                "from eviction", len(held.rows), age, self.overdue_s)

    def census(self) -> PinCensus:
        oldest = next(iter(self._held.values()), None)
        age = time.monotonic() - oldest.since if oldest is not None else 0.0
        return PinCensus(len(self._held), age, self.abandoned, self.overdue)
