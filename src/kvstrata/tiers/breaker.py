"""tiers/breaker.py: the circuit breaker of the tiers behind a network (``Breaker.call``).

``call(fn, default)`` runs ``fn`` while the circuit is closed. After ``failures`` consecutive
errors it opens: calls return ``default`` at once (a miss, a dropped save) instead of waiting for
a dead service, so requests are served from local tiers and recompute. After ``reset_ms`` one call
is let through (half-open); success closes the circuit, failure reopens it with twice the delay, up
to ``max_backoff_ms``. Errors are logged once per opening, not per call. ``trial`` lets a watcher
thread (the Redis epoch subscriber) make the half-open trial itself, so that the circuit closes
when the service is back with no request to pay for it (a trial may cost a timeout) and saves
resume, and at once when the watcher has just seen the service come back, whatever the backoff.

Only the errors of the service count (``errors``: the client library's error classes and
``OSError``, which covers sockets, timeouts and TLS). Anything else raised by ``fn`` is a bug in
kvstrata, not an unreachable service: it propagates unchanged, so it is seen as what it is instead
of being reported as "circuit open". Code that parses what the service returned must therefore
handle hostile values itself (count them, treat them as a miss) and never rely on the breaker.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from kvstrata.config import BreakerConfig
from kvstrata.metrics import Counters

log = logging.getLogger(__name__)
T = TypeVar("T")


class Breaker:
    def __init__(self, cfg: BreakerConfig, name: str, counters: Counters,
                 errors: tuple[type[BaseException], ...] = (OSError,)) -> None:
        self._cfg, self._name, self._counters = cfg, name, counters
        self._errors = errors
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0
        self._backoff = cfg.reset_ms / 1000
        self._probing = False

    def _allow(self) -> bool:
        with self._lock:
            if not self._open_until:
                return True
            if self._probing or time.monotonic() < self._open_until:
                return False
            self._probing = True  # half-open: exactly one trial call
            return True

    def call(self, fn: Callable[[], T], default: T) -> T:
        if not self._allow():
            self._counters.inc(f"{self._name}_skipped")
            return default
        try:
            result = fn()
        except self._errors as e:  # the I/O edge: a service error becomes a miss
            self._failed(e)
            return default
        except BaseException:
            with self._lock:
                self._probing = False  # a bug in a half-open trial must not wedge the circuit
            raise
        with self._lock:
            if self._open_until:
                log.warning("kvstrata %s: reachable again, circuit closed", self._name)
                self._counters.inc(f"{self._name}_circuit_closed")
            self._failures, self._open_until, self._probing = 0, 0.0, False
            self._backoff = self._cfg.reset_ms / 1000
        return result

    def trial(self, fn: Callable[[], object], *, now: bool = False) -> None:
        """If the circuit is open and its trial is due, make it here: ``fn``, whose success closes
        the circuit and whose failure reopens it with the backoff growing as usual. ``now``: due
        at once, whatever the backoff (the caller has just seen the service accept it again)."""
        with self._lock:
            if not self._open_until or self._probing:
                return
            if now:
                self._open_until = min(self._open_until, time.monotonic())
            elif time.monotonic() < self._open_until:
                return
        self.call(fn, None)  # a request may take the trial first; this call is then skipped

    def _failed(self, err: BaseException) -> None:
        self._counters.inc(f"{self._name}_errors")
        with self._lock:
            self._failures += 1
            if self._probing or self._failures >= self._cfg.failures:
                if not self._open_until:
                    log.warning("kvstrata %s: %s; circuit open, serving from local tiers", self._name, err)
                    self._counters.inc(f"{self._name}_circuit_opened")
                self._open_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self._cfg.max_backoff_ms / 1000)
                self._probing = False
