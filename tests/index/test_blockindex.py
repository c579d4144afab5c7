"""The index alone: validation of chains, collisions, pins and leases, LRU order."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import BlockChain, Namespace, chain_keys, root_key

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
OTHER = Namespace("test", "tiny", "v2", "bfloat16", "4x[2,16,64]", 16)


def chain_for(tokens, ns=NS, epoch=0) -> BlockChain:
    return chain_keys(root_key(ns.seed, epoch), np.asarray(tokens), ns.block_size)


def commit_chain(index: BlockIndex, chain: BlockChain, ns=NS, epoch=0, tier=1) -> list:
    return [index.commit(EntryMeta(k, p, f, n, ns.seed, epoch, 64, 1, n < 16), tier)
            for k, p, f, n in zip(*chain)]


def test_match_returns_longest_valid_prefix():
    index = BlockIndex()
    stored = chain_for(range(64))
    commit_chain(index, stored)
    assert index.match(NS.seed, 0, stored) == 4
    longer = chain_for(list(range(64)) + list(range(100, 132)))
    assert index.match(NS.seed, 0, longer) == 4
    diverging = chain_for(list(range(40)) + [999] * 24)
    assert index.match(NS.seed, 0, diverging) == 2


def test_match_rejects_wrong_namespace_epoch_and_tokens():
    index = BlockIndex()
    stored = chain_for(range(32))
    commit_chain(index, stored)
    assert index.match(OTHER.seed, 0, stored) == 0
    assert index.match(NS.seed, 1, stored) == 0
    forged = stored._replace(fps=[stored.fps[0], stored.fps[1] ^ 1])
    assert index.match(NS.seed, 0, forged) == 1
    wrong_parent = stored._replace(parents=[stored.parents[0], b"\x01" * 16])
    assert index.match(NS.seed, 0, wrong_parent) == 1


def test_truncated_keys_collide_and_the_index_rejects_the_impostor():
    """Scenario: with 8-bit keys almost every block collides; a lookup must never accept an entry
    that was stored for different tokens or a different prefix."""
    index = BlockIndex(key_bits=8)
    prompts = [[i] * 16 for i in range(600)]
    owners = {}
    for i, p in enumerate(prompts):
        chain = chain_for(p)
        if commit_chain(index, chain)[0] is not None:
            owners[chain.keys[0][:1]] = i
    assert len(owners) <= 256 < len(prompts)  # collisions really happened
    accepted = 0
    for i, p in enumerate(prompts):
        n = index.match(NS.seed, 0, chain_for(p))
        if n:
            accepted += 1
            assert owners[chain_for(p).keys[0][:1]] == i
    assert accepted == len(owners)


def test_colliding_child_with_a_different_prefix_is_rejected():
    """Scenario: the child's tokens match but its parent chain does not (the case a token-only
    check would accept): the chained fingerprint and the parent key reject it."""
    index = BlockIndex(key_bits=8)
    a = chain_for(list(range(16)) + list(range(500, 516)))
    commit_chain(index, a)
    for first in range(1000, 3000):
        b = chain_for([first] * 16 + list(range(500, 516)))
        if b.keys[1][:1] == a.keys[1][:1] and b.keys[0][:1] != a.keys[0][:1]:
            commit_chain(index, b._replace(keys=b.keys[:1], parents=b.parents[:1], fps=b.fps[:1],
                                           lengths=b.lengths[:1]))
            assert index.match(NS.seed, 0, b) == 1  # block 0 is b's own; block 1 belongs to a
            return
    pytest.fail("no colliding prefix found")


def test_duplicate_commit_keeps_one_entry_and_adds_tiers():
    index = BlockIndex()
    chain = chain_for(range(16))
    row1 = commit_chain(index, chain, tier=1)[0]
    row2 = commit_chain(index, chain, tier=2)[0]
    assert row1 == row2 and len(index) == 1
    assert index.tiers_of(np.array([row1]))[0] == 3


def test_pins_protect_from_eviction_until_unpinned_or_dropped():
    """Scenario: pinned rows are neither victims nor claimable until unpinned; a pin held past
    lease_s stays (no deadline); a lease its holder drops is released at the next victim pick."""
    index = BlockIndex(lease_s=0.05)
    chain = chain_for(range(64))
    rows = commit_chain(index, chain)
    _, lease = index.pin_keys(chain.keys[:2])
    assert set(index.lru_victims(1, 10)) == set(rows[2:])
    key0 = index.meta(rows[0]).key
    assert not index.claim(key0, 1)
    index.unpin(lease)
    assert index.claim(key0, 1)
    _, held = index.pin_keys([chain.keys[1]])
    time.sleep(0.1)
    assert rows[1] not in index.lru_victims(1, 10)
    del held
    assert rows[1] in index.lru_victims(1, 10)


def test_lru_victims_are_least_recently_matched_first():
    index = BlockIndex()
    chains = [chain_for([i] * 16) for i in range(5)]
    rows = [commit_chain(index, c)[0] for c in chains]
    index.match(NS.seed, 0, chains[0])
    index.match(NS.seed, 0, chains[2])
    assert index.lru_victims(1, 3) == [rows[1], rows[3], rows[4]]


def test_commit_many_equals_commit_one_by_one():
    a, b = BlockIndex(), BlockIndex()
    chain = chain_for(range(100))
    metas = [EntryMeta(k, p, f, n, NS.seed, 0, 64, 7, n < 16) for k, p, f, n in zip(*chain)]
    rows = a.commit_many(metas + metas[:2], 2)
    for m in metas:
        b.commit(m, 2)
    assert None not in rows and rows[:2] == rows[-2:]
    assert a.match(NS.seed, 0, chain) == b.match(NS.seed, 0, chain) == len(metas)
    assert [a.meta(r) for r in rows[: len(metas)]] == metas
    assert a.tail_lengths(chain.parents[-1]) == [100 % 16]


def test_stale_epoch_entries_are_replaced_and_reported_for_gc():
    index = BlockIndex()
    old = chain_for(range(16), epoch=0)
    rows = commit_chain(index, old, epoch=0)
    assert index.stale_rows(NS.seed, 1) == rows  # any other epoch is stale: no order
    assert index.stale_rows(NS.seed, 0) == []


def test_index_grows_past_initial_capacity():
    index = BlockIndex(capacity=4)
    chain = chain_for(range(16 * 50))
    commit_chain(index, chain)
    assert index.match(NS.seed, 0, chain) == 50
