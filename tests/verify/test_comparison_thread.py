"""Verified hits never wait on a tier on the engine's thread (``store/verify.py``): the comparison
(reading the stored copy, deleting a mismatch from every tier, the verification record) runs on the
store's comparison thread, bounded by ``verify.queue_blocks``; past the bound a verification is
skipped and counted (``verify_skipped``).

Before, ``complete_verify`` did all of it on its caller's thread, which is vLLM's scheduler
(``pending.Ops.report``, from ``update_connector_output``) and SGLang's storage calls: a hung
shared tier hung the engine's step for the tier's timeout at each call.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstrata.config import load_config
from kvstrata.store import BlockStore
from kvstrata.verify.compare import segments_of
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens
from tests.harness import redisutil

SEGMENTS = segments_of(BLOCK_BYTES, 4, torch.float32)
TIMEOUT_S = 1.0  # remote.timeout_ms: what one call to a hung Redis costs
STEP_S = 0.25  # the most a scheduler-side call may take here (a loaded 2-core machine)


def floats(seed: int, n: int) -> torch.Tensor:
    return torch.randn((n, BLOCK_BYTES // 4), generator=torch.Generator().manual_seed(seed)).view(torch.uint8)


def total(snap: dict, name: str) -> int:
    return sum(v for k, v in snap.items() if k.startswith(f"{name}_"))


def fill(store: BlockStore, res, rows: torch.Tensor) -> None:
    for slot, row in zip(res.slots, rows):
        store.arena.data[slot, : row.numel()] = row


def test_a_full_queue_skips_and_counts_and_never_waits(tmp_path, monkeypatch):
    """Scenario: the comparison thread is held up (its tier reads block); verifications beyond
    ``verify.queue_blocks`` waiting are refused at once, their slots given back, and counted."""
    store = BlockStore(make_config(tmp_path, {"verify.queue_blocks": 4}))
    ns = make_namespace(kv_dtype="float32")
    tokens = random_tokens("queue", 4 * BLOCK_SIZE)
    epoch, chain = store.chain(ns, tokens)
    kv = floats(1, 4)
    assert store.save_now(ns, epoch, chain, kv) == 4
    free = len(store.l1._free)

    release = threading.Event()
    for tier in store.tiers:  # whichever holds the copy the comparison reads
        monkeypatch.setattr(tier, "read", lambda meta, out, read=tier.read: release.wait(30) and read(meta, out))
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    fill(store, res, kv)
    store.complete_verify(res, SEGMENTS)  # 4 blocks: the bound, taken by the thread
    extra = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
    fill(store, extra, kv)
    started = time.monotonic()
    assert store.complete_verify(extra, SEGMENTS) == []
    assert time.monotonic() - started < STEP_S
    assert store.snapshot()["verify_skipped"] == 4
    assert not store.wait_verified(0.2)  # the first one is still waiting for its reads
    release.set()
    assert store.wait_verified(30)
    assert total(store.snapshot(), "verify_checks") == 4
    assert len(store.l1._free) == free  # every scratch slot went back
    store.close()


# ------------------------------------------------------------- a hung Redis, behind a real proxy
def open_store(tmp_path, url: str) -> BlockStore:
    return BlockStore(load_config(None, {
        "l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(tmp_path / "l2"), "l2.write": "through",
        "remote.enabled": True, "remote.url": url, "remote.timeout_ms": int(TIMEOUT_S * 1000),
        "remote.invalidation_ms": 20, "remote.confirm_margin_ms": 100,
        "remote.breaker.failures": 1000,  # never open: every call to the hung tier costs its timeout
        "verify.queue_blocks": 8}))


@pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")
def test_a_hung_shared_tier_delays_no_scheduler_step(tmp_path, redis_url):  # redis_url: tests/conftest.py
    """Scenario: the shared tier (real Redis through ``FaultyProxy``) hangs while verifications
    are settled the way vLLM's scheduler settles them (``pending.Ops.verify``, then every writer's
    ``Ops.report`` in ``update_connector_output``): the first has a mismatch, whose deletion from
    the shared tier and verification record hang. No report call takes more than ``STEP_S``
    (a call to the hung tier costs ``TIMEOUT_S``); the comparison thread is the one that waits; a
    verification beyond ``verify.queue_blocks`` is skipped and counted. When Redis answers
    again everything queued is compared. The same comparison on the caller's thread (what the
    scheduler did before) waits for the tier."""
    pytest.importorskip("vllm")
    from kvstrata.adapters.vllm.pending import Ops
    from kvstrata.tools.torture.faults import FaultyProxy

    ns = make_namespace(kv_dtype="float32")
    tokens = random_tokens("hung", 4 * BLOCK_SIZE)
    kv = floats(1, 4)
    wrong = kv.clone()
    wrong[0] = floats(99, 1)[0]  # block 0: another prompt's KV under its key
    with FaultyProxy(redis_url) as proxy, open_store(tmp_path, proxy.url) as store:
        epoch, chain = store.chain(ns, tokens)
        assert store.save_now(ns, epoch, chain, kv) == 4
        assert store.flush(30)
        ops = Ops(store, None, 1, frozenset({0}), (tuple(SEGMENTS),))  # type: ignore[arg-type]
        proxy.set_mode("hang")
        steps = []
        for computed in (wrong, kv, kv):  # 4 blocks each: the first two fill the queue's 8
            res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
            fill(store, res, computed[: len(res.slots)])
            ops.verify("req", res, list(range(len(res.slots))))
            (op,) = ops.take()[1]
            started = time.monotonic()
            ops.report(op.op_id, 0, True)  # every writer has copied: the comparison is due
            steps.append(time.monotonic() - started)
        print(f"scheduler-side report calls while Redis hangs: {[round(s * 1000, 1) for s in steps]} ms "
              f"(a call to the hung tier: {TIMEOUT_S * 1000:.0f} ms)")
        assert max(steps) < STEP_S, steps
        assert not store.wait_verified(0.3)  # the comparison thread waits on the tier
        assert store.snapshot().get("verify_skipped") == 4  # the third: beyond the 8 blocks waiting
        proxy.set_mode("pass")
        assert store.wait_verified(60)
        snap = store.snapshot()
        assert total(snap, "verify_mismatches") == 1 and total(snap, "verify_checks") == 4 + 3, snap
        assert store.lookup(ns, tokens).num_blocks == 0  # block 0 is gone: the chain stops there

        # before: the comparison on the caller's thread
        epoch, chain = store.chain(ns, tokens)
        assert store.save_now(ns, epoch, chain, kv) >= 1 and store.flush(30)
        proxy.set_mode("hang")
        res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
        fill(store, res, wrong[: len(res.slots)])
        started = time.monotonic()
        store.complete_verify(res, SEGMENTS, wait=True)
        inline = time.monotonic() - started
        print(f"the same comparison on the caller's thread: {inline * 1000:.0f} ms")
        assert inline >= 0.9 * TIMEOUT_S
        proxy.set_mode("pass")
