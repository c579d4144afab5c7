"""Background saves: a bounded queue drained by worker threads, so saving never blocks a step.

``submit(n_blocks, job, on_fail)`` either queues the job or, when ``n_blocks`` more would exceed
the bound, refuses at once (the caller counts the drop). A job that raises is logged with its
traceback and then ``on_fail()`` runs, so whoever waits for the job (an engine holding buffers
until ``on_done(n)``, a request waiting for staging) always hears back. Nothing here waits on the
engine's thread except ``flush()``, which tests and shutdown use. ``fan_out(n, fn)`` runs ``n``
items on the calling thread and the idle save threads together, for a caller that waits anyway.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

_Job = tuple[int, Callable[[], None], Callable[[], None] | None]


class Saver:
    def __init__(self, max_blocks: int, threads: int = 1, name: str = "save") -> None:
        self._max = max_blocks
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstrata-{name}-{i}", daemon=True)
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

    def fan_out(self, n: int, fn: Callable[[int], None]) -> None:
        """Run ``fn(0)`` .. ``fn(n - 1)`` on this thread and up to every save thread, and return
        when every call has finished. File writes release the GIL, so the kernel's page-cache
        copies of different blocks overlap. Items are taken from a shared counter, so a save
        thread busy with queued saves just finds nothing left: this never waits for unrelated
        jobs, and is safe to call from a save thread."""
        helpers = min(len(self._threads), n - 1)
        if helpers <= 0:
            for k in range(n):
                fn(k)
            return
        items = iter(range(n))
        cond = threading.Condition()
        finished = [0]

        def drain() -> None:
            while True:
                with cond:
                    k = next(items, None)
                if k is None:
                    return
                try:
                    fn(k)
                finally:
                    with cond:
                        finished[0] += 1
                        cond.notify_all()

        for _ in range(helpers):
            if not self.submit(0, drain):
                break
        drain()
        with cond:
            cond.wait_for(lambda: finished[0] == n)

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

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout=timeout)
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)
