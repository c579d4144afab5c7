"""Test helpers: private redis-server instances on loopback ports (standalone and a 3-master Cluster)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import redis
import torch

from kvstrata.config import load_config
from kvstrata.store import BlockStore
from kvstrata.tools import serving

REDIS = shutil.which("redis-server")


def free_port(bus: bool = False) -> int:
    """A free loopback port; with ``bus``, one whose cluster bus port (+10000) is free too."""
    if not bus:
        return serving.free_port()  # below the ephemeral range: see serving.free_port
    import random

    for _ in range(200):
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as s1, socket.socket() as s2:
                s1.bind(("127.0.0.1", port))
                s2.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def start(port: int, folder: Path, *extra: str) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([REDIS or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(folder), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    for _ in range(100):
        try:
            if client.ping():
                return proc
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=10)


@contextmanager
def standalone(folder: Path, *extra: str) -> Iterator[tuple[str, int, list[subprocess.Popen[bytes]]]]:
    """Yields (url, port, [process]); the process list lets a test kill and restart it."""
    port = free_port()
    procs = [start(port, folder, *extra)]
    try:
        yield f"redis://127.0.0.1:{port}/0", port, procs
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)


@contextmanager
def cluster(folder: Path, masters: int = 3) -> Iterator[str]:
    ports = [free_port(bus=True) for _ in range(masters)]
    procs = [start(p, folder / str(p), "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf",
                   "--cluster-node-timeout", "2000") for p in ports]
    try:
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        client = redis.Redis(port=ports[0])
        for _ in range(200):
            if client.cluster("info").get("cluster_state") == "ok":
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for p in procs:
            stop(p)


@contextmanager
def shared_backend(kind: str, folder: Path) -> Iterator[dict[str, object]]:
    """``remote.*`` settings for a fresh shared tier: "redis", "cluster" or "fs"."""
    if kind == "redis":
        with standalone(folder / "redis") as (url, _port, _procs):
            yield {"backend": "redis", "url": url}
    elif kind == "cluster":
        with cluster(folder / "cluster") as url:
            yield {"backend": "redis", "url": url, "cluster": True}
    else:
        yield {"backend": "fs", "path": str(folder / "shared")}


def listening(store: Any, timeout_s: float = 30) -> None:
    """Wait until ``store``'s epoch subscriber is subscribed (it connects on its own thread): a
    message published before that never reaches it."""
    assert store.epochs.listening.wait(timeout_s), f"no epoch subscriber after {timeout_s} s"


# ------------------------------------------------------------- what the remote tier's tests share
BLOCK_BYTES = 2048  # a block of the remote tier's unit tests


def redis_store(tmp: Path, name: str, url: str, **extra: object) -> BlockStore:
    """A store with a folder of its own (``tmp/name``, L1 of 1 MiB) and the Redis at ``url`` as its
    shared tier, epochs invalidated after 1 ms; ``extra``: more config overrides."""
    overrides = {"l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(tmp / name / "l2"),
                 "remote.enabled": True, "remote.url": url, "remote.invalidation_ms": 1, **extra}
    return BlockStore(load_config(None, overrides))


def random_prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n, dtype=np.uint32)


def key_payloads(chain: Any, size: int = BLOCK_BYTES) -> torch.Tensor:
    """Block bytes derived from each key (the key repeated), so any load can be checked against its key."""
    rows = [np.frombuffer(k * (size // 16), np.uint8) for k in chain.keys]
    return torch.from_numpy(np.stack(rows).copy())


class SharedPrompt:
    """A writer (``open_store("writer")``) stored ``tokens`` in the remote tier and flushed;
    ``reader(name, ...)`` opens a fresh instance (``open_store(name, ...)``) that knows nothing of
    it locally, so its lookups and loads read what Redis holds. ``close()`` closes the readers."""

    def __init__(self, url: str, open_store: Callable[..., Any], ns: Any, tokens: np.ndarray) -> None:
        self.client = redis.Redis.from_url(url)
        self.tokens, self._open, self.opened = tokens, open_store, []
        with open_store("writer") as writer:
            self.epoch, self.chain = writer.chain(ns, tokens)
            self.expected = key_payloads(self.chain)
            assert writer.save_now(ns, self.epoch, self.chain, self.expected) == len(self.chain.keys)
            writer.flush()

    def reader(self, name: str = "reader", *args: Any, **kw: Any) -> Any:
        store = self._open(name, *args, **kw)
        self.opened.append(store)
        return store

    def close(self) -> None:
        for store in self.opened:
            store.close()
