"""``python -m benchmarks remote``: the Redis tier beside raw redis-py on the same server, in one run.

- ``raw_redis_set_gbps`` / ``raw_redis_get_gbps``: one pipelined SET / one MGET of the same
  payloads as ready ``bytes`` (the least any client does);
- ``strata_redis_set_gbps`` / ``strata_redis_get_gbps``: ``RedisTier.write_many`` / ``read_many``
  (header, index entry in the same transaction, bounds checks, checksum verification, copy into
  the destination tensor);
- ``mac_redis_set_gbps`` / ``mac_redis_get_gbps``: the same with a secret (``remote.auth_key_file``):
  every value sealed with keyed BLAKE3, every read checked against its MAC (which replaces the
  payload's xxh3 pass); ``ratios.mac_get_time`` / ``mac_set_time`` are the time of an L3 get / set
  with the MAC over the same without (target: get at most 1.1);
- ``l3_hit_ms`` / ``mac_l3_hit_ms`` / ``enc_l3_hit_ms``: an L3 hit through the store, without a
  secret, with the MAC, and with ``remote.encrypt`` (AES-256-GCM): a fresh store (L1 and Redis,
  nothing local) looks up and loads a prompt another store saved, 12 blocks of 3 MiB (the
  1,500-token prompt of ``bench ttft``'s ``small`` model); medians over interleaved rounds,
  ``ratios.mac_l3_hit`` (target at most 1.1), ``ratios.enc_l3_hit`` (encrypt on over off, both
  with the secret: target at most 1.15) and ``ratios.enc_l3_hit_vs_plain`` (over no secret);
- ``mac_us``: per block size, the MAC of one block (``Auth.block_tag``) beside its xxh3-64;
- ``aead``: per block size, one core's AES-256-GCM (as ``Seal`` runs it, and bare) beside
  ChaCha20-Poly1305, GB/s (``remote_aead``);
- ``invalidation_visible_ms``: median over 20 epoch bumps of the time until a second process sees
  the new epoch;
- ``lookup_round_trips``: commands the server receives for one lookup of a 64-block prefix stored
  by another instance (epoch check included).

Starts a private ``redis-server`` on a loopback port unless ``--url`` is given.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.format.auth import Auth
from kvstrata.format.block import pack_header, payload_checksum
from kvstrata.config import load_config
from kvstrata.index import EntryMeta
from kvstrata.keys import Namespace
from kvstrata.store import BlockStore
from tests.harness.redis_server import redis_server
from benchmarks.remote_aead import aead_gbps

NS = Namespace("bench", "bench-model", "v1", "bfloat16", "bench", 16)


def _store(url: str, tmp: Path, name: str, secret: bool = False, encrypt: bool = False) -> BlockStore:
    extra: dict[str, object] = {"remote.encrypt": encrypt}
    if secret:
        key = tmp / f"{name}.key"  # one secret per name: every store of that name shares it
        if not key.exists():
            key.write_text(os.urandom(32).hex())
        extra["remote.auth_key_file"] = str(key)
    return BlockStore(load_config(None, {"l1.size": "1GiB", "l1.pin_memory": False, "l2.enabled": False,
                                         "remote.enabled": True, "remote.url": url,
                                         "remote.timeout_ms": 5000, "saves.queue_blocks": 1 << 20,
                                         "l2.path": str(tmp / name), **extra}))


def _hit(url: str, tmp: Path, rounds: int, blocks: int = 12, block_bytes: int = 3 << 20) -> dict[str, float]:
    """Median ms of a fresh store's lookup + load of ``blocks`` blocks from Redis: no secret, the
    MAC, the MAC and encryption (interleaved round by round, so that drift hits all alike)."""
    tokens = np.random.default_rng(1).integers(0, 30000, blocks * 16, dtype=np.uint32)
    payload = torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8)
    configs = (("l3_hit_ms", False, False), ("mac_l3_hit_ms", True, False), ("enc_l3_hit_ms", True, True))
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for name, secret, encrypt in configs:
        with _store(url, tmp, f"hit-{name}", secret, encrypt) as writer:
            epoch, chain = writer.chain(NS, tokens)
            writer.save_now(NS, epoch, chain, payload)
            writer.flush()
    for r in range(rounds + 1):  # round 0 warms
        for name, secret, encrypt in configs:
            with _store(url, tmp, f"hit-{name}", secret, encrypt) as reader:
                out = torch.empty_like(payload)
                t = time.perf_counter()
                hit = reader.lookup(NS, tokens)
                loaded = reader.load_into(hit, out)
                took = (time.perf_counter() - t) * 1000
                if loaded != blocks or not torch.equal(out, payload):
                    raise RuntimeError(f"L3 hit benchmark ({name}) loaded {loaded} of {blocks} blocks")
                if r:
                    times[name].append(took)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def _mac_us(sizes: tuple[int, ...] = (64 << 10, 256 << 10, 1 << 20, 4 << 20)) -> dict[str, dict[str, float]]:
    """Microseconds per block: keyed BLAKE3 (the MAC) and xxh3-64 (the checksum), medians of 5."""
    auth = Auth(os.urandom(32))
    out = {}
    for size in sizes:
        payload = [memoryview(os.urandom(size))]
        header = pack_header(EntryMeta(b"k" * 16, b"p" * 16, 1, 16, NS.seed, 1, size, 1))
        reps = max(4, (64 << 20) // size)

        def per_block(fn: Any) -> float:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.append((time.perf_counter() - t) / reps * 1e6)
            return round(statistics.median(times), 1)

        out[f"{size >> 10}KiB"] = {"blake3_mac_us": per_block(lambda: auth.block_tag(b"redis", b"k" * 16, header, payload)),
                                   "xxh3_us": per_block(lambda: payload_checksum(payload[0]))}
    return out


def _throughput(url: str, tmp: Path, block_bytes: int, n: int, rounds: int) -> dict[str, float]:
    import redis

    raw = redis.Redis.from_url(url)
    store = _store(url, tmp, "tput")
    tier = store.remote
    sealed = _store(url, tmp, "tput-mac", secret=True)
    mac_tier = sealed.remote
    assert tier is not None and mac_tier is not None
    src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8)
    values = [bytes(src[i].numpy()) for i in range(n)]
    out = torch.zeros_like(src)
    res: dict[str, list[float]] = {k: [] for k in ("raw_set", "raw_get", "strata_set", "strata_get",
                                                   "mac_set", "mac_get")}
    for r in range(rounds + 1):  # round 0 warms connections and allocators
        tokens = np.arange(r * n * 16, (r + 1) * n * 16, dtype=np.uint32)
        epoch, chain = store.chain(NS, tokens)
        metas = [EntryMeta(k, p, f, ln, NS.seed, epoch, block_bytes, payload_checksum(v))
                 for (k, p, f, ln), v in zip(zip(*chain), values)]
        names = [f"rawbench:{r}:{i}" for i in range(n)]

        def raw_set() -> None:
            pipe = raw.pipeline(transaction=False)
            for name, v in zip(names, values):
                pipe.set(name, v)
            pipe.execute()

        def timed(fn: Any) -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        res["raw_set"].append(timed(raw_set))
        res["strata_set"].append(timed(lambda: tier.write_many(metas, list(src))))
        res["raw_get"].append(timed(lambda: raw.mget(names)))
        got = [0]
        res["strata_get"].append(timed(lambda: got.__setitem__(0, tier.read_many(metas, list(out)))))
        if got[0] != n or not torch.equal(out, src):
            raise RuntimeError("remote benchmark read back different bytes")
        out.zero_()
        res["mac_set"].append(timed(lambda: mac_tier.write_many(metas, list(src))))
        res["mac_get"].append(timed(lambda: got.__setitem__(0, mac_tier.read_many(metas, list(out)))))
        if got[0] != n or not torch.equal(out, src):
            raise RuntimeError("remote benchmark read back different bytes with the MAC")
        raw.flushall()
    store.close()
    sealed.close()
    nbytes = n * block_bytes
    names = {"raw_set": "raw_redis_set_gbps", "raw_get": "raw_redis_get_gbps",
             "strata_set": "strata_redis_set_gbps", "strata_get": "strata_redis_get_gbps",
             "mac_set": "mac_redis_set_gbps", "mac_get": "mac_redis_get_gbps"}
    return {names[k]: round(nbytes / statistics.median(v[1:]) / 1e9, 3) for k, v in res.items()}


def _observer(url: str, tmp: str, seed: bytes, bumps: int, ready: Any, queue: Any) -> None:
    store = _store(url, Path(tmp), "observer")
    seen = store.epochs.get(seed)
    ready.set()
    times = []
    while len(times) < bumps:
        epoch = store.epochs.get(seed)
        if epoch != seen:
            times.append(time.time())
            seen = epoch
        else:
            time.sleep(0.0005)
    queue.put(times)
    store.close()


def _invalidation(url: str, tmp: Path, bumps: int = 20) -> float:
    ctx = mp.get_context("spawn")
    ready, queue = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_observer, args=(url, str(tmp), NS.seed, bumps, ready, queue))
    proc.start()
    ready.wait(60)
    store = _store(url, tmp, "bumper")
    sent = []
    for _ in range(bumps):
        time.sleep(0.05)
        sent.append(time.time())
        store.epochs.bump(NS.seed)
    seen = queue.get(timeout=60)
    proc.join(30)
    store.close()
    return round(statistics.median((b - a) * 1000 for a, b in zip(sent, seen)), 2)


def _round_trips(url: str, tmp: Path) -> int:
    import redis

    a, b = _store(url, tmp, "rt-a"), _store(url, tmp, "rt-b")
    tokens = np.random.default_rng(0).integers(0, 30000, 64 * 16, dtype=np.uint32)
    epoch, chain = a.chain(NS, tokens)
    a.save_now(NS, epoch, chain, torch.zeros((64, 4096), dtype=torch.uint8))
    a.flush()
    server = redis.Redis.from_url(url)
    b.lookup(NS, tokens[:10])  # open connections, as between requests
    time.sleep(0.2)  # let the cached epoch go stale: the lookup checks it again
    server.config_resetstat()
    hit = b.lookup(NS, tokens)
    stats = server.info("commandstats")
    a.close()
    b.close()
    if hit.num_blocks != 64:
        raise RuntimeError(f"round-trip benchmark hit {hit.num_blocks} of 64 blocks")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config|resetstat"))


def run(url: str | None = None, quick: bool = False) -> dict[str, object]:
    if url is None and shutil.which("redis-server") is None:
        raise SystemExit("python -m benchmarks remote: redis-server is not installed and no --url was given")
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-remote-"))
    try:
        with redis_server(url, tmp / "redis", maxmemory=None, flush=False) as url:
            out: dict[str, object] = {"url": url, "block_bytes": 256 << 10}
            out.update(_throughput(url, tmp, 256 << 10, 64 if quick else 256, 3 if quick else 7))
            out.update(_hit(url, tmp, 5 if quick else 11))
            out["invalidation_visible_ms"] = _invalidation(url, tmp)
            out["lookup_round_trips"] = _round_trips(url, tmp)
        out["ratios"] = {
            "set_vs_raw": round(out["strata_redis_set_gbps"] / out["raw_redis_set_gbps"], 3),  # type: ignore[operator]
            "get_vs_raw": round(out["strata_redis_get_gbps"] / out["raw_redis_get_gbps"], 3),  # type: ignore[operator]
            # time with the MAC over time without (gbps ratio inverted): target get <= 1.1
            "mac_get_time": round(out["strata_redis_get_gbps"] / out["mac_redis_get_gbps"], 3),  # type: ignore[operator]
            "mac_set_time": round(out["strata_redis_set_gbps"] / out["mac_redis_set_gbps"], 3),  # type: ignore[operator]
            "mac_l3_hit": round(out["mac_l3_hit_ms"] / out["l3_hit_ms"], 3),  # type: ignore[operator]
            # encrypt on over off (both with the secret): target <= 1.15
            "enc_l3_hit": round(out["enc_l3_hit_ms"] / out["mac_l3_hit_ms"], 3),  # type: ignore[operator]
            "enc_l3_hit_vs_plain": round(out["enc_l3_hit_ms"] / out["l3_hit_ms"], 3),  # type: ignore[operator]
        }
        out["mac_us"] = _mac_us()
        out["aead"] = aead_gbps()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
