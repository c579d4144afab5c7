"""Builders of the kvstrata tests: configs, namespaces, prompts and key-derived payloads.

Plain functions and constants, imported by test modules (``from tests.builders import ...``), by
child-process helper scripts (the repo root is on their ``PYTHONPATH``: tests/conftest.py) and by
the fixtures of tests/conftest.py that wrap them for tests that prefer injection.

Payloads are derived from block keys (``payload_for``), so any loaded block can be checked
against the key it was stored under without remembering what was written.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from kvstrata.config import StrataConfig, load_config
from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import BlockStore, Hit

BLOCK_SIZE = 16  # tokens per block
BLOCK_BYTES = 256  # payload bytes per block (tiny on purpose)
# The folder of the engine tests' no-connector outputs (``Baselines``, tests/engines/launchers.py), one
# for all the session's test workers: tests/conftest.py makes it.
BASELINES_ENV = "KVSTRATA_TEST_BASELINES"


def make_config(tmp_path: Path, overrides: Mapping[str, Any] | None = None, /,
                **kwargs: Any) -> StrataConfig:
    """A validated config whose L2 lives under ``tmp_path/"l2"``.

    Overrides use dotted keys, either as a mapping (``{"l2.write": "on_evict"}``) or as keyword
    arguments with ``__`` for the dot (``l2__write="on_evict"``, ``lease_seconds=0.2``).
    """
    merged: dict[str, Any] = {
        "l2.path": str(Path(tmp_path) / "l2"),
        "l1.size": 1 << 20,
        "l1.pin_memory": False,
        "l2.size": 64 << 20,
    }
    merged.update(overrides or {})
    merged.update({k.replace("__", "."): v for k, v in kwargs.items()})
    return load_config(None, merged)


def make_namespace(**changes: Any) -> Namespace:
    fields: dict[str, Any] = dict(engine="test", model="tiny", model_version="v1",
                                  kv_dtype="bfloat16", layout="4x[2,16,64]", block_size=BLOCK_SIZE)
    fields.update(changes)
    return Namespace(**fields)


def payload_for(key: bytes, size: int = BLOCK_BYTES) -> torch.Tensor:
    """Deterministic uint8 payload of ``size`` bytes derived from ``key`` (the key, repeated,
    with a position ramp mixed in so that no two offsets of a block look alike)."""
    reps = -(-size // len(key))
    base = np.frombuffer((key * reps)[:size], dtype=np.uint8)
    ramp = (np.arange(size, dtype=np.uint32) * 7 % 251).astype(np.uint8)
    return torch.from_numpy(base ^ ramp)


def payloads_for(chain: BlockChain, size: int = BLOCK_BYTES) -> torch.Tensor:
    """``[len(chain), size]`` uint8 tensor: row i is ``payload_for(chain.keys[i])``."""
    if not chain.keys:
        return torch.empty((0, size), dtype=torch.uint8)
    return torch.stack([payload_for(k, size) for k in chain.keys])


def random_tokens(seed: int | str, n: int, vocab: int = 50_000) -> np.ndarray:
    rng = random.Random(seed)
    return np.array([rng.randrange(vocab) for _ in range(n)], dtype=np.uint32)


def store_prompt(store: BlockStore, ns: Namespace, tokens: Sequence[int] | np.ndarray,
                 size: int = BLOCK_BYTES) -> tuple[BlockChain, int]:
    """Synchronously store every block of ``tokens`` (partial tail included).

    Returns the chain and the number of blocks newly stored."""
    epoch, chain = store.chain(ns, tokens)
    return chain, store.save_now(ns, epoch, chain, payloads_for(chain, size))


def load_hit(store: BlockStore, hit: Hit, size: int = BLOCK_BYTES) -> tuple[int, torch.Tensor]:
    """Load a hit into a fresh zeroed buffer; returns (blocks loaded, buffer)."""
    out = torch.zeros((hit.num_blocks, size), dtype=torch.uint8)
    return store.load_into(hit, out), out


def assert_payloads_match(keys: Iterable[bytes], out: torch.Tensor, n: int,
                          size: int = BLOCK_BYTES) -> None:
    """The first ``n`` rows of ``out`` are exactly the payloads of the first ``n`` keys."""
    for i, key in enumerate(list(keys)[:n]):
        assert torch.equal(out[i], payload_for(key, size)), f"block {i} has another block's bytes"


def sglang_keys(seed: int, n: int) -> list[str]:
    """Chained hex SHA-256 page keys, like SGLang's."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{seed}:{i}".encode()).digest()
        keys.append(prev.hex())
    return keys
