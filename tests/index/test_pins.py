"""Pins and their holders: a pin the engine holds lasts until the engine gives
it back, however slow the copy under it; only a pin whose holder is gone (its ``Lease`` dropped)
stops protecting its blocks. ``tests/engines/test_vllm_pins.py`` shows the same through vLLM."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from tests.builders import BLOCK_BYTES, BLOCK_SIZE, load_hit, payload_for, random_tokens, store_prompt
from kvstrata.index import BlockIndex, EntryMeta
from kvstrata.keys import chain_keys, root_key

NS_SEED = b"n" * 16


def _index_with(n_blocks: int, lease_s: float) -> tuple[BlockIndex, list[bytes], list[int]]:
    index = BlockIndex(lease_s=lease_s, capacity=4)
    chain = chain_keys(root_key(NS_SEED, 1), np.arange(16 * n_blocks, dtype=np.uint32), 16)
    metas = [EntryMeta(k, p, f, n, NS_SEED, 1, 64, 1) for k, p, f, n in zip(*chain)]
    rows = index.commit_many(metas, 1)
    return index, chain.keys, rows  # type: ignore[return-value]


def _in_l1(store, key: bytes) -> bool:
    return store.l1.slot_of(key) is not None


def test_a_pin_held_past_its_lease_keeps_its_rows_from_claims_and_reuse():
    """Scenario: an index with lease_s 0.05 pins 2 of 4 rows and the holder keeps the lease for
    0.15 s; the pinned rows are then neither victims nor claimable, and new blocks committed after
    every unpinned row was evicted never take a pinned row."""
    index, keys, rows = _index_with(4, lease_s=0.05)
    _, lease = index.pin_keys(keys[:2])
    time.sleep(0.15)
    assert set(index.lru_victims(1, 10)) == set(rows[2:])
    assert not index.claim(keys[0], 1) and index.claim(keys[2], 1) and index.claim(keys[3], 1)
    others = chain_keys(root_key(NS_SEED, 1), np.arange(1000, 1000 + 16 * 8, dtype=np.uint32), 16)
    new_rows = index.commit_many([EntryMeta(k, p, f, n, NS_SEED, 1, 64, 1) for k, p, f, n in zip(*others)], 1)
    assert not set(new_rows) & set(rows[:2])
    assert [m.key for m in index.metas(np.array(rows[:2]), keys[:2])] == keys[:2]  # type: ignore[union-attr]
    index.unpin(lease)
    assert index.claim(keys[0], 1)


def test_a_pinned_slot_keeps_its_blocks_bytes_under_a_copy_slower_than_the_lease(store_factory, ns):
    """Scenario (the finding): lease_seconds is 0.05, L1 holds 8 blocks, no L2. A 3-block prompt is
    looked up with pin=True and its L1 slots read, as vLLM's scheduler does for a load op; the
    copy out of them takes longer than the lease (0.15 s pass), while 30 two-block prompts are
    saved (L1 turns over 7 times). The pinned slots still hold the blocks' own bytes (with an
    expiring lease they were refilled with other blocks), and a load of the hit returns them.
    Given back, the blocks are evicted like any other."""
    store = store_factory(**{"l1.size": 8 * BLOCK_BYTES, "l2.enabled": False, "lease_seconds": 0.05})
    tokens = random_tokens("pinned", 3 * BLOCK_SIZE)
    chain, _ = store_prompt(store, ns, tokens)
    hit = store.lookup(ns, tokens, pin=True)
    slots = store.arena.slots(hit)
    assert hit.num_blocks == 3 and None not in slots
    time.sleep(0.15)
    for i in range(30):
        store_prompt(store, ns, random_tokens(f"other{i}", 2 * BLOCK_SIZE))
    data = store.arena.data
    assert data is not None
    for slot, key in zip(slots, chain.keys):
        assert torch.equal(data[slot, :BLOCK_BYTES], payload_for(key)), "a pinned slot was refilled with another block"
    n, out = load_hit(store, hit)
    assert n == 3 and all(torch.equal(out[i], payload_for(k)) for i, k in enumerate(chain.keys))

    store.complete_load(hit)
    for i in range(8):
        store_prompt(store, ns, random_tokens(f"after{i}", BLOCK_SIZE))
    assert not any(_in_l1(store, k) for k in chain.keys)


def test_a_caller_that_raises_between_pin_and_unpin_does_not_pin_forever(store_factory, ns):
    """Scenario: a caller looks up with pin=True and raises before complete_load (no finally);
    once the exception is handled, its blocks are evicted by the next wave of saves like any
    unpinned block, well within the default lease_seconds (60 s)."""
    store = store_factory(**{"l1.size": 8 * BLOCK_BYTES, "l2.enabled": False})
    tokens = random_tokens("raiser", 2 * BLOCK_SIZE)
    chain, _ = store_prompt(store, ns, tokens)

    def careless() -> None:
        hit = store.lookup(ns, tokens, pin=True)
        assert hit.lease is not None
        raise RuntimeError("the caller failed before complete_load")

    try:
        careless()
    except RuntimeError:
        pass
    for i in range(8):
        store_prompt(store, ns, random_tokens(f"wave{i}", BLOCK_SIZE))
    assert not any(_in_l1(store, k) for k in chain.keys)
    assert store.index.pins() == (0, 0.0, 1, 0)


def test_pins_of_a_thread_that_died_are_released(store_factory, ns, monkeypatch):
    """Scenario: a thread pins a hit and dies of an exception with it; the blocks are evicted by
    the next wave, while a hit the main thread holds across the same wave is not."""
    # pytest's own hook keeps the exception, and so the thread's frames; the default one does not
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    store = store_factory(**{"l1.size": 8 * BLOCK_BYTES, "l2.enabled": False})
    dead, alive = random_tokens("dead", 2 * BLOCK_SIZE), random_tokens("alive", 2 * BLOCK_SIZE)
    dead_chain, _ = store_prompt(store, ns, dead)
    alive_chain, _ = store_prompt(store, ns, alive)
    held = store.lookup(ns, alive, pin=True)

    def worker() -> None:
        hit = store.lookup(ns, dead, pin=True)
        assert hit.num_blocks == 2
        raise RuntimeError("the thread dies here, its hit with it")

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    gc.collect()  # a cycle through the thread's frame, if any
    for i in range(8):
        store_prompt(store, ns, random_tokens(f"wave{i}", BLOCK_SIZE))
    assert not any(_in_l1(store, k) for k in dead_chain.keys)
    assert all(_in_l1(store, k) for k in alive_chain.keys)
    store.complete_load(held)


def test_a_lease_cannot_be_copied_pickled_or_given_back_twice_or_elsewhere():
    """Scenario: a copy of a lease, once collected, would release the pin its original holds; so
    copy, deepcopy and pickle refuse, and the pin stays. Given back to another index (whose
    lease of the same id it is not) or twice, it releases nothing more."""
    index, keys, rows = _index_with(2, lease_s=60)
    _, lease = index.pin_keys(keys)
    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="owner token"):
            attempt(lease)
    gc.collect()
    assert index.lru_victims(1, 10) == []
    other, other_keys, _ = _index_with(2, lease_s=60)
    _, foreign = other.pin_keys(other_keys)  # the same lease id, in another index
    assert foreign.id == lease.id
    index.unpin(foreign)  # not this index's: nothing is released
    assert index.lru_victims(1, 10) == []
    index.unpin(lease)
    index.unpin(lease)  # a second give-back does nothing
    other.unpin(foreign)
    assert sorted(index.lru_victims(1, 10)) == sorted(rows)
    assert index.pins().abandoned == 0


def test_a_pin_held_past_lease_seconds_is_logged_once_and_kept(caplog):
    """Scenario: lease_s 0.05; a pin held 0.1 s is reported as overdue by the next index call
    (a warning, once), and stays until it is given back."""
    index, keys, rows = _index_with(3, lease_s=0.05)
    _, lease = index.pin_keys(keys[:1])
    time.sleep(0.1)
    with caplog.at_level(logging.DEBUG, logger="kvstrata.index.blockindex"):
        assert rows[0] not in index.lru_victims(1, 10)
        index._next_audit = 0.0  # audits are at most once a second: force the next one
        assert rows[0] not in index.lru_victims(1, 10)
    overdue = [r for r in caplog.records if "has been held" in r.getMessage()]
    assert [r.levelno for r in overdue] == [logging.WARNING]
    census = index.pins()
    assert census.held == 1 and census.oldest_s >= 0.1 and census.overdue == 1
    index.unpin(lease)
    assert rows[0] in index.lru_victims(1, 10)


def test_pins_held_and_dropped_from_many_threads_all_end_released(store_factory, ns):
    """Scenario: four threads look up with pin=True for 2 s while two save; each hit is given back,
    or dropped (its holder gone), at random, some across a sleep longer than lease_seconds. Every
    load returns its blocks' own bytes, and at the end no pin is left: every row's pin count is
    zero, each lease released exactly once."""
    store = store_factory(**{"l1.size": 12 * BLOCK_BYTES, "l2.enabled": False, "lease_seconds": 0.01})
    prompts = [random_tokens(f"p{i}", BLOCK_SIZE * (1 + i % 3)) for i in range(24)]
    stop = time.monotonic() + 2.0
    errors: list[str] = []
    wrong = [0]

    def saver(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while time.monotonic() < stop:
            store_prompt(store, ns, prompts[rng.integers(len(prompts))])

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while time.monotonic() < stop:
            hit = store.lookup(ns, prompts[rng.integers(len(prompts))], pin=True)
            slots = store.arena.slots(hit)
            if rng.random() < 0.2:
                time.sleep(0.02)  # a copy slower than the lease
            data = store.arena.data
            for slot, key in zip(slots, hit.chain.keys):
                if slot is not None and data is not None and not torch.equal(data[slot, :BLOCK_BYTES], payload_for(key)):
                    wrong[0] += 1
            if rng.random() < 0.5:
                store.complete_load(hit)
            del hit  # given back or dropped

    def guard(fn, seed: int) -> None:
        try:
            fn(seed)
        except Exception as e:  # noqa: BLE001 - anything raised from the store is a finding
            errors.append(repr(e))

    threads = [threading.Thread(target=guard, args=(saver, i)) for i in range(2)]
    threads += [threading.Thread(target=guard, args=(reader, 10 + i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert wrong[0] == 0, f"{wrong[0]} pinned slots held another block's bytes"
    gc.collect()
    census = store.index.pins()  # reaps what was dropped last
    assert census.held == 0 and census.abandoned > 0
    assert int(store.index._pins.sum()) == 0
