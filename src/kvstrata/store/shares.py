"""``victims``: which blocks a tier gives up when it needs room, tenant by tenant (``kvstrata.tenants``).

Without shares on a tier, its least recently used unpinned blocks (cause ``lru``). With shares,
what each tenant holds there is counted from the index (one vectorized pass per call: a batch of
evictions, never a block), ``TierShares.eviction_order`` names the holders of shares that give
(a named tenant, or ``"*"``: every tenant not named, together), and each gives the least recently
used blocks of its tenants, no more than it is over its share (at least one), so that a holder is
not pushed below its share while another one still has blocks over its own.
"""

from __future__ import annotations

import time
from typing import Mapping

import numpy as np

from kvstrata.store.parts import Parts
from kvstrata.tenants import LRU
from kvstrata.tiers import BlockTier


def victims(parts: Parts, tier: BlockTier, n: int, writer: bytes | None = None,
            incoming: int = 0) -> list[tuple[int, str]]:
    """Up to ``n`` (row, cause) of unpinned blocks of ``tier`` to evict for the namespace
    ``writer`` (a seed; None: no writer, as gc) to add ``incoming`` bytes."""
    index = parts.index
    policy = parts.shares.get(tier.name)
    if policy is None:
        return [(row, LRU) for row in index.lru_victims(tier.bit, n)]
    tenants = parts.tenants
    seeds, nbytes, blocks = index.usage([tier.bit])
    owners = tenants.tenants(seeds)
    usage = {t: b for t, (b, _c) in _by_tenant(tier, owners, nbytes[0], blocks[0]).items()}
    who = None if writer is None else tenants.tenant_of(writer)
    for holder, cause, over in policy.eviction_order(usage, tier.capacity_bytes, who, incoming):
        rows = index.lru_victims(tier.bit, n, [s for s, t in zip(seeds, owners) if policy.holder(t) == holder])
        picked, freed = [], 0
        for row in rows:
            if picked and freed >= over:
                break
            picked.append((row, cause))
            freed += tier.stored_bytes(index.meta(row).size)
        if picked:
            return picked
    return [(row, LRU) for row in index.lru_victims(tier.bit, n)]


def tenant_report(parts: Parts, resident: Mapping[str, int] | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """Per tier, per tenant: bytes of the tier's capacity, blocks and the share in bytes (``kvstrata
    stats``, the gauges; a tenant not named: the ``"*"`` share, which it holds with the others not
    named). A tier that keeps its own account across instances says (``tenant_usage``); else, with
    one namespace in the index and ``resident``'s figures given, those are its tenant's; else one
    pass over the index for every tier."""
    seeds = parts.index.namespace_seeds()
    one = parts.tenants.tenant_of(seeds[0]) if resident is not None and len(seeds) == 1 else None
    counted: tuple[list[str], np.ndarray, np.ndarray] | None = None
    out: dict[str, dict[str, dict[str, int]]] = {}
    for i, tier in enumerate(parts.tiers):
        usage = tier.tenant_usage()
        if usage is None and one is not None:
            assert resident is not None
            blocks = resident[f"{tier.name}_resident_blocks"]
            usage = {one: (resident[f"{tier.name}_resident_bytes"], blocks)} if blocks else {}
        elif usage is None:
            if counted is None:
                seeds, nbytes, held = parts.index.usage([t.bit for t in parts.tiers])
                counted = (parts.tenants.tenants(seeds), nbytes, held)
            usage = _by_tenant(tier, counted[0], counted[1][i], counted[2][i])
        policy = parts.shares.get(tier.name)
        out[tier.name] = {t: {"bytes": b, "blocks": c, "share_bytes": policy.limit(t, tier.capacity_bytes)
                              if policy is not None else 0} for t, (b, c) in sorted(usage.items())}
    return out


class TenantGauges:
    """The tenant gauges of ``resident`` (every engine step): ``tenant_report`` from the tiers' own
    figures with one namespace in the index, else its pass over the index (milliseconds at hundreds
    of thousands of blocks) at most every ``REFRESH_S``."""

    REFRESH_S = 1.0

    def __init__(self) -> None:
        self._at = float("-inf")
        self._last: dict[str, int] = {}

    def figures(self, parts: Parts, resident: Mapping[str, int]) -> dict[str, int]:
        single = len(parts.index.namespace_seeds()) <= 1
        if single or time.monotonic() - self._at >= self.REFRESH_S:
            self._at = float("-inf") if single else time.monotonic()
            self._last = {f"{tier}_tenant_{figure}@{tenant}": value
                          for tier, held in tenant_report(parts, resident).items()
                          for tenant, figures in held.items() for figure, value in figures.items()}
        return self._last


def _by_tenant(tier: BlockTier, owners: list[str], nbytes: np.ndarray, blocks: np.ndarray) -> dict[str, tuple[int, int]]:
    """(bytes of ``tier``'s capacity, blocks) per tenant, from the per-namespace figures."""
    out: dict[str, tuple[int, int]] = {}
    for owner, b, c in zip(owners, nbytes.tolist(), blocks.tolist()):
        if c:
            got = out.get(owner, (0, 0))
            out[owner] = (got[0] + tier.footprint(b, c), got[1] + c)
    return out
