"""tools/torture/worker.py: one worker process: its store, oracle and counts (``Worker``), its
threads (``actor.Actor``), and ``worker_main``, what the parent's forkserver runs."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from kvstrata.keys import Namespace, as_tokens

from kvstrata.tools.torture.actor import Actor
from kvstrata.tools.torture.oracle import RetiredLog
from kvstrata.tools.torture.world import BLOCK_TOKENS, SWITCH_S, build_universe, store_config

class Tally:
    """One worker's counts, dumped atomically to ``<run>/counts/<wid>.json`` (the parent sums
    them); wrong/stale/lost events also go at once to ``events.log``, so a kill cannot hide one."""

    def __init__(self, run: Path, wid: int, store: Any) -> None:
        self._path = run / "counts" / f"{wid}.json"
        self._events = run / "events.log"
        self._wid, self._store = wid, store
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[name] += n

    def event(self, kind: str, n: int, detail: str, why: str = "") -> None:
        self.add(kind, n)
        line = json.dumps({"kind": kind, "blocks": n, "wid": self._wid, "pid": os.getpid(), "why": why,
                           "detail": detail, "t": time.monotonic()})  # one clock for all processes
        fd = os.open(self._events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode() + b"\n")
        finally:
            os.close(fd)

    def dump(self) -> None:
        with self._lock:
            data = {"wid": self._wid, "counts": dict(self.counts), "store": self._store.counters.snapshot()}
        tmp = self._path.with_name(f".{self._path.name}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path)


class Worker:
    """The threads of one worker process and the state they share (store, oracle, counts)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from kvstrata.store import BlockStore
        from kvstrata.store.parts import open_keys

        self.spec = spec
        self.run_dir = Path(spec["run"])
        self.l2 = Path(spec["l2"])
        self.key_bits = 16 if spec["wid"] % 2 else 128
        config = store_config(spec)
        self.store = BlockStore(config, key_bits=self.key_bits)
        self.keys = open_keys(config)  # the oracle's own: keys recomputed from the config, not the store
        self.oracle = RetiredLog(self.run_dir / "retired.log", spec["grace_s"])
        self.tally = Tally(self.run_dir, spec["wid"], self.store)
        self.universe = build_universe(spec["seed"])
        weights = [1.0 / (i + 1) ** 0.9 for i in range(len(self.universe))]
        self.cum = list(np.cumsum(weights))
        self.stop = threading.Event()
        self.redis = None
        if spec.get("redis"):
            import redis

            # Straight to the server, past the --net-faults proxy: the chaos (state loss, flipped
            # values) is another actor's, which the faults between this store and Redis do not stop.
            self.redis = redis.Redis.from_url(spec.get("redis_direct") or spec["redis"], socket_timeout=2)
        # Prompts saved lately by any thread of this process: looking them up while other
        # threads evict is where lookup/pin/load races live.
        self.recent: deque[tuple[Namespace, np.ndarray]] = deque(maxlen=24)
        self._pairs: dict[tuple[bytes, int], list[tuple[np.ndarray, np.ndarray]]] = {}
        self._pairs_lock = threading.Lock()
        self.threads_total = spec["procs"] * spec["threads"]

    def collision_pairs(self, ns: Namespace, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """One-block prompts whose keys under ``epoch`` share their first ``key_bits/8`` bytes
        (the bytes this worker's index keys by), found by hashing 2,000 random candidates."""
        with self._pairs_lock:
            found = self._pairs.get((ns.seed, epoch))
            if found is not None:
                return found
        kb = self.key_bits // 8
        rng = random.Random(f"collide-{self.spec['seed']}")
        root = self.keys.root_key(ns.seed, epoch)
        seen: dict[bytes, np.ndarray] = {}
        pairs = []
        for _ in range(2000):
            toks = as_tokens([rng.randrange(1000, 60000) for _ in range(BLOCK_TOKENS)])
            short = self.keys.block_key(root, toks)[0][:kb]
            other = seen.setdefault(short, toks)
            if other is not toks:
                pairs.append((other, toks))
        with self._pairs_lock:
            if len(self._pairs) > 32:
                self._pairs.clear()
            self._pairs[(ns.seed, epoch)] = pairs
        return pairs

    def run(self) -> None:
        threads = [threading.Thread(target=Actor(self, t).run, name=f"torture-{t}", daemon=True)
                   for t in range(self.spec["threads"])]
        for t in threads:
            t.start()
        deadline = self.spec["deadline_ns"]
        while not self.stop.wait(0.5):
            self.tally.dump()
            if not _alive(self.spec["parent"]) or time.monotonic_ns() > deadline:
                self.stop.set()
        for t in threads:
            t.join(timeout=10)
        self.tally.dump()
        self.store.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def worker_main(spec: dict[str, Any]) -> None:
    """A worker process: output to its log, run until SIGTERM, the deadline, or the parent's
    death."""
    fd = os.open(Path(spec["run"]) / f"worker-{spec['wid']}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    sys.setswitchinterval(SWITCH_S)
    worker = Worker(spec)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle: it stops us
    worker.run()
