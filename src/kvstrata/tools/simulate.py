"""``kvstrata simulate``: capacity planning by replaying a trace through the real index and LRU code.

Every trace block (one Mooncake hash id, 512 tokens) becomes one chained key (``chain_digests``),
so the index validates exactly as in serving. No engine, no payload bytes: each tier is the index's
tier bit plus a capacity in blocks, evicted with ``BlockIndex.lru_victims`` as the store does.
Policy as in the store: a request loads its longest stored prefix from the fastest tier holding
each block, promotes what it read into L1, and saves its new blocks to L1 and through to L2 and
L3; L1 evictions fall back to the lower tiers' copies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import Namespace, chain_digests, root_key

from kvstrata.tools.trace import TRACE_BLOCK, Request

NS = Namespace("simulate", "trace", "v1", "-", "-", TRACE_BLOCK)


@dataclass
class Tier:
    name: str
    bit: int
    capacity: int  # blocks; 0 disables the tier
    held: int = 0
    served: int = 0


@dataclass
class Report:
    requests: int = 0
    block_refs: int = 0
    tiers: list[Tier] = field(default_factory=list)

    def as_dict(self, block_bytes: int) -> dict[str, object]:
        served = sum(t.served for t in self.tiers)
        return {
            "requests": self.requests,
            "block_references": self.block_refs,
            "hit_rate": round(served / max(1, self.block_refs), 4),
            "tiers": {t.name: {"capacity_blocks": t.capacity, "hit_rate": round(t.served / max(1, self.block_refs), 4),
                               "bytes_served": t.served * block_bytes} for t in self.tiers},
            "recomputed_bytes": (self.block_refs - served) * block_bytes,
        }


def simulate(requests: list[Request], capacities: dict[str, int]) -> Report:
    """Replay ``requests``; ``capacities`` maps "l1"/"l2"/"l3" to blocks (0: tier absent)."""
    index = BlockIndex(capacity=1 << 16)
    tiers = [Tier(name, 1 << i, capacities.get(name, 0)) for i, name in enumerate(("l1", "l2", "l3"))]
    tiers = [t for t in tiers if t.capacity]
    report = Report(tiers=tiers)
    root = root_key(NS.seed, 0)
    for req in requests:
        chain = chain_digests(root, [h.to_bytes(8, "little") for h in req.hash_ids], TRACE_BLOCK)
        rows = index.match_rows(NS.seed, 0, chain)
        bits = index.tiers_of(rows)
        for t in tiers:  # each hit block is served by the fastest tier holding it
            faster = sum(u.bit for u in tiers if u.bit < t.bit)
            t.served += int(np.count_nonzero(((bits & t.bit) != 0) & ((bits & faster) == 0)))
        report.requests += 1
        report.block_refs += len(chain.keys)
        metas = [EntryMeta(k, p, f, n, NS.seed, 0, 1, 1) for k, p, f, n in zip(*chain)]
        for t in tiers:  # promote hits into, and write new blocks through to, every tier
            rows_all = index.rows_of(chain.keys)
            have = np.zeros(len(metas), bool)
            known = rows_all >= 0
            have[known] = (index.tiers_of(rows_all[known]) & t.bit).astype(bool)
            fresh = [m for m, h in zip(metas, have) if not h]
            _make_room(index, t, len(fresh))
            t.held += sum(r is not None for r in index.commit_many(fresh, t.bit))
    return report


def _make_room(index: BlockIndex, tier: Tier, incoming: int) -> None:
    excess = tier.held + incoming - tier.capacity
    if excess > 0:
        for row in index.lru_victims(tier.bit, excess):
            if index.claim(index.meta(row).key, tier.bit):
                tier.held -= 1


def run(trace: list[Request], sizes: dict[str, int], block_bytes: int, as_json: bool) -> int:
    capacities = {name: size // block_bytes if size else 0 for name, size in sizes.items()}
    bounded = simulate(trace, capacities).as_dict(block_bytes)
    unbounded = simulate(trace, {"l1": len(trace) * 1000 + 1}).as_dict(block_bytes)
    result = {**bounded, "block_bytes": block_bytes, "unbounded_hit_rate": unbounded["hit_rate"]}
    if as_json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['requests']} requests, {result['block_references']} block references "
                        f"of {block_bytes} bytes")
    for col in ("tier", "capacity (blocks)", "hit rate", "bytes served"):
        table.add_column(col, justify="right")
    for name, t in result["tiers"].items():  # type: ignore[union-attr]
        table.add_row(name, str(t["capacity_blocks"]), f"{t['hit_rate']:.1%}", f"{t['bytes_served']:,}")
    Console().print(table)
    print(f"total hit rate {result['hit_rate']:.1%} (an unbounded cache: {result['unbounded_hit_rate']:.1%}); "
          f"recomputed {result['recomputed_bytes']:,} bytes")
    return 0
