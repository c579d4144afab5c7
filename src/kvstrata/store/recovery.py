"""``Recovery``: L2's blocks into the index in the background, so that opening a store reads no
block file whatever the tier's size.

Until it is done a lookup finds L2's blocks by header (``lookup._adopt``, as it finds another
process's), and ``l2.size`` holds through the tier's ledger (``tiers/ledger.py``: an upper bound
on what the folder holds until it is counted). The scan is ``tiers.recover.recover_shards``: the one
folder scan, one shard folder at a time, deleting dead writers' temp files and damaged blocks as
the start-up scan did. Each shard's blocks are committed filed by mtime as older than anything
used since open (``BlockIndex.commit_recovered``): adopted or saved blocks only gain the tier bit,
so a block is never indexed twice nor its bytes counted twice (bytes are counted from the listing,
never from commits). The scan only reads and deletes leftovers: killing the process mid-scan
loses nothing, and the next start scans again.

The thread runs at the lowest CPU priority (``nice 19``, Linux threads have their own) and stops
between shards when the store closes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from kvstrata.index import BlockIndex
from kvstrata.tiers import DiskTier
from kvstrata.tiers.recover import recover_shards

log = logging.getLogger(__name__)
PAUSE_S = 0.0  # after each shard folder; tests raise it to act (write, crash) while the scan runs
# Yielding to requests: the scan is Python, and while it runs a request thread waits for the GIL
# at each of its system calls (lookups by header measured 3-5x slower). So for ``QUIET_S`` after
# each lookup or load the scan sleeps before its next entry, ``YIELD_S`` at a time, then examines
# at least ``YIELD_EVERY`` entries before it sleeps again: under nonstop traffic it keeps roughly
# a tenth of its speed, and it runs at full speed once requests pause.
QUIET_S = 0.05
YIELD_S = 0.01
YIELD_EVERY = 32


class Recovery:
    def __init__(self, index: BlockIndex, tier: DiskTier) -> None:
        """Counted from now on (``used_bytes`` an upper bound); the scan runs from ``start``."""
        self._index = index
        self._tier = tier
        self._delay_s = PAUSE_S
        self._then: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self.shards = 0  # shard folders recovered so far
        self.blocks = 0
        self._busy_until = 0.0  # monotonic time until which requests are being served
        self._owed = 0  # entries to examine before the scan may sleep again
        tier.begin_recovery()
        self._thread = threading.Thread(target=self._run, name="kvstrata-l2-recovery", daemon=True)

    def start(self, then: Callable[[], None] | None = None) -> None:
        """Run the scan; ``then()`` after it, on its thread, if it ran through (the store's
        reclaim of older epochs and trim to ``l2.size``)."""
        self._then = then
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every shard is recovered and ``then`` has run (True), or ``timeout`` seconds
        (False)."""
        return self._done.wait(timeout)

    def note_request(self) -> None:
        """A lookup or load is being served: the scan makes way for a while (``QUIET_S``)."""
        self._busy_until = time.monotonic() + QUIET_S

    def _pace(self) -> None:
        if self._owed:
            self._owed -= 1
        elif time.monotonic() < self._busy_until:
            self._stop.wait(YIELD_S)
            self._owed = YIELD_EVERY

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        _lower_priority()
        start = time.monotonic()
        try:
            if self._scan() and self._then is not None:
                self._then()
        except Exception:  # an I/O edge: the store keeps serving, L2 accounted by its upper bound
            log.exception("kvstrata: the recovery of %s failed; blocks there are still found by lookups, "
                          "and l2.size is kept against an upper bound until it is counted", self._tier.root)
            return
        finally:
            self._done.set()
        if self.blocks:
            log.info("kvstrata: recovered %d blocks (%d bytes) from %s in %.1f s", self.blocks,
                     self._tier.used_bytes, self._tier.root, time.monotonic() - start)

    def _scan(self) -> bool:
        tier, ledger, bit = self._tier, self._tier.ledger, self._tier.bit
        for shard, found in recover_shards(tier, self._pace):
            if shard >= 0:
                with ledger.shard_locks[shard]:  # no delete of this process between listing and commit goes unseen
                    keep = [f for f in found if f.meta is not None and f.meta.key not in ledger.gone]
                    self._index.commit_recovered([f.meta for f in keep], bit, [f.mtime for f in keep])  # type: ignore[misc]
                    ledger.shard_done()
                self.shards += 1
                self.blocks += len(keep)
            if self._stop.wait(self._delay_s) if self._delay_s else self._stop.is_set():
                return False
        return True


def _lower_priority() -> None:
    """This thread at nice 10 (on Linux ``setpriority`` on a thread id affects that thread only):
    below the request threads, not starved. At nice 19 a scan on a host whose cores are busy (an
    engine's busy-polling processes, other tenants) got ~1.5% of a core: a 50,000-block folder was
    still uncounted after 120 s (with l2.size held against its upper bound meanwhile), 25 s at 10."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
