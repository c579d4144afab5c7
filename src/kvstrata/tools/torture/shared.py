"""tools/torture/shared.py: what the threads of one worker process share, as its actors see it:
``Worker``, the part of ``worker.Worker`` an ``actor.Actor`` uses, and ``Counts``, its
``worker.Tally``. Protocols, so that ``actor`` and ``worker`` do not import each other (the worker
starts the actors)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import threading
    from collections import deque
    from pathlib import Path

    import numpy as np

    from kvstrata.keys import KeyScheme, Namespace
    from kvstrata.store import BlockStore
    from kvstrata.tools.torture.oracle import RetiredLog


class Counts(Protocol):
    """A worker's counts, dumped for the parent; wrong, stale and lost blocks are also events."""

    def add(self, name: str, n: int = 1) -> None: ...

    def event(self, kind: str, n: int, detail: str, why: str = "") -> None: ...


class Worker(Protocol):
    """One worker process's store, oracle and counts, its prompts, and its stop flag."""

    spec: dict[str, Any]  # the parent's settings for this worker (seed, wid, procs, threads, ...)
    store: BlockStore
    keys: KeyScheme  # the oracle's own, recomputed from the config
    tally: Counts
    oracle: RetiredLog
    l2: Path
    key_bits: int  # the index's key width in this worker (16 or 128)
    redis: Any  # a redis.Redis straight to the server, or None
    universe: list[np.ndarray]
    cum: list[float]  # cumulative draw weights of the universe's prompts
    recent: deque[tuple[Namespace, np.ndarray]]
    stop: threading.Event
    threads_total: int

    def collision_pairs(self, ns: Namespace, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]: ...
