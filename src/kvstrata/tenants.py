"""tenants.py: who a block belongs to, and each tenant's fair share of a tier (``tenants.shares``).

A tenant is the ``namespace.tenant`` of the namespace a block belongs to (the tenant ``default``
where it is empty). The namespace's seed includes it, so every block has exactly one tenant, read
from its index entry (``ns_seed``) once this process has seen the namespace (``TenantMap``: every
store call names its namespace, and adapters name theirs at start). A namespace this process has
not seen (blocks found on L2 before the engine names it) counts as ``default`` meanwhile. Cache
salts do not make tenants: a salt separates keys inside one namespace, and a share is given to
what an operator configures per engine (docs/tenants.md).

``TierShares`` is the policy for one tier, the same for every tier and for the Redis tier's own
accounting (``tiers/redis_shares.py``): given what each tenant holds, the holders of shares that
give up blocks, in order, and why (``eviction_order``). A holder is a tenant named in the tier's
shares, or ``"*"``: every tenant not named, together, under one share (``holder``), so that a
tenant gains nothing by storing under more names. Shares are guarantees, not caps: a holder uses
free room beyond its share; once the tier is full the writer's holder, if it is over its share,
gives first; then the holders over their share give, the most over first; a holder within its
share loses blocks only after every holder over its share has none left to give (then: one LRU).
A holder gives its least recently used blocks, whichever of its tenants holds them: within
``"*"`` the tenants not named are one LRU, as the whole tier is without shares.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable, Mapping

from kvstrata.config.values import DEFAULT_TENANT, OTHER_TENANTS
from kvstrata.keys import Namespace
from kvstrata.metrics import CAUSES

# why a block left a tier (``<tier>_evicted_<cause>``, ``kvstrata_evictions_by_cause_total``)
OWN_SHARE = "own_share"  # the writer's holder was over its share and gave up one of its blocks
OVER_SHARE = "over_share"  # another holder over its share gave it up for a writer within its own
LRU = "lru"  # no shares on the tier, or no holder over its share: least recently used of all
EPOCH = "epoch"  # an older epoch of its namespace (an invalidation, a reset), reclaimed by gc
assert CAUSES == (OWN_SHARE, OVER_SHARE, LRU, EPOCH)  # the metrics' ``cause`` label values


def tenant_name(tenant: str) -> str:
    """The name a ``namespace.tenant`` value goes by in shares and metrics."""
    return tenant or DEFAULT_TENANT


class TenantMap:
    """Namespace seed -> tenant, as learned from the namespaces this process is asked about."""

    def __init__(self) -> None:
        self._of: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def learn(self, ns: Namespace) -> None:
        if ns.seed not in self._of:  # a dict lookup per store call
            with self._lock:
                self._of[ns.seed] = tenant_name(ns.tenant)

    def tenant_of(self, seed: bytes) -> str:
        return self._of.get(seed, DEFAULT_TENANT)

    def tenants(self, seeds: list[bytes]) -> list[str]:
        of = self._of
        return [of.get(s, DEFAULT_TENANT) for s in seeds]


class TierShares:
    """The shares of one tier: ``{tenant: fraction | bytes}``; ``"*"``: one share for all the
    tenants not named there, together."""

    def __init__(self, tier: str, shares: Mapping[str, float | int]) -> None:
        self.tier = tier
        self._shares = dict(shares)

    def holder(self, tenant: str) -> str:
        """Whose share ``tenant`` is counted in: ``tenant`` itself where the shares name it, else
        ``"*"``, the one share of all the tenants not named."""
        return tenant if tenant in self._shares else OTHER_TENANTS

    def members(self, holder: str, tenants: Iterable[str]) -> list[str]:
        """The ``tenants`` counted in the share of ``holder``."""
        return [t for t in tenants if self.holder(t) == holder]

    def limit(self, tenant: str, capacity: int) -> int:
        """The bytes of the tier the holder of ``tenant`` keeps against the others (0: none); a
        tenant not named shares it with the others not named."""
        share = self._shares.get(self.holder(tenant), 0.0)
        return int(share * capacity) if isinstance(share, float) else min(share, capacity)

    def eviction_order(self, usage: Mapping[str, int], capacity: int, writer: str | None = None,
                       incoming: int = 0) -> list[tuple[str, str, int]]:
        """(holder, cause, bytes over its share) of the holders that give up blocks, in order, for
        ``writer`` (a tenant) to add ``incoming`` bytes, given what each tenant holds (``usage``);
        empty when no holder is over its share (then one LRU)."""
        held: dict[str, int] = {}
        for tenant, used in usage.items():
            holder = self.holder(tenant)
            held[holder] = held.get(holder, 0) + used
        own = None if writer is None else self.holder(writer)
        if own is not None:
            held[own] = held.get(own, 0) + incoming
        over = {h: used - self.limit(h, capacity) for h, used in held.items()}
        order = [(own, OWN_SHARE, over[own])] if own is not None and over[own] > 0 else []
        others = sorted((h for h, o in over.items() if o > 0 and h != own), key=lambda h: (-over[h], h))
        return order + [(h, OVER_SHARE, over[h]) for h in others]


def tier_shares(shares: Mapping[str, Mapping[str, float | int]]) -> dict[str, TierShares]:
    """``tenants.shares`` as the policy of each tier that has shares."""
    return {tier: TierShares(tier, s) for tier, s in shares.items() if s}


def fair_order(policy: TierShares, usage: dict[str, int], capacity: int,
               candidates: list[tuple[str, int, object]]) -> list[tuple[object, str]]:
    """The order in which a full listing of a tier (the shared folder's sweep) gives up blocks:
    ``candidates`` are (tenant, bytes, block), oldest first, that may go; ``usage`` is what each
    tenant holds in all (lowered here as blocks are picked). Each step asks ``eviction_order``
    which holder gives next (its oldest block, whichever of its tenants holds it); once no
    holder is over its share, the oldest of all. Returns (block, cause) until the tier would fit
    ``capacity`` or nothing is left."""
    queues: dict[str, deque[tuple[int, str, int, object]]] = {}
    for age, (tenant, nbytes, block) in enumerate(candidates):
        queues.setdefault(policy.holder(tenant), deque()).append((age, tenant, nbytes, block))
    total, out = sum(usage.values()), []
    while total > capacity and any(queues.values()):
        giver = next(((h, cause) for h, cause, _over in policy.eviction_order(usage, capacity) if queues.get(h)),
                     None)
        if giver is None:  # no holder over its share has any to give: the oldest of all
            giver = (min((q[0][0], h) for h, q in queues.items() if q)[1], LRU)
        _age, tenant, nbytes, block = queues[giver[0]].popleft()
        usage[tenant] -= nbytes
        total -= nbytes
        out.append((block, giver[1]))
    return out
