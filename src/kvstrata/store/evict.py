"""Capacity and moving blocks down: L1 slots taken by LRU eviction (demoting a block to L2 when
L2 is written on eviction), blocks written to the backing tiers (``write_backing``: room made
before each batch, committed after), and ``gc`` of older epochs.

A block leaves a tier only after the index ``claim``s it there, which fails while the block is
pinned: a reader holding a pin never has its block deleted, nor its slot or row reused, however
long it holds it (pins have no deadline: ``index/pins.py``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Sequence

import numpy as np
import torch

from kvstrata.format.block import payload_checksum
from kvstrata.index import EntryMeta
from kvstrata.index.blockindex import RETIRED
from kvstrata.tenants import EPOCH
from kvstrata.tiers import BlockTier, DiskTier, SharedFsTier
from kvstrata.store import report
from kvstrata.store.parts import Parts
from kvstrata.store.shares import victims
from kvstrata.store.protocol import Reservation

_EVICT_BATCH = 16
# While L2's folder is still being counted (``tiers/ledger.py``) its used bytes are an upper bound,
# and a write that finds no room even after evicting waits this long for the count to finish
# (milliseconds for a small folder; a large one drops the write, as a full tier does).
_COUNT_WAIT_S = 2.0


class Evictor:
    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self._lock = threading.Lock()  # one reservation evicts at a time
        self._holder = 0  # the thread holding ``_lock`` (it never waits for L2's count: prepare_store would)
        self._unreported = Counter[str]()  # dropped by the end of L2's count, reported by the next gc()
        self._unreported_lock = threading.Lock()

    def reserve_slots(self, metas: list[EntryMeta]) -> Reservation:
        """Fresh L1 slots for ``metas`` (one block size), evicting LRU blocks for room; a prefix
        of them when L1 holds too many pinned blocks. Nobody sees the slots until published."""
        parts = self.parts
        if not metas:
            return Reservation([], [])
        size = metas[0].size
        if any(m.size != size for m in metas) or not parts.l1.fits(size):
            parts.counters.inc("l1_too_large" if not parts.l1.fits(size) else "l1_mixed_sizes")
            return Reservation([], [])
        evicted: list[EntryMeta] = []
        with self._lock:
            self._holder = threading.get_ident()
            try:
                slots = parts.l1.reserve(len(metas), size)
                while len(slots) < len(metas):
                    short = len(metas) - len(slots)
                    chosen = victims(parts, parts.l1, short, metas[0].ns_seed, short * size)
                    if not chosen:
                        parts.counters.inc("l1_full", short)
                        break
                    evicted += [meta for meta in (self._evict_l1(row, cause) for row, cause in chosen) if meta]
                    slots += parts.l1.reserve(len(metas) - len(slots), size)
            finally:
                self._holder = 0
        parts.counters.tier_changed(parts.l1.name, evicted, False)
        return Reservation(metas[: len(slots)], slots)

    def _evict_l1(self, row: int, cause: str) -> EntryMeta | None:
        """Evict the block at ``row`` from L1 (demoting it first if so configured); its meta if evicted."""
        parts = self.parts
        meta = parts.index.meta(row)
        demote = (parts.l2 is not None and parts.config.l2.write == "on_evict" and meta.epoch != RETIRED
                  and not int(parts.index.tiers_of(np.array([row]))[0]) & parts.l2.bit)
        if demote:
            _rows, lease = parts.index.pin_keys([meta.key])  # the slot must not be reused mid-write
            try:
                slot = parts.l1.slot_of(meta.key) if lease is not None else None
                if slot is not None and parts.l1.data is not None:
                    self.write_backing([meta], [parts.l1.data[slot, : meta.size]])
                    parts.counters.inc("l1_demoted")
            finally:
                if lease is not None:
                    parts.index.unpin(lease)
        if not parts.index.claim(meta.key, parts.l1.bit):
            return None
        parts.l1.delete(meta.key)
        parts.counters.inc("l1_evicted")
        parts.counters.inc(f"l1_evicted_{cause}")
        return meta

    def write_backing(self, metas: list[EntryMeta], payloads: Sequence[torch.Tensor],
                      tiers: list[BlockTier] | None = None) -> int:
        """Checksum blocks and publish them on the backing tiers (default: all), room made first,
        then commit them. Used by write-through, demotion and the benchmark. Returns how many
        the first tier took."""
        metas = [m._replace(checksum=payload_checksum(memoryview(p[: m.size].numpy())))
                 for m, p in zip(metas, payloads)]
        first = 0
        for tier in self.parts.backing if tiers is None else tiers:
            self.make_room(tier, sum(tier.stored_bytes(m.size) for m in metas), metas[0].ns_seed if metas else None)
            ok = tier.write_many(metas, list(payloads))
            committed = self.commit([m for m, good in zip(metas, ok) if good], tier)
            self.enforce_capacity(tier)
            first = first or committed
        return first

    def commit(self, metas: list[EntryMeta], tier: BlockTier) -> int:
        """Commit blocks written to a backing tier; tells the tier listener. Returns how many."""
        rows = self.parts.index.commit_many(metas, tier.bit) if metas else []
        done = [meta for meta, row in zip(metas, rows) if row is not None]
        self.parts.counters.tier_changed(tier.name, done, True)
        return len(done)

    def enforce_capacity(self, tier: BlockTier) -> None:
        self.make_room(tier, 0)

    def make_room(self, tier: BlockTier, nbytes: int, writer: bytes | None = None) -> None:
        """Evict blocks of ``tier`` until ``nbytes`` more (of the namespace ``writer``, a seed) fit in
        its capacity: least recently used, tenant by tenant where the tier has shares (``shares.py``).

        Called before a batch is written, so a tier never holds more than its capacity (a disk
        tier also refuses a write its capacity has no room for: a concurrent writer may have
        taken the room meanwhile, and that block is then dropped, not the bound exceeded)."""
        self._evict_for(tier, nbytes, writer)
        if tier.used_bytes + nbytes > tier.capacity_bytes and self._await_count(tier):
            self._evict_for(tier, nbytes, writer)

    def _await_count(self, tier: BlockTier) -> bool:
        """Wait (up to ``_COUNT_WAIT_S``) for the count of L2's folder if it is still running:
        True if it finished, and the real figure may have room."""
        recovery, l2 = self.parts.recovery, self.parts.l2
        if (tier is not l2 or l2 is None or recovery is None or not l2.ledger.counting
                or self._holder == threading.get_ident()):
            return False
        return recovery.wait(_COUNT_WAIT_S)

    def _evict_for(self, tier: BlockTier, nbytes: int, writer: bytes | None) -> None:
        counters = self.parts.counters
        while tier.used_bytes + nbytes > tier.capacity_bytes:
            need = tier.used_bytes + nbytes - tier.capacity_bytes
            chosen = victims(self.parts, tier, _EVICT_BATCH, writer, need)
            dropped: list[EntryMeta] = []
            for row, cause in chosen:
                if tier.used_bytes + nbytes <= tier.capacity_bytes:
                    break
                meta = self.drop_from(tier, row)
                if meta is not None:
                    dropped.append(meta)
                    counters.inc(f"{tier.name}_evicted_{cause}")
            counters.inc(f"{tier.name}_evicted", len(dropped))
            self.parts.counters.tier_changed(tier.name, dropped, False)
            if not dropped or tier.used_bytes + nbytes <= tier.capacity_bytes:
                return  # room made, or nothing evictable (all pinned or claimed by others meanwhile)

    def drop_from(self, tier: BlockTier, row: int) -> EntryMeta | None:
        """Delete the block at ``row`` from ``tier`` unless it is pinned (or claimed meanwhile);
        its meta if deleted. The caller tells the tier listener, once per batch."""
        meta = self.parts.index.meta(row)
        if not self.parts.index.claim(meta.key, tier.bit):
            return None
        tier.delete(meta.key)
        if meta.tail and isinstance(tier, DiskTier):
            tier.delete_tail_marker(meta.parent, meta.ntok, meta.key)
        return meta

    def namespaces(self) -> list[bytes]:
        return sorted(set(self.parts.index.census([]).seeds) | set(self.parts.epochs.known()))

    def gc(self, only: list[bytes] | None = None) -> dict[str, int]:
        """Reclaim unpinned entries of older epochs, then enforce every tier's capacity. The counts
        include what the end of L2's background count dropped since the last call (``kvstrata gc``
        waits for that count, which does the disk tier's part of the work)."""
        parts = self.parts
        removed = self._drop_stale(only, parts.tiers)
        if "remote" in parts.shares and isinstance(parts.remote, SharedFsTier):  # its sweep needs every tenant
            for ns in report.descriptors(parts, self.namespaces()).values():
                parts.tenants.learn(ns)
        for tier in parts.backing:
            self.enforce_capacity(tier)
            swept = tier.sweep(parts.config.lease_seconds)
            if swept:
                removed[tier.name] += swept
        parts.counters.inc("gc_removed", sum(removed.values()))
        with self._unreported_lock:  # already counted in gc_removed when dropped
            removed.update(self._unreported)
            self._unreported.clear()
        return dict(removed)

    def after_recovery(self) -> None:
        """L2's folder is all in the index now: drop its blocks of older epochs (an invalidation
        during the scan could not see them) and trim it to ``l2.size`` (lowered since it was
        filled). Runs on the recovery thread."""
        parts = self.parts
        assert parts.l2 is not None
        removed = self._drop_stale(None, [parts.l2])
        self.enforce_capacity(parts.l2)
        parts.counters.inc("gc_removed", sum(removed.values()))
        with self._unreported_lock:
            self._unreported.update(removed)

    def _drop_stale(self, only: list[bytes] | None, tiers: list[BlockTier]) -> Counter[str]:
        parts = self.parts
        removed = Counter[str]()
        for seed in only or self.namespaces():
            current, confirmed = parts.epochs.lookup_epoch(seed, time.monotonic())
            if not confirmed:  # the shared tier does not answer: which epoch is current is not known
                continue
            rows = parts.index.stale_rows(seed, current)
            bits = parts.index.tiers_of(np.array(rows, dtype=np.int64)).tolist() if rows else []
            for tier in tiers:
                dropped = [m for row, b in zip(rows, bits) if b & tier.bit and (m := self.drop_from(tier, row))]
                removed[tier.name] += len(dropped)
                parts.counters.inc(f"{tier.name}_evicted_{EPOCH}", len(dropped))
                parts.counters.tier_changed(tier.name, dropped, False)
        return removed
