"""BlockStore behaviour: tiers, partial tails, eviction, demotion, capacity, invalidation,
async saves, truncated-key collisions, and a property test of the longest-prefix rule."""

from __future__ import annotations

import os
import itertools
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.builders import (BLOCK_BYTES, BLOCK_SIZE, assert_payloads_match, load_hit, make_config,
                            make_namespace, payload_for, payloads_for, random_tokens, store_prompt)
from kvstrata.format.block import HEADER_SIZE
from kvstrata.store import BlockStore

L1_BIT, L2_BIT = 1, 2
FILE_BYTES = HEADER_SIZE + BLOCK_BYTES


def _prompts(tag: str, count: int, length: int = BLOCK_SIZE) -> list[np.ndarray]:
    return [random_tokens(f"{tag}-{i}", length) for i in range(count)]


def _in_l1(store: BlockStore, key: bytes) -> bool:
    return store.l1.slot_of(key) is not None  # does not touch the LRU


# --------------------------------------------------------------------------- tiers
def test_put_then_load_returns_identical_bytes_from_l1(store_factory, ns):
    """Scenario: a 3-block prompt is put, looked up and loaded in the same store: every block
    comes from L1 and carries exactly the stored bytes."""
    store = store_factory()
    tokens = random_tokens("p", 3 * BLOCK_SIZE)
    chain, stored = store_prompt(store, ns, tokens)
    assert stored == 3

    hit = store.lookup(ns, tokens)
    assert hit.num_blocks == 3 and hit.num_tokens == 3 * BLOCK_SIZE
    assert all(t & L1_BIT for t in hit.tiers)
    n, out = load_hit(store, hit)
    assert n == 3
    assert_payloads_match(chain.keys, out, 3)
    assert store.counters.get("hit_blocks_l1") == 3
    assert store.counters.get("hit_blocks_l2") == 0


def test_reopened_store_serves_identical_bytes_from_l2(tmp_path, ns):
    """Scenario: store A puts a prompt (written through to disk) and closes; a new store B on the
    same l2.path finds every block on L2 only and loads identical bytes from there."""
    tokens = random_tokens("p", 4 * BLOCK_SIZE + 5)
    with BlockStore(make_config(tmp_path)) as a:
        chain, _ = store_prompt(a, ns, tokens)
    with BlockStore(make_config(tmp_path)) as b:
        hit = b.lookup(ns, tokens)
        assert hit.num_tokens == len(tokens)
        assert hit.tiers == [L2_BIT] * 5
        n, out = load_hit(b, hit)
        assert n == 5
        assert_payloads_match(chain.keys, out, 5)
        assert b.counters.get("hit_blocks_l2") == 5
        assert b.counters.get("hit_blocks_l1") == 0


def test_l2_hits_are_promoted_to_l1(tmp_path, ns):
    """Scenario: after a reopen, the first load is served by L2; the blocks are promoted, so the
    next lookup sees them in L1 and the next load counts L1 hits only."""
    tokens = random_tokens("p", 3 * BLOCK_SIZE)
    with BlockStore(make_config(tmp_path)) as a:
        chain, _ = store_prompt(a, ns, tokens)
    with BlockStore(make_config(tmp_path)) as b:
        n, _ = load_hit(b, b.lookup(ns, tokens))
        assert n == 3 and b.counters.get("hit_blocks_l2") == 3

        again = b.lookup(ns, tokens)
        assert all(t == L1_BIT | L2_BIT for t in again.tiers)
        n, out = load_hit(b, again)
        assert n == 3
        assert_payloads_match(chain.keys, out, 3)
        assert b.counters.get("hit_blocks_l1") == 3
        assert b.counters.get("hit_blocks_l2") == 3  # unchanged: second load never touched disk


# ------------------------------------------------------------------------ partial tail
def test_request_extending_stored_prompt_hits_its_partial_tail(store_factory, ns):
    """Scenario: a 100-token prompt (6 full blocks + 4-token tail) is stored; the same prompt
    plus 20 more tokens hits all 100 stored tokens, tail included; the exact prompt hits 100."""
    store = store_factory()
    tokens = random_tokens("p", 100)
    chain, stored = store_prompt(store, ns, tokens)
    assert stored == 7 and chain.lengths[-1] == 4

    longer = np.concatenate([tokens, random_tokens("more", 20)])
    hit = store.lookup(ns, longer)
    assert hit.num_tokens == 100
    assert hit.chain.keys == chain.keys
    n, out = load_hit(store, hit)
    assert n == 7
    assert_payloads_match(chain.keys, out, 7)
    assert store.lookup(ns, tokens).num_tokens == 100


def test_request_differing_inside_tail_hits_only_full_blocks(store_factory, ns):
    """Scenario: the request equals the stored 100 tokens except token 98 (inside the tail):
    only the 96 tokens of full blocks hit."""
    store = store_factory()
    tokens = random_tokens("p", 100)
    store_prompt(store, ns, tokens)
    other = tokens.copy()
    other[98] += 1
    assert store.lookup(ns, other).num_tokens == 96
    assert store.lookup(ns, np.concatenate([other, tokens[:30]])).num_tokens == 96


def test_full_blocks_do_not_depend_on_the_tail(store_factory, ns):
    """Scenario: a request sharing the stored prompt's 96 full-block tokens and then diverging
    (different tail, longer continuation) still hits 96; storing it adds only its own tail and
    reuses the 6 full blocks."""
    store = store_factory()
    tokens = random_tokens("p", 100)
    chain, _ = store_prompt(store, ns, tokens)
    diverging = np.concatenate([tokens[:96], random_tokens("x", 30)])
    hit = store.lookup(ns, diverging)
    assert hit.num_tokens == 96
    assert hit.chain.keys == chain.keys[:6]

    other_chain, stored = store_prompt(store, ns, diverging[:105])  # 6 full blocks + 9-token tail
    assert stored == 1
    assert other_chain.keys[:6] == chain.keys[:6]
    assert store.lookup(ns, diverging[:105]).num_tokens == 105
    assert store.lookup(ns, tokens).num_tokens == 100  # the first tail is still there


# ---------------------------------------------------------------------------- eviction
def test_l1_evicts_least_recently_used_first(store_factory, ns):
    """Scenario: L1 holds 48 one-block prompts, L2 is off; prompts 0-7 are touched by lookups,
    then more prompts arrive: the evicted blocks are always the least recently used ones (the
    untouched early prompts), never the touched ones or the newcomers."""
    slots = 48
    store = store_factory(**{"l1.size": slots * BLOCK_BYTES, "l2.enabled": False})
    prompts = _prompts("p", slots)
    keys = [store_prompt(store, ns, p)[0].keys[0] for p in prompts]
    assert store.l1.num_slots == slots
    for p in prompts[:8]:
        assert store.lookup(ns, p).num_blocks == 1

    recency = keys[8:] + keys[:8]  # least recently used first
    new = _prompts("new", 4)
    new_keys = [store_prompt(store, ns, p)[0].keys[0] for p in new]

    evicted = [k for k in recency if not _in_l1(store, k)]
    assert evicted, "inserting into a full L1 must evict something"
    assert evicted == recency[: len(evicted)], "an evicted block was more recent than a survivor"
    assert all(_in_l1(store, k) for k in keys[:8])
    assert all(_in_l1(store, k) for k in new_keys)
    assert store.counters.get("l1_evicted") == len(evicted)
    for p, k in zip(prompts[:8], keys[:8]):
        n, out = load_hit(store, store.lookup(ns, p))
        assert n == 1 and torch.equal(out[0], payload_for(k))


def test_pinned_blocks_survive_eviction_while_the_lease_holds(store_factory, ns):
    """Scenario: 4 of 32 L1 blocks are pinned by lookup(pin=True); 64 more blocks pass through
    L1, evicting every other original; the pinned ones stay and load intact. Once released,
    the next wave evicts them like anything else."""
    store = store_factory(**{"l1.size": 32 * BLOCK_BYTES, "l2.enabled": False})
    prompts = _prompts("p", 32)
    keys = [store_prompt(store, ns, p)[0].keys[0] for p in prompts]
    hits = [store.lookup(ns, p, pin=True) for p in prompts[:4]]
    assert all(h.lease is not None for h in hits)

    for p in _prompts("wave1", 64):
        store_prompt(store, ns, p)
    assert all(_in_l1(store, k) for k in keys[:4])
    assert not any(_in_l1(store, k) for k in keys[4:])
    for h, k in zip(hits, keys[:4]):
        n, out = load_hit(store, h)
        assert n == 1 and torch.equal(out[0], payload_for(k))

    for h in hits:
        store.complete_load(h)
    for p in _prompts("wave2", 64):
        store_prompt(store, ns, p)
    assert not any(_in_l1(store, k) for k in keys[:4])


def test_hits_dropped_without_complete_load_no_longer_protect_their_blocks(store_factory, ns):
    """Scenario: 4 blocks are looked up with pin=True and their hits dropped without
    complete_load (a holder that is gone); 4 more are pinned and their hits kept, past
    lease_seconds. The next wave of inserts evicts the dropped ones and none of the held ones
    (tests/index/test_pins.py has the rest of the rule)."""
    store = store_factory(**{"l1.size": 32 * BLOCK_BYTES, "l2.enabled": False, "lease_seconds": 0.05})
    prompts = _prompts("p", 32)
    keys = [store_prompt(store, ns, p)[0].keys[0] for p in prompts]
    for p in prompts[:4]:
        store.lookup(ns, p, pin=True)  # the hit, and with it the lease, is dropped at once
    held = [store.lookup(ns, p, pin=True) for p in prompts[4:8]]
    time.sleep(0.1)
    for p in _prompts("wave", 64):
        store_prompt(store, ns, p)
    assert not any(_in_l1(store, k) for k in keys[:4])
    assert all(_in_l1(store, k) for k in keys[4:8])
    assert store.index.pins().abandoned == 4
    for h in held:
        store.complete_load(h)


def test_load_of_unpinned_hit_evicted_before_load_reports_zero_blocks(store_factory, ns):
    """Scenario: a hit taken without a pin is evicted (L2 off) before load; load must report
    that nothing was loaded (0 blocks) rather than raise or fill the buffer with other bytes."""
    store = store_factory(**{"l1.size": 32 * BLOCK_BYTES, "l2.enabled": False})
    tokens = random_tokens("p", 2 * BLOCK_SIZE)
    chain, _ = store_prompt(store, ns, tokens)
    hit = store.lookup(ns, tokens)
    assert hit.num_blocks == 2
    for p in _prompts("wave", 64):
        store_prompt(store, ns, p)
    assert not any(_in_l1(store, k) for k in chain.keys)

    out = torch.zeros((2, BLOCK_BYTES), dtype=torch.uint8)
    assert store.load_into(hit, out) == 0


# ---------------------------------------------------------------------------- demotion
def test_on_evict_demotes_evicted_blocks_to_l2(store_factory, ns):
    """Scenario: l2.write is on_evict and L1 holds 32 blocks; 64 one-block prompts are put.
    Blocks still in L1 have no file; every evicted block has one, and all 64 look up and load
    correctly (also from a freshly opened store for the demoted ones)."""
    cfg = {"l1.size": 32 * BLOCK_BYTES, "l2.write": "on_evict"}
    store = store_factory(**cfg)
    prompts = _prompts("p", 64)
    keys = [store_prompt(store, ns, p)[0].keys[0] for p in prompts]

    in_l1 = {k for k in keys if _in_l1(store, k)}
    demoted = [k for k in keys if k not in in_l1]
    assert demoted and store.counters.get("l1_demoted") == len(demoted)
    assert all(store.l2.path(k).is_file() for k in demoted)
    assert not any(store.l2.path(k).exists() for k in in_l1)

    fresh = store_factory(**cfg)
    for p, k in zip(prompts, keys):
        if k in in_l1:
            continue
        n, out = load_hit(fresh, fresh.lookup(ns, p))
        assert n == 1 and torch.equal(out[0], payload_for(k))
    for p, k in zip(prompts, keys):
        n, out = load_hit(store, store.lookup(ns, p))
        assert n == 1 and torch.equal(out[0], payload_for(k))


def test_write_through_puts_every_saved_block_on_l2_after_flush(store_factory, ns):
    """Scenario: l2.write is through; three prompts (with partial tails) are saved
    asynchronously; after flush() every block has a file and the index marks it on L2."""
    store = store_factory(**{"l2.write": "through"})
    chains = []
    for i, length in enumerate((40, 64, 17)):
        epoch, chain = store.chain(ns, random_tokens(f"p{i}", length))
        assert store.save(ns, epoch, chain, payloads_for(chain))
        chains.append(chain)
    assert store.flush(timeout=10)
    for chain in chains:
        for key in chain.keys:
            assert store.l2.path(key).is_file()
        rows = store.index.rows_of(chain.keys)
        assert all(int(t) & L2_BIT for t in store.index.tiers_of(rows))


# ------------------------------------------------------------------------- L2 capacity
def test_l2_capacity_bound_holds_and_least_recently_used_go_first(store_factory, ns):
    """Scenario: L2 holds 40 block files; 80 one-block prompts are written through while prompt
    0 is looked up again and again. After every put the tier's bytes (counted and on disk) stay
    within capacity; the blocks that left L2 are always the least recently used ones and the
    frequently used prompt 0 is never among them."""
    capacity = 40 * FILE_BYTES
    store = store_factory(**{"l2.size": capacity})
    prompts = _prompts("p", 80)
    recency: list[bytes] = []  # least recently used first
    key0 = b""
    for i, p in enumerate(prompts):
        key = store_prompt(store, ns, p)[0].keys[0]
        recency.append(key)
        key0 = key0 or key
        if i % 5 == 4:
            assert store.lookup(ns, prompts[0]).num_blocks == 1
            recency.remove(key0)
            recency.append(key0)
        on_disk = sum(f.stat().st_size for f in store.l2.root.rglob("*.kvb"))
        assert store.l2.used_bytes <= capacity
        assert on_disk <= capacity

    gone = [k for k in recency if not store.l2.path(k).exists()]
    assert gone, "80 blocks cannot fit in 40 slots"
    assert gone == recency[: len(gone)], "a block left L2 while an older one stayed"
    assert store.l2.path(recency[-1]).exists()
    assert store.counters.get("l2_evicted") == len(gone)


def test_l2_capacity_bound_holds_after_one_prompt_larger_than_l2(store_factory, ns):
    """Scenario: L2 holds 4 block files and a single 10-block prompt is written through in one
    put; once put returns, the tier's bytes must not exceed its capacity."""
    capacity = 4 * FILE_BYTES
    store = store_factory(**{"l2.size": capacity})
    store_prompt(store, ns, random_tokens("p", 10 * BLOCK_SIZE))
    on_disk = sum(f.stat().st_size for f in store.l2.root.rglob("*.kvb"))
    assert store.l2.used_bytes <= capacity
    assert on_disk <= capacity


def test_recovered_blocks_leave_l2_oldest_first(tmp_path, ns):
    """Scenario: 1100 one-block prompts are on disk with increasing mtimes (more than the index's
    initial 1024 rows); a store reopens the folder with room for 1000 blocks (its recovery trims
    the excess) and writes one more block, which forces another L2 eviction: the blocks that go
    are the oldest files, never newer ones."""
    size = 32
    file_bytes = HEADER_SIZE + size
    prompts = _prompts("r", 1100)
    with BlockStore(make_config(tmp_path, **{"l1.size": 2000 * size})) as a:
        keys = [store_prompt(a, ns, p, size)[0].keys[0] for p in prompts]
        for i, key in enumerate(keys):
            os.utime(a.l2.path(key), (1_000_000 + i, 1_000_000 + i))
    with BlockStore(make_config(tmp_path, **{"l1.size": 2000 * size,
                                             "l2.size": 1000 * file_bytes})) as b:
        assert b.wait_recovered(30)  # the background scan files the recovered blocks by mtime
        assert len(b.index) == 1000  # and then trims the folder to the lowered l2.size
        store_prompt(b, ns, random_tokens("new", BLOCK_SIZE), size)
        assert b.l2.used_bytes <= 1000 * file_bytes
        gone = [i for i, k in enumerate(keys) if not b.l2.path(k).exists()]
        assert len(gone) >= 101
        assert gone == list(range(len(gone))), f"newer files evicted first: {gone[:5]}..."


# ------------------------------------------------------------------------ invalidation
def test_invalidate_hides_blocks_at_once_and_new_saves_hit_again(store_factory, ns):
    """Scenario: a stored prompt hits; invalidate(ns.seed) bumps the epoch and the very next
    lookup hits nothing; saving the prompt again under the new epoch makes it hit again."""
    store = store_factory()
    tokens = random_tokens("p", 50)
    store_prompt(store, ns, tokens)
    assert store.lookup(ns, tokens).num_tokens == 50

    before = store.current_epoch(ns)
    after = store.invalidate(ns.seed)
    assert after != before and store.current_epoch(ns) == after
    assert store.lookup(ns, tokens).num_blocks == 0

    chain, stored = store_prompt(store, ns, tokens)
    assert stored == 4
    hit = store.lookup(ns, tokens)
    assert hit.num_tokens == 50 and hit.epoch == after
    n, out = load_hit(store, hit)
    assert n == 4
    assert_payloads_match(chain.keys, out, 4)


def test_invalidate_is_seen_by_another_store_on_the_same_folder(store_factory, ns):
    """Scenario: stores A and B share one L2 folder and both hit a prompt; A invalidates; B's
    next lookup hits 0 blocks although B's own index still holds the old entries; after A saves
    again, B hits again (adopting the new epoch's blocks from disk)."""
    a, b = store_factory(), store_factory()
    tokens = random_tokens("p", 40)
    store_prompt(a, ns, tokens)
    assert b.lookup(ns, tokens).num_tokens == 40

    new = a.invalidate(ns.seed)
    assert b.lookup(ns, tokens).num_blocks == 0
    assert b.lookup(ns, tokens[:16]).num_blocks == 0

    chain, _ = store_prompt(a, ns, tokens)
    hit = b.lookup(ns, tokens)
    assert hit.num_tokens == 40 and hit.epoch == new
    n, out = load_hit(b, hit)
    assert n == 3
    assert_payloads_match(chain.keys, out, 3)


def test_invalidate_gc_removes_old_epoch_files(store_factory, ns):
    """Scenario: a prompt with a partial tail is written through; invalidate() runs GC, which
    deletes every old-epoch block file and the tail marker; the other namespace is untouched."""
    store = store_factory()
    other_ns = make_namespace(model_version="v2")
    chain, _ = store_prompt(store, ns, random_tokens("p", 40))
    other, _ = store_prompt(store, other_ns, random_tokens("p", 40))
    files = [store.l2.path(k) for k in chain.keys]
    assert all(f.is_file() for f in files)
    assert store.l2.tail_lengths(chain.parents[-1]) == [8]

    store.invalidate(ns.seed)
    assert not any(f.exists() for f in files)
    assert store.l2.tail_lengths(chain.parents[-1]) == []
    assert all(store.l2.path(k).is_file() for k in other.keys)
    assert store.counters.get("gc_removed") >= len(chain.keys)


def test_gc_of_another_instance_removes_recovered_old_epoch_files(tmp_path, ns):
    """Scenario: C opens the folder first (so its index never learns the blocks); A stores a
    prompt and closes; B reopens the folder, recovering the blocks; C bumps the epoch (its own
    GC has nothing to remove); B.gc() then deletes the now-stale files it recovered."""
    with BlockStore(make_config(tmp_path)) as c:
        assert c.wait_recovered(30)  # its scan is over before A writes, or it could learn them
        with BlockStore(make_config(tmp_path)) as a:
            chain, _ = store_prompt(a, ns, random_tokens("p", 48))
        with BlockStore(make_config(tmp_path)) as b:
            assert b.wait_recovered(30)
            assert len(b.index) == 3
            c.invalidate(ns.seed)
            assert all(b.l2.path(k).is_file() for k in chain.keys)  # C never knew them
            assert b.lookup(ns, random_tokens("p", 48)).num_blocks == 0
            removed = b.gc()
            assert removed.get("l2") == 3
            assert not any(b.l2.path(k).exists() for k in chain.keys)
            assert len(b.index) == 0


# -------------------------------------------------------------------------- async save
def test_save_returns_immediately_and_on_done_reports_count(store_factory, ns):
    """Scenario: the saver thread is held inside a first save's on_done; a second save still
    returns True at once; when released, on_done reports 3 stored blocks for the first, 2 for
    the second, and 0 for a repeat of an already stored chain."""
    store = store_factory()
    entered, release = threading.Event(), threading.Event()
    done: list[tuple[str, int]] = []

    def blocker(n: int) -> None:
        done.append(("first", n))
        entered.set()
        release.wait(10)

    e1, c1 = store.chain(ns, random_tokens("a", 48))
    e2, c2 = store.chain(ns, random_tokens("b", 20))
    assert store.save(ns, e1, c1, payloads_for(c1), on_done=blocker)
    assert entered.wait(10)
    t0 = time.monotonic()
    assert store.save(ns, e2, c2, payloads_for(c2), on_done=lambda n: done.append(("second", n)))
    assert store.save(ns, e1, c1, payloads_for(c1), on_done=lambda n: done.append(("repeat", n)))
    assert time.monotonic() - t0 < 0.5
    assert done == [("first", 3)]  # the others are still queued behind the blocked job

    release.set()
    assert store.flush(timeout=10)
    assert done == [("first", 3), ("second", 2), ("repeat", 0)]
    assert store.lookup(ns, random_tokens("b", 20)).num_tokens == 20


def test_failed_save_job_still_calls_on_done_with_zero(store_factory, ns, caplog):
    """Scenario: a save whose job raises (here: payloads for 1 block of a 3-block chain). The
    engine holds its buffers until on_done: it must hear back, once, with 0 stored, and the
    error is logged with its traceback. Before, the one payload row was broadcast into all
    three slots and stored as the bytes of blocks 1 and 2 (wrong KV); and a job that raised
    never called on_done."""
    store = store_factory()
    epoch, chain = store.chain(ns, random_tokens("short", 48))
    done: list[int] = []
    assert store.save(ns, epoch, chain, payloads_for(chain)[:1], on_done=done.append)
    assert store.flush(timeout=10)
    assert done == [0]
    assert "save failed" in caplog.text
    assert store.lookup(ns, random_tokens("short", 48)).num_blocks == 0


def test_save_is_refused_and_counted_when_the_queue_is_full(store_factory, ns):
    """Scenario: saves.queue_blocks is 2 and a 2-block save is stuck in on_done; a further save
    returns False immediately, counts its blocks in saves_dropped, and is never stored."""
    store = store_factory(**{"saves.queue_blocks": 2})
    entered, release = threading.Event(), threading.Event()
    e1, c1 = store.chain(ns, random_tokens("a", 32))
    assert store.save(ns, e1, c1, payloads_for(c1),
                      on_done=lambda n: (entered.set(), release.wait(10)))
    assert entered.wait(10)

    dropped_tokens = random_tokens("b", 24)
    e2, c2 = store.chain(ns, dropped_tokens)
    t0 = time.monotonic()
    assert store.save(ns, e2, c2, payloads_for(c2)) is False
    assert time.monotonic() - t0 < 0.5
    assert store.counters.get("saves_dropped") == 2

    release.set()
    assert store.flush(timeout=10)
    assert store.lookup(ns, dropped_tokens).num_blocks == 0
    assert store.lookup(ns, random_tokens("a", 32)).num_blocks == 2


# -------------------------------------------------------------------------- collisions
def test_truncated_key_collisions_never_serve_another_prompts_bytes(tmp_path, ns):
    """Scenario: the index keys on 16 bits (``key_bits=16``); two stores sharing one disk tier each put 1500 distinct
    one-block prompts (3000 in all), then a fresh store recovers the folder. In all three,
    every lookup either misses or loads exactly that prompt's own payload, and collisions really
    happened (some prompt that was put is not found)."""
    size = 32
    cfg = make_config(tmp_path, **{"l1.size": 4000 * size})
    prompts = _prompts("c", 3000)
    a, b = BlockStore(cfg, key_bits=16), BlockStore(cfg, key_bits=16)
    try:
        keys = []
        for i, p in enumerate(prompts):
            chain, _ = store_prompt(a if i % 2 else b, ns, p, size)
            keys.append(chain.keys[0])
        assert len(set(k[:2] for k in keys)) < len(keys), "no 16-bit collision among the keys"
        with BlockStore(cfg, key_bits=16) as fresh:
            for store in (a, b, fresh):
                misses = 0
                for p, key in zip(prompts, keys):
                    hit = store.lookup(ns, p)
                    if hit.num_blocks == 0:
                        misses += 1
                        continue
                    assert hit.chain.keys == [key]
                    n, out = load_hit(store, hit, size)
                    assert n == 1
                    assert torch.equal(out[0], payload_for(key, size))
                assert misses > 0, "collisions must make some stored prompt miss"
    finally:
        a.close()
        b.close()


def _colliding_prompts(store: BlockStore, ns, bits: int) -> tuple[np.ndarray, np.ndarray]:
    seen: dict[bytes, np.ndarray] = {}
    for i in range(100_000):
        p = random_tokens(f"coll-{i}", BLOCK_SIZE)
        key = store.chain(ns, p)[1].keys[0][: bits // 8]
        if key in seen:
            return seen[key], p
        seen[key] = p
    raise AssertionError("no collision found")


def test_load_never_serves_a_colliding_block_that_replaced_the_hit(store_factory, ns):
    """Scenario: key_bits is 16; X is looked up (no pin), then evicted by other prompts, then Y,
    whose truncated key equals X's, is stored. Loading the old hit must not fill the buffer with
    Y's bytes: it either loads nothing or X's own payload."""
    store = store_factory(key_bits=16, **{"l1.size": 32 * BLOCK_BYTES, "l2.enabled": False})
    x, y = _colliding_prompts(store, ns, 16)
    x_chain, _ = store_prompt(store, ns, x)
    hit = store.lookup(ns, x)
    assert hit.num_blocks == 1
    for p in _prompts("wave", 40):
        store_prompt(store, ns, p)
    assert not _in_l1(store, x_chain.keys[0])
    y_chain, stored = store_prompt(store, ns, y)
    assert stored == 1

    out = torch.zeros((1, BLOCK_BYTES), dtype=torch.uint8)
    n = store.load_into(hit, out)
    assert not torch.equal(out[0], payload_for(y_chain.keys[0])), "served Y's bytes for X"
    assert n == 0 or torch.equal(out[0], payload_for(x_chain.keys[0]))


# ------------------------------------------------------------------------ property test
def _expected_hit(stored: list[list[int]], query: list[int], bs: int) -> int:
    """Reference model: longest run of stored full blocks, then the longest stored partial
    block (fewer than bs tokens) that follows that run and begins the rest of the query."""
    full: set[tuple[int, ...]] = set()
    tails: set[tuple[int, ...]] = set()
    for s in stored:
        for k in range(1, len(s) // bs + 1):
            full.add(tuple(s[: k * bs]))
        if len(s) % bs:
            tails.add(tuple(s))
    n = 0
    while (n + 1) * bs <= len(query) and tuple(query[: (n + 1) * bs]) in full:
        n += 1
    query_blocks = -(-len(query) // bs)
    if n == query_blocks:
        return n * bs
    best = 0
    for t in range(1, bs):
        if n * bs + t <= len(query) and tuple(query[: n * bs + t]) in tails:
            best = t
    return n * bs + best


_SMALL_BS = 4
_tok = st.integers(0, 2)
_pieces = st.tuples(st.integers(0, 24), st.lists(_tok, max_size=9))
_example_ids = itertools.count()


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory):
    """A writer and a reader store on one folder, both opened before any example writes.

    Opening a store costs ~256 mkdir calls, so the examples share the pair and stay
    independent by each using a namespace of its own."""
    cfg = make_config(tmp_path_factory.mktemp("prop"), **{"l1.size": 16 << 20})
    reader, writer = BlockStore(cfg), BlockStore(cfg)
    yield writer, reader
    writer.close()
    reader.close()


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(base=st.lists(_tok, min_size=24, max_size=24),
       stored=st.lists(_pieces, min_size=1, max_size=5),
       queries=st.lists(_pieces, min_size=1, max_size=6))
def test_lookup_hits_the_longest_stored_prefix(shared_pair, base, stored, queries):
    """Scenario (property): sequences built from shared prefixes of one base sequence plus short
    random suffixes over a 3-token vocabulary (block size 4) are stored; for every query, both
    the writing store and a second store opened on the same folder before the writes (which
    discovers blocks and tail markers on disk) hit exactly the longest stored prefix that the
    reference model computes (full blocks first, then at most one partial tail)."""
    writer, reader = shared_pair
    ns = make_namespace(block_size=_SMALL_BS, model_version=f"example-{next(_example_ids)}")
    stored_seqs = [base[:cut] + suffix for cut, suffix in stored]
    query_seqs = [base[:cut] + suffix for cut, suffix in queries] + stored_seqs
    for s in stored_seqs:
        epoch, chain = writer.chain(ns, s)
        writer.save_now(ns, epoch, chain, payloads_for(chain, 64))
    for q in query_seqs:
        want = _expected_hit(stored_seqs, q, _SMALL_BS)
        event("miss" if not want else "ends in a partial tail" if want % _SMALL_BS
              else "full blocks only")
        for store in (writer, reader):
            hit = store.lookup(ns, q)
            assert hit.num_tokens == want, (q, store is reader)
            n, out = load_hit(store, hit, 64)
            assert n == hit.num_blocks
            assert_payloads_match(hit.chain.keys, out, n, 64)
    # the reference model assumes nothing is ever evicted
    assert writer.counters.get("l1_evicted") == reader.counters.get("l1_evicted") == 0


def test_arena_prefaulter_tops_up_only_when_half_of_the_headroom_is_used(tmp_path, monkeypatch):
    """Pages are mapped ahead of the slots in use, in large top-ups: never a little on every new
    slot, which would put page population inside the request that uses the slot."""
    import time

    from kvstrata.worker.arena import Prefaulter, create_shared_arena

    monkeypatch.setattr(Prefaulter, "AHEAD", 8 << 20)
    monkeypatch.setattr(Prefaulter, "CHUNK", 1 << 20)
    arena, pre = create_shared_arena(str(tmp_path / "arena"), 64, 1 << 20)  # 64 MiB
    assert pre._target == 8 << 20
    pre.ahead_of(3 << 20)  # 5 MiB still mapped ahead: more than half of AHEAD
    assert pre._target == 8 << 20
    pre.ahead_of(5 << 20)  # 3 MiB left: top up to 8 MiB beyond the offset
    assert pre._target == 13 << 20
    pre.ahead_of(100 << 20)  # never beyond the arena
    assert pre._target == 64 << 20
    deadline = time.monotonic() + 10
    while pre._done < pre._target and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pre._done == 64 << 20
    arena[63].fill_(1)  # still an ordinary, writable mapping
    assert int(arena[63].sum()) == 1 << 20
