"""``lookup_groups``: one prefix boundary for every KV-cache group of a hybrid model.

Under vLLM's hybrid KV cache manager each group keeps a block table of its own, and each needs
other blocks to resume a prompt at token N: full attention every block below N, a sliding window
only the blocks its window reaches back to, an SSM only its state at N. Every group chains its
keys under ``group_root(root_key(seed, epoch), tag)`` of the store's key scheme: one namespace and
one epoch, so one ``invalidate`` and one epoch confirmation cover all the groups.

``GroupLookup.lookup_groups`` returns the largest block boundary N that every group can serve, and
per group exactly the blocks it must load at N. It never returns groups at different boundaries:
the engine resumes all its groups at one token, and a group loaded for another N would be wrong KV.

Each wanted block is confirmed at the index for its own group (``valid_mask``: namespace, epoch,
parent, fingerprint, token count); a wanted block the index lacks is adopted from a backing tier
by its header when another process stored it there. The wanted keys are then validated and pinned
in one index call per group (unpinned: validated) and a block that went in between (evicted,
replaced) is marked invalid and N searched again below: the masks only shrink, so this ends.

Full blocks only: N is a multiple of the block size (a single group's partial tail is
``lookup``'s). ``lo`` is assumed block-aligned (the engine holds whole blocks); if it is not, the
block holding token ``lo`` is asked for as well.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstrata.index import EntryMeta
from kvstrata.keys import BlockChain, Extra, Namespace, as_tokens
from kvstrata.tiers import BlockTier
from kvstrata.store.lookup import chain_slice
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import GroupHit, GroupRule, Hit

EMPTY = BlockChain([], [], [], [])


@dataclass(slots=True)
class _Group:
    """One group during one lookup: its chain (blocks ``[0, top)``) and what is known of them."""

    rule: GroupRule
    chain: BlockChain
    valid: np.ndarray  # per block: committed and valid in the index (adopted ones included)
    asked: np.ndarray  # per block: bits of the backing tiers asked for its header in this lookup



class GroupLookup:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    def lookup_groups(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra,
                      rules: Sequence[GroupRule], *, lo: int, hi: int, pin: bool) -> GroupHit:
        since = time.monotonic()  # before anything else: the epoch must be confirmed since then
        if not rules:
            raise ValueError("lookup_groups needs at least one group rule")
        if len({r.tag for r in rules}) != len(rules):
            raise ValueError("every group needs its own tag: two groups would share their keys")
        if lo < 0:
            raise ValueError(f"lo={lo}: the tokens the engine holds cannot be negative")
        tokens = as_tokens(tokens)
        epoch, confirmed = self.parts.epochs.lookup_epoch(ns.seed, since)
        self.parts.counters.inc("lookups")
        if not confirmed or not self.parts.epochs.joined(ns.seed):  # as ``Lookup._unconfirmed``
            self.parts.counters.inc("not_joined_misses" if confirmed else "unconfirmed_epoch_misses")
            return _miss(ns, 0, len(rules))
        if self.parts.quarantine.holds(ns.seed, epoch):  # counted there
            return _miss(ns, 0, len(rules))
        bs = ns.block_size
        lo_block, top = lo // bs, min(hi, len(tokens)) // bs
        if top <= lo_block:
            return _miss(ns, epoch, len(rules))
        search = _Search(self.parts, ns, epoch, lo_block)
        keys = self.parts.keys
        root = keys.root_key(ns.seed, epoch)
        groups = [search.group(rule, keys.chain_keys(keys.group_root(root, rule.tag), tokens, bs, extra,
                                                     partial=False, limit=top)) for rule in rules]
        stop = top
        for g in groups:  # full groups first, ascending: a cold prompt costs one probe per tier
            if g.rule.kind == "full":
                hole = search.settle(g, np.arange(lo_block, stop))
                stop = stop if hole < 0 else hole
        while True:
            stop = search.boundary(groups, stop)
            if stop <= lo_block:
                return _miss(ns, epoch, len(rules))
            hit = search.take(groups, stop, pin)
            if hit is not None:
                self.parts.counters.inc("lookup_hit_blocks", hit.num_blocks)
                return hit


def _miss(ns: Namespace, epoch: int, n: int) -> GroupHit:
    return GroupHit(0, [Hit(ns, epoch, EMPTY, [], None) for _ in range(n)],
                    [np.empty(0, np.int64) for _ in range(n)])


class _Search:
    """The state of one ``lookup_groups`` call: the namespace, the confirmed epoch, the block size
    adopted headers must have, and the boundary search over the groups' masks."""

    def __init__(self, parts: Parts, ns: Namespace, epoch: int, lo_block: int) -> None:
        self.parts = parts
        self.ns = ns
        self.epoch = epoch
        self.lo_block = lo_block
        self.size = parts.l1.slot_bytes  # 0: not fixed; learnt from the first known block
        self.all_bits = 0
        for tier in parts.backing:
            self.all_bits |= tier.bit

    def group(self, rule: GroupRule, chain: BlockChain) -> _Group:
        """The group's masks; blocks below ``lo_block`` are never wanted, so never checked."""
        top = len(chain.keys)
        valid = np.zeros(top, bool)
        if top > self.lo_block:
            valid[self.lo_block:] = self.parts.index.valid_mask(self.ns.seed, self.epoch,
                                                               chain_slice(chain, self.lo_block))
        return _Group(rule, chain, valid, np.zeros(top, np.uint8))

    def boundary(self, groups: list[_Group], stop: int) -> int:
        """The largest ``stop' <= stop`` (in blocks) at which every group has all its wanted blocks.

        A hole at block j in a group's range at ``stop`` is in that group's range at every
        boundary from j + 1 to ``stop`` (a range's first block only grows with the boundary), so the
        search jumps to j: as many steps as holes met, not as blocks."""
        bs = self.ns.block_size
        while stop > self.lo_block:
            for g in groups:
                first = g.rule.first_block(stop, self.lo_block, bs)
                hole = self.settle(g, np.arange(stop - 1, first - 1, -1))  # the highest hole first
                if hole >= 0:
                    stop = hole
                    break
            else:
                return stop
        return stop

    def settle(self, g: _Group, idx: np.ndarray) -> int:
        """The first block of ``idx`` (in its order) that is invalid once the backing tiers were
        asked for the headers of the blocks the index lacks, or -1. A tier's ``probe_many`` may stop
        at its first missing key, so the tiers are asked again until that block was put to all."""
        while True:
            bad = idx[~g.valid[idx]]
            if not len(bad) or g.asked[bad[0]] == self.all_bits:
                return int(bad[0]) if len(bad) else -1
            for tier in self.parts.backing:
                ask = idx[~g.valid[idx] & ((g.asked[idx] & tier.bit) == 0)]
                if not len(ask):
                    continue
                metas = tier.probe_many([g.chain.keys[i] for i in ask.tolist()])
                g.asked[ask[: len(metas)] if metas else ask] |= tier.bit  # no answer: the tier is down
                self.adopt(g, ask[: len(metas)], metas, tier)

    def adopt(self, g: _Group, idx: np.ndarray, metas: list[EntryMeta | None], tier: BlockTier) -> None:
        """Commit the headers that are the group's blocks (namespace, epoch, parent, fingerprint,
        token count and block size all match) and mark them valid where the index took them."""
        good, at = [], []
        for i, meta in zip(idx.tolist(), metas):
            if meta is not None and self.fits(g.chain, i, meta):
                good.append(meta)
                at.append(i)
        if not good:
            return
        taken = [i for i, row in zip(at, self.parts.index.commit_many(good, tier.bit)) if row is not None]
        if taken:
            g.valid[taken] = self.parts.index.valid_mask(self.ns.seed, self.epoch, g.chain.pick(taken))

    def fits(self, chain: BlockChain, i: int, meta: EntryMeta) -> bool:
        if (meta.ns_seed != self.ns.seed or meta.epoch != self.epoch or meta.parent != chain.parents[i]
                or meta.fp != chain.fps[i] or meta.ntok != chain.lengths[i] or meta.tail):
            return False
        if not self.size:
            self.size = self._known_size(chain, i) or meta.size
        if meta.size != self.size:  # every block of a namespace has one size (groups are padded to it)
            self.parts.counters.inc("adopt_wrong_size")
            return False
        return True

    def _known_size(self, chain: BlockChain, i: int) -> int:
        """The size of the block before ``i`` where the index holds it (0: unknown): a header that
        claims another size is forged or foreign."""
        if i == 0:
            return 0
        rows = self.parts.index.rows_of(chain.keys[i - 1 : i])
        meta = self.parts.index.metas(rows, chain.keys[i - 1 : i])[0] if rows[0] >= 0 else None
        return meta.size if meta is not None else 0

    def take(self, groups: list[_Group], stop: int, pin: bool) -> GroupHit | None:
        """Every group's wanted blocks at ``stop``, validated again (and pinned, with ``pin``) in
        one index call per group; None, with every pin given back and the blocks that went marked
        invalid, if any block went since its mask was taken."""
        bs, index = self.ns.block_size, self.parts.index
        hits: list[Hit] = []
        positions: list[np.ndarray] = []
        gone = False
        for g in groups:
            first = g.rule.first_block(stop, self.lo_block, bs)
            part = chain_slice(g.chain, first, stop)
            rows, lease = np.empty(0, np.int64), None
            if part.keys:
                if pin:
                    rows, lease = index.match_pinned(self.ns.seed, self.epoch, part)
                else:
                    rows = index.match_rows(self.ns.seed, self.epoch, part)
            if len(rows) < len(part.keys):
                bad = set(np.flatnonzero(~index.valid_mask(self.ns.seed, self.epoch, part)).tolist())
                bad.add(len(rows))  # failed under the pin: invalid for this lookup even if back since
                marks = first + np.fromiter(sorted(bad), np.int64)
                g.valid[marks] = False
                g.asked[marks] = self.all_bits  # not to be adopted again: the masks only shrink
                gone = True
            hits.append(Hit(self.ns, self.epoch, part, index.tiers_of(rows).tolist(), lease))
            positions.append(np.arange(first, stop, dtype=np.int64))
        if gone:
            for hit in hits:
                if hit.lease is not None:
                    index.unpin(hit.lease)
            return None
        return GroupHit(stop * bs, hits, positions)
