"""index/table.py: the rows of the block index: ``EntryMeta`` (one block's entry, what a tier
stores beside its bytes) and ``Table``, the committed entries kept in numpy columns.

One entry per stored block, in numpy columns (a slab of rows) with a ``KeyMap`` from key to row
(``keymap``: numpy slots, not a dict), so that an entry costs a fixed ~100-200 bytes and a lookup
finds and validates a whole prefix with a handful of vectorized steps instead of per-block Python
objects. ``Table`` writes rows (``_commit``, ``_commit_many``), reads them (``_rows_of``,
``_meta``), frees them (``_remove``) and keeps the tail counts (partial blocks per parent). It
takes no lock: ``BlockIndex`` calls it under its own.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvstrata.index.keymap import KeyMap, words_of


class EntryMeta(NamedTuple):
    """What a tier needs to know to store or verify a block, and what a disk header carries."""

    key: bytes
    parent: bytes
    fp: int
    ntok: int
    ns_seed: bytes
    epoch: int
    size: int
    checksum: int  # xxh3-64 of the payload; 0 until it is written to a tier outside the process
    tail: bool = False  # a partial block (fewer tokens than the block size)


RECENT = 1 << 56  # the first use stamp; recovered blocks are stamped below it


class Table:
    """The columns, the key -> row map, the free rows, the namespaces and the tail counts."""

    def __init__(self, key_bits: int, capacity: int) -> None:
        if key_bits % 8 or not 8 <= key_bits <= 128:
            raise ValueError(f"key_bits must be a multiple of 8 in [8, 128], got {key_bits}")
        self._key_bytes = key_bits // 8
        self._map = KeyMap(self._key_bytes, np.zeros((0, 2), np.uint64))
        self._free: list[int] = []
        # Use stamps start high: ``_commit_many`` can then file recovered blocks as older than
        # any block used since open, in the order of their files' mtimes (microseconds < 2^56).
        self._tick = RECENT
        self._ns_ids: dict[bytes, int] = {}
        self._ns_seeds: list[bytes] = []
        # parent key -> {token count: number of stored partial children of that length}. Counted,
        # not a set: two tails of one length under one parent (other tokens) are two entries, and
        # evicting one must not hide the other.
        self._tails: dict[bytes, dict[int, int]] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "_cap", 0)
        cols = {
            "key": np.zeros((capacity, 2), np.uint64),
            "parent": np.zeros((capacity, 2), np.uint64),
            "fp": np.zeros(capacity, np.uint64),
            "checksum": np.zeros(capacity, np.uint64),
            "last": np.zeros(capacity, np.uint64),
            "epoch": np.zeros(capacity, np.uint64),  # the namespace epoch (random u64)
            "size": np.zeros(capacity, np.uint32),
            "ntok": np.zeros(capacity, np.uint32),
            "ns": np.zeros(capacity, np.uint16),
            "pins": np.zeros(capacity, np.uint16),
            "tiers": np.zeros(capacity, np.uint8),
            "tail": np.zeros(capacity, np.bool_),
        }
        for name, col in cols.items():
            if old:
                col[:old] = getattr(self, "_" + name)
            setattr(self, "_" + name, col)
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._cap = capacity
        self._map.keys = self._key

    def _ns_id(self, ns_seed: bytes) -> int:
        ns = self._ns_ids.get(ns_seed)
        if ns is None:
            ns = self._ns_ids[ns_seed] = len(self._ns_seeds)
            self._ns_seeds.append(ns_seed)
        return ns

    def __len__(self) -> int:
        return len(self._map)

    def _rows_of(self, keys: list[bytes]) -> np.ndarray:
        full = np.frombuffer(b"".join(keys), np.uint64).reshape(len(keys), 2)
        rows = self._map.find(full)
        found = rows >= 0
        if self._key_bytes < 16 and found.any():  # the row must hold this very key (a truncated
            same = (self._key[rows[found]] == full[found]).all(1)  # key may name another block)
            rows[np.flatnonzero(found)[~same]] = -1
        return rows

    def _row_of(self, key: bytes) -> int:
        """``_rows_of`` for one key, without numpy temporaries."""
        w0, w1 = words_of(key)
        row = self._map.get_one(w0, w1)
        if row >= 0 and self._key_bytes < 16:
            if self._key.item(row, 0) != w0 or self._key.item(row, 1) != w1:
                return -1
        return row

    def _meta(self, row: int) -> EntryMeta:
        parent = self._parent[row].tobytes()
        return EntryMeta(
            key=self._key[row].tobytes(),
            parent=parent,
            fp=int(self._fp[row]),
            ntok=int(self._ntok[row]),
            ns_seed=self._ns_seeds[self._ns[row]],
            epoch=int(self._epoch[row]),
            size=int(self._size[row]),
            checksum=int(self._checksum[row]),
            tail=bool(self._tail[row]),
        )

    def _commit(self, meta: EntryMeta, tier_bit: int) -> int | None:
        """``BlockIndex.commit``, under the caller's lock."""
        w0, w1 = words_of(meta.key)
        ns = self._ns_id(meta.ns_seed)
        row = self._map.get_one(w0, w1)
        if row >= 0:
            same = (
                self._key[row].tobytes() == meta.key
                and self._parent[row].tobytes() == meta.parent
                and int(self._fp[row]) == meta.fp
                and self._ns[row] == ns
                and self._epoch[row] == meta.epoch
            )
            if same:
                self._tiers[row] |= tier_bit
                if meta.checksum:
                    self._checksum[row] = meta.checksum
                return row
            if self._pins[row] or self._tiers[row]:
                return None  # collision: first writer wins; the chain check rejects the loser
            self._remove(row)
        if not self._free:
            self._alloc(self._cap * 2)
        row = self._free.pop()
        self._key[row] = np.frombuffer(meta.key, np.uint64)
        self._map.insert_one(w0, w1, row)
        self._parent[row] = np.frombuffer(meta.parent, np.uint64)
        self._fp[row] = meta.fp
        self._checksum[row] = meta.checksum
        self._epoch[row] = meta.epoch
        self._size[row] = meta.size
        self._ntok[row] = meta.ntok
        self._ns[row] = ns
        self._pins[row] = 0
        self._tiers[row] = tier_bit
        self._tail[row] = meta.tail
        self._tick += 1
        self._last[row] = self._tick
        if meta.tail:
            self._add_tail(meta.parent, meta.ntok)
        return row

    def _commit_many(self, metas: list[EntryMeta], tier_bit: int,
                     stamps: np.ndarray | None = None) -> list[int | None]:
        """``BlockIndex.commit_many``, under the caller's lock: keys not yet indexed are written
        with one vectorized assignment per column, the rest go through ``_commit``. With
        ``stamps`` (one per meta, below ``RECENT``) new rows take them as their last use instead
        of now; rows already indexed keep theirs."""
        if not metas:
            return []
        words = np.frombuffer(b"".join(m.key for m in metas), np.uint64).reshape(len(metas), 2)
        is_fresh = self._first_seen(words) & (self._map.find(words) < 0)
        fresh = np.flatnonzero(is_fresh)
        slow = np.flatnonzero(~is_fresh).tolist()
        n = len(fresh)
        while len(self._free) < n:
            self._alloc(self._cap * 2)
        rows = np.array(self._free[len(self._free) - n :][::-1], dtype=np.int64)
        del self._free[len(self._free) - n :]
        new = [metas[i] for i in fresh.tolist()]
        self._key[rows] = words[fresh]
        self._map.insert_many(words[fresh], rows)
        self._parent[rows] = np.frombuffer(b"".join(m.parent for m in new), np.uint64).reshape(n, 2)
        self._fp[rows] = np.array([m.fp for m in new], np.uint64)
        self._checksum[rows] = np.array([m.checksum for m in new], np.uint64)
        self._epoch[rows] = np.array([m.epoch for m in new], np.uint64)
        self._size[rows] = np.array([m.size for m in new], np.uint32)
        self._ntok[rows] = np.array([m.ntok for m in new], np.uint32)
        self._ns[rows] = np.array([self._ns_id(m.ns_seed) for m in new], np.uint16)
        self._pins[rows] = 0
        self._tiers[rows] = tier_bit
        self._tail[rows] = np.array([m.tail for m in new], np.bool_)
        if stamps is None:
            self._stamp(rows)
        else:
            self._last[rows] = stamps[fresh]
        for m in new:
            if m.tail:
                self._add_tail(m.parent, m.ntok)
        found = np.empty(len(metas), np.int64)
        found[fresh] = rows
        found[slow] = self._map.find(words[slow])  # indexed before, or earlier in this batch
        out: list[int | None] = found.tolist()
        if slow:  # already indexed: the same block (vectorized: add the tier) or a collision
            same = self._same(slow, metas, out)
            rows_same = np.array([out[i] for i, ok in zip(slow, same) if ok], np.int64)
            if len(rows_same):
                self._tiers[rows_same] |= np.uint8(tier_bit)
                sums = np.array([metas[i].checksum for i, ok in zip(slow, same) if ok], np.uint64)
                self._checksum[rows_same] = np.where(sums != 0, sums, self._checksum[rows_same])
            for i, ok in zip(slow, same):
                if not ok:
                    out[i] = self._commit(metas[i], tier_bit)
        return out

    def _first_seen(self, words: np.ndarray) -> np.ndarray:
        """Per key ((n, 2) uint64): is it the first in the batch with its (truncated) key? Sorted
        by the first word only, which already tells digests apart: the few keys that share one
        are sorted again by both."""
        first = np.ones(len(words), np.bool_)
        if len(words) < 2:
            return first
        keys = words & np.frombuffer(b"\xff" * self._key_bytes + b"\x00" * (16 - self._key_bytes), np.uint64)
        order = np.argsort(keys[:, 0], kind="stable")
        head = keys[order, 0]
        twin = np.flatnonzero(head[1:] == head[:-1])
        if len(twin):
            shared = np.unique(np.concatenate([order[twin], order[twin + 1]]))
            sub = keys[shared]
            by_key = np.lexsort((sub[:, 1], sub[:, 0]))  # stable: batch order within a key
            s = sub[by_key]
            first[shared[by_key[1:][(s[1:] == s[:-1]).all(1)]]] = False
        return first

    def _same(self, idx: list[int], metas: list[EntryMeta], rows: list[int | None]) -> np.ndarray:
        """Whether each ``metas[i]`` (i in ``idx``) is exactly the block indexed at ``rows[i]``."""
        r = np.array([rows[i] for i in idx], np.int64)
        sub = [metas[i] for i in idx]
        n = len(sub)
        key = np.frombuffer(b"".join(m.key for m in sub), np.uint64).reshape(n, 2)
        parent = np.frombuffer(b"".join(m.parent for m in sub), np.uint64).reshape(n, 2)
        ns = np.array([self._ns_ids.get(m.ns_seed, -1) for m in sub])
        return ((self._key[r] == key).all(1) & (self._parent[r] == parent).all(1)
                & (self._fp[r] == np.fromiter((m.fp for m in sub), np.uint64, n))
                & (self._epoch[r] == np.fromiter((m.epoch for m in sub), np.uint64, n))
                & (self._ns[r] == ns))

    def _add_tail(self, parent: bytes, ntok: int) -> None:
        counts = self._tails.setdefault(parent, {})
        counts[ntok] = counts.get(ntok, 0) + 1

    def _remove(self, row: int) -> None:
        self._map.remove(self._key.item(row, 0), self._key.item(row, 1), row)
        parent = self._parent[row].tobytes()
        counts = self._tails.get(parent)
        ntok = int(self._ntok[row])
        if counts is not None and ntok in counts and self._tail[row]:
            counts[ntok] -= 1
            if not counts[ntok]:
                del counts[ntok]
            if not counts:
                del self._tails[parent]
        self._tiers[row] = 0
        self._free.append(row)

    def _stamp(self, rows: np.ndarray) -> None:
        """Mark rows used now; earlier rows count as more recent, so that eviction takes the end
        of a chain before its beginning (a block is useless once a block before it is gone)."""
        n = len(rows)
        self._last[rows] = self._tick + np.arange(n, 0, -1, dtype=np.uint64)
        self._tick += n
