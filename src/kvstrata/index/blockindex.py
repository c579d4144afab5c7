"""index/blockindex.py: ``BlockIndex``, which blocks exist, where, and whether a requested chain
may use them. Its rows (numpy columns, a numpy ``KeyMap`` from key to row) are ``table``'s.

Primitives:
- ``match(ns, epoch, chain, start)``: length of the leading run of ``chain`` that is committed and
  valid: present in some tier, same namespace and epoch, same parent key, same fingerprint, same
  token count. It never looks at a payload. Does not modify the index except for LRU ticks.
- ``commit(...)``: publish a block whose payload is already complete in a tier. Same key committed
  twice keeps the first (the content is the same by construction); a colliding key with a different
  chain is dropped, never overwritten.
- ``pin_keys(keys)`` / ``unpin(lease)``: look keys up and pin the leading run of them under one
  lock acquisition. A pinned row keeps its key (it is never removed or reused, and its L1 slot is
  never freed) until its ``Lease`` is given back or dropped (see Pins). Looking rows up and
  pinning them under two acquisitions is the race this closes: in between, the row can be freed
  and handed to another block.
- ``metas(rows, keys)``: entry metadata of rows, checked against the keys asked for: every read of
  a row verifies its key, so a stale row number can never serve another block.
- ``lru_victims(tier, n)``: the least recently used unpinned rows of a tier.
- ``claim(key, tier)`` / ``drop_tier(key, tier)``: evict a block from a tier, or note that the tier lost its copy; the entry goes when no tier holds it.
- ``retire(key)``: hide a block from every lookup at once, pinned or not (a verified mismatch): its
  entry validates under no epoch any more; the caller deletes its copies.

Pins (``pins.py``: who holds them, and when they end): a held pin has no deadline; a pin whose
holder dropped its ``Lease`` is released at the index's next pin, claim or victim pick.

Thread safety: every public method takes the index lock; callers hold no lock of their own.
"""

from __future__ import annotations

import threading
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from kvstrata.keys import BlockChain
from kvstrata.index.pins import Lease, PinCensus, Pins
from kvstrata.index.table import RECENT, EntryMeta, Table

RETIRED = 0  # the epoch of a retired entry: ``new_epoch`` never makes 0 (its low bits are non-zero)


class Census(NamedTuple):
    """What ``BlockIndex.census`` counts: (blocks, payload bytes) per (seed, epoch) and per tier
    bit, and the seeds of the namespaces indexed."""

    per_epoch: dict[tuple[bytes, int], tuple[int, int]]
    per_tier: dict[int, tuple[int, int]]
    seeds: list[bytes]


class BlockIndex(Table):
    """Committed blocks of all namespaces of one store. See the module docstring."""

    def __init__(self, key_bits: int = 128, lease_s: float = 60.0, capacity: int = 1024) -> None:
        """``lease_s``: a pin held longer than this is logged as overdue (``pins.py``)."""
        super().__init__(key_bits, capacity)
        self._lock = threading.RLock()
        self._leases = Pins(lease_s)

    # ------------------------------------------------------------------ lookup
    def match(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int = 0) -> int:
        """Number of blocks of ``chain[start:]`` that form a committed, valid run. Never reads KV."""
        return len(self.match_rows(ns_seed, epoch, chain, start))

    def match_rows(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int = 0) -> np.ndarray:
        """Rows of the committed, valid run of ``chain[start:]`` (see ``match``)."""
        with self._lock:
            return self._match_rows(ns_seed, epoch, chain, start)

    def match_pinned(self, ns_seed: bytes, epoch: int, chain: BlockChain) -> tuple[np.ndarray, Lease | None]:
        """``match_rows`` from the start of ``chain``, with the rows pinned in the same lock
        acquisition. Returns the rows and the lease (None when empty)."""
        with self._lock:
            r = self._match_rows(ns_seed, epoch, chain, 0)
            return r, (self._pin(r) if len(r) else None)

    def _match_rows(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int) -> np.ndarray:
        keys = chain.keys[start:] if start else chain.keys
        r = self._map.find(np.frombuffer(b"".join(keys), np.uint64).reshape(len(keys), 2))
        miss = np.flatnonzero(r < 0)
        if len(miss):
            r = r[: miss[0]]
        if not len(r):
            return r
        bad = np.flatnonzero(~self._valid(ns_seed, epoch, chain, r, start))
        if len(bad):
            r = r[: bad[0]]
        self._stamp(r)
        return r

    def valid_mask(self, ns_seed: bytes, epoch: int, chain: BlockChain) -> np.ndarray:
        """Per block of ``chain``: is a valid copy already committed? (Used to skip re-saves.)"""
        keys = np.frombuffer(b"".join(chain.keys), np.uint64).reshape(len(chain.keys), 2)
        with self._lock:
            rows = self._map.find(keys)
            mask = rows >= 0
            if mask.any():
                mask[mask] = self._valid(ns_seed, epoch, chain, rows, 0)[mask]
            return mask

    def _valid(self, ns_seed: bytes, epoch: int, chain: BlockChain, r: np.ndarray, start: int) -> np.ndarray:
        """Vectorized entry check of rows ``r`` against ``chain[start:start+len(r)]``."""
        n = len(r)
        stop = start + n
        ns = self._ns_ids.get(ns_seed, -1)
        parent = np.frombuffer(b"".join(chain.parents[start:stop]), np.uint64)
        lengths = chain.lengths[start:stop]
        ntok = np.full(n, lengths[0], np.uint32)
        if lengths[-1] != lengths[0] or lengths.count(lengths[0]) != n:
            ntok = np.array(lengths, np.uint32)
        ok = (
            (self._parent[r, 0] == parent[0::2])
            & (self._parent[r, 1] == parent[1::2])
            & (self._fp[r] == np.fromiter(chain.fps[start:stop], np.uint64, n))
            & (self._ntok[r] == ntok)
            & (self._epoch[r] == np.uint64(epoch))
            & (self._ns[r] == ns)
            & (self._tiers[r] != 0)
        )
        if self._key_bytes < 16:  # the map matched only a prefix of the key: compare the rest
            key = np.frombuffer(b"".join(chain.keys[start:stop]), np.uint64)
            ok &= (self._key[r, 0] == key[0::2]) & (self._key[r, 1] == key[1::2])
        return ok

    def rows_of(self, keys: list[bytes]) -> np.ndarray:
        """Rows of keys validated by ``match`` (same order); -1 where the entry has gone since.
        Unpinned rows can change owner right after this returns: to read them, use ``pin_keys``."""
        with self._lock:
            return self._rows_of(keys)

    def pin_keys(self, keys: list[bytes], *, leading: bool = True) -> tuple[np.ndarray, Lease | None]:
        """Rows of the leading run of ``keys`` that are indexed and held by some tier, pinned
        together under one lock acquisition. Returns the rows and the lease (None when empty).
        With ``leading=False``, every such key is pinned and the rows are aligned with ``keys``
        (-1 where a key is not stored)."""
        with self._lock:
            rows = self._rows_of(keys)
            held = rows >= 0
            held[held] = self._tiers[rows[held]] != 0
            if leading:
                bad = np.flatnonzero(~held)
                rows = rows[: bad[0]] if len(bad) else rows
                pinned = rows
            else:
                rows[~held] = -1
                pinned = rows[held]
            if not len(pinned):
                return rows, None
            return rows, self._pin(pinned)

    def tail_lengths(self, parent: bytes) -> list[int]:
        """Token counts of partial blocks stored after ``parent``, longest first."""
        with self._lock:
            return sorted(self._tails.get(parent, ()), reverse=True)

    def tiers_of(self, rows: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._tiers[rows].copy()

    def meta(self, row: int) -> EntryMeta:
        with self._lock:
            return self._meta(row)

    def metas(self, rows: np.ndarray, keys: list[bytes]) -> list[EntryMeta | None]:
        """``meta`` of each row, or None where the row no longer holds the key asked for."""
        with self._lock:
            out: list[EntryMeta | None] = []
            for row, key in zip(rows.tolist(), keys):
                meta = self._meta(row) if row >= 0 else None
                out.append(meta if meta is not None and meta.key == key and self._tiers[row] else None)
            return out

    # ------------------------------------------------------------------ writes
    def commit(self, meta: EntryMeta, tier_bit: int) -> int | None:
        """Publish ``meta`` as present in ``tier_bit``. Returns the row, or None if dropped.

        A block with the same identity that is already committed just gains the tier bit. A
        different block under the same (possibly truncated) key is a collision: the existing entry
        wins unless it belongs to an older epoch or no tier holds it any more.
        """
        with self._lock:
            return self._commit(meta, tier_bit)

    def commit_many(self, metas: list[EntryMeta], tier_bit: int) -> list[int | None]:
        """``commit`` for many blocks at once (recovery, bulk saves), duplicates and collisions by
        the same rules, new keys written in one vectorized assignment per column. Rows aligned with
        ``metas``."""
        with self._lock:
            return self._commit_many(metas, tier_bit)

    def commit_recovered(self, metas: list[EntryMeta], tier_bit: int, mtimes: list[float]) -> None:
        """``commit_many`` for blocks found in a tier folder at start-up (``mtimes``: their files'),
        filed as used before anything used since open, oldest file first: eviction takes them
        in mtime order, after nothing a lookup touched. Blocks already indexed (adopted by a
        lookup, or saved since open) only gain the tier, and keep their place in the LRU order."""
        stamps = np.clip(np.array(mtimes, np.float64) * 1e6, 0, RECENT - 1).astype(np.uint64)
        with self._lock:
            self._commit_many(metas, tier_bit, stamps)

    def claim(self, key: bytes, tier_bit: int) -> bool:
        """Atomically take block ``key`` out of a tier for eviction; False if a reader has it
        pinned, or it is not indexed in that tier (any more)."""
        with self._lock:
            self._reap()
            row = self._row_of(key)
            if row < 0 or self._pins[row] or not self._tiers[row] & tier_bit:
                return False
            self._tiers[row] &= ~np.uint8(tier_bit)
            if not self._tiers[row]:
                self._remove(row)
            return True

    def retire(self, key: bytes) -> tuple[EntryMeta, int] | None:
        """Hide block ``key`` from every lookup and ``valid_mask`` now, pinned or not: its entry
        takes epoch ``RETIRED``, which no namespace epoch is (``epochs.base.new_epoch``), so gc
        sees it as stale. Returns its meta as it was and its tier bits (the caller deletes the
        copies: ``claim``/``drop_tier``), or None if it is not indexed."""
        with self._lock:
            row = self._row_of(key)
            if row < 0:
                return None
            meta, bits = self._meta(row), int(self._tiers[row])
            self._epoch[row] = RETIRED
            return meta, bits

    def drop_tier(self, key: bytes, tier_bit: int) -> None:
        """The tier no longer holds block ``key``; forget the entry when no tier does."""
        with self._lock:
            row = self._row_of(key)
            if row < 0:
                return
            self._tiers[row] &= ~np.uint8(tier_bit)
            if not self._tiers[row] and not self._pins[row]:
                self._remove(row)

    # -------------------------------------------------------------- pins, LRU
    def _pin(self, rows: np.ndarray) -> Lease:
        """Protect ``rows`` from eviction until the lease is given back (``unpin``) or dropped."""
        self._reap()
        np.add.at(self._pins, rows, 1)
        return self._leases.add(rows)

    def unpin(self, lease: Lease) -> None:
        """Give the lease's pin back (a second call does nothing)."""
        with self._lock:
            rows = self._leases.give_back(lease)
            if rows is not None:
                self._release(rows)

    def pins(self) -> PinCensus:
        """Pins held now (and the oldest one's age), and those abandoned and overdue so far."""
        with self._lock:
            self._reap()
            return self._leases.census()

    def _release(self, rows: np.ndarray) -> None:
        np.subtract.at(self._pins, rows, 1)
        key = self._key.item
        for row in rows[(self._pins[rows] == 0) & (self._tiers[rows] == 0)].tolist():
            if self._map.get_one(key(row, 0), key(row, 1)) == row:  # still live (not yet removed)
                self._remove(row)

    def _reap(self) -> None:
        """Release dropped leases' pins (and log overdue ones), before every pin, claim and pick."""
        for rows in self._leases.take_abandoned():
            self._release(rows)
        self._leases.audit()

    def lru_victims(self, tier_bit: int, n: int, seeds: list[bytes] | None = None) -> list[int]:
        """Up to ``n`` unpinned rows of a tier (of the namespaces ``seeds`` only, if given), least
        recently used first."""
        with self._lock:
            self._reap()
            held = (self._tiers & tier_bit).astype(bool) & (self._pins == 0)
            if seeds is not None:
                ids = [self._ns_ids[s] for s in seeds if s in self._ns_ids]
                held &= np.isin(self._ns[: len(held)], np.array(ids, np.uint16))
            cand = np.flatnonzero(held)
            if len(cand) > n:
                cand = cand[np.argpartition(self._last[cand], n - 1)[:n]]
            return [int(r) for r in cand[np.argsort(self._last[cand], kind="stable")]]

    # ------------------------------------------------------------------ views
    def entries(self) -> Iterator[tuple[int, EntryMeta, int]]:
        """Snapshot of (row, meta, tier bits) for stats and GC."""
        with self._lock:
            rows = np.sort(self._map.rows()).tolist()  # row order: allocation order
            snap = [(row, self._meta(row), int(self._tiers[row])) for row in rows]
        yield from snap

    def census(self, tier_bits: list[int]) -> Census:
        """Blocks and bytes per (namespace seed, epoch) and per tier bit, and the namespaces
        indexed: vectorized over the columns (no per-entry object), for ``stats`` and GC."""
        with self._lock:
            rows = self._map.rows()
            ns, epoch, tiers = self._ns[rows], self._epoch[rows], self._tiers[rows]
            size = self._size[rows].astype(np.int64)
            seeds = list(self._ns_seeds)
        per_tier = {}
        for bit in tier_bits:
            held = (tiers & bit) != 0
            per_tier[bit] = (int(np.count_nonzero(held)), int(size[held].sum()))
        epochs, epoch_of = np.unique(epoch, return_inverse=True)  # group by (epoch, ns) as one int
        width = len(seeds) or 1
        groups, inverse = np.unique(epoch_of.reshape(-1).astype(np.int64) * width + ns, return_inverse=True)
        counts = np.bincount(inverse.reshape(-1), minlength=len(groups))
        nbytes = np.bincount(inverse.reshape(-1), weights=size, minlength=len(groups))
        per_epoch = {(seeds[int(g % width)], int(epochs[g // width])): (int(c), int(b))
                     for g, c, b in zip(groups.tolist(), counts.tolist(), nbytes.tolist())}
        return Census(per_epoch, per_tier, sorted({seed for seed, _ in per_epoch}))

    def namespace_seeds(self) -> list[bytes]:
        """The namespaces the index has had entries of (a few: not only those it holds now)."""
        with self._lock:
            return list(self._ns_seeds)

    def usage(self, tier_bits: Sequence[int]) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """(namespace seeds, bytes, blocks) each tier of ``tier_bits`` holds per namespace (arrays
        of shape [tiers, namespaces]): one copy of the columns, a ``bincount`` per tier."""
        with self._lock:
            held = np.flatnonzero(self._tiers)
            ns, size, bits = self._ns[held], self._size[held].astype(np.float64), self._tiers[held]
            seeds = list(self._ns_seeds)
        nbytes = np.zeros((len(tier_bits), len(seeds)), np.int64)
        blocks = np.zeros((len(tier_bits), len(seeds)), np.int64)
        for i, bit in enumerate(tier_bits):
            on = (bits & bit) != 0
            nbytes[i] = np.bincount(ns[on], weights=size[on], minlength=len(seeds))
            blocks[i] = np.bincount(ns[on], minlength=len(seeds))
        return seeds, nbytes, blocks

    def stale_rows(self, ns_seed: bytes, epoch: int) -> list[int]:
        """Unpinned rows of ``ns_seed`` from epochs other than ``epoch`` (for GC)."""
        with self._lock:
            self._reap()
            ns = self._ns_ids.get(ns_seed)
            if ns is None:
                return []
            used = self._map.rows()
            mask = (self._ns[used] == ns) & (self._epoch[used] != np.uint64(epoch)) & (self._pins[used] == 0)
            return [int(r) for r in used[mask]]
