"""Fair shares of the Redis shared tier between two real vLLM engines, one per tenant
(``namespace.tenant`` a and b, ``tenants.shares.remote: {a: 0.5, b: 0.5}``, ``remote.size`` of 64
blocks, L1 of 10 blocks, no L2).

Scenario: B serves its working set (3 prompts of 9 blocks, under its half of the tier), then A
floods the tier with unique prompts, one tier's worth per round, four rounds (4x the tier); after
each round B asks for its working set again, vLLM's own prefix cache reset first, so that every
hit is a load from Redis (B's L1 holds barely one prompt). B keeps at least 95% of its prompt
tokens as hits, loaded from the shared tier, with outputs equal to vLLM alone. The loss without
shares is shown through the store API (tests/tenants/test_shares_redis.py), not by two more engines.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from tests.harness import redisutil
from engines.launchers import BS, StepEngine, delta, gen, ids

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

BLOCK_BYTES = 4 * 2 * 2 * 64 * BS * 2  # the tiny model's KV per block: layers, K and V, heads, head dim, bf16
STORED = BLOCK_BYTES + 2 * 128  # what a block takes of remote.size: its value and index entry (two headers)
TIER_BLOCKS = 64
WORKING = [ids(700 + i, 8 * BS + 10) for i in range(3)]  # B: 8 full blocks and a tail each
ROUNDS, FLOOD = 4, 8  # A: 8 prompts of 8 blocks per round, a tier's worth


def config(tmp: Path, tenant: str, url: str) -> Path:
    path = tmp / f"{tenant}.yaml"
    path.write_text(f"""namespace:
  tenant: {tenant}
l1:
  size: {10 * BLOCK_BYTES}
l2:
  enabled: false
remote:
  enabled: true
  url: {url}
  timeout_ms: 2000
  size: {TIER_BLOCKS * STORED}
tenants:
  shares:
    remote: {{a: 0.5, b: 0.5}}
""")
    return path


def wait_written(engine: StepEngine, before: dict[str, int], blocks: int, timeout: float = 120) -> dict[str, int]:
    """Until ``engine`` wrote at least ``blocks`` blocks to Redis since ``before`` and stopped
    (three reads alike); what its counters grew by."""
    deadline, seen = time.monotonic() + timeout, [-1, -2]
    while True:
        grown = delta(engine.counters(), before)
        written = grown.get("remote_bytes_written", 0)
        if written >= blocks * BLOCK_BYTES and seen[-2:] == [written, written]:
            return grown
        assert time.monotonic() < deadline, f"{written} bytes written to Redis: {grown}"
        seen.append(written)
        time.sleep(0.3)


def test_a_flood_of_4x_the_tier_leaves_engine_b_its_redis_hits(model, tmp_path, baseline):
    started = time.monotonic()
    with redisutil.standalone(tmp_path / "redis") as (url, port, _procs):
        admin = redis.Redis(port=port)
        with StepEngine(model, tmp_path, config(tmp_path, "a", url), name="tenant-a") as a, \
                StepEngine(model, tmp_path, config(tmp_path, "b", url), name="tenant-b") as b:
            before = b.counters()
            first = b.run([gen(p) for p in WORKING])
            wait_written(b, before, 8 * len(WORKING))
            asked = hit = blocks_asked = 0
            b_before = b.counters()
            for r in range(ROUNDS):
                a_before = a.counters()
                a.run([gen(ids(10_000 + 100 * r + i, 8 * BS)) for i in range(FLOOD)])
                wait_written(a, a_before, 6 * FLOOD)  # a few saves may be dropped (L1 of 10 blocks)
                out = b.run([{"op": "reset"}, *[gen(p) for p in WORKING]])[1:]
                for prompt, o, f in zip(WORKING, out, first):
                    assert o["tokens"] == f["tokens"]
                    asked += len(prompt)
                    hit += o["cached"]
                    blocks_asked += len(prompt) // BS + 1
            grown = delta(b.counters(), b_before)
            a_counts = a.counters()
        usage = {t: int(admin.get(f"kvstrata:{{t:{t.encode().hex()}}}:bytes") or 0) for t in "ab"}
        admin.close()
    rate = hit / asked
    print(f"engine B's prompt tokens hit after A's flood of {ROUNDS}x the tier: {rate:.3f} "
          f"({grown.get('hit_blocks_remote', 0)} of {blocks_asked} blocks from Redis); "
          f"A evicted {a_counts.get('remote_evicted_own_share', 0)} of its own; usage {usage}; "
          f"{time.monotonic() - started:.0f} s")
    assert [f["tokens"] for f in first] == [baseline(p) for p in WORKING]
    assert rate >= 0.95, f"B kept {rate:.3f} of its prompt tokens as hits"
    assert grown.get("hit_blocks_remote", 0) >= 0.95 * blocks_asked, grown
    assert not grown.get("hit_blocks_l1"), grown  # every hit a load from the shared tier
    assert a_counts.get("remote_evicted_own_share", 0) > 0 and not a_counts.get("remote_evicted_lru")
    assert not grown.get("remote_evicted")  # B, within its share, evicted nothing
    assert sum(usage.values()) <= TIER_BLOCKS * STORED
