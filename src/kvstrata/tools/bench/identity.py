"""``kvstrata bench identity``: what establishing a model's identity costs at engine start.

Two folders, each fingerprinted by ``kvstrata.identity.model_identity`` in one run:

- ``small``: the ``small`` preset of ``examples/make_tiny_model.py`` (Qwen2-0.5B shapes, one 943 MB
  safetensors file), built into a temp folder unless ``--model`` names one;
- ``sparse``: ``--sparse-gb`` (default 10) of weights as 5 sparse safetensors shards (a real header
  of 128 tensors each, then holes), plus a config.json.

Per folder: ``cold`` is a call with no identity cache and the files' pages dropped from the page
cache (``posix_fadvise(DONTNEED)`` after ``fsync``; holes of a sparse file are never on disk, so
there it measures the syscalls); ``cached`` is the next call, which only stats the files;
``full_hash`` is xxh3 over every byte (page cache warm), the cost identity would have if it read
everything. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import xxhash

from kvstrata import identity

MAKE_MODEL = Path(__file__).resolve().parents[3] / "examples" / "make_tiny_model.py"
SHARDS = 5
TENSORS_PER_SHARD = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="an existing model folder instead of building the "
                        "small preset into a temp folder")
    parser.add_argument("--sparse-gb", type=float, default=10.0, help="size of the sparse folder (default 10)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def make_sparse_model(folder: Path, total_bytes: int) -> None:
    """``SHARDS`` safetensors files of ``total_bytes`` together: a valid header, then holes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    shard = total_bytes // SHARDS
    for i in range(SHARDS):
        step = (shard - (1 << 20)) // TENSORS_PER_SHARD
        meta = {f"model.layers.{i * TENSORS_PER_SHARD + t}.weight":
                {"dtype": "BF16", "shape": [step // 2], "data_offsets": [t * step, (t + 1) * step]}
                for t in range(TENSORS_PER_SHARD)}
        header = json.dumps(meta).encode()
        header += b" " * (-(8 + len(header)) % 8)
        path = folder / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            f.truncate(8 + len(header) + TENSORS_PER_SHARD * step)


def drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def full_hash(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h = xxhash.xxh3_128()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)


def _ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(folder: Path, cache_dir: Path, repeats: int) -> dict[str, float | int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    cold, cached = [], []
    saved = os.environ.get("KVSTRATA_CACHE_DIR")
    os.environ["KVSTRATA_CACHE_DIR"] = str(cache_dir)
    try:
        for _ in range(repeats):
            identity.cache_path().unlink(missing_ok=True)
            drop_page_cache(folder)
            cold.append(_ms(lambda: identity.model_identity(str(folder))))
            cached.append(_ms(lambda: identity.model_identity(str(folder))))
        ident = identity.model_identity(str(folder))
    finally:
        if saved is None:
            os.environ.pop("KVSTRATA_CACHE_DIR")
        else:
            os.environ["KVSTRATA_CACHE_DIR"] = saved
    assert ident.trusted and " 0 read" in ident.source, ident
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "cold_ms": round(statistics.median(cold), 2), "cached_ms": round(statistics.median(cached), 3),
            "full_hash_ms": round(statistics.median(_ms(lambda: full_hash(folder)) for _ in range(repeats)), 1)}


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-identity-") as tmp:
        root = Path(tmp)
        if args.model:
            small = Path(args.model)
        else:
            small = root / "small"
            subprocess.run([sys.executable, str(MAKE_MODEL), str(small), "--preset", "small"], check=True,
                           stdout=subprocess.DEVNULL)
        sparse = root / "sparse"
        make_sparse_model(sparse, int(args.sparse_gb * 1e9))
        # identity never caches a file younger than 2 s (it may still be being written)
        newest = max(p.stat().st_mtime for folder in (small, sparse) for p in folder.rglob("*"))
        time.sleep(max(0.0, newest + 2.5 - time.time()))
        result = {name: measure(folder, root / f"cache-{name}", args.repeats)
                  for name, folder in (("small", small), ("sparse", sparse))}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'folder':8} {'files':>5} {'GB':>6} {'cold ms':>9} {'cached ms':>10} {'full hash ms':>13}")
    for name, r in result.items():
        print(f"{name:8} {r['files']:>5} {r['bytes'] / 1e9:>6.2f} {r['cold_ms']:>9.1f} {r['cached_ms']:>10.2f} "
              f"{r['full_hash_ms']:>13.0f}")
    return 0
