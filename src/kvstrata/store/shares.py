"""``Shares``: which blocks a tier gives up when it needs room, tenant by tenant (``kvstrata.tenants``).

Without shares on a tier, its least recently used unpinned blocks (cause ``lru``). With shares,
what each tenant holds there is counted from the index (one vectorized pass per call: a batch of
evictions, never a block), ``TierShares.eviction_order`` names the tenants that give, and each
gives its own least recently used blocks, no more than it is over its share (at least one), so
that a tenant is not pushed below its share while another one still has blocks over its own.
"""

from __future__ import annotations

from kvstrata.store.parts import Parts
from kvstrata.tenants import LRU, tier_shares
from kvstrata.tiers import BlockTier


class Shares:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.policies = tier_shares(parts.config.tenants.shares)

    def victims(self, tier: BlockTier, n: int, writer: bytes | None = None,
                incoming: int = 0) -> list[tuple[int, str]]:
        """Up to ``n`` (row, cause) of unpinned blocks of ``tier`` to evict for the namespace
        ``writer`` (a seed; None: no writer, as gc) to add ``incoming`` bytes."""
        index = self.parts.index
        policy = self.policies.get(tier.name)
        if policy is None:
            return [(row, LRU) for row in index.lru_victims(tier.bit, n)]
        tenants = self.parts.tenants
        seeds, nbytes, blocks = index.usage(tier.bit)
        owners = tenants.tenants(seeds)
        usage: dict[str, int] = {}
        for owner, b, c in zip(owners, nbytes.tolist(), blocks.tolist()):
            usage[owner] = usage.get(owner, 0) + tier.footprint(b, c)
        who = None if writer is None else tenants.tenant_of(writer)
        for tenant, cause, over in policy.eviction_order(usage, tier.capacity_bytes, who, incoming):
            rows = index.lru_victims(tier.bit, n, [s for s, o in zip(seeds, owners) if o == tenant])
            picked, freed = [], 0
            for row in rows:
                if picked and freed >= over:
                    break
                picked.append((row, cause))
                freed += tier.stored_bytes(index.meta(row).size)
            if picked:
                return picked
        return [(row, LRU) for row in index.lru_victims(tier.bit, n)]

    def usage(self, tier: BlockTier) -> dict[str, tuple[int, int]]:
        """(bytes of the tier's capacity, blocks) per tenant of what this process's index holds on
        ``tier``."""
        seeds, nbytes, blocks = self.parts.index.usage(tier.bit)
        out: dict[str, tuple[int, int]] = {}
        for owner, b, c in zip(self.parts.tenants.tenants(seeds), nbytes.tolist(), blocks.tolist()):
            if c:
                got = out.get(owner, (0, 0))
                out[owner] = (got[0] + tier.footprint(b, c), got[1] + c)
        return out

    def report(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier, per tenant: bytes, blocks and the share in bytes (``kvstrata stats``, gauges)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for tier in self.parts.tiers:
            usage = tier.tenant_usage()
            if usage is None:
                usage = self.usage(tier)
            policy = self.policies.get(tier.name)
            out[tier.name] = {t: {"bytes": b, "blocks": c, "share_bytes": policy.limit(t, tier.capacity_bytes)
                                  if policy is not None else 0} for t, (b, c) in sorted(usage.items())}
        return out
