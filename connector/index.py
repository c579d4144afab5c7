"""The block index: which blocks exist, where, and whether a requested chain may use them.

One entry per stored block, kept in numpy columns (a slab of rows) with one dict from key to row,
so that an entry costs a fixed ~150 bytes and lookups validate a whole prefix with a handful of
vectorized comparisons instead of per-block Python objects.

Primitives:
- ``match(ns, epoch, chain, start)``: length of the leading run of ``chain`` that is committed and
  valid: present in some tier, same namespace and epoch, same parent key, same fingerprint, same
  token count. It never looks at a payload. Does not modify the index except for LRU ticks.
- ``commit(...)``: publish a block whose payload is already complete in a tier. Same key committed
  twice keeps the first (the content is the same by construction); a colliding key with a different
  chain is dropped, never overwritten.
- ``pin_keys(keys)`` / ``unpin(lease)``: look keys up and pin the leading run of them under one
  lock acquisition. A pinned row keeps its key (it is never removed or reused, and its L1 slot is
  never freed) until the pin goes; the lease deadline means a caller that dies or forgets can
  never protect blocks forever. Looking rows up and pinning them under two acquisitions is the
  race this closes: in between, the row can be freed and handed to another block.
- ``metas(rows, keys)``: entry metadata of rows, checked against the keys asked for: every read of
  a row verifies its key, so a stale row number can never serve another block.
- ``lru_victims(tier, n)``: the least recently used unpinned rows of a tier.
- ``claim(key, tier)`` / ``drop_tier(key, tier)``: evict a block from a tier, or note that the tier lost its copy; the entry goes when no tier holds it.

Thread safety: every public method takes the index lock; callers hold no lock of their own.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, NamedTuple

import numpy as np

from .keys import BlockChain

_KEY = np.dtype((np.uint64, 2))  # 16-byte key as two uint64 for vectorized compares


class EntryMeta(NamedTuple):
    """What a tier needs to know to store or verify a block, and what a disk header carries."""

    key: bytes
    parent: bytes
    fp: int
    ntok: int
    ns_seed: bytes
    epoch: int
    size: int
    checksum: int  # xxh3-64 of the payload; 0 until a tier that verifies has computed it
    tail: bool = False  # a partial block (fewer tokens than the block size)


class Lease(NamedTuple):
    rows: np.ndarray
    deadline: float


class BlockIndex:
    """Committed blocks of all namespaces of one store. See the module docstring."""

    def __init__(self, key_bits: int = 128, lease_s: float = 60.0, capacity: int = 1024) -> None:
        if key_bits % 8 or not 8 <= key_bits <= 128:
            raise ValueError(f"key_bits must be a multiple of 8 in [8, 128], got {key_bits}")
        self._key_bytes = key_bits // 8
        self._lease_s = lease_s
        self._lock = threading.RLock()
        self._rows: dict[bytes, int] = {}
        self._free: list[int] = []
        self._tick = 0
        self._leases: dict[int, Lease] = {}
        self._next_lease = 1
        self._ns_ids: dict[bytes, int] = {}
        self._ns_seeds: list[bytes] = []
        # parent key -> {token count: number of stored partial children of that length}. Counted,
        # not a set: two tails of one length under one parent (other tokens) are two entries, and
        # evicting one must not hide the other.
        self._tails: dict[bytes, dict[int, int]] = {}
        self._alloc(capacity)

    # ----------------------------------------------------------------- storage
    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "_cap", 0)
        cols = {
            "key": np.zeros((capacity, 2), np.uint64),
            "parent": np.zeros((capacity, 2), np.uint64),
            "fp": np.zeros(capacity, np.uint64),
            "checksum": np.zeros(capacity, np.uint64),
            "last": np.zeros(capacity, np.uint64),
            "epoch": np.zeros(capacity, np.uint64),  # the namespace generation (random u64)
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

    def _ns_id(self, ns_seed: bytes) -> int:
        ns = self._ns_ids.get(ns_seed)
        if ns is None:
            ns = self._ns_ids[ns_seed] = len(self._ns_seeds)
            self._ns_seeds.append(ns_seed)
        return ns

    def __len__(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------ lookup
    def match(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int = 0) -> int:
        """Number of blocks of ``chain[start:]`` that form a committed, valid run. Never reads KV."""
        return len(self.match_rows(ns_seed, epoch, chain, start))

    def match_rows(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int = 0) -> np.ndarray:
        """Rows of the committed, valid run of ``chain[start:]`` (see ``match``)."""
        with self._lock:
            return self._match_rows(ns_seed, epoch, chain, start)

    def match_pinned(self, ns_seed: bytes, epoch: int, chain: BlockChain) -> tuple[np.ndarray, int | None]:
        """``match_rows`` from the start of ``chain``, with the rows pinned in the same lock
        acquisition. Returns the rows and the lease (None when empty)."""
        with self._lock:
            r = self._match_rows(ns_seed, epoch, chain, 0)
            return r, (self._pin(r, None) if len(r) else None)

    def _match_rows(self, ns_seed: bytes, epoch: int, chain: BlockChain, start: int) -> np.ndarray:
        keys = chain.keys[start:] if start else chain.keys
        if self._key_bytes < 16:
            keys = [k[: self._key_bytes] for k in keys]
        rows = list(map(self._rows.get, keys))  # C-level loop over the dict
        try:
            rows = rows[: rows.index(None)]
        except ValueError:
            pass
        if not rows:
            return np.empty(0, np.int64)
        r = np.array(rows, dtype=np.int64)
        bad = np.flatnonzero(~self._valid(ns_seed, epoch, chain, r, start))
        if len(bad):
            r = r[: bad[0]]
        self._stamp(r)
        return r

    def valid_mask(self, ns_seed: bytes, epoch: int, chain: BlockChain) -> np.ndarray:
        """Per block of ``chain``: is a valid copy already committed? (Used to skip re-saves.)"""
        kb = self._key_bytes
        with self._lock:
            rows = np.array([self._rows.get(k[:kb], -1) for k in chain.keys], dtype=np.int64)
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
        if self._key_bytes < 16:  # the dict matched only a prefix of the key: compare the rest
            key = np.frombuffer(b"".join(chain.keys[start:stop]), np.uint64)
            ok &= (self._key[r, 0] == key[0::2]) & (self._key[r, 1] == key[1::2])
        return ok

    def rows_of(self, keys: list[bytes]) -> np.ndarray:
        """Rows of keys validated by ``match`` (same order); -1 where the entry has gone since.
        Unpinned rows can change owner right after this returns: to read them, use ``pin_keys``."""
        with self._lock:
            return self._rows_of(keys)

    def _rows_of(self, keys: list[bytes]) -> np.ndarray:
        kb = self._key_bytes
        get = self._rows.get
        rows = np.array([get(k[:kb], -1) for k in keys], dtype=np.int64)
        found = rows >= 0
        if found.any():  # the row must hold this very key (a truncated key may name another block)
            full = np.frombuffer(b"".join(keys), np.uint64).reshape(len(keys), 2)
            same = (self._key[rows[found]] == full[found]).all(1)
            rows[np.flatnonzero(found)[~same]] = -1
        return rows

    def pin_keys(self, keys: list[bytes], lease_s: float | None = None, *,
                 leading: bool = True) -> tuple[np.ndarray, int | None]:
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
            return rows, self._pin(pinned, lease_s)

    def tail_lengths(self, parent: bytes) -> list[int]:
        """Token counts of partial blocks stored after ``parent``, longest first."""
        with self._lock:
            return sorted(self._tails.get(parent, ()), reverse=True)

    def has_tail(self, parent: bytes, ntok: int) -> bool:
        """Whether some partial block of ``ntok`` tokens after ``parent`` is still indexed."""
        with self._lock:
            return ntok in self._tails.get(parent, ())

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

    # ------------------------------------------------------------------ writes
    def commit(self, meta: EntryMeta, tier_bit: int) -> int | None:
        """Publish ``meta`` as present in ``tier_bit``. Returns the row, or None if dropped.

        A block with the same identity that is already committed just gains the tier bit. A
        different block under the same (possibly truncated) key is a collision: the existing entry
        wins unless it belongs to an older epoch or no tier holds it any more.
        """
        k = meta.key[: self._key_bytes]
        with self._lock:
            ns = self._ns_id(meta.ns_seed)
            row = self._rows.get(k)
            if row is not None:
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
            self._rows[k] = row
            self._key[row] = np.frombuffer(meta.key, np.uint64)
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

    def commit_many(self, metas: list[EntryMeta], tier_bit: int) -> list[int | None]:
        """``commit`` for many blocks at once (recovery, bulk saves). Rows aligned with ``metas``.

        Keys not yet indexed are written with one vectorized assignment per column; the rest go
        through ``commit`` so that duplicates and collisions follow the same rules.
        """
        kb = self._key_bytes
        with self._lock:
            fresh: dict[bytes, EntryMeta] = {}
            slow = []
            for i, m in enumerate(metas):
                k = m.key[:kb]
                if k in self._rows or k in fresh:
                    slow.append(i)
                else:
                    fresh[k] = m
            n = len(fresh)
            while len(self._free) < n:
                self._alloc(self._cap * 2)
            rows = np.array(self._free[len(self._free) - n :][::-1], dtype=np.int64)
            del self._free[len(self._free) - n :]
            new = list(fresh.values())
            self._rows.update(zip(fresh, rows.tolist()))
            self._key[rows] = np.frombuffer(b"".join(m.key for m in new), np.uint64).reshape(n, 2)
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
            self._stamp(rows)
            for m in new:
                if m.tail:
                    self._add_tail(m.parent, m.ntok)
            out: list[int | None] = [self._rows[m.key[:kb]] for m in metas]
            if slow:  # already indexed: the same block (vectorized: add the tier) or a collision
                same = self._same(slow, metas, out)
                rows_same = np.array([out[i] for i, ok in zip(slow, same) if ok], np.int64)
                if len(rows_same):
                    self._tiers[rows_same] |= np.uint8(tier_bit)
                    sums = np.array([metas[i].checksum for i, ok in zip(slow, same) if ok], np.uint64)
                    self._checksum[rows_same] = np.where(sums != 0, sums, self._checksum[rows_same])
                for i, ok in zip(slow, same):
                    if not ok:
                        out[i] = self.commit(metas[i], tier_bit)
            return out

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

    def claim(self, key: bytes, tier_bit: int) -> bool:
        """Atomically take block ``key`` out of a tier for eviction; False if a reader has it
        pinned, or it is not indexed in that tier (any more)."""
        with self._lock:
            self._expire_leases()
            row = int(self._rows_of([key])[0])
            if row < 0 or self._pins[row] or not self._tiers[row] & tier_bit:
                return False
            self._tiers[row] &= ~np.uint8(tier_bit)
            if not self._tiers[row]:
                self._remove(row)
            return True

    def drop_tier(self, key: bytes, tier_bit: int) -> None:
        """The tier no longer holds block ``key``; forget the entry when no tier does."""
        with self._lock:
            row = int(self._rows_of([key])[0])
            if row < 0:
                return
            self._tiers[row] &= ~np.uint8(tier_bit)
            if not self._tiers[row] and not self._pins[row]:
                self._remove(row)

    def drop_key(self, key: bytes) -> int | None:
        """Remove a block from every tier's bookkeeping (bad payload). Returns its old row."""
        with self._lock:
            row = self._rows.get(key[: self._key_bytes])
            if row is not None:
                self._tiers[row] = 0
                if not self._pins[row]:
                    self._remove(row)
            return row

    def _add_tail(self, parent: bytes, ntok: int) -> None:
        counts = self._tails.setdefault(parent, {})
        counts[ntok] = counts.get(ntok, 0) + 1

    def _remove(self, row: int) -> None:
        key = self._key[row].tobytes()
        short = key[: self._key_bytes]
        assert self._rows.get(short) == row, "removing a row that is not live"
        del self._rows[short]
        parent = self._parent[row].tobytes()
        counts = self._tails.get(parent)
        ntok = int(self._ntok[row])
        if counts is not None and ntok in counts and self._is_tail(row, parent):
            counts[ntok] -= 1
            if not counts[ntok]:
                del counts[ntok]
            if not counts:
                del self._tails[parent]
        self._tiers[row] = 0
        self._free.append(row)

    def _is_tail(self, row: int, parent: bytes) -> bool:
        return bool(self._tail[row])

    # -------------------------------------------------------------- pins, LRU
    def pin(self, rows: np.ndarray, lease_s: float | None = None) -> int:
        """Protect ``rows`` from eviction until ``unpin`` or the lease expires. Returns a lease id.
        Only for rows the caller already holds pinned or has just committed; to pin by key, use
        ``pin_keys`` (a row found by an earlier lookup may belong to another block by now)."""
        with self._lock:
            return self._pin(np.asarray(rows, dtype=np.int64), lease_s)

    def _pin(self, rows: np.ndarray, lease_s: float | None) -> int:
        self._expire_leases()
        lease = self._next_lease
        self._next_lease += 1
        np.add.at(self._pins, rows, 1)
        deadline = time.monotonic() + (self._lease_s if lease_s is None else lease_s)
        self._leases[lease] = Lease(rows, deadline)
        return lease

    def unpin(self, lease: int) -> None:
        with self._lock:
            held = self._leases.pop(lease, None)
            if held is not None:
                self._release(held.rows)

    def _release(self, rows: np.ndarray) -> None:
        np.subtract.at(self._pins, rows, 1)
        for row in rows[(self._pins[rows] == 0) & (self._tiers[rows] == 0)]:
            if self._rows.get(self._key[row].tobytes()[: self._key_bytes]) == row:
                self._remove(int(row))

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for lease in [k for k, v in self._leases.items() if v.deadline < now]:
            self._release(self._leases.pop(lease).rows)

    def pinned(self, row: int) -> bool:
        with self._lock:
            self._expire_leases()
            return bool(self._pins[row])

    def lru_victims(self, tier_bit: int, n: int) -> list[int]:
        """Up to ``n`` unpinned rows of a tier, least recently used first."""
        with self._lock:
            self._expire_leases()
            cand = np.flatnonzero((self._tiers & tier_bit).astype(bool) & (self._pins == 0))
            if len(cand) > n:
                cand = cand[np.argpartition(self._last[cand], n - 1)[:n]]
            return [int(r) for r in cand[np.argsort(self._last[cand], kind="stable")]]

    def touch(self, rows: np.ndarray) -> None:
        with self._lock:
            self._stamp(np.asarray(rows, np.int64))

    def _stamp(self, rows: np.ndarray) -> None:
        """Mark rows used now; earlier rows count as more recent, so that eviction takes the end
        of a chain before its beginning (a block is useless once a block before it is gone)."""
        n = len(rows)
        self._last[rows] = self._tick + np.arange(n, 0, -1, dtype=np.uint64)
        self._tick += n

    # ------------------------------------------------------------------ views
    def entries(self) -> Iterator[tuple[int, EntryMeta, int]]:
        """Snapshot of (row, meta, tier bits) for stats and GC."""
        with self._lock:
            snap = [(row, self._meta(row), int(self._tiers[row])) for row in self._rows.values()]
        yield from snap

    def stale_rows(self, ns_seed: bytes, epoch: int) -> list[int]:
        """Unpinned rows of ``ns_seed`` from generations other than ``epoch`` (for GC)."""
        with self._lock:
            self._expire_leases()
            ns = self._ns_ids.get(ns_seed)
            if ns is None:
                return []
            used = np.fromiter(self._rows.values(), np.int64, len(self._rows))
            mask = (self._ns[used] == ns) & (self._epoch[used] != np.uint64(epoch)) & (self._pins[used] == 0)
            return [int(r) for r in used[mask]]
