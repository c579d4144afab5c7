"""SGLang's ``file`` backend (``HiCacheFile``) beside kvstrata's ``StrataStorage``, in one process.

Both backends move the same pages between one real SGLang host pool (``MHATokenToKVPoolHost``,
layer-first, bf16) and a folder on the same disk, and each is called exactly as SGLang's cache
controller calls it in a server:

- ``HiCacheFile`` through the generic page path SGLang uses for it (``_generic_page_set``:
  ``get_data_page`` views, then ``batch_set``; ``_generic_page_get``: ``batch_exists``, a fresh
  ``get_dummy_flat_data_page`` per page, ``batch_get``, then ``set_from_flat_data_page``);
- ``StrataStorage`` through the zero-copy ``interface_v1`` path of configs/sglang.yaml
  (``batch_set_v1`` / ``batch_exists`` + ``batch_get_v1`` on host indices, with prefix keys).

So the figures include each side's host-pool copies, which is what a server pays. Pages have the
Qwen2-0.5B shape (24 layers x K,V x 2 KV heads x 64 head dim x 64 tokens x 2 bytes = 768 KiB),
moved in batches of 32 (one 2k-token prompt); ``get`` includes the ``batch_exists`` query a
prefetch makes first. Neither side fsyncs. Each round writes fresh keys with both sides (order
alternating, ``os.sync()`` before each side so neither inherits the other's dirty pages), then
reads them back with both: reads are right after writing, so both are served from the OS page
cache (warm), treated the same.

kvstrata keeps an L1 (CPU arena) in front of its disk tier. For the disk-path comparison
(``strata_sglang_*``) its L1 holds one batch only, smaller than the host pool, so the adapter
bypasses it: each page goes between the pool and its file with one ``pwritev``/``preadv`` over
the page's runs and a streaming checksum, and every page read comes from disk (checked with the
store's counters). ``strata_sglang_default_*`` is configs/sglang.yaml's 2 GiB L1, larger than
this pool, so pages go through L1 and reads right after writes are L1 hits. Both kvstrata sides
write their files on the calling thread and the save thread together (``saves.threads: 1``, the
default; file writes release the GIL), where ``HiCacheFile`` writes on the calling thread only;
``strata_set_writer_threads`` says how many.

``python -m benchmarks.store_sglang [--quick] --json`` runs it where sglang is importable;
``sglang_fields`` (called by ``kvstrata bench store``) runs that in ./.venv-sglang when this
interpreter has no sglang.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness.sglang_pool import extra_info, host_pool, storage_config

GB = 1e9
LAYERS, HEADS, HEAD_DIM, PAGE = 24, 2, 64, 64  # Qwen2-0.5B's KV shape, SGLang page of 64 tokens
BATCH = 32  # pages per backend call (SGLang's limit is 128 = STORAGE_BATCH_SIZE)
SIDES = ("file", "strata", "strata_default")
MODEL = "bench-qwen2-0.5b"  # the model name SGLang passes the backends


def page_keys(seed: int, n: int) -> list[str]:
    """Chained hex SHA-256 page keys, shaped like SGLang's."""
    keys, prev = [], seed.to_bytes(8, "little")
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def _install_cpu_shims() -> None:
    """SGLang's host pool imports torchvision and sgl_kernel; on CPU the test shims bridge them."""
    import torch

    if torch.cuda.is_available():
        return
    from tests.harness.sglang_server import SHIMS

    sys.path.insert(0, str(SHIMS))
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang_cpu_hook  # type: ignore[import-not-found]

    sglang_cpu_hook.install()


def _pool(pages: int) -> Any:
    """A real layer-first host pool of ``pages`` pages (device buffers of half that, ratio 2)."""
    pool = host_pool(pages * PAGE // 2, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, page=PAGE)
    assert pool.size >= pages * PAGE, (pool.size, pages)
    return pool


class FileSide:
    """``HiCacheFile`` driven like SGLang's ``_generic_page_set`` / ``_generic_page_get``."""

    def __init__(self, folder: Path, pool: Any) -> None:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile

        config = storage_config({"file_storage_path": str(folder)}, model_name=MODEL)
        self.pool, self.backend = pool, HiCacheFile(config, str(folder))

    def set(self, keys: list[str], host: Any, prefix: list[str]) -> bool:
        data = [self.pool.get_data_page(host[i * PAGE]) for i in range(len(keys))]
        return self.backend.batch_set(keys, data)

    def get(self, keys: list[str], host: Any, prefix: list[str]) -> int:
        if self.backend.batch_exists(keys) != len(keys):
            return 0
        dummies = [self.pool.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummies)
        n = 0
        for i, page in enumerate(pages):
            if page is None:
                break
            self.pool.set_from_flat_data_page(host[i * PAGE], page)
            n += 1
        return n

    def drop_all(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        pass


class StrataSide:
    """``StrataStorage`` driven like SGLang's zero-copy path (``interface_v1``, prefix keys)."""

    def __init__(self, folder: Path, pool: Any, l1_bytes: int | str) -> None:
        from kvstrata.adapters.sglang import StrataStorage

        extra = {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang",
                 "class_name": "StrataStorage", "interface_v1": 1, "l1": {"size": l1_bytes, "pin_memory": False},
                 "l2": {"path": str(folder), "size": "64GiB"}, "namespace": {"model_version": "bench"}}
        self.backend = StrataStorage(storage_config(extra, model_name=MODEL), {})
        self.backend.register_mem_pool_host(pool)

    def set(self, keys: list[str], host: Any, prefix: list[str]) -> bool:
        return all(self.backend.batch_set_v1(keys, host, extra_info(prefix)))

    def get(self, keys: list[str], host: Any, prefix: list[str]) -> int:
        info = extra_info(prefix)
        if self.backend.batch_exists(keys, info) != len(keys):
            return 0
        return sum(self.backend.batch_get_v1(keys, host, info))

    @property
    def bypass_l1(self) -> bool:
        return bool(self.backend.bypass_l1)

    def counter(self, name: str) -> int:
        return int(self.backend.store.counters.snapshot().get(name, 0))

    def drop_all(self) -> None:
        self.backend.clear()  # new epoch; gc then deletes the old epoch's files
        self.backend.store.gc()

    def close(self) -> None:
        self.backend.close()


def run(quick: bool = False) -> dict[str, Any]:
    _install_cpu_shims()
    import torch

    torch.set_num_threads(1)  # copies are memory-bound; one thread keeps the sides comparable
    pages = 64 if quick else 256
    rounds = 3 if quick else 5
    page_bytes = 2 * LAYERS * HEADS * HEAD_DIM * PAGE * 2
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-bench-sglang-", dir=os.environ.get("KVSTRATA_BENCH_DIR")))
    pool = _pool(2 * pages)  # source pages, then the pages read back
    pool.kv_buffer[:, :, : pages * PAGE].copy_(
        torch.randn((2, LAYERS, pages * PAGE, HEADS, HEAD_DIM)).to(torch.bfloat16))
    src, dst = torch.arange(0, pages * PAGE), torch.arange(pages * PAGE, 2 * pages * PAGE)
    sides: dict[str, Any] = {}
    try:
        sides = {"file": FileSide(tmp / "file", pool),
                 "strata": StrataSide(tmp / "strata", pool, BATCH * page_bytes),
                 "strata_default": StrataSide(tmp / "strata-default", pool, "2GiB")}
        bypass = {name: sides[name].bypass_l1 for name in ("strata", "strata_default")}
        writers = sides["strata"].backend.store.config.saves.threads
        times: dict[str, dict[str, list[float]]] = {s: {"set": [], "get": []} for s in SIDES}
        from_disk = []
        for r in range(rounds + 1):  # round 0 warms allocators and staging buffers; not reported
            keys = page_keys(r, pages)
            order = SIDES if r % 2 else SIDES[::-1]
            for op in ("set", "get"):
                for name in order:
                    side = sides[name]
                    if op == "get":
                        pool.kv_buffer[:, :, dst[0] : dst[-1] + 1].zero_()
                        before = side.counter("hit_blocks_l2") if name == "strata" else 0
                    os.sync()
                    t = time.perf_counter()
                    done = _batches(side, op, keys, src if op == "set" else dst)
                    times[name][op].append(time.perf_counter() - t)
                    if done != pages:
                        raise RuntimeError(f"{name} {op}: {done} of {pages} pages")
                    if op == "get":
                        if not torch.equal(pool.kv_buffer[:, :, dst[0] : dst[-1] + 1],
                                           pool.kv_buffer[:, :, : pages * PAGE]):
                            raise RuntimeError(f"{name} read back different bytes")
                        if name == "strata" and r:
                            from_disk.append(side.counter("hit_blocks_l2") - before)
            for side in sides.values():
                side.drop_all()
    finally:
        for side in sides.values():
            side.close()
        shutil.rmtree(tmp, ignore_errors=True)
    nbytes = pages * page_bytes
    gbps = {f"{n}_{op}": round(nbytes / statistics.median(v[op][1:]) / GB, 3) for n, v in times.items() for op in v}
    out: dict[str, Any] = {
        "sglang_file_get_gbps": gbps["file_get"], "sglang_file_set_gbps": gbps["file_set"],
        "strata_sglang_get_gbps": gbps["strata_get"], "strata_sglang_set_gbps": gbps["strata_set"],
        "strata_sglang_default_get_gbps": gbps["strata_default_get"],
        "strata_sglang_default_set_gbps": gbps["strata_default_set"],
    }
    out["strata_over_file_get"] = round(out["strata_sglang_get_gbps"] / out["sglang_file_get_gbps"], 3)
    out["strata_over_file_set"] = round(out["strata_sglang_set_gbps"] / out["sglang_file_set_gbps"], 3)
    out["sglang_store_details"] = {
        "quick": quick, "pages": pages, "page_bytes": page_bytes, "batch_pages": BATCH, "rounds": rounds,
        "layout": "layer_first", "page_cache": "warm (reads right after writes, both sides)",
        "strata_l1_bytes": BATCH * page_bytes, "strata_pages_read_from_disk": from_disk,
        "strata_bypass_l1": bypass["strata"], "strata_default_bypass_l1": bypass["strata_default"],
        "strata_set_writer_threads": 1 + writers,
        "seconds": {n: {op: [round(x, 4) for x in v[op][1:]] for op in v} for n, v in times.items()}}
    if any(d != pages for d in from_disk):
        raise RuntimeError(f"strata reads did not all come from disk: {from_disk} of {pages}")
    return out


def _batches(side: Any, op: str, keys: list[str], host: Any) -> int:
    done = 0
    for lo in range(0, len(keys), BATCH):
        batch, where = keys[lo : lo + BATCH], host[lo * PAGE : (lo + BATCH) * PAGE]
        if op == "set":
            done += len(batch) if side.set(batch, where, keys[:lo]) else 0
        else:
            done += side.get(batch, where, keys[:lo])
    return done


def sglang_fields(quick: bool, timeout: float = 900) -> dict[str, Any]:
    """This benchmark's fields, from this interpreter or from SGLang's environment in a subprocess;
    ``{"sglang": None, "sglang_reason": ...}`` when SGLang is not available."""
    import importlib.util

    from tests.harness.sglang_server import SGLangUnavailable, find_python

    if importlib.util.find_spec("sglang") is not None:
        return run(quick)
    try:
        python = find_python()
    except SGLangUnavailable as e:
        return {"sglang": None, "sglang_reason": str(e)}
    cmd = [python, "-m", "benchmarks.store_sglang", "--json"] + (["--quick"] if quick else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"sglang": None, "sglang_reason": f"{' '.join(cmd)} timed out after {timeout:.0f} s"}
    if p.returncode:
        return {"sglang": None, "sglang_reason": f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-800:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_sglang",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 pages and 3 rounds instead of 256 and 5")
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default prints it indented)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
