"""What a load serves and what the engine took: the tier each block of a hit is served from
(``origins``), the counts of what the engine took (``count_served``), and the label of a load's
latency sample (``load_sample``). Used by ``BlockStore``'s loads and by the adapters through it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvstrata.store.parts import Parts
from kvstrata.store.protocol import Hit


def origins(parts: Parts, hit: Hit) -> list[str]:
    """See ``BlockStore.origins``. One pass per tier, not per block."""
    slots = parts.l1.slots_of(hit.chain.keys)
    bits = np.asarray(hit.tiers, dtype=np.int64)
    which = np.zeros(len(bits), dtype=np.int8)
    todo = np.fromiter((s is None for s in slots), dtype=bool, count=len(bits))
    for i, tier in enumerate(parts.backing, 1):
        on = todo & ((bits & tier.bit) != 0)
        which[on] = i
        todo &= ~on
    names = [tier.name for tier in parts.tiers]
    return [names[i] for i in which.tolist()]


def load_sample(parts: Parts, hit: Hit) -> str:
    """``load_seconds_<the outermost tier a load of hit may read>``."""
    order = [tier.name for tier in parts.tiers]
    return f"load_seconds_{max(origins(parts, hit), key=order.index, default=order[0])}"


def count_served(parts: Parts, origins: Sequence[str], tokens: Sequence[int], copied_from_l1: bool,
                 l1_bytes: int) -> None:
    """See ``BlockStore.count_served``."""
    counters = parts.counters
    counters.inc("served_tokens", sum(tokens))
    per_tier: dict[str, int] = {}
    for tier, n in zip(origins, tokens):
        per_tier[tier] = per_tier.get(tier, 0) + n
    for tier, n in per_tier.items():
        counters.inc(f"hit_tokens_{tier}", n)
    if copied_from_l1 and "l1" in per_tier:
        counters.inc("hit_blocks_l1", sum(1 for tier in origins if tier == "l1"))
    if l1_bytes:
        counters.inc("l1_bytes_read", l1_bytes)
