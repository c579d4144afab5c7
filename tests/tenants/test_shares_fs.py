"""Fair shares of the shared folder (``remote.backend: fs``) between tenants: its bound is kept by
``kvstrata gc``'s sweep, which reads every block's header (its namespace, hence its tenant, from
the namespaces' descriptors in the folder) and gives up blocks tenant by tenant.

Two instances, one per tenant, on one folder of 64 blocks; L1 tiny, no L2. B stores its working
set (20 blocks) and reads it; A floods the folder with 4x its size, a gc after each tier's worth
(as an operator's timer runs it). A fresh instance of B then loads its working set from the folder:
with a 50/50 share all of it is there; without shares the sweep, one LRU by mtime, took it.
"""

from __future__ import annotations

import time

from kvstrata.format.block import HEADER_SIZE
from kvstrata.store import BlockStore
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, load_hit, make_config, make_namespace, random_tokens, store_prompt

FILE = HEADER_SIZE + BLOCK_BYTES
TIER_BLOCKS, B_SET, ROUNDS = 64, 20, 4


def _config(tmp_path, who: str, shares: dict | None):
    cfg = {"l1.size": 4 * BLOCK_BYTES, "l2.enabled": False, "l2.path": str(tmp_path / f"l2-{who}"),
           "remote.enabled": True, "remote.backend": "fs", "remote.path": str(tmp_path / "shared"),
           "remote.size": TIER_BLOCKS * FILE, "lease_seconds": 0.05}
    if shares is not None:
        cfg["tenants.shares"] = {"remote": shares}
    return make_config(tmp_path, cfg)


def _kept(tmp_path, shares: dict | None) -> tuple[float, dict[str, int]]:
    a_ns, b_ns = make_namespace(tenant="a"), make_namespace(tenant="b")
    working = [random_tokens(f"b{i}", BLOCK_SIZE) for i in range(B_SET)]
    with BlockStore(_config(tmp_path, "b", shares)) as b:
        b.describe(b_ns)
        for p in working:
            store_prompt(b, b_ns, p)
        assert b.flush(10)
    time.sleep(0.1)  # past the lease: B's blocks may go, as far as leases go
    with BlockStore(_config(tmp_path, "a", shares)) as a:
        a.describe(a_ns)
        for r in range(ROUNDS):
            for i in range(TIER_BLOCKS):
                store_prompt(a, a_ns, random_tokens(f"a{r}-{i}", BLOCK_SIZE))
            assert a.flush(10)
            time.sleep(0.1)
            a.gc()
        counters = a.counters.snapshot()
    files = sum(1 for _ in (tmp_path / "shared").rglob("*.kvb"))
    assert files * FILE <= TIER_BLOCKS * FILE
    with BlockStore(_config(tmp_path, "b2", shares)) as b2:  # a fresh instance: only the folder has them
        loaded = sum(load_hit(b2, b2.lookup(b_ns, p))[0] for p in working)
    return loaded / B_SET, counters


def test_the_sweep_keeps_b_its_share_while_a_floods_4x_the_folder(tmp_path):
    rate, counters = _kept(tmp_path / "shares", {"a": 0.5, "b": 0.5})
    assert rate >= 0.95, f"B kept {rate:.3f} of its working set in the shared folder"
    assert counters["remote_evicted_over_share"] > 0 and not counters.get("remote_evicted_lru")
    rate_lru, counters = _kept(tmp_path / "lru", None)
    assert rate_lru < 0.5, f"without shares B kept {rate_lru:.3f}: the flood shows no loss"
    assert counters["remote_evicted_lru"] > 0
    print(f"B's working set kept in the shared folder: with 50/50 shares {rate:.3f}, without {rate_lru:.3f}")
