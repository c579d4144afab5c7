"""The scale section of ``kvstrata bench store`` (``--scale N``, default 1,000,000 blocks): what a
large L2 folder costs at engine start and after.

N blocks of real prompts (chained keys of ``PROMPT_BLOCKS``-block prompts) are written straight in
the disk format with sparse payloads (a header, then a hole: ``SCALE_BLOCK_BYTES`` each on paper,
one filesystem block on disk), so a million fit on this machine's disk in minutes. Reported:

- ``open_ms_empty`` / ``open_ms_at_1m``: ``BlockStore(...)`` on an empty folder / on the N blocks
  (medians of 3; the background recovery is stopped by ``close``);
- ``first_lookup_ms_at_1m``: the first lookup of a stored prompt (``first_lookup_blocks`` blocks)
  right after open, found by header, and loading it;
- ``recovery_s_at_1m``: until the background scan has every block in the index (what opening cost
  before it moved to the background);
- ``lookup_us_per_1k_blocks_at_1m``: ``lookup_us_per_1k_blocks`` with the N entries resident,
  and ``lookup_us_per_1k_blocks_small_beside``: the same in a store of 1,000 entries, the two
  measured round by round in turn (a shared machine's load drifts between sections of the run);
- ``index_bytes_per_entry_at_1m``: the recovered index's allocations (numpy columns at capacity,
  the key dict and its key objects, the free list, the tail counts) per entry;
- ``check_s_at_1m``: ``kvstrata check`` (every header and payload checksum) over the folder.

The field names say 1m whatever N is; ``scale_blocks`` says what N was.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
import numpy as np
import torch

from kvstrata.format.block import HEADER_SIZE, pack_header, payload_checksum
from kvstrata.cli.check import check_disk
from kvstrata.config import load_config
from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import NO_EXTRA, Namespace
from kvstrata.store import BlockStore
from kvstrata.tiers.folder import block_name

PROMPT_BLOCKS = 100
SCALE_BLOCK_BYTES = 16 << 10


def _config(root: Path, n: int) -> object:
    return load_config(None, {"l1.size": 64 << 20, "l1.pin_memory": False, "l2.path": str(root),
                              "l2.size": max(1 << 30, 2 * n * (HEADER_SIZE + SCALE_BLOCK_BYTES)), "l2.write": "on_evict"})


def _prompt(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 150_000, PROMPT_BLOCKS * 16, dtype=np.uint32)


def _generate(root: Path, ns: Namespace, n: int, progress: bool) -> None:
    """``n`` blocks (``n // PROMPT_BLOCKS`` prompts) in ``root``, sparse, in the disk format."""
    with BlockStore(_config(root, n)) as store:  # type: ignore[arg-type]  # the folders and the namespace's epoch
        epoch, keys = store.current_epoch(ns), store.keys  # the keys its lookups will compute
    root_k = keys.root_key(ns.seed, epoch)
    chains = (keys.chain_keys(root_k, _prompt(i), 16, NO_EXTRA, partial=False) for i in range(n // PROMPT_BLOCKS))
    checksum = payload_checksum(bytes(SCALE_BLOCK_BYTES))
    blocks = str(root / "blocks")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    t = time.monotonic()
    for i, chain in enumerate(chains):
        for key, parent, fp, ntok in zip(*chain):
            h = key.hex()
            meta = EntryMeta(key, parent, fp, ntok, ns.seed, epoch, SCALE_BLOCK_BYTES, checksum)
            fd = os.open(f"{blocks}/{h[:2]}/{block_name(h)}", flags, 0o600)
            os.write(fd, pack_header(meta))
            os.ftruncate(fd, HEADER_SIZE + SCALE_BLOCK_BYTES)  # the payload is a hole of zeros
            os.close(fd)
        if progress and i % 1000 == 999:
            print(f"    {(i + 1) * PROMPT_BLOCKS:,} blocks written ({time.monotonic() - t:.0f} s)", flush=True)


def _open_ms(root: Path, n: int) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        store = BlockStore(_config(root, n))  # type: ignore[arg-type]
        times.append((time.perf_counter() - t) * 1000)
        store.close()
    return statistics.median(times)


def _index_bytes(index: BlockIndex) -> float:
    """Bytes the index holds per entry, from its allocations."""
    cols = sum(v.nbytes for v in vars(index).values() if isinstance(v, np.ndarray))
    keys = index._map.nbytes  # noqa: SLF001  (the key column is counted with the columns)
    free = sys.getsizeof(index._free)  # noqa: SLF001
    tails = sys.getsizeof(index._tails)  # noqa: SLF001
    return (cols + keys + free + tails) / max(1, len(index))


def scale_fields(n: int, tmp: Path, progress: bool = True) -> dict[str, object]:
    ns = Namespace("bench", "bench-scale", "v1", "bfloat16", "bench", 16)
    root = tmp / "scale" / "l2"
    out: dict[str, object] = {"scale_blocks": n // PROMPT_BLOCKS * PROMPT_BLOCKS,
                              "scale_block_bytes": SCALE_BLOCK_BYTES, "first_lookup_blocks": PROMPT_BLOCKS}
    empty = tmp / "scale-empty" / "l2"
    BlockStore(_config(empty, n)).close()  # type: ignore[arg-type]  # its folders, as at a restart
    out["open_ms_empty"] = round(_open_ms(empty, n), 2)
    t = time.monotonic()
    _generate(root, ns, n, progress)
    out["scale_generate_s"] = round(time.monotonic() - t, 1)
    os.sync()
    out["open_ms_at_1m"] = round(_open_ms(root, n), 2)

    cfg = _config(root, n)
    t0 = time.perf_counter()
    store = BlockStore(cfg)  # type: ignore[arg-type]
    try:
        t1 = time.perf_counter()
        hit = store.lookup(ns, _prompt(n // PROMPT_BLOCKS // 2))
        out["first_lookup_ms_at_1m"] = round((time.perf_counter() - t1) * 1000, 2)
        if hit.num_blocks != PROMPT_BLOCKS:
            raise RuntimeError(f"the first lookup found {hit.num_blocks} of {PROMPT_BLOCKS} stored blocks")
        buf = torch.empty((PROMPT_BLOCKS, SCALE_BLOCK_BYTES), dtype=torch.uint8)
        t2 = time.perf_counter()
        if store.load_into(hit, buf) != PROMPT_BLOCKS:
            raise RuntimeError("the first hit failed to load")
        out["first_load_ms_at_1m"] = round((time.perf_counter() - t2) * 1000, 2)
        if progress:
            print("    waiting for the background recovery ...", flush=True)
        store.wait_recovered()
        out["recovery_s_at_1m"] = round(time.perf_counter() - t0, 2)
        if len(store.index) < out["scale_blocks"]:  # type: ignore[operator]
            raise RuntimeError(f"recovered {len(store.index)} of {out['scale_blocks']} blocks")
        with BlockStore(_config(tmp / "scale-small" / "l2", n)) as small:  # type: ignore[arg-type]
            big_us, small_us = _lookup_us([store, small], 1000)
        out["lookup_us_per_1k_blocks_at_1m"] = round(big_us, 1)
        out["lookup_us_per_1k_blocks_small_beside"] = round(small_us, 1)
        out["index_bytes_per_entry_at_1m"] = round(_index_bytes(store.index), 1)
    finally:
        store.close()
    if progress:
        print("    kvstrata check ...", flush=True)
    t = time.monotonic()
    report = check_disk(root, fix=False, progress=False)
    out["check_s_at_1m"] = round(time.monotonic() - t, 3)  # a --quick folder checks in milliseconds
    if report["bad"] or report["ok"] < out["scale_blocks"]:  # type: ignore[operator]
        raise RuntimeError(f"check found {report['ok']} good and {report['bad']} bad blocks")
    return out


def _lookup_us(stores: list[BlockStore], n_blocks: int, rounds: int = 201) -> list[float]:
    """The ``lookup_us_per_1k_blocks`` measure (``store_lookup``) in each store, in turn."""
    ns = Namespace("bench", "bench-model", "v1", "bfloat16", "bench", 16)
    tokens = np.random.default_rng(0).integers(0, 150_000, n_blocks * 16, dtype=np.uint32)
    for store in stores:
        epoch, chain = store.chain(ns, tokens)
        store.save_now(ns, epoch, chain, torch.zeros((n_blocks, SCALE_BLOCK_BYTES), dtype=torch.uint8))
    times: list[list[float]] = [[] for _ in stores]
    for _ in range(rounds):
        for store, out in zip(stores, times):
            t = time.perf_counter()
            hit = store.lookup(ns, tokens)
            out.append(time.perf_counter() - t)
            assert hit.num_blocks == n_blocks
    return [statistics.median(t) * 1e6 * 1000 / n_blocks for t in times]
