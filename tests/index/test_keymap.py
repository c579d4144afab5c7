"""KeyMap, the index's numpy map from (truncated) keys to rows, against a dict model; and the
index's bulk commit over it, against one commit at a time."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.index import BlockIndex, EntryMeta, KeyMap
from kvstrata.index.keymap import words_of


def key_of(low: int, high: int) -> bytes:
    """A 16-byte key from its two words; small word values make truncated keys collide."""
    return struct.pack("=QQ", low, high)


class Model:
    """A KeyMap beside the dict of truncated keys it replaces, over one key column."""

    def __init__(self, key_bits: int, capacity: int = 512) -> None:
        self.kb = key_bits // 8
        self.keys = np.zeros((capacity, 2), np.uint64)
        self.map = KeyMap(self.kb, self.keys)
        self.dict: dict[bytes, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def insert(self, keys: list[bytes], bulk: bool) -> None:
        new: dict[bytes, bytes] = {}
        for key in keys:
            if key[: self.kb] not in self.dict and key[: self.kb] not in new:
                new[key[: self.kb]] = key
        rows = [self.free.pop() for _ in new]
        for row, (short, key) in zip(rows, new.items()):
            self.keys[row] = np.frombuffer(key, np.uint64)
            self.dict[short] = row
            if not bulk:
                self.map.insert_one(*words_of(key), row)
        if bulk:
            words = np.frombuffer(b"".join(new.values()), np.uint64).reshape(len(new), 2)
            self.map.insert_many(words, np.array(rows, np.int64))

    def remove(self, key: bytes) -> None:
        row = self.dict.pop(key[: self.kb], None)
        if row is not None:
            self.map.remove(int(self.keys[row, 0]), int(self.keys[row, 1]), row)
            self.keys[row] = 0  # a freed row's key column is stale; the map must not read it
            self.free.append(row)

    def remove_nth(self, n: int) -> None:
        if self.dict:
            short = list(self.dict)[n % len(self.dict)]
            self.remove(short + bytes(16 - self.kb))

    def check(self, queries: list[bytes]) -> None:
        want = [self.dict.get(q[: self.kb], -1) for q in queries]
        words = np.frombuffer(b"".join(queries), np.uint64).reshape(len(queries), 2)
        assert self.map.find(words).tolist() == want
        rows = sorted(self.dict.values())  # in row order: ``find``'s consecutive-row path
        assert self.map.find(self.keys[rows]).tolist() == rows
        assert [self.map.get_one(*words_of(q)) for q in queries] == want
        assert sorted(self.map.rows().tolist()) == sorted(self.dict.values())
        assert len(self.map) == len(self.dict)


# Keys from a small space: the low byte takes 24 values (1-byte keys collide), the first word 96,
# the second 4 (so 64-bit keys collide too), and many share a probe run in a small map.
KEYS = st.builds(lambda lo, mid, hi: key_of(lo + (mid << 8), hi),
                 st.integers(0, 23), st.integers(0, 3), st.integers(0, 3))
ALL_KEYS = [key_of(lo + (mid << 8), hi) for lo in range(24) for mid in range(4) for hi in range(4)]
OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(KEYS, max_size=12), st.booleans()),
    st.tuples(st.just("remove"), st.integers(0, 99)),  # the n-th key present
    st.tuples(st.just("check"), st.lists(KEYS, min_size=1, max_size=40)),
), max_size=60)


@pytest.mark.parametrize("key_bits", [8, 64, 128])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_keymap_matches_a_dict_of_truncated_keys(key_bits, ops):
    model = Model(key_bits)
    for op in ops:
        if op[0] == "insert":
            model.insert(op[1], op[2])
        elif op[0] == "remove":
            model.remove_nth(op[1])
            model.check(ALL_KEYS)  # a removal that cuts a probe run hides keys after it
        else:
            model.check(op[1])
    model.check(ALL_KEYS)


@pytest.mark.parametrize("key_bits", [8, 64, 128])
def test_growth_and_tombstone_rebuilds_keep_every_key(key_bits):
    """Scenario: 20,000 random keys in, every other one out, 5,000 more in, then churn: one out,
    one in, 20,000 times. The map grows, rebuilds away its tombstones and stays sized by its live
    keys (at most 16 slots per key: a rebuild that doubled every time would not), and it answers
    as the dict does (1-byte keys: 256 distinct at most)."""
    rng = np.random.default_rng(key_bits)
    pool = [bytes(k) for k in rng.integers(0, 256, (40_000, 16), dtype=np.uint8)]
    model = Model(key_bits, capacity=40_000)
    model.insert(pool[:20_000], bulk=True)
    for key in pool[:20_000:2]:
        model.remove(key)
    model.insert(pool[20_000:25_000], bulk=False)
    model.check(pool[:30_000])
    live = list(model.dict)
    for i in range(20_000):
        model.remove(live[i % len(live)] + bytes(16 - model.kb))
        model.insert([pool[25_000 + i % 15_000]], bulk=False)
        live = live if i % 1000 else list(model.dict)
    model.check(pool)
    assert len(model.map) == len(model.dict)
    assert len(model.map._slots) <= 16 * len(model.dict)  # noqa: SLF001  (no growth by churn)


def test_find_is_vectorized(monkeypatch):
    """find of 100,000 keys (half present) probes them together: only keys of rare long probe
    runs go one by one (a loop per key would make 100,000 scalar probes)."""
    rng = np.random.default_rng(0)
    model = Model(128, capacity=100_000)
    words = rng.integers(0, 2**63, (150_000, 2), dtype=np.uint64)
    model.keys[:] = words[:100_000]
    model.map.insert_many(words[:100_000], np.arange(100_000))
    calls = []
    probe = model.map._probe  # noqa: SLF001
    monkeypatch.setattr(model.map, "_probe", lambda *a: calls.append(1) or probe(*a))
    query = words[50_000:]
    rows = model.map.find(query)
    assert rows[:50_000].tolist() == list(range(50_000, 100_000))
    assert (rows[50_000:] == -1).all()
    assert len(calls) < 100


def test_keys_of_one_byte_spread_over_the_slots():
    """Scenario: 1-byte keys (key_bits=8) all 256 present: a hash of the masked first word must
    still give them distinct home slots, or every find walks one long probe run."""
    model = Model(8, capacity=256)
    model.insert([bytes([b]) + bytes(15) for b in range(256)], bulk=True)
    homes = model.map._homes(np.arange(256, dtype=np.uint64))  # noqa: SLF001
    assert len(np.unique(homes)) >= 200


NS_SEED = b"\x01" * 16


@pytest.mark.parametrize("key_bits", [8, 128])
@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=30))
def test_commit_many_equals_commits_one_by_one(key_bits, picks):
    """Duplicates inside the batch, truncated-key collisions and blocks already indexed: the
    vectorized bulk commit gives the rows (or None) that committing one at a time gives."""
    def meta(key_id: int, parent_id: int) -> EntryMeta:
        key = key_of(key_id * 0x100 + key_id, key_id)  # key ids 0 and 1 share their low byte...
        return EntryMeta(key, key_of(parent_id, 7), parent_id, 16, NS_SEED, 1, 64, 0)

    metas = [meta(k, p) for k, p in picks]
    one, bulk = BlockIndex(key_bits, capacity=4), BlockIndex(key_bits, capacity=4)
    for index in (one, bulk):
        index.commit(meta(2, 0), 1)  # already indexed before the batch
    def held(index: BlockIndex, rows: list[int | None]) -> list[bytes | None]:
        return [None if r is None else index.meta(r).key for r in rows]  # rows may be numbered apart

    expected = held(one, [one.commit(m, 2) for m in metas])
    assert held(bulk, bulk.commit_many(metas, 2)) == expected
    assert len(bulk) == len(one)
    assert sorted((m.key, t) for _, m, t in bulk.entries()) == sorted((m.key, t) for _, m, t in one.entries())


@pytest.mark.parametrize("key_bits", [8, 128])
def test_find_in_consecutive_rows_skips_freed_and_reused_rows(key_bits: int) -> None:
    """A prompt's keys in consecutive rows are found by comparing that slice of the key column;
    a freed row keeps its stale key there (the table does not clear it) and must not count, and
    a row reused by another key must not answer for the old one."""
    keys = np.zeros((64, 2), np.uint64)
    kmap = KeyMap(key_bits // 8, keys)
    ks = [key_of(i + 1, 7) for i in range(20)]
    words = np.frombuffer(b"".join(ks), np.uint64).reshape(20, 2)
    keys[:20] = words
    kmap.insert_many(words, np.arange(20))
    assert kmap.find(words).tolist() == list(range(20))
    kmap.remove(*words_of(ks[5]), 5)  # stale: row 5 still holds ks[5] in the key column
    kmap.remove(*words_of(ks[9]), 9)
    keys[9] = np.frombuffer(key_of(200, 1), np.uint64)  # row 9 reused by another key
    kmap.insert_one(*words_of(key_of(200, 1)), 9)
    want = [-1 if i in (5, 9) else i for i in range(20)]
    assert kmap.find(words).tolist() == want
    assert kmap.find(words[::-1].copy()).tolist() == want[::-1]
    assert kmap.find(words[5:]).tolist() == want[5:]  # the first key missing: hashed path only
    assert kmap.find(np.frombuffer(key_of(200, 1), np.uint64).reshape(1, 2)).tolist() == [9]
    keys[5] = 0  # whatever a freed row holds, it is not mapped
    assert kmap.find(words).tolist() == want
