"""``Scopes``: the namespaces a store is asked about, under the store's own key scheme.

A namespace names its key scheme (``Namespace.key_scheme``, in its seed), so that blocks keyed by
two schemes never share a namespace. Engine glue builds its namespace without asking the store
which scheme it keys by (``key_scheme`` defaults to ``keys.DEFAULT_KEY_SCHEME``, the config's
default too). A store configured with another scheme (``keys.hash: xxh3``) takes such a namespace
as the same namespace under its own scheme (``own``: another seed), on every call that names one;
and a seed the glue passes (``invalidate``, ``reset``, ``joined``) as the seed of that namespace
(``seed``). Under the default scheme both are the identity.
"""

from __future__ import annotations

import dataclasses
import logging

from kvstrata.keys import Namespace
from kvstrata.tenants import TenantMap

log = logging.getLogger(__name__)


class Scopes:
    def __init__(self, scheme: str, tenants: TenantMap) -> None:
        self.scheme = scheme
        self._tenants = tenants  # learns each namespace's tenant here, on the calls that name it
        self._own: dict[Namespace, Namespace] = {}  # a few entries: one per namespace a process serves
        self._seeds: dict[bytes, bytes] = {}  # the glue's seed -> the seed of its namespace here

    def own(self, ns: Namespace) -> Namespace:
        """``ns`` under this store's key scheme (``ns`` itself when it names that scheme)."""
        self._tenants.learn(ns)
        if ns.key_scheme == self.scheme:
            return ns
        own = self._own.get(ns)
        if own is None:  # two threads may both make it: equal namespaces, one seed
            own = dataclasses.replace(ns, key_scheme=self.scheme)
            self._seeds[ns.seed] = own.seed
            self._own[ns] = own
            self._tenants.learn(own)
            log.info("kvstrata: namespace %s (keys %s) is namespace %s under this store's keys (%s)",
                     ns.id, ns.key_scheme, own.id, self.scheme)
        return own

    def seed(self, ns_seed: bytes) -> bytes:
        """The seed of the namespace ``ns_seed`` names here: a seed ``own`` re-keyed, or itself."""
        return self._seeds.get(ns_seed, ns_seed)
