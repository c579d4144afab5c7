"""Fair shares of L1 and L2 between tenants, through the store API (``tenants.shares``).

Two tenants (two namespaces differing only in ``tenant``) share a small L2. Tenant B's working
set (20 one-block prompts, under half the tier) is asked for after every round; tenant A floods the
tier with unique prompts, one tier's worth per round, four rounds (4x the tier). With a 50/50
share B keeps at least 95% of its hits (it keeps all of them); with no shares the same traffic
costs B almost every hit (LRU: A's newest blocks push B's out). L1 is a few blocks, so every hit
of B is a hit on L2; the same with L1 as the tier (no L2). ``"*"`` is one share for all the
tenants not named: a flood under eight names takes that one share, not eight of them.
"""

from __future__ import annotations

import pytest

from kvstrata.config import ConfigError
from kvstrata.format.block import HEADER_SIZE
from kvstrata.store import BlockStore
from kvstrata.tenants import LRU, OVER_SHARE, OWN_SHARE, TierShares, fair_order
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens, store_prompt

FILE = HEADER_SIZE + BLOCK_BYTES  # what a block takes of l2.size
TIER_BLOCKS = 64
B_SET = 20
ROUNDS = 4


TIERS = {"l2": {"l1.size": 4 * BLOCK_BYTES, "l2.size": TIER_BLOCKS * FILE},
         "l1": {"l1.size": TIER_BLOCKS * BLOCK_BYTES, "l2.enabled": False}}


class EachUnnamed(TierShares):
    """The arithmetic before issue 50, kept as the control: ``"*"`` a share of its own for each
    tenant not named (every tenant the holder of its own)."""

    def __init__(self, tier: str, shares: dict) -> None:
        super().__init__(tier, shares)
        self.given = dict(shares)

    def holder(self, tenant: str) -> str:
        return tenant

    def limit(self, tenant: str, capacity: int) -> int:
        share = self.given.get(tenant, self.given.get("*", 0.0))
        return int(share * capacity) if isinstance(share, float) else min(share, capacity)


def each_unnamed(monkeypatch) -> None:
    """Stores opened from now on apply ``EachUnnamed`` (the control)."""
    monkeypatch.setattr("kvstrata.store.parts.tier_shares",
                        lambda shares: {t: EachUnnamed(t, s) for t, s in shares.items() if s})


def _run(tmp_path, shares: dict | None, tier: str = "l2", names: tuple[str, ...] = ("a",)) -> tuple[float, BlockStore]:
    """B's hit rate while A floods under ``names`` (one prompt each, in turn), and the store (open)."""
    cfg = dict(TIERS[tier])
    if shares is not None:
        cfg["tenants.shares"] = {tier: shares}
    store = BlockStore(make_config(tmp_path, cfg))
    flood, b = [make_namespace(tenant=name) for name in names], make_namespace(tenant="b")
    working = [random_tokens(f"b{i}", BLOCK_SIZE) for i in range(B_SET)]
    for p in working:
        store_prompt(store, b, p)
    hits = asked = 0
    for r in range(ROUNDS):
        for i in range(TIER_BLOCKS):
            store_prompt(store, flood[i % len(flood)], random_tokens(f"a{r}-{i}", BLOCK_SIZE))
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


EIGHT = tuple(f"x{k}" for k in range(8))
STAR = {"b": 0.4, "*": 0.2}  # the shares: B's working set (20 of 64 blocks) within its 40%


@pytest.mark.parametrize("tier", ["l2", "l1"])
def test_a_flood_under_eight_names_takes_one_star_share_and_b_keeps_its_hits(tmp_path, tier, monkeypatch):
    """Scenario (issue 50, "shares that cannot be multiplied"): shares ``{b: 40%, "*": 20%}``; A
    floods 4x the tier rotating over eight tenant names, none of them named. The eight are one
    holder of the one ``"*"`` share, over it at once: they give up their own blocks, and B,
    within its share, keeps all its hits. Control: with ``"*"`` a share for each name (the
    arithmetic before, ``EachUnnamed``: 8 x 20% > the tier) no name is ever over its share, the
    tier is one LRU and B loses its hits; under one name that arithmetic kept them."""
    rate, store = _run(tmp_path / "fixed", STAR, tier, EIGHT)
    with store:
        assert rate >= 0.95, f"B kept {rate:.3f} of its hits against a flood under eight names"
        counters = store.counters
        assert counters.get(f"{tier}_evicted_own_share") > 0  # the "*" holder, over its share, gave its own
        assert counters.get(f"{tier}_evicted_lru") == counters.get(f"{tier}_evicted_over_share") == 0
        usage = store.stats()["tenants"][tier]
        assert usage["b"]["blocks"] == B_SET
        capacity = store.stats()["tiers"][tier]["capacity_bytes"]
        assert {usage[x]["share_bytes"] for x in EIGHT} == {int(0.2 * capacity)}  # one share, held together
    each_unnamed(monkeypatch)
    rate_each, store = _run(tmp_path / "each", STAR, tier, EIGHT)
    with store:
        assert rate_each < 0.5, f"with a share per name B kept {rate_each:.3f}: the control shows no loss"
        assert store.counters.get(f"{tier}_evicted_lru") > 0
    rate_one, store = _run(tmp_path / "one", STAR, tier, ("x",))
    store.close()
    assert rate_one >= 0.95, f"with a share per name, under one name, B kept {rate_one:.3f}"
    print(f"{tier}: B's hit rate against a flood under 8 names, shares {{b: 40%, '*': 20%}}: "
          f"one '*' share {rate:.3f}; a '*' share per name (before) {rate_each:.3f}, under one name {rate_one:.3f}")


def test_the_empty_tenant_is_default_and_can_be_named(tmp_path):
    cfg = {"l1.size": 4 * BLOCK_BYTES, "l2.size": TIER_BLOCKS * FILE,
           "tenants.shares": {"l2": {"default": 0.5}}}
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
    # b writes within its share: the holders over theirs give, the most over first ("*": c)
    assert shares.eviction_order(usage, cap, "b", 1000) == [("*", OVER_SHARE, 25_904), ("a", OVER_SHARE, 10_000)]
    # a writes over its share: a gives first
    assert shares.eviction_order(usage, cap, "a", 1000)[0] == ("a", OWN_SHARE, 11_000)
    # nobody over: empty (the caller falls back to one LRU)
    assert shares.eviction_order({"a": 10, "b": 10}, cap, "a", 10) == []
    assert LRU == "lru"


def test_the_tenants_not_named_hold_one_star_share_together():
    shares = TierShares("l2", STAR)
    cap = 100_000
    assert [shares.holder(t) for t in ("b", "x0", "default")] == ["b", "*", "*"]
    assert shares.limit("x0", cap) == shares.limit("x7", cap) == shares.limit("*", cap) == 20_000
    # eight names at 5% each: 40% together, over the one 20% share; b (30%) within its own 40%
    usage = {"b": 30_000, **{x: 5_000 for x in EIGHT}}
    assert shares.eviction_order(usage, cap, "x3", 1000) == [("*", OWN_SHARE, 21_000)]
    assert shares.eviction_order(usage, cap, "b", 1000) == [("*", OVER_SHARE, 20_000)]
    assert shares.members("*", usage) == list(EIGHT)
    # the same bytes under each name apart (the arithmetic before): nobody over, one LRU
    assert EachUnnamed("l2", STAR).eviction_order(usage, cap, "x3", 1000) == []
    # no "*": the tenants not named keep nothing against the named ones
    assert TierShares("l2", {"b": 0.5}).eviction_order({"b": 10, "x": 10}, 20, "b", 0) == [("*", OVER_SHARE, 10)]


def test_the_sweep_order_takes_the_star_holders_oldest_first_across_its_names():
    """``fair_order`` (the shared folder's gc): the eight names give as one holder, its oldest
    block first whichever name holds it; B, within its share, gives nothing though its block is
    the oldest of all. Control: with a share per name nobody is over, and the oldest of all goes."""
    usage = {"b": 20, **{x: 5 for x in EIGHT}}  # of a tier of 50: "*" holds 40, its share 10
    candidates = [("b", 1, "b-old")] + [(x, 1, f"{x}-{i}") for i in range(5) for x in EIGHT]
    order = fair_order(TierShares("remote", STAR), dict(usage), 50, candidates)
    assert order == [(block, OVER_SHARE) for _t, _n, block in candidates[1:11]]
    before = fair_order(EachUnnamed("remote", STAR), dict(usage), 50, candidates)
    assert before[0] == ("b-old", LRU) and {cause for _, cause in before} == {LRU}


@pytest.mark.parametrize("shares, words", [
    ({"l2": {"a": 0.7, "b": 0.6}}, "add up to 1.3"),
    ({"l2": {"b": 0.7, "*": 0.4}}, "('b': 0.7, '*': 0.4) add up to 1.1"),
    ({"l2": {"b": 0.5, "*": "40MiB"}}, "tenants.shares.l2: the shares ('b': 0.5, '*': 41943040 bytes) take "
                                       "75497472 bytes, more than the tier (l2.size: 67108864 bytes)"),
    ({"l2": {"Chat": 0.5}}, "tenant name 'Chat'"),
    ({"l2": {"b ": 0.5}}, "tenant name 'b '"),
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
    cfg = make_config(tmp_path, {"l1.size": "4MiB", "tenants.shares": {"l1": {"a": "25%", "b": "1MiB", "*": "50%"}}})
    assert cfg.tenants.shares["l1"] == {"a": 0.25, "b": 1 << 20, "*": 0.5}  # 4 MiB in all: the whole tier
