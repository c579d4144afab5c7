"""index/keymap.py: ``KeyMap``, the block index's map from (possibly truncated) 128-bit keys to
rows, held in numpy instead of a Python dict.

Why not a dict: at a million entries a dict of 16-byte keys costs ~90 bytes per entry and every
``get`` is a chain of dependent cache misses (bucket, key object, its bytes), one key at a time:
a 1,000-block lookup spent 4x longer in the dict at 1M entries than at 1K. Here the map holds
only rows, in one power-of-two array of slots (-1 empty, -2 tombstone) with linear probing from a
multiplicative hash of the key's first word; a slot's key is the row's entry in the table's key
column, which the table holds anyway. ``find`` probes all of a prompt's keys at once (their home
slots in one numpy step, a window of the next slots for the few displaced keys in another), so
the cache misses of one key overlap with the others' and the cost hardly grows with the map.

Before hashing, ``find`` tries the rows after the first key's: a prompt's blocks are committed
together (one ``commit_many`` per save, rows taken from the free list in ascending order), so
they usually sit in consecutive rows, and comparing that slice of the key column with the keys
asked for reads memory in order instead of one random slot per key. A row counts only if it is
mapped (``_mapped``: a freed row keeps its stale key) and holds the very key; the map holds one
row per key, so such a row is the answer. Keys not found there go through the slots as above.

Keys are compared by their first ``key_bytes`` bytes (the rest of each (2,) uint64 word pair is
masked off): two blocks whose keys agree there are the same key to the map, as they were to the
dict of truncated keys. The table decides what a collision means.

Primitives: ``find`` / ``insert_many`` (vectorized), ``get_one`` / ``insert_one`` / ``remove``
(scalar: pure Python ints, a couple of microseconds), ``rows`` (every live row). Load, counting
tombstones, stays <= 3/8 (``MAX_LOAD``): when it would not, the slots are rebuilt (vectorized,
from the live rows) without tombstones, as many as keep the live keys under 1/4
(``REBUILD_LOAD``). Not 1/2, the textbook bound: at 1/2 a prompt's 1,000 keys have probe runs up
to ~20 slots and a fifth of them are not at home; the slots cost 11-32 bytes a key (int32 rows).
Not thread safe: the index calls it under its lock.
"""

from __future__ import annotations

import sys

import numpy as np

EMPTY = -1
TOMBSTONE = -2
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: Fibonacci hashing spreads even 1-byte keys
_M64 = (1 << 64) - 1
_MIN_SLOTS = 16
MAX_LOAD = (3, 8)  # (live + tombstones) / slots <= 3/8
REBUILD_LOAD = (1, 4)  # live / slots after a rebuild: 1/8 of the slots is headroom till the next
_V16 = np.dtype("V16")
_WINDOW = 8  # slots after home that ``find`` probes in one step; longer runs go one by one
_STEPS = np.arange(1, _WINDOW + 1)


def words_of(key: bytes) -> tuple[int, int]:
    """The two uint64 words of a 16-byte key as numpy reads them (native byte order)."""
    return int.from_bytes(key[:8], sys.byteorder), int.from_bytes(key[8:16], sys.byteorder)


class KeyMap:
    """Truncated key -> row, verified against ``keys`` (the table's (cap, 2) uint64 key column;
    the table assigns a new array here when it grows). See the module docstring."""

    def __init__(self, key_bytes: int, keys: np.ndarray, slots: int = _MIN_SLOTS) -> None:
        assert 1 <= key_bytes <= 16
        self.keys = keys
        mask = np.frombuffer(b"\xff" * key_bytes + b"\x00" * (16 - key_bytes), np.uint64)
        self._m0, self._m1 = int(mask[0]), int(mask[1])
        self._wmask = mask.copy()
        self._masked = key_bytes < 16
        self._live = 0
        self._tombs = 0
        self._mapped = np.zeros(len(keys), np.bool_)  # per row of ``keys``: is it in the map?
        self._reset(max(_MIN_SLOTS, 1 << (slots - 1).bit_length()))

    def _reset(self, nslots: int) -> None:
        self._slots = np.full(nslots, EMPTY, np.int32)  # rows < 2^31: 300 GB of table
        self._pmask = nslots - 1
        self._shift = 64 - (nslots.bit_length() - 1)
        self._tombs = 0

    @property
    def keys(self) -> np.ndarray:
        return self._keys

    @keys.setter
    def keys(self, keys: np.ndarray) -> None:
        assert keys.flags.c_contiguous and keys.shape[1:] == (2,) and keys.dtype == np.uint64
        self._keys = keys
        self._kv = keys.view(_V16).reshape(-1)  # one item per row: 2x faster to gather than rows
        mapped = getattr(self, "_mapped", None)
        if mapped is not None and len(mapped) != len(keys):  # the table grew: rows keep their flag
            self._mapped = np.zeros(len(keys), np.bool_)
            self._mapped[: len(mapped)] = mapped

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    # ---------------------------------------------------------------- scalar
    def get_one(self, w0: int, w1: int) -> int:
        """The row of the key with words (w0, w1), or -1."""
        k0 = w0 & self._m0
        return self._probe(((k0 * GOLDEN) & _M64) >> self._shift, k0, w1 & self._m1)

    def _probe(self, i: int, k0: int, k1: int) -> int:
        """The row of the masked key (k0, k1), probing from slot ``i`` on, or -1."""
        m0, m1 = self._m0, self._m1
        slots, item, pmask = self._slots, self._keys.item, self._pmask
        while True:
            r = slots.item(i)
            if r >= 0:
                if item(r, 0) & m0 == k0 and item(r, 1) & m1 == k1:
                    return r
            elif r == EMPTY:
                return -1
            i = (i + 1) & pmask

    def insert_one(self, w0: int, w1: int, row: int) -> None:
        """Map the key (w0, w1), known absent, to ``row`` (whose key column already holds it)."""
        if self._over(1):
            self._resize(1)
        slots, pmask = self._slots, self._pmask
        i = (((w0 & self._m0) * GOLDEN) & _M64) >> self._shift
        while (r := slots.item(i)) >= 0:
            i = (i + 1) & pmask
        if r == TOMBSTONE:
            self._tombs -= 1
        slots[i] = row
        self._mapped[row] = True
        self._live += 1

    def remove(self, w0: int, w1: int, row: int) -> None:
        """Unmap ``row``, filed under the key (w0, w1)."""
        slots, pmask = self._slots, self._pmask
        i = (((w0 & self._m0) * GOLDEN) & _M64) >> self._shift
        while (r := slots.item(i)) != row:
            assert r != EMPTY, "removing a row that is not mapped"
            i = (i + 1) & pmask
        if slots.item((i + 1) & pmask) == EMPTY:
            slots[i] = EMPTY  # the end of a probe run: no key probes past it
        else:
            slots[i] = TOMBSTONE
            self._tombs += 1
        self._mapped[row] = False
        self._live -= 1

    # ------------------------------------------------------------ vectorized
    def _over(self, extra: int) -> bool:
        return MAX_LOAD[1] * (self._live + self._tombs + extra) > MAX_LOAD[0] * len(self._slots)

    def _homes(self, k0: np.ndarray) -> np.ndarray:
        """Home slots of first words (masked here): the top bits of k0 * GOLDEN."""
        h = (k0 & np.uint64(self._m0) if self._masked else k0) * np.uint64(GOLDEN)  # mod 2^64
        h >>= np.uint64(self._shift)
        return h.view(np.int64)  # < 2^63: the same values

    def _hits(self, r: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Whether slots holding rows ``r`` (any shape) hold the keys ``want`` (masked words,
        shape r.shape + (2,)). Compared as two uint64 words whose two equality bytes must both
        be 1: a 16-byte void compare costs twice as much."""
        got = self._kv[r].view(np.uint64).reshape(r.shape + (2,))  # one 16-byte copy per row
        if self._masked:  # (empty and tombstone slots gather the last rows: ignored below)
            got &= self._wmask
        hit = (got == want).view(np.uint16)[..., 0] == 0x0101
        hit &= r >= 0
        return hit

    def find(self, words: np.ndarray) -> np.ndarray:
        """Rows of keys ``words`` ((n, 2) uint64), -1 where missing: the rows after the first
        key's first (one slice of the key column), then, for the keys not there, every one probed
        at once: one numpy step for the home slots, where most keys are; one for a window of the
        next ``_WINDOW`` slots of the others; the few runs longer than that one by one."""
        n = len(words)
        if not n or not self._live:
            return np.full(n, -1, np.int64)
        want = words & self._wmask if self._masked else np.ascontiguousarray(words)
        k0, k1 = int(want[0, 0]), int(want[0, 1])
        r0 = self._probe(((k0 * GOLDEN) & _M64) >> self._shift, k0, k1)
        if r0 < 0:
            return self._find_hashed(words, want)
        m = min(n, len(self._keys) - r0)
        seg = self._keys[r0 : r0 + m]
        if self._masked:
            seg = seg & self._wmask
        same = (seg == want[:m]).view(np.uint16)[:, 0] == 0x0101  # both words equal
        same &= self._mapped[r0 : r0 + m]
        if m == n and same.all():  # the common case: the prompt's blocks in consecutive rows
            return np.arange(r0, r0 + n, dtype=np.int64)
        out = np.full(n, -1, np.int64)
        out[:m][same] = np.flatnonzero(same) + r0
        todo = np.flatnonzero(out < 0)
        out[todo] = self._find_hashed(words[todo], want[todo])
        return out

    def _find_hashed(self, words: np.ndarray, want: np.ndarray) -> np.ndarray:
        """``find`` through the slots (``want``: ``words`` masked)."""
        slots, pmask = self._slots, self._pmask
        pos = self._homes(words[:, 0])
        r = slots[pos]
        hit = self._hits(r, want)
        if hit.all():  # every key at its home slot
            return r.astype(np.int64)
        out = np.where(hit, r, -1).astype(np.int64)
        todo = np.flatnonzero(~hit & (r != EMPTY))
        if not len(todo):
            return out
        pos, want = pos[todo], want[todo]
        rw = slots[(pos[:, None] + _STEPS) & pmask]  # (m, _WINDOW): the slots after home
        hit = self._hits(rw, want[:, None, :])
        found = hit.any(1)  # a key's row is the only slot that can match it: take it anywhere
        out[todo[found]] = rw[found, hit[found].argmax(1)]
        longer = np.flatnonzero(~found & (rw != EMPTY).all(1))
        m0, m1 = self._m0, self._m1
        for j, i in zip(todo[longer].tolist(), pos[longer].tolist()):
            out[j] = self._probe((i + _WINDOW + 1) & pmask, int(words[j, 0]) & m0, int(words[j, 1]) & m1)
        return out

    def insert_many(self, words: np.ndarray, rows: np.ndarray) -> None:
        """Map keys ``words`` ((n, 2) uint64), known absent and distinct, to ``rows`` (whose key
        column already holds them): one numpy step per probe distance, slot conflicts inside
        the batch settled by letting one claimant per slot take it and moving the others on."""
        n = len(rows)
        if not n:
            return
        if self._over(n):
            self._resize(n)
        rows = np.asarray(rows, np.int64)
        self._place(words[:, 0], rows)
        self._mapped[rows] = True
        self._live += n

    def _place(self, k0: np.ndarray, rows: np.ndarray) -> None:
        slots, pmask = self._slots, self._pmask
        pos = self._homes(k0)
        scratch = np.empty(len(slots), np.int64) if len(rows) > 4096 else None
        while len(rows):
            free = slots[pos] < 0
            pos_f, rows_f = pos[free], rows[free]
            if scratch is not None:  # any one writer per slot wins; read back who did
                idx = np.arange(len(pos_f))
                scratch[pos_f] = idx
                first = np.flatnonzero(scratch[pos_f] == idx)
            else:
                first = np.unique(pos_f, return_index=True)[1]
            self._tombs -= int(np.count_nonzero(slots[pos_f[first]] == TOMBSTONE))
            slots[pos_f[first]] = rows_f[first]
            left = np.ones(len(rows), np.bool_)
            left[np.flatnonzero(free)[first]] = False
            rows = rows[left]
            pos = (pos[left] + 1) & pmask

    def _resize(self, extra: int) -> None:
        """Rebuild the slots without tombstones, as few as live + ``extra`` fill to at most
        ``REBUILD_LOAD`` (grown, or shrunk after removals): the rest up to ``MAX_LOAD`` is the
        headroom before the next rebuild, so tombstones cost O(1) amortized work per removal."""
        live = self.rows()
        n = _MIN_SLOTS
        while REBUILD_LOAD[1] * (len(live) + extra) > REBUILD_LOAD[0] * n:
            n *= 2
        self._reset(n)
        if len(live):
            self._place(self._keys[live, 0], live)

    def rows(self) -> np.ndarray:
        """Every mapped row (int64, in slot order)."""
        s = self._slots
        return s[s >= 0].astype(np.int64)
