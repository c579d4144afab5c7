"""A namespace this instance serves nothing of, after a verified mismatch with
``verify.on_mismatch: quarantine`` (``verify.py``).

Local to the process: every lookup of the namespace misses (counted, ``quarantined_misses``) while
its epoch is the one it was quarantined in. A new epoch lifts it, whoever made it: an operator's
``kvstrata invalidate`` (every instance adopts it), an engine reset after new weights; so does a
restart. Saves go on: what the engine computes itself is what the next epoch starts from.
"""

from __future__ import annotations

import logging
import threading

from kvstrata.metrics import Counters

log = logging.getLogger(__name__)


class Quarantine:
    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._held: dict[bytes, int] = {}  # seed -> the epoch it was quarantined in
        self._lock = threading.Lock()

    def hold(self, seed: bytes, epoch: int) -> None:
        with self._lock:
            self._held[seed] = epoch
        log.error("kvstrata: namespace %s quarantined: nothing of it is served here until its epoch changes "
                  "(kvstrata invalidate, or an engine reset) or the engine restarts", seed.hex()[:16])

    def holds(self, seed: bytes, epoch: int) -> bool:
        """Whether a lookup of ``seed`` in its current ``epoch`` must miss (counted). One dict test
        when nothing is quarantined; a quarantine of an older epoch is lifted here."""
        if not self._held:
            return False
        with self._lock:
            held = self._held.get(seed)
            if held is not None and held != epoch:
                del self._held[seed]
                log.warning("kvstrata: namespace %s is out of quarantine (its epoch changed)", seed.hex()[:16])
                held = None
        if held is None:
            return False
        self._counters.inc("quarantined_misses")
        return True

    def seeds(self) -> set[bytes]:
        with self._lock:
            return set(self._held)
