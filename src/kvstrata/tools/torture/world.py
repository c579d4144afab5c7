"""tools/torture/world.py: what the torture runs on: the tiny store every worker opens
(``store_config``), its namespaces and payload size, the chaos rates, and the seeded universe of
prompts every worker draws from (``build_universe``)."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np

from kvstrata.config import StrataConfig
from kvstrata.keys import Namespace, as_tokens

BLOCK_TOKENS = 4
PAYLOAD_BYTES = 512  # a multiple of the 16-byte key
HEADER_BYTES = 128  # per block file and Redis value (format/block.py)
L1_BLOCKS = 12
L2_BLOCKS = 32
VOCAB = 4  # small, so that prompts share blocks and sibling tails are common
SENTINEL = 0xA5
NAMESPACES = [Namespace("torture", m, "v1", "uint8", f"[{PAYLOAD_BYTES}]", BLOCK_TOKENS) for m in ("alpha", "beta")]
# Chaos, events per second over the whole run (shared by all threads of all workers).
RATES = {"invalidate": 0.4, "epoch_loss": 0.25, "corrupt_l2": 6.0, "corrupt_redis": 4.0,
         "collision_probe": 2.0, "tail_probe": 1.5, "flush": 1.0}
SWITCH_S = 1e-4  # GIL hand-offs 50x more often than Python's default: thread interleavings widen
REJECTION = re.compile(r"checksum|bad_header|bad_epoch|rollback|load_fail|missing|read_error|collision|reject|mismatch")


def build_universe(seed: int, n: int = 240) -> list[np.ndarray]:
    """Prompts of 1-4 full blocks and an optional partial tail, the same in every worker: most
    extend an earlier prompt's full blocks, and a third re-use one with another tail of the
    same length (equal-length siblings under one parent)."""
    rng = random.Random(f"universe-{seed}")

    def blk() -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(BLOCK_TOKENS))

    systems = [blk() for _ in range(6)]
    shapes: list[tuple[list[tuple[int, ...]], tuple[int, ...]]] = []
    for _ in range(n):
        r = rng.random()
        if shapes and r < 0.35:
            full, tail = rng.choice(shapes)
            length = len(tail) or rng.randrange(1, BLOCK_TOKENS)
            shapes.append((list(full), tuple(rng.randrange(VOCAB) for _ in range(length))))
            continue
        if shapes and r < 0.75:
            full = list(rng.choice(shapes)[0])[: rng.randrange(1, 4)]
        else:
            full = [rng.choice(systems)]
        full += [blk() for _ in range(rng.randrange(0, 5 - len(full)))]
        tail = tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, BLOCK_TOKENS))) if rng.random() < 0.6 else ()
        shapes.append((full[:4], tail))
    out = [as_tokens([t for b in full for t in b] + list(tail)) for full, tail in shapes]
    rng.shuffle(out)
    return out


def store_config(spec: dict[str, Any]) -> StrataConfig:
    """The tiny store every worker opens (``spec``: ``l2``, and ``redis``, ``prefix``,
    ``invalidation_ms`` for the shared tier)."""
    data: dict[str, Any] = {
        "l1": {"size": L1_BLOCKS * PAYLOAD_BYTES, "pin_memory": False},
        "l2": {"path": spec["l2"], "size": L2_BLOCKS * (PAYLOAD_BYTES + HEADER_BYTES)},
        "saves": {"queue_blocks": 256},
        "lease_seconds": 30.0,
    }
    if spec.get("redis"):
        # A short breaker backoff: with --net-faults the tier comes and goes every few seconds,
        # and the run should see hits resume each time it answers again.
        data["remote"] = {"enabled": True, "url": spec["redis"], "key_prefix": spec["prefix"],
                          "invalidation_ms": spec["invalidation_ms"],
                          "breaker": {"reset_ms": 250, "max_backoff_ms": 2000}}
    return StrataConfig.model_validate(data)
