"""Fair shares of L1 and L2 between tenants, through the store API (``tenants.shares``).

Two tenants (two namespaces differing only in ``tenant``) share a small L2. Tenant B's working
set (20 one-block prompts, under half the tier) is asked for after every round; tenant A floods the
tier with unique prompts, one tier's worth per round, four rounds (4x the tier). With a 50/50
share B keeps at least 95% of its hits (it keeps all of them); with no shares the same traffic
costs B almost every hit (LRU: A's newest blocks push B's out). L1 is a few blocks, so every hit
of B is a hit on L2; the same with L1 as the tier (no L2).
"""

from __future__ import annotations

import pytest

from kvstrata.config import ConfigError
from kvstrata.format.block import HEADER_SIZE
from kvstrata.store import BlockStore
from kvstrata.tenants import LRU, OVER_SHARE, OWN_SHARE, TierShares
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens, store_prompt

FILE = HEADER_SIZE + BLOCK_BYTES  # what a block takes of l2.size
TIER_BLOCKS = 64
B_SET = 20
ROUNDS = 4


TIERS = {"l2": {"l1.size": 4 * BLOCK_BYTES, "l2.size": TIER_BLOCKS * FILE},
         "l1": {"l1.size": TIER_BLOCKS * BLOCK_BYTES, "l2.enabled": False}}


def _run(tmp_path, shares: dict | None, tier: str = "l2") -> tuple[float, BlockStore]:
    cfg = dict(TIERS[tier])
    if shares is not None:
        cfg["tenants.shares"] = {tier: shares}
    store = BlockStore(make_config(tmp_path, cfg))
    a, b = make_namespace(tenant="a"), make_namespace(tenant="b")
    working = [random_tokens(f"b{i}", BLOCK_SIZE) for i in range(B_SET)]
    for p in working:
        store_prompt(store, b, p)
    hits = asked = 0
    for r in range(ROUNDS):
        for i in range(TIER_BLOCKS):
            store_prompt(store, a, random_tokens(f"a{r}-{i}", BLOCK_SIZE))
        for p in working:  # B comes back once per tier's worth of A's prompts
            asked += 1
            found = store.lookup(b, p).num_blocks
            hits += found
            if not found:  # a miss is recomputed and saved again, as an engine does
                store_prompt(store, b, p)
        held = store.l2 if tier == "l2" else store.l1
        assert held.used_bytes <= held.capacity_bytes
    return hits / asked, store


@pytest.mark.parametrize("tier", ["l2", "l1"])
def test_a_flood_of_4x_the_tier_leaves_b_its_hits_within_its_share(tmp_path, tier):
    rate, store = _run(tmp_path / "shared", {"a": 0.5, "b": 0.5}, tier)
    with store:
        assert rate >= 0.95, f"B kept {rate:.3f} of its hits within its share"
        counters = store.counters
        assert counters.get(f"{tier}_evicted_own_share") > 0  # A, over its share, evicted its own
        assert counters.get(f"{tier}_evicted_lru") == 0
        usage = store.stats()["tenants"][tier]
        assert usage["b"]["blocks"] == B_SET
        assert usage["a"]["bytes"] + usage["b"]["bytes"] <= store.stats()["tiers"][tier]["capacity_bytes"]
    rate_lru, store = _run(tmp_path / "lru", None, tier)
    with store:
        assert rate_lru < 0.5, f"without shares B kept {rate_lru:.3f} of its hits: the flood shows no loss"
        assert store.counters.get(f"{tier}_evicted_lru") > 0
    print(f"{tier}: B's hit rate: with 50/50 shares {rate:.3f}, without shares {rate_lru:.3f}")


def test_a_tenant_may_use_free_room_beyond_its_share(tmp_path):
    """Shares are guarantees, not caps: alone on the tier, A fills it whole."""
    cfg = {"l1.size": 4 * BLOCK_BYTES, "l2.size": TIER_BLOCKS * FILE, "tenants.shares": {"l2": {"a": 0.25, "b": 0.75}}}
    with BlockStore(make_config(tmp_path, cfg)) as store:
        a = make_namespace(tenant="a")
        for i in range(TIER_BLOCKS):
            store_prompt(store, a, random_tokens(f"a{i}", BLOCK_SIZE))
        assert store.counters.get("l2_evicted") == 0
        assert store.stats()["tenants"]["l2"]["a"]["blocks"] == TIER_BLOCKS


def test_unnamed_tenants_take_the_star_share_and_the_empty_tenant_is_default(tmp_path):
    cfg = {"l1.size": 4 * BLOCK_BYTES, "l2.size": TIER_BLOCKS * FILE,
           "tenants.shares": {"l2": {"*": 0.5}}}
    with BlockStore(make_config(tmp_path, cfg)) as store:
        x, d = make_namespace(tenant="x"), make_namespace()
        keep = [random_tokens(f"d{i}", BLOCK_SIZE) for i in range(10)]
        for p in keep:
            store_prompt(store, d, p)
        for i in range(3 * TIER_BLOCKS):
            store_prompt(store, x, random_tokens(f"x{i}", BLOCK_SIZE))
        assert all(store.lookup(d, p).num_blocks == 1 for p in keep)
        assert set(store.stats()["tenants"]["l2"]) == {"x", "default"}


def test_eviction_order():
    shares = TierShares("l2", {"a": 0.5, "b": 0.25, "*": 4096})
    cap = 100_000
    usage = {"a": 60_000, "b": 10_000, "c": 30_000}
    # b writes within its share: the tenants over theirs give, the most over first
    assert shares.eviction_order(usage, cap, "b", 1000) == [("c", OVER_SHARE, 25_904), ("a", OVER_SHARE, 10_000)]
    # a writes over its share: a gives first
    assert shares.eviction_order(usage, cap, "a", 1000)[0] == ("a", OWN_SHARE, 11_000)
    # nobody over: empty (the caller falls back to one LRU)
    assert shares.eviction_order({"a": 10, "b": 10}, cap, "a", 10) == []
    assert LRU == "lru"


@pytest.mark.parametrize("shares, words", [
    ({"l2": {"a": 0.7, "b": 0.6}}, "add up to 1.3"),
    ({"l2": {"a": 1.5}}, "fraction in [0, 1]"),
    ({"l2": {"a": 1}}, "a share of 1 bytes"),
    ({"l2": {"a": "lots"}}, "a size like 8GiB"),
    ({"disk": {"a": 0.5}}, "disk"),
    ({"l2": {"": 0.5}}, "tenant name"),
])
def test_bad_shares_are_named(tmp_path, shares, words):
    with pytest.raises(ConfigError) as e:
        make_config(tmp_path, {"tenants.shares": shares})
    assert words in str(e.value) and "tenants.shares" in str(e.value)


def test_shares_in_percent_and_bytes(tmp_path):
    cfg = make_config(tmp_path, {"tenants.shares": {"l1": {"a": "25%", "b": "1MiB"}}})
    assert cfg.tenants.shares["l1"] == {"a": 0.25, "b": 1 << 20}
