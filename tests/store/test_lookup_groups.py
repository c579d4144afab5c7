"""``lookup_groups``: one boundary for every KV-cache group of a hybrid model.

Blocks are stored per group under ``group_root(root_key(seed, epoch), tag)`` (only the blocks a
test names), then looked up with full / window / state rules. Block size 16; prompts of 10 blocks
(160 tokens); the window group's window is 40 tokens, so at boundary N it loads the blocks from
``(N - 39) // 16`` on (at 160: blocks 7-9; at 128: 5-7)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.builders import BLOCK_BYTES, BLOCK_SIZE, assert_payloads_match, make_namespace, payloads_for, random_tokens
from kvstrata.keys import NO_EXTRA, BlockChain, Namespace, as_tokens
from kvstrata.store import BlockStore, GroupHit, GroupRule

FULL = GroupRule("full", b"g0:full")
WINDOW = GroupRule("window", b"g1:swa", window_tokens=40)
STATE = GroupRule("state", b"g2:ssm")
N_BLOCKS = 10
ALL = range(N_BLOCKS)


def group_chain(store: BlockStore, ns: Namespace, epoch: int, tokens: np.ndarray, rule: GroupRule) -> BlockChain:
    """The group's keys from the store's key scheme's primitives (not from ``store.group_chain``)."""
    keys = store.keys
    root = keys.group_root(keys.root_key(ns.seed, epoch), rule.tag)
    return keys.chain_keys(root, as_tokens(tokens), ns.block_size, partial=False)


def blocks_of(chain: BlockChain, idx) -> BlockChain:
    idx = list(idx)
    return BlockChain(*([part[i] for i in idx] for part in chain))


def store_group(store: BlockStore, ns: Namespace, tokens: np.ndarray, rule: GroupRule, idx,
                epoch: int | None = None, as_ns: Namespace | None = None) -> BlockChain:
    """Save the blocks ``idx`` of the group's chain (keys under ``ns`` and ``epoch``), written as
    blocks of ``as_ns`` (default ``ns``) under ``epoch``."""
    epoch = store.current_epoch(ns) if epoch is None else epoch
    part = blocks_of(group_chain(store, ns, epoch, tokens, rule), idx)
    if part.keys:
        assert store.save_now(as_ns or ns, epoch, part, payloads_for(part)) == len(part.keys)
    return part


def look(store: BlockStore, ns: Namespace, tokens: np.ndarray, rules, *, lo: int = 0, hi: int | None = None,
         pin: bool = False) -> GroupHit:
    return store.lookup_groups(ns, tokens, NO_EXTRA, rules, lo=lo,
                               hi=len(tokens) if hi is None else hi, pin=pin)


def positions(hit: GroupHit) -> list[list[int]]:
    return [p.tolist() for p in hit.positions]


def pinned(store: BlockStore) -> int:
    """Rows held in L1 that eviction may not take (pinned)."""
    return len(store.index) - len(store.index.lru_victims(store.l1.bit, 1 << 20))


def reference(stored: dict[bytes, set[int]], rules, lo: int, hi: int, n_tokens: int, bs: int = BLOCK_SIZE) -> int:
    """The spec, one boundary at a time from the top: the largest N = n * bs, lo < N <= hi, at which
    every group has all the blocks it loads."""
    for n in range(min(hi, n_tokens) // bs, lo // bs, -1):
        wants = []
        for r in rules:
            if r.kind == "full":
                wants.append(range(lo // bs, n))
            elif r.kind == "state":
                wants.append([n - 1])
            else:
                wants.append(range(max(lo // bs, (n * bs - r.window_tokens + 1) // bs), n))
        if all(set(w) <= stored[r.tag] for w, r in zip(wants, rules)):
            return n * bs
    return 0


# --------------------------------------------------------------------------- truth tables
@pytest.mark.parametrize("full_missing, window_missing, boundary", [
    ((), (), 160),
    ((), (2,), 160),  # a hole the window at 160 does not reach does not matter
    ((), (8,), 128),  # a hole inside it: at 128 the window needs blocks 5-7
    ((), (8, 6), 96),  # ... and at 128 another: at 96 it needs blocks 3-5
    ((4,), (), 64),  # full attention needs every block below N
    ((4,), (0,), 64),  # at 64 the window needs blocks 1-3, not 0
    ((4,), (1,), 16),  # ... so a hole at 1 leaves 16 (the window at 16 needs block 0 only)
    ((0,), (), 0),
    ((), (9,), 144),
])
def test_full_and_window_groups_share_the_largest_boundary_both_serve(store_factory, ns, full_missing,
                                                                      window_missing, boundary):
    store = store_factory()
    tokens = random_tokens("fw", N_BLOCKS * BLOCK_SIZE)
    store_group(store, ns, tokens, FULL, [i for i in ALL if i not in full_missing])
    store_group(store, ns, tokens, WINDOW, [i for i in ALL if i not in window_missing])
    hit = look(store, ns, tokens, [FULL, WINDOW])
    assert hit.boundary == boundary
    n = boundary // BLOCK_SIZE
    if n:
        assert positions(hit) == [list(range(n)), list(range(max(0, (boundary - 39) // 16), n))]
    else:
        assert [h.num_blocks for h in hit.hits] == [0, 0]


@pytest.mark.parametrize("states, window_missing, hi, boundary", [
    ({3, 7}, (), 160, 128),  # states at 64 and 128 only: the largest one wins
    ({3, 7}, (), 120, 64),  # hi caps N below the state at 128
    ({3, 7, 9}, (8,), 160, 128),  # the state at 160 is there but the window has a hole at it
    ({3, 7, 9}, (), 160, 160),
    ({0}, (), 160, 16),
    (set(), (), 160, 0),
])
def test_state_group_takes_the_largest_boundary_with_a_state_whose_other_groups_pass(
        store_factory, ns, states, window_missing, hi, boundary):
    store = store_factory()
    tokens = random_tokens("fws", N_BLOCKS * BLOCK_SIZE)
    store_group(store, ns, tokens, FULL, ALL)
    store_group(store, ns, tokens, WINDOW, [i for i in ALL if i not in window_missing])
    store_group(store, ns, tokens, STATE, sorted(states))
    hit = look(store, ns, tokens, [FULL, WINDOW, STATE], hi=hi)
    assert hit.boundary == boundary
    if boundary:
        assert positions(hit)[2] == [boundary // BLOCK_SIZE - 1]  # the state at N, nothing else


def test_lo_asks_nothing_below_the_prefix_the_engine_holds(store_factory, ns):
    """Scenario: the engine holds the first 4 blocks (lo = 64); none of them is stored in any group,
    yet the hit reaches 160 and names only blocks from 4 on; a state only at 64 itself is no hit
    (N must be above lo)."""
    store = store_factory()
    tokens = random_tokens("lo", N_BLOCKS * BLOCK_SIZE)
    store_group(store, ns, tokens, FULL, range(4, 10))
    store_group(store, ns, tokens, WINDOW, range(4, 10))
    store_group(store, ns, tokens, STATE, [3, 9])
    hit = look(store, ns, tokens, [FULL, WINDOW, STATE], lo=64)
    assert hit.boundary == 160
    assert positions(hit) == [list(range(4, 10)), [7, 8, 9], [9]]
    assert look(store, ns, tokens, [FULL, WINDOW, STATE], lo=0).boundary == 0  # block 0 is not stored
    assert look(store, ns, tokens, [FULL, WINDOW, STATE], lo=64, hi=159).boundary == 0
    hit = look(store, ns, tokens, [FULL, WINDOW], lo=64, hi=100)
    assert hit.boundary == 96 and positions(hit) == [[4, 5], [4, 5]]  # the window clamped at lo


def test_hits_hold_each_groups_own_payloads_and_count_once(store_factory, ns):
    store = store_factory()
    tokens = random_tokens("bytes", N_BLOCKS * BLOCK_SIZE)
    for rule in (FULL, WINDOW, STATE):
        store_group(store, ns, tokens, rule, ALL)
    before = store.snapshot()
    hit = look(store, ns, tokens, [FULL, WINDOW, STATE], pin=True)
    assert hit.boundary == 160 and hit.num_blocks == 10 + 3 + 1
    after = store.snapshot()
    assert after["lookups"] - before.get("lookups", 0) == 1
    assert after["lookup_hit_blocks"] - before.get("lookup_hit_blocks", 0) == 14
    epoch = store.current_epoch(ns)
    for rule, h, pos in zip((FULL, WINDOW, STATE), hit.hits, hit.positions):
        want = blocks_of(group_chain(store, ns, epoch, tokens, rule), pos.tolist())
        assert h.chain.keys == want.keys
        out = torch.zeros((h.num_blocks, BLOCK_BYTES), dtype=torch.uint8)
        assert store.load_into(h, out) == h.num_blocks
        assert_payloads_match(want.keys, out, h.num_blocks)
    assert pinned(store) == 14
    for h in hit.hits:
        store.complete_load(h)
    assert pinned(store) == 0


def test_groups_chains_differ_by_tag(store_factory, ns):
    """Scenario: the same tokens under two tags share no key; blocks stored for one tag are no hit
    for a group of another tag, nor for the plain (non-group) lookup."""
    store = store_factory()
    tokens = random_tokens("tags", N_BLOCKS * BLOCK_SIZE)
    epoch = store.current_epoch(ns)
    assert not set(group_chain(store, ns, epoch, tokens, FULL).keys) & set(
        group_chain(store, ns, epoch, tokens, WINDOW).keys)
    store_group(store, ns, tokens, FULL, ALL)
    assert look(store, ns, tokens, [FULL]).boundary == 160
    assert look(store, ns, tokens, [GroupRule("full", b"g9:full")]).boundary == 0
    assert look(store, ns, tokens, [FULL, GroupRule("window", b"g1:other", window_tokens=40)]).boundary == 0
    assert store.lookup(ns, tokens).num_blocks == 0


# --------------------------------------------------------------------- races and pins
def test_block_dropped_between_mask_and_pin_lowers_the_boundary_and_leaks_no_pin(store_factory, ns, monkeypatch):
    """Scenario: every group validates at 160; then, just before the pin, the window group's block
    8 is evicted (no L2: gone). The lookup must not hand out 160 with a hole; it falls back to 128
    (window blocks 5-7), and only the returned blocks stay pinned."""
    store = store_factory(**{"l2.enabled": False})
    tokens = random_tokens("race", N_BLOCKS * BLOCK_SIZE)
    store_group(store, ns, tokens, FULL, ALL)
    window = store_group(store, ns, tokens, WINDOW, ALL)
    store_group(store, ns, tokens, STATE, [7, 9])
    index = store.index
    original = index.match_pinned
    calls = []

    def evict_first(seed, epoch, chain):
        if not calls:
            assert index.claim(window.keys[8], store.l1.bit)
        calls.append(len(chain.keys))
        return original(seed, epoch, chain)

    monkeypatch.setattr(index, "match_pinned", evict_first)
    hit = look(store, ns, tokens, [FULL, WINDOW, STATE], pin=True)
    assert hit.boundary == 128
    assert positions(hit) == [list(range(8)), [5, 6, 7], [7]]
    assert len(calls) > 3  # a second round of pins after the first failed
    assert pinned(store) == hit.num_blocks  # the first round's pins were given back
    for h in hit.hits:
        store.complete_load(h)
    assert pinned(store) == 0


def test_block_dropped_before_an_unpinned_lookup_takes_it_is_not_returned(store_factory, ns, monkeypatch):
    store = store_factory(**{"l2.enabled": False})
    tokens = random_tokens("race2", N_BLOCKS * BLOCK_SIZE)
    full = store_group(store, ns, tokens, FULL, ALL)
    store_group(store, ns, tokens, STATE, [4, 9])
    index = store.index
    original = index.match_rows

    def evict_first(seed, epoch, chain, start=0):
        if full.keys[6] in chain.keys and index.rows_of([full.keys[6]])[0] >= 0:
            assert index.claim(full.keys[6], store.l1.bit)
        return original(seed, epoch, chain, start)

    monkeypatch.setattr(index, "match_rows", evict_first)
    hit = look(store, ns, tokens, [FULL, STATE])
    assert hit.boundary == 80 and positions(hit) == [list(range(5)), [4]]
    assert pinned(store) == 0


# -------------------------------------------------- other processes' blocks, by header
def test_blocks_another_store_wrote_to_the_shared_folder_are_adopted_by_header(store_factory, ns):
    """Scenario: B has recovered its (empty) L2 folder before A stores; B itself holds the full and
    window groups; A stores the state at 96 only (an interior block, no leading run of B's) and, for
    another prompt, all three groups. B finds both by header and loads A's bytes."""
    a, b = store_factory(), store_factory()
    assert b.wait_recovered(30)
    tokens = random_tokens("adopt", N_BLOCKS * BLOCK_SIZE)
    store_group(b, ns, tokens, FULL, ALL)
    store_group(b, ns, tokens, WINDOW, ALL)
    state = store_group(a, ns, tokens, STATE, [5])
    other = random_tokens("adopt-all", N_BLOCKS * BLOCK_SIZE)
    for rule in (FULL, WINDOW, STATE):
        store_group(a, ns, other, rule, ALL)
    assert a.flush(30)
    assert b.index.rows_of(state.keys)[0] < 0  # B has not seen it yet

    hit = look(b, ns, tokens, [FULL, WINDOW, STATE], pin=True)
    assert hit.boundary == 96 and positions(hit)[2] == [5]
    out = torch.zeros((1, BLOCK_BYTES), dtype=torch.uint8)
    assert b.load_into(hit.hits[2], out) == 1
    assert_payloads_match(state.keys, out, 1)

    hit = look(b, ns, other, [FULL, WINDOW, STATE])
    assert hit.boundary == 160 and hit.num_blocks == 14
    for h in hit.hits:
        out = torch.zeros((h.num_blocks, BLOCK_BYTES), dtype=torch.uint8)
        assert b.load_into(h, out) == h.num_blocks
        assert_payloads_match(h.chain.keys, out, h.num_blocks)


@pytest.mark.parametrize("forgery", ["namespace", "epoch"])
def test_a_block_file_of_another_namespace_or_epoch_under_the_key_is_not_adopted(store_factory, ns, forgery):
    """Scenario: A writes files under exactly the keys B wants, but their headers name another
    namespace (or another epoch); B, with everything else stored, must not adopt them."""
    a, b = store_factory(), store_factory()
    assert b.wait_recovered(30)
    tokens = random_tokens("forged", N_BLOCKS * BLOCK_SIZE)
    store_group(b, ns, tokens, FULL, ALL)
    epoch = b.current_epoch(ns)
    if forgery == "namespace":
        other = make_namespace(model_version="v2")
        store_group(a, ns, tokens, STATE, [9], epoch=epoch, as_ns=other)
    else:
        keys = group_chain(b, ns, epoch, tokens, STATE)
        part = blocks_of(keys, [9])
        assert a.save_now(ns, epoch + 1, part, payloads_for(part)) == 1
    assert a.flush(30)
    assert look(b, ns, tokens, [FULL, STATE]).boundary == 0
    forged = blocks_of(group_chain(b, ns, epoch, tokens, STATE), [9])
    assert b.index.rows_of(forged.keys)[0] < 0  # not even indexed: it would shadow B's own block later
    assert look(b, ns, tokens, [FULL]).boundary == 160  # the control: the full group alone hits


def test_invalidate_hides_every_group_here_and_in_another_store(store_factory, ns):
    a, b = store_factory(), store_factory()
    tokens = random_tokens("inval", N_BLOCKS * BLOCK_SIZE)
    for rule in (FULL, WINDOW, STATE):
        store_group(a, ns, tokens, rule, ALL)
    assert a.flush(30)
    assert look(a, ns, tokens, [FULL, WINDOW, STATE]).boundary == 160
    assert look(b, ns, tokens, [FULL, WINDOW, STATE]).boundary == 160
    assert a.invalidate(ns.seed) is not None
    for store in (a, b):
        hit = look(store, ns, tokens, [FULL, WINDOW, STATE], pin=True)
        assert hit.boundary == 0 and hit.num_blocks == 0 and all(h.lease is None for h in hit.hits)
        assert look(store, ns, tokens, [WINDOW]).boundary == 0


def test_an_epoch_the_epoch_store_does_not_vouch_for_serves_nothing(store_factory, ns, monkeypatch):
    """Scenario: every group is stored, but the epoch store cannot confirm the namespace's epoch
    (the shared tier was not reached within its bound): a miss of no epoch, counted as such."""
    store = store_factory()
    tokens = random_tokens("unconfirmed", N_BLOCKS * BLOCK_SIZE)
    for rule in (FULL, WINDOW, STATE):
        store_group(store, ns, tokens, rule, ALL)
    epoch = store.current_epoch(ns)
    monkeypatch.setattr(store.epochs, "lookup_epoch", lambda seed, since: (epoch, False))
    hit = look(store, ns, tokens, [FULL, WINDOW, STATE], pin=True)
    assert hit.boundary == 0 and all(h.epoch == 0 and h.lease is None for h in hit.hits)
    assert store.snapshot()["unconfirmed_epoch_misses"] == 1
    monkeypatch.undo()
    assert look(store, ns, tokens, [FULL, WINDOW, STATE]).boundary == 160  # the control


# ------------------------------------------------------------------------ property
def test_boundary_matches_the_spec_on_random_stores(store_factory, ns):
    """Scenario (seeded random): 60 prompts, each with random blocks stored per group, random
    rules (with or without a full group; windows of 1 to 48 tokens), lo and hi; the boundary is
    the spec's, one boundary at a time from the top (``reference``)."""
    store = store_factory(**{"l1.size": 8 << 20})
    rng = random.Random(28)
    for case in range(60):
        tokens = random_tokens(f"prop{case}", N_BLOCKS * BLOCK_SIZE)
        window = GroupRule("window", b"w", window_tokens=rng.choice([1, 15, 16, 17, 40, 48]))
        rules = [r for r in (GroupRule("full", b"f"), window, GroupRule("state", b"s")) if rng.random() < 0.7]
        rules = rules or [window]
        stored = {}
        for rule in rules:
            dense = rule.kind != "state"
            stored[rule.tag] = {i for i in ALL if rng.random() < (0.9 if dense else 0.4)}
            store_group(store, ns, tokens, rule, sorted(stored[rule.tag]))
        lo = rng.choice([0, 0, 16, 48])
        hi = rng.choice([160, 160, 150, 100])
        want = reference(stored, rules, lo, hi, len(tokens))
        hit = look(store, ns, tokens, rules, lo=lo, hi=hi)
        assert hit.boundary == want, (case, rules, stored, lo, hi)
        for rule, pos in zip(rules, hit.positions):
            assert set(pos.tolist()) <= stored[rule.tag]
            assert all(p >= lo // BLOCK_SIZE for p in pos.tolist())


def test_rules_are_checked(store_factory, ns):
    with pytest.raises(ValueError):
        GroupRule("window", b"w")
    with pytest.raises(ValueError):
        GroupRule("full", b"f", window_tokens=16)
    with pytest.raises(ValueError):
        GroupRule("mamba", b"m")  # type: ignore[arg-type]
    store = store_factory(**{"l2.enabled": False})
    with pytest.raises(ValueError):
        look(store, ns, np.arange(32), [FULL, GroupRule("state", FULL.tag)])
