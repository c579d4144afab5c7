"""tiers/breaker.py: the circuit breaker of the tiers behind a network (``Breaker.call``).

``call(fn, default)`` runs ``fn`` while the circuit is closed. After ``failures`` consecutive
errors it opens: calls return ``default`` at once (a miss, a dropped save) instead of waiting for
a dead service, so requests are served from local tiers and recompute. After ``reset_ms`` one call
is let through (half-open); success closes the circuit, failure reopens it with twice the delay, up
to ``max_backoff_ms``. Errors are logged once per opening, not per call. ``retry_now`` lets a
watcher that has seen the service come back (the Redis epoch subscriber, connected again) make that
trial at once instead of at the end of the backoff, which may be ``max_backoff_ms`` away.

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

from ..config import BreakerConfig
from ..metrics import Counters

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

    def retry_now(self, fn: Callable[[], object]) -> None:
        """The service looks reachable again (a watcher connected to it): if the circuit is open,
        make the half-open trial ``fn`` now. Success closes the circuit; failure reopens it, the
        backoff growing as usual, so a service that accepts connections but fails calls costs one
        trial per sign of life, never a burst of timeouts."""
        with self._lock:
            if not self._open_until or self._probing:
                return
            self._open_until = time.monotonic()  # due: the next call is the trial
        self.call(fn, None)  # another thread may take the trial first; this one is then skipped

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
