"""tenants.py: who a block belongs to, and each tenant's fair share of a tier (``tenants.shares``).

A tenant is the ``namespace.tenant`` of the namespace a block belongs to (the tenant ``default``
where it is empty). The namespace's seed includes it, so every block has exactly one tenant, read
from its index entry (``ns_seed``) once this process has seen the namespace (``TenantMap``: every
store call names its namespace, and adapters name theirs at start). A namespace this process has
not seen (blocks found on L2 before the engine names it) counts as ``default`` meanwhile. Cache
salts do not make tenants: a salt separates keys inside one namespace, and a share is given to
what an operator configures per engine (docs/tenants.md).

``TierShares`` is the policy for one tier, the same for every tier and for the Redis tier's own
accounting (``tiers/redis_shares.py``): given what each tenant holds, the tenants that give up
blocks, in order, and why (``eviction_order``). Shares are guarantees, not caps: a tenant uses free
room beyond its share; once the tier is full the writer, if it is over its share, evicts its own
blocks first; then the tenants over their share give, the most over first; a tenant within its
share loses blocks only after every tenant over its share has none left to give (then: one LRU).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Mapping

from kvstrata.config.schema import DEFAULT_TENANT, OTHER_TENANTS
from kvstrata.keys import Namespace
from kvstrata.metrics import CAUSES

# why a block left a tier (``<tier>_evicted_<cause>``, ``kvstrata_evictions_by_cause_total``)
OWN_SHARE = "own_share"  # the writer was over its share and gave up one of its own
OVER_SHARE = "over_share"  # another tenant over its share gave it up for a writer within its own
LRU = "lru"  # no shares on the tier, or no tenant over its share: least recently used of all
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
    """The shares of one tier: ``{tenant: fraction | bytes}``, ``"*"`` for each tenant not named."""

    def __init__(self, tier: str, shares: Mapping[str, float | int]) -> None:
        self.tier = tier
        self._shares = dict(shares)

    def limit(self, tenant: str, capacity: int) -> int:
        """The bytes of the tier ``tenant`` keeps against the others (0: none)."""
        share = self._shares.get(tenant, self._shares.get(OTHER_TENANTS, 0.0))
        return int(share * capacity) if isinstance(share, float) else min(share, capacity)

    def eviction_order(self, usage: Mapping[str, int], capacity: int, writer: str | None = None,
                       incoming: int = 0) -> list[tuple[str, str, int]]:
        """(tenant, cause, bytes over its share) of the tenants that give up blocks, in order, for
        ``writer`` to add ``incoming`` bytes; empty when no tenant is over its share (then one LRU)."""
        over = {t: used - self.limit(t, capacity) for t, used in usage.items()}
        if writer is not None:
            over[writer] = over.get(writer, -self.limit(writer, capacity)) + incoming
        order = []
        if writer is not None and over[writer] > 0:
            order.append((writer, OWN_SHARE, over[writer]))
        others = sorted((t for t, o in over.items() if o > 0 and t != writer), key=lambda t: (-over[t], t))
        return order + [(t, OVER_SHARE, over[t]) for t in others]


def tier_shares(shares: Mapping[str, Mapping[str, float | int]]) -> dict[str, TierShares]:
    """``tenants.shares`` as the policy of each tier that has shares."""
    return {tier: TierShares(tier, s) for tier, s in shares.items() if s}


def fair_order(policy: TierShares, usage: dict[str, int], capacity: int,
               candidates: list[tuple[str, int, object]]) -> list[tuple[object, str]]:
    """The order in which a full listing of a tier (the shared folder's sweep) gives up blocks:
    ``candidates`` are (tenant, bytes, block), oldest first, that may go; ``usage`` is what each
    tenant holds in all (lowered here as blocks are picked). Each step asks ``eviction_order``
    which tenant gives next; once nobody is over its share, the oldest of all. Returns (block,
    cause) until the tier would fit ``capacity`` or nothing is left."""
    queues: dict[str, deque[tuple[int, int, object]]] = {}
    for age, (tenant, nbytes, block) in enumerate(candidates):
        queues.setdefault(tenant, deque()).append((age, nbytes, block))
    total, out = sum(usage.values()), []
    while total > capacity and any(queues.values()):
        giver = next(((t, cause) for t, cause, _over in policy.eviction_order(usage, capacity) if queues.get(t)),
                     None)
        if giver is None:  # nobody over its share has any to give: the oldest of all
            giver = (min((q[0][0], t) for t, q in queues.items() if q)[1], LRU)
        _age, nbytes, block = queues[giver[0]].popleft()
        usage[giver[0]] -= nbytes
        total -= nbytes
        out.append((block, giver[1]))
    return out
