"""The lookup section of ``kvstrata bench store`` (``lookup_fields``): a whole-prompt lookup in a
store of each key scheme (``keys.hash``) beside vLLM's own prefix hashing of the same blocks.

- ``lookup_us_per_1k_blocks_<scheme>``: microseconds per 1,000 blocks of one lookup of a stored
  1,000-block prompt (keys computed, index matched), the blake3 store keyed by a secret as a
  deployment with one runs it; ``lookup_us_per_1k_blocks`` is the default scheme's;
- ``engine_hash_us_per_1k_blocks``: vLLM's ``hash_block_tokens`` with sha256 over the same blocks,
  as its scheduler runs it (None where vLLM is not importable);
- ``lookup_vs_engine_hash_<scheme>``: the median of each round's ratio of the two.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvstrata.config import load_config
from kvstrata.keys import DEFAULT_KEY_SCHEME, SCHEMES, Namespace
from kvstrata.store import BlockStore


def lookup_fields(n_blocks: int, rounds: int, tmp: Path) -> dict[str, object]:
    """A whole-prompt lookup of ``n_blocks`` stored 16-token blocks (keys computed, index matched)
    in a store of each key scheme, the blake3 one keyed by a secret as a deployment with one runs
    it, beside vLLM's own prefix hashing of the same blocks. Every round runs each side once, in
    an order that rotates round by round; figures are medians over the rounds, and each ratio the
    median of the rounds' own ratios (the sides of one round ran within milliseconds)."""
    key_file = tmp / "bench.key"
    key_file.write_text(os.urandom(32).hex())
    key_file.chmod(0o600)
    tokens = np.random.default_rng(0).integers(0, 150_000, n_blocks * 16, dtype=np.uint32)
    sides: dict[str, Callable[[], None]] = {}
    stores = []
    for name in SCHEMES:
        store = BlockStore(load_config(None, {"l1.size": 64 * (n_blocks + 1), "l1.pin_memory": False,
                                              "l2.enabled": False, "keys.hash": name,
                                              "remote.auth_key_file": str(key_file)}))
        stores.append(store)
        ns = Namespace("bench", "bench-model", "v1", "bfloat16", "bench", 16, key_scheme=name)
        epoch, chain = store.chain(ns, tokens)
        store.save_now(ns, epoch, chain, torch.zeros((n_blocks, 64), dtype=torch.uint8))

        def lookup(store: BlockStore = store, ns: Namespace = ns) -> None:
            hit = store.lookup(ns, tokens)
            assert hit.num_blocks == n_blocks

        sides[name] = lookup
    engine = _engine_hasher(tokens, n_blocks)
    if engine is not None:
        sides["engine_hash"] = engine
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds + 1):  # round 0 warms caches and allocators; it is not reported
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            sides[name]()
            if r:
                times[name].append(time.perf_counter() - t)
    for store in stores:
        store.close()

    def per_1k(name: str) -> float:
        return round(statistics.median(times[name]) * 1e9 / n_blocks, 1)  # microseconds per 1,000 blocks

    out: dict[str, object] = {f"lookup_us_per_1k_blocks_{name}": per_1k(name) for name in SCHEMES}
    out["lookup_us_per_1k_blocks"] = out[f"lookup_us_per_1k_blocks_{DEFAULT_KEY_SCHEME}"]
    out["key_scheme_default"] = DEFAULT_KEY_SCHEME
    out["engine_hash_us_per_1k_blocks"] = per_1k("engine_hash") if engine is not None else None
    for name in SCHEMES:
        out[f"lookup_vs_engine_hash_{name}"] = None if engine is None else round(statistics.median(
            a / b for a, b in zip(times[name], times["engine_hash"])), 3)
    return out


def _engine_hasher(tokens: np.ndarray, n_blocks: int) -> Callable[[], None] | None:
    """vLLM's own prefix hashing (sha256) over the same blocks, as the scheduler runs it."""
    try:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
    except ImportError:
        return None
    init_none_hash(sha256)
    ids = tokens.tolist()

    def engine() -> None:
        parent = None
        for i in range(n_blocks):
            parent = hash_block_tokens(sha256, parent, ids[i * 16 : (i + 1) * 16], None)

    return engine
