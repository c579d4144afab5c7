"""``kvstrata bench store``: the store's paths measured beside raw baselines, in one process.

Every pair runs on the same bytes, the same block sizes and the same folder, interleaved round by
round, and reports medians; ratios are what to read (absolute numbers on a shared 2-core machine
mean little). Baselines:
- ``memcpy``: one torch ``copy_`` per block between preallocated, pre-touched tensors (the least any
  store must do per block);
- ``pwrite`` / ``pread``: per block, ``os.open`` + one ``pwrite``/``pread`` + ``os.close`` of a file
  in the same folder (the least a file-per-block tier must do; no fsync on either side);
- ``engine_hash``: vLLM's own ``hash_block_tokens`` with sha256 over the same token blocks, beside
  a whole-prompt lookup in a store of each key scheme (``store_lookup``).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import xxhash

from kvstrata.config import load_config
from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import DEFAULT_KEY_SCHEME, SCHEMES, Namespace
from kvstrata.store import BlockStore

GB = 1e9


def _median_time(fn: Callable[[], object], rounds: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(rounds):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _interleaved(res: dict[str, list[float]], a: tuple[str, Callable[[int, int], None]],
                 b: tuple[str, Callable[[int, int], None]], n: int, chunk: int = 4) -> None:
    """Run two sides over blocks [0, n) in alternating chunks; append each side's total time."""
    totals = {a[0]: 0.0, b[0]: 0.0}
    for k, lo in enumerate(range(0, n, chunk)):
        hi = min(n, lo + chunk)
        for name, fn in (a, b) if k % 2 else (b, a):
            t = time.perf_counter()
            fn(lo, hi)
            totals[name] += time.perf_counter() - t
    for name, total in totals.items():
        res[name].append(total)


def _ns(block_tokens: int) -> Namespace:
    return Namespace("bench", "bench-model", "v1", "bfloat16", "bench", block_tokens)


def _store(tmp: Path, l1_bytes: int, l2: bool) -> BlockStore:
    cfg = load_config(None, {"l1.size": l1_bytes, "l1.pin_memory": False, "l2.enabled": l2,
                             "l2.path": str(tmp / "l2"), "l2.size": 1 << 40, "l2.write": "on_evict",
                             "saves.queue_blocks": 1 << 20})
    return BlockStore(cfg)


def _memory_and_disk(block_bytes: int, total: int, rounds: int, tmp: Path) -> dict[str, float]:
    n = max(4, total // block_bytes)
    src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    res: dict[str, list[float]] = {k: [] for k in ("memcpy", "l1_put", "l1_get", "pwrite", "pread",
                                                   "disk_put", "disk_get")}
    store = _store(tmp, block_bytes * n * (rounds + 2), l2=True)
    assert store.l2 is not None
    store.l1._allocate(block_bytes)  # noqa: SLF001 - pre-touch the arena like the baseline's tensors
    assert store.l1.data is not None
    store.l1.data.zero_()
    ns = _ns(16)
    raw_dir = tmp / "raw"
    raw_dir.mkdir(exist_ok=True)
    views = [memoryview(src[i].numpy()) for i in range(n)]
    outs = [memoryview(dst[i].numpy()) for i in range(n)]
    for r in range(rounds + 1):  # round 0 warms caches and allocators; it is not reported
        tokens = np.arange(r * n * 16, (r + 1) * n * 16, dtype=np.uint32)
        epoch, chain = store.chain(ns, tokens)

        def memcpy() -> None:
            for i in range(n):
                dst[i].copy_(src[i])

        res["memcpy"].append(_median_time(memcpy, 1))
        res["l1_put"].append(_median_time(lambda: store.save_now(ns, epoch, chain, src), 1))
        hit = store.lookup(ns, tokens)
        assert hit.num_blocks == n
        res["l1_get"].append(_median_time(lambda: store.load_into(hit, dst), 1))

        def pwrite(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(raw_dir / f"{r}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.pwrite(fd, views[i], 0)
                os.close(fd)

        def pread(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                fd = os.open(raw_dir / f"{r}-{i}", os.O_RDONLY)
                os.preadv(fd, [outs[i]], 0)
                os.close(fd)

        metas = [store.index.meta(int(row)) for row in store.index.rows_of(chain.keys)]

        def disk_put(lo: int, hi: int) -> None:
            store._evictor.write_backing(metas[lo:hi], list(src[lo:hi]))

        def disk_get(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                if not store.l2.read(metas[i], dst[i]):
                    raise RuntimeError("benchmark block failed to read back")

        # The disk's state (dirty pages, writeback throttling) changes within a second, so the two
        # sides alternate every few blocks, first one then the other, and each sums its own time.
        os.sync()
        _interleaved(res, ("pwrite", pwrite), ("disk_put", disk_put), n)
        metas = [store.index.meta(int(row)) for row in store.index.rows_of(chain.keys)]  # checksums
        _interleaved(res, ("pread", pread), ("disk_get", disk_get), n)
        if not torch.equal(dst, src):
            raise RuntimeError("benchmark read back different bytes")
        for p in raw_dir.iterdir():
            p.unlink()
        for key in chain.keys:
            store.l2.delete(key)
    store.close()
    nbytes = n * block_bytes
    return {f"{k}_gbps": round(nbytes / statistics.median(v[1:]) / GB, 3) for k, v in res.items()}


def _index_bytes(n: int) -> dict[str, float]:
    """Traced bytes of a BlockIndex holding ``n`` entries, divided by ``n``.

    Counts everything the index allocates: the key map's slots, the free list and every numpy
    column at its allocated capacity (keys live in a column; no key object is kept). No token ids
    are stored (a 64-bit chained fingerprint replaces them), so there is nothing to exclude.
    """
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(n)]
    metas = [EntryMeta(k, keys[i - 1] if i else b"\0" * 16, i, 16, b"s" * 16, 0, 1 << 18, i + 1)
             for i, k in enumerate(keys)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    index.commit_many(metas, 2)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(index) == n
    return {"index_bytes_per_entry": round(used / n, 1), "index_entries_measured": n}


def run(quick: bool = False, progress: bool = True, scale: int | None = None) -> dict[str, object]:
    """The whole benchmark; ``scale``: blocks of the scale section (``store_scale``; default
    1,000,000, or 2,000 with ``quick``; 0 skips it)."""
    total = (64 if quick else 256) << 20
    rounds = 3 if quick else 7
    sizes = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
    torch.set_num_threads(1)  # copies are memory-bound; one thread keeps both sides comparable
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-", dir=os.environ.get("KVSTRATA_BENCH_DIR")))
    out: dict[str, object] = {"quick": quick, "bench_dir": str(tmp)}
    try:
        by_size = {}
        for label, size in sizes.items():
            if progress:
                print(f"  block size {label} ...", flush=True)
            by_size[label] = _memory_and_disk(size, total, rounds, tmp)
        first = by_size["256KiB"]
        out.update(first)
        out["block_bytes"] = sizes["256KiB"]
        out["by_block_size"] = by_size
        if progress:
            print("  lookup ...", flush=True)
        from kvstrata.tools.bench.store_lookup import lookup_fields

        out.update(lookup_fields(1000, 15 if quick else 61, tmp))
        if progress:
            for name in SCHEMES:
                print(f"    {name}: {out[f'lookup_us_per_1k_blocks_{name}']} us per 1k blocks, "
                      f"{out[f'lookup_vs_engine_hash_{name}']} of vLLM's own hashing "
                      f"({out['engine_hash_us_per_1k_blocks']} us)", flush=True)
        if progress:
            print("  index memory ...", flush=True)
        out.update(_index_bytes(200_000 if quick else 1_000_000))  # per entry: the same at either size
        scale = (2_000 if quick else 1_000_000) if scale is None else scale
        if scale:
            if progress:
                print(f"  scale: {scale:,} blocks on L2 ...", flush=True)
            from kvstrata.tools.bench.store_scale import scale_fields

            out.update(scale_fields(scale, tmp, progress))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["ratios"] = _ratios(out)
    return out


def _ratios(r: dict[str, object]) -> dict[str, float | None]:
    def ratio(a: str, b: str, src: dict[str, object]) -> float:
        return round(float(src[a]) / float(src[b]), 3)  # type: ignore[arg-type]

    worst = {
        name: min(ratio(a, b, v) for v in r["by_block_size"].values())  # type: ignore[union-attr]
        for name, (a, b) in {
            "l1_put_vs_memcpy": ("l1_put_gbps", "memcpy_gbps"),
            "l1_get_vs_memcpy": ("l1_get_gbps", "memcpy_gbps"),
            "disk_put_vs_pwrite": ("disk_put_gbps", "pwrite_gbps"),
            "disk_get_vs_pread": ("disk_get_gbps", "pread_gbps"),
        }.items()
    }
    for name in SCHEMES:  # medians of each round's ratio (``store_lookup``)
        worst[f"lookup_vs_engine_hash_{name}"] = r[f"lookup_vs_engine_hash_{name}"]  # type: ignore[assignment]
    worst["lookup_vs_engine_hash"] = worst[f"lookup_vs_engine_hash_{DEFAULT_KEY_SCHEME}"]
    if "open_ms_at_1m" in r:
        worst["open_at_1m_vs_empty"] = ratio("open_ms_at_1m", "open_ms_empty", r)
        worst["lookup_at_1m_vs_small_index"] = ratio("lookup_us_per_1k_blocks_at_1m",
                                                     "lookup_us_per_1k_blocks_small_beside", r)
    return worst
