"""The store's half of verified hits (``kvstrata/store/verify.py``): scratch slots for stored blocks,
the comparison with their stored copy, and what a mismatch does (deleted from every tier, hidden at
once even while pinned, counted, logged, quarantine)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvstrata.config import ConfigError, StrataConfig
from kvstrata.store import BlockStore
from kvstrata.verify.compare import segments_of
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens

SEGMENTS = segments_of(BLOCK_BYTES, 4, torch.float32)


def total(snap: dict, name: str) -> int:
    """A per-tier counter summed over the tiers (the copy compared is read from a tier chosen at
    random among those holding it)."""
    return sum(v for k, v in snap.items() if k.startswith(f"{name}_"))


def floats(seed: int, n: int) -> torch.Tensor:
    """``n`` blocks of random float32 KV, as uint8 rows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, BLOCK_BYTES // 4), generator=g).view(torch.uint8)


def stored(tmp_path, n_tokens: int = 4 * BLOCK_SIZE + 5, **overrides):
    store = BlockStore(make_config(tmp_path, {"l2.write": "through", **overrides}))
    ns = make_namespace(kv_dtype="float32")
    tokens = random_tokens("verify", n_tokens)
    epoch, chain = store.chain(ns, tokens)
    kv = floats(1, len(chain.keys))
    assert store.save_now(ns, epoch, chain, kv) == len(chain.keys)
    return store, ns, tokens, epoch, chain, kv


def fill(store: BlockStore, res, rows: torch.Tensor) -> None:
    data = store.arena.data
    for slot, row in zip(res.slots, rows):
        data[slot, : row.numel()] = row


def test_scratch_slots_for_stored_full_blocks_only(tmp_path):
    store, ns, tokens, epoch, chain, _kv = stored(tmp_path)
    longer = np.concatenate([tokens[: 4 * BLOCK_SIZE], random_tokens("more", 2 * BLOCK_SIZE)])
    _, other = store.chain(ns, longer, partial=False)
    free = store.l1.free_slots if hasattr(store.l1, "free_slots") else None
    res = store.prepare_verify(ns, epoch, other, BLOCK_BYTES)
    # the 4 stored full blocks; not the 2 unstored ones (prepare_store's), nor the stored tail
    assert [m.key for m in res.metas] == chain.keys[:4]
    assert len(set(res.slots)) == 4
    res_tail = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    assert chain.keys[4] not in [m.key for m in res_tail.metas]
    assert store.complete_verify(res_tail, SEGMENTS, success=False) == []
    store.complete_verify(res, SEGMENTS, success=False)
    if free is not None:
        assert store.l1.free_slots == free
    store.close()


def test_honest_recomputation_passes_and_keeps_the_blocks(tmp_path):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path)
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    noisy = kv[:4].view(torch.float32) * (1 + 1e-6 * torch.randn(4, BLOCK_BYTES // 4))
    fill(store, res, noisy.view(torch.uint8))
    results = store.complete_verify(res, SEGMENTS, wait=True)
    assert len(results) == 4 and all(r.ok for r in results)
    assert max(r.error for r in results) > 0  # not bit-identical, and still a match
    snap = store.snapshot()
    assert total(snap, "verify_checks") == 4 and not total(snap, "verify_mismatches")
    assert store.lookup(ns, tokens).num_blocks == len(chain.keys)
    assert store.stats()["verify"][ns.seed.hex()]["checks"] == 4
    # the scratch slots went back: a second round gets slots again, as many
    res2 = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    assert len(res2.slots) == 4
    store.complete_verify(res2, SEGMENTS, success=False)
    store.close()


def test_mismatch_deletes_the_block_from_every_tier(tmp_path, caplog):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path)
    store.flush()
    l2_files_before = store.l2.used_bytes
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    computed = kv[:4].clone()
    computed[2] = floats(99, 1)[0]  # block 2: another prompt's KV under this key
    fill(store, res, computed)
    with caplog.at_level(logging.ERROR, logger="kvstrata.store.verify"):
        results = store.complete_verify(res, SEGMENTS, wait=True)
    assert [r.ok for r in results] == [True, True, False, True]
    assert chain.keys[2].hex() in caplog.text and "MISMATCH" in caplog.text
    assert "served from l1" in caplog.text or "served from l2" in caplog.text
    snap = store.snapshot()
    assert total(snap, "verify_checks") == 4 and total(snap, "verify_mismatches") == 1
    assert store.lookup(ns, tokens).num_blocks == 2  # the chain stops at the deleted block
    assert store.l2.used_bytes < l2_files_before  # its disk copy is gone too
    assert store.stats()["verify"][ns.seed.hex()]["last_mismatch"]["key"] == chain.keys[2].hex()
    # a restarted store (the index rebuilt from L2) does not find it either
    store.close()
    again = BlockStore(make_config(tmp_path, {"l2.write": "through"}))
    again.wait_recovered(30)
    assert again.lookup(ns, tokens).num_blocks == 2
    # and the block computed again is stored again under its key
    _, chain2 = again.chain(ns, tokens)
    assert again.save_now(ns, again.current_epoch(ns), chain2, kv) >= 1
    assert again.lookup(ns, tokens).num_blocks == len(chain.keys)
    again.close()


def test_mismatch_of_a_block_served_from_disk(tmp_path):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path)
    store.flush()
    for key in chain.keys[:4]:  # out of L1: only the disk holds them
        assert store.index.claim(key, store.l1.bit)
        store.l1.delete(key)
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    computed = kv[:4].clone()
    computed[0] = floats(7, 1)[0]
    fill(store, res, computed)
    results = store.complete_verify(res, SEGMENTS, wait=True)
    assert [r.ok for r in results] == [False, True, True, True]
    snap = store.snapshot()
    assert snap["verify_checks_l2"] == 4 and snap["verify_mismatches_l2"] == 1
    assert store.lookup(ns, tokens).num_blocks == 0
    assert not snap.get("hit_blocks_l2")  # reading for a comparison serves nothing
    store.close()


def test_a_pinned_mismatching_block_is_hidden_at_once(tmp_path):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path)
    store.flush()
    reader = store.lookup(ns, tokens, pin=True)  # another request is loading it right now
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    computed = kv[:4].clone()
    computed[0] = floats(8, 1)[0]
    fill(store, res, computed)
    assert not store.complete_verify(res, SEGMENTS, wait=True)[0].ok
    assert store.lookup(ns, tokens).num_blocks == 0  # hidden although pinned
    assert not store.stored_mask(ns, epoch, chain)[0]  # and to be saved again
    slot = store.l1.slot_of(chain.keys[0])
    assert slot is not None  # the reader's slot is not taken from under it
    store.complete_load(reader)
    assert store.gc()  # then reclaimed
    assert store.l1.slot_of(chain.keys[0]) is None
    store.close()


def test_quarantine_serves_nothing_until_the_epoch_changes(tmp_path):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path, **{"verify.on_mismatch": "quarantine"})
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    computed = kv[:4].clone()
    computed[3] = floats(9, 1)[0]
    fill(store, res, computed)
    store.complete_verify(res, SEGMENTS, wait=True)
    assert store.lookup(ns, tokens).num_blocks == 0  # blocks 0-2 are fine, and still not served
    assert store.snapshot()["quarantined_misses"] >= 1
    assert store.stats()["verify"][ns.seed.hex()]["quarantined"]
    other = make_namespace(kv_dtype="float32", tenant="other")
    e2, c2 = store.chain(other, tokens)
    store.save_now(other, e2, c2, kv)
    assert store.lookup(other, tokens).num_blocks == len(c2.keys)  # other namespaces serve on
    assert store.invalidate(ns.seed) is not None  # an operator's flush lifts it
    e3, c3 = store.chain(ns, tokens)
    store.save_now(ns, e3, c3, kv)
    assert store.lookup(ns, tokens).num_blocks == len(c3.keys)
    store.close()


def test_verify_config_is_checked(tmp_path):
    cfg = make_config(tmp_path, {"verify.sample_rate": 0.5, "verify.tolerances": {"bfloat16": 0.05}})
    assert cfg.verify.sample_rate == 0.5
    for bad in ({"verify.sample_rate": 1.5}, {"verify.on_mismatch": "ignore"},
                {"verify.tolerances": {"bfloat16": 0}}, {"verify.tolerances": {"int4": 0.1}}):
        with pytest.raises(ConfigError, match="verify"):
            make_config(tmp_path, bad)
    assert StrataConfig().verify.sample_rate == 0.001


def test_tolerance_override_applies(tmp_path):
    store, ns, tokens, epoch, chain, kv = stored(tmp_path, **{"verify.tolerances": {"float32": 0.5}})
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    noisy = kv[:4].view(torch.float32) * 1.2  # 17% off: a mismatch at the default 1e-3
    fill(store, res, noisy.view(torch.uint8))
    assert all(r.ok and r.tolerance == 0.5 for r in store.complete_verify(res, SEGMENTS, wait=True))
    store.close()
