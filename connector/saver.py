"""Background saves: a bounded queue drained by worker threads, so saving never blocks a step.

``submit(n_blocks, job)`` either queues the job or, when ``n_blocks`` more would exceed the bound,
refuses at once (the caller counts the drop). Nothing here waits on the engine's thread except
``flush()``, which tests and shutdown use.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Saver:
    def __init__(self, max_blocks: int, threads: int = 1) -> None:
        self._max = max_blocks
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[tuple[int, Callable[[], None]] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstrata-save-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, n_blocks: int, job: Callable[[], None]) -> bool:
        with self._lock:
            if self._pending + n_blocks > self._max:
                return False
            self._pending += n_blocks
        self._queue.put((n_blocks, job))
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            n, job = item
            try:
                job()
            except Exception:  # a failed save must never kill the saver; the block is just not stored
                log.exception("kvstrata: save failed")
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
