"""Background saves: a bounded queue drained by worker threads, so saving never blocks a step.

``submit(n_blocks, job, on_fail)`` either queues the job or, when ``n_blocks`` more would exceed
the bound, refuses at once (the caller counts the drop). A job that raises is logged with its
traceback and then ``on_fail()`` runs, so whoever waits for the job (an engine holding buffers
until ``on_done(n)``, a request waiting for staging) always hears back. Nothing here waits on the
engine's thread except ``flush()``, which tests and shutdown use.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

_Job = tuple[int, Callable[[], None], Callable[[], None] | None]


class Saver:
    def __init__(self, max_blocks: int, threads: int = 1) -> None:
        self._max = max_blocks
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstrata-save-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, n_blocks: int, job: Callable[[], None],
               on_fail: Callable[[], None] | None = None) -> bool:
        """Queue ``job``; ``on_fail`` runs after it if it raises. False (and nothing queued, so
        neither runs) when ``n_blocks`` more would exceed the bound."""
        with self._lock:
            if self._pending + n_blocks > self._max:
                return False
            self._pending += n_blocks
        self._queue.put((n_blocks, job, on_fail))
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            n, job, on_fail = item
            try:
                job()
            except Exception:  # a failed save must never kill the saver; the block is just not stored
                log.exception("kvstrata: save failed")
                if on_fail is not None:
                    try:
                        on_fail()
                    except Exception:
                        log.exception("kvstrata: failure callback of a save failed")
            finally:
                with self._lock:
                    self._pending -= n
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save has finished."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.flush(timeout=30)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)
