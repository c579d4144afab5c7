"""``Bumps``: a namespace's epoch moved on, and what is kept beside it.

- ``flush``: an operator's invalidation (``kvstrata invalidate``, no weights changed): a new epoch
  of the same weights generation, adopted by every instance;
- ``reset``: an engine's reset after a weight update: a new generation, which every other instance
  serves and saves nothing of until it resets too, or, when another instance reset first, that
  instance's epoch joined (``epochs/joins.py``);
- ``describe``: what a namespace is (``epochs/descriptors.py``), kept beside its epoch.

Either bump reclaims the namespace's older entries at once (``Evictor.gc``). A bump that cannot be
written where the other instances read it fails loudly: this instance then serves nothing of the
namespace until it is written, and the others keep the old epoch until then.
"""

from __future__ import annotations

import logging

from kvstrata.epochs.descriptors import MAX_BYTES as DESCRIPTOR_MAX, encode as encode_descriptor
from kvstrata.keys import Namespace
from kvstrata.store.evict import Evictor
from kvstrata.store.parts import Parts

log = logging.getLogger(__name__)


class Bumps:
    def __init__(self, parts: Parts, evictor: Evictor) -> None:
        self.parts = parts
        self.evictor = evictor

    def flush(self, ns_seed: bytes) -> int | None:
        """See ``BlockStore.invalidate``."""
        epoch = self.parts.epochs.bump(ns_seed)
        if epoch is None:
            self._failed(ns_seed, "invalidated")
            return None
        self.parts.counters.inc("invalidations")
        log.info("kvstrata: namespace %s is now at epoch %016x", ns_seed[:8].hex(), epoch)
        self.evictor.gc([ns_seed])
        return epoch

    def reset(self, ns_seed: bytes) -> int | None:
        """See ``BlockStore.reset``."""
        epoch, joined = self.parts.epochs.reset(ns_seed)
        if epoch is None:
            self._failed(ns_seed, "invalidated by this reset")
            return None
        if joined:
            self.parts.counters.inc("epoch_joins")
            log.info("kvstrata: namespace %s joined epoch %016x, made by another instance's reset", ns_seed[:8].hex(),
                     epoch)
        else:
            self.parts.counters.inc("invalidations")
            log.info("kvstrata: namespace %s is now at epoch %016x (new weights: other instances serve none of it "
                     "until they reset too)", ns_seed[:8].hex(), epoch)
        self.evictor.gc([ns_seed])
        return epoch

    def describe(self, ns: Namespace) -> None:
        """See ``BlockStore.describe``."""
        blob = encode_descriptor(ns)
        self.parts.epochs.get(ns.seed)
        if blob is None:
            log.warning("kvstrata: namespace %s is too large to describe (over %d bytes); stats will "
                        "show its id only", ns.id, DESCRIPTOR_MAX)
            return
        self.parts.epochs.describe(ns.seed, blob)

    def _failed(self, ns_seed: bytes, what: str) -> None:
        self.parts.counters.inc("invalidation_failures")
        log.error("kvstrata: namespace %s could not be %s: the new epoch was not written where "
                  "the other instances read it (the shared tier, or the epochs folder); this instance serves "
                  "none of its blocks until it is (retried at every lookup), the others keep serving the old "
                  "epoch until then", ns_seed[:8].hex(), what)
