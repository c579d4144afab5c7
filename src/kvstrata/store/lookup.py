"""``lookup``: the longest valid stored prefix of a prompt, pinned on request (``prepare_load``).

Index only: backing tiers are asked for 128-byte headers of blocks another process stored (they
are adopted into the index), never for payloads. A prompt's hit may end in a stored partial block
(a tail). A lookup uses the namespace's epoch only if the epoch store vouches for it
(``EpochStore.lookup_epoch``: confirmed by the shared tier within its bound); otherwise it is
a miss, counted as ``unconfirmed_epoch_misses``. So is a lookup of a namespace this instance has
not joined (``EpochStore.joined``: a reset made elsewhere), counted as ``not_joined_misses``.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvstrata.keys import NO_EXTRA, BlockChain, Extra, Namespace, as_tokens, extra_at
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import Hit


def chain_slice(chain: BlockChain, start: int, stop: int | None = None) -> BlockChain:
    return BlockChain(*(part[start:stop] for part in chain))


class Lookup:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def chain(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = NO_EXTRA,
              *, partial: bool = True) -> tuple[int, BlockChain]:
        """Current epoch and the chained keys of ``tokens`` (full blocks, then the partial tail)."""
        epoch = self.parts.epochs.get(ns.seed)
        keys = self.parts.keys
        return epoch, keys.chain_keys(keys.root_key(ns.seed, epoch), as_tokens(tokens), ns.block_size, extra,
                                      partial=partial)

    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = NO_EXTRA,
               *, pin: bool = False) -> Hit:
        since = time.monotonic()  # before anything else: the epoch must be confirmed since then
        tokens = as_tokens(tokens)
        epoch, confirmed = self.parts.epochs.lookup_epoch(ns.seed, since)
        if not confirmed or not self.parts.epochs.joined(ns.seed):
            return self._unconfirmed(ns, confirmed)
        if self.parts.quarantine.holds(ns.seed, epoch):
            return self._quarantined(ns)
        keys = self.parts.keys
        chain = keys.chain_keys(keys.root_key(ns.seed, epoch), tokens, ns.block_size, extra)
        if pin:  # validated and pinned in one index call: the common, whole-prompt hit is done
            rows_full, lease = self.parts.index.match_pinned(ns.seed, epoch, chain)
        else:
            rows_full, lease = self.parts.index.match_rows(ns.seed, epoch, chain), None
        n = len(rows_full)
        if n == len(chain.keys):
            self.parts.counters.inc("lookups")
            self.parts.counters.inc("lookup_hit_blocks", n)
            return Hit(ns, epoch, chain, self.parts.index.tiers_of(rows_full).tolist(), lease)
        if lease is not None:  # adoption or a tail extends the hit: pin it all by key below
            self.parts.index.unpin(lease)
        n += self._match(ns.seed, epoch, chain, n)  # blocks another process stored, by header
        hit = chain if n == len(chain.keys) else chain_slice(chain, 0, n)
        if n < len(chain.keys):
            tail = self._match_tail(ns, epoch, chain.parents[n], tokens, n * ns.block_size, extra)
            if tail is not None:
                hit = BlockChain(*(a + b for a, b in zip(hit, tail)))
        return self._hit(ns, epoch, hit, pin)

    def lookup_chain(self, ns: Namespace, epoch: int, chain: BlockChain, *, pin: bool = False) -> Hit:
        """Like ``lookup`` for a chain built by the caller (``keys.chain_digests``): the longest
        valid stored prefix of ``chain``, from the index and tier headers only. A miss unless
        ``epoch`` is the namespace's epoch, confirmed now."""
        current, confirmed = self.parts.epochs.lookup_epoch(ns.seed, time.monotonic())
        if not confirmed or not self.parts.epochs.joined(ns.seed):
            return self._unconfirmed(ns, confirmed)
        if self.parts.quarantine.holds(ns.seed, current):
            return self._quarantined(ns)
        n = self._match(ns.seed, epoch, chain, 0) if current == epoch else 0  # replaced since the chain was built
        return self._hit(ns, epoch, chain_slice(chain, 0, n), pin)

    def _unconfirmed(self, ns: Namespace, confirmed: bool = False) -> Hit:
        """A miss of no epoch (``epoch`` 0): the shared tier has not confirmed the
        namespace's epoch recently enough (or a reset of it is not written yet), or (``confirmed``)
        this instance has not joined it (a reset made elsewhere: ``joins``), so nothing of it may
        be served."""
        self.parts.counters.inc("lookups")
        self.parts.counters.inc("not_joined_misses" if confirmed else "unconfirmed_epoch_misses")
        return Hit(ns, 0, BlockChain([], [], [], []), [], None)

    def _quarantined(self, ns: Namespace) -> Hit:
        """A miss: this instance holds the namespace in quarantine (``quarantine.py``, counted there)."""
        self.parts.counters.inc("lookups")
        return Hit(ns, 0, BlockChain([], [], [], []), [], None)

    def _hit(self, ns: Namespace, epoch: int, chain: BlockChain, pin: bool) -> Hit:
        """The validated run ``chain`` as a Hit. With ``pin``, its rows are looked up by key and
        pinned in one index call: a block dropped since validation (its row possibly reused by
        another block) ends the hit there instead of being read under another block's row."""
        if pin:
            rows, lease = self.parts.index.pin_keys(chain.keys)
        else:
            rows, lease = self.parts.index.rows_of(chain.keys), None
            gone = np.flatnonzero(rows < 0)
            rows = rows[: gone[0]] if len(gone) else rows
        if len(rows) < len(chain.keys):
            chain = chain_slice(chain, 0, len(rows))
        self.parts.counters.inc("lookups")
        self.parts.counters.inc("lookup_hit_blocks", len(rows))
        return Hit(ns, epoch, chain, self.parts.index.tiers_of(rows).tolist(), lease)

    def _match(self, seed: bytes, epoch: int, chain: BlockChain, start: int) -> int:
        """Leading valid run from ``start``; blocks other processes stored are adopted by header."""
        n = start
        total = len(chain.keys)
        while n < total:
            n += self.parts.index.match(seed, epoch, chain, n)
            if n == total or not self._adopt(seed, epoch, chain, n):
                break
        return n - start

    def _adopt(self, seed: bytes, epoch: int, chain: BlockChain, i: int) -> bool:
        """Commit the blocks from ``i`` on that a backing tier holds under their keys (one batched
        header probe per tier: O(1) round trips for a remote tier)."""
        size = self._block_size(chain, i)
        for tier in self.parts.backing:
            metas = tier.probe_many(chain.keys[i:])
            good = []
            for j, meta in enumerate(metas):
                k = i + j
                if (meta is None or meta.ns_seed != seed or meta.epoch != epoch or meta.parent != chain.parents[k]
                        or meta.fp != chain.fps[k] or meta.ntok != chain.lengths[k]):
                    break
                if meta.size != (size or meta.size):  # every block of a namespace has one size
                    self.parts.counters.inc("adopt_wrong_size")
                    break
                size = meta.size
                good.append(meta)
            if good:
                self.parts.index.commit_many(good, tier.bit)
                return self.parts.index.match(seed, epoch, chain, i) > 0
        return False

    def _block_size(self, chain: BlockChain, i: int) -> int:
        """The byte size every block of ``chain`` must have (0: not known yet): the L1 slot size
        when it is fixed, else the size of the block before ``i``. A header from a backing tier
        claiming another size is forged or foreign: staged, it would fill part of a slot and leave
        the rest of it stale."""
        if self.parts.l1.slot_bytes:
            return self.parts.l1.slot_bytes
        if i:
            rows = self.parts.index.rows_of(chain.keys[i - 1 : i])
            if len(rows) and rows[0] >= 0:
                meta = self.parts.index.metas(rows[:1], chain.keys[i - 1 : i])[0]
                if meta is not None:
                    return meta.size
        return 0

    def _match_tail(self, ns: Namespace, epoch: int, parent: bytes, tokens: np.ndarray, start: int,
                    extra: Extra) -> BlockChain | None:
        """A stored partial block after ``parent`` (at token ``start``) whose tokens begin
        ``tokens[start:]``, longest first."""
        rest = tokens[start:]
        lengths = set(self.parts.index.tail_lengths(parent))
        for tier in self.parts.backing:
            lengths.update(tier.tail_lengths(parent))
        for ntok in sorted(lengths, reverse=True):
            if ntok >= ns.block_size or ntok > len(rest):
                continue
            key, fp = self.parts.keys.block_key(parent, rest[:ntok], extra_at(extra, start, start + ntok))
            one = BlockChain([key], [parent], [fp], [ntok])
            if self._match(ns.seed, epoch, one, 0):
                return one
        return None
