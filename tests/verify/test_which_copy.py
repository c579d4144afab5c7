"""A verified block is compared with the copy of a tier chosen at random among those that hold it
(``store/verify.py``), so a wrong copy in the shared tier, the one every other instance loads, is
found while this instance's L1 holds a right one.

Before, the copy a load would use was compared (L1 first): while L1 held a right copy the shared
tier's was never read, and another instance, holding none, loaded the wrong one.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.config import load_config
from kvstrata.store import BlockStore
from kvstrata.verify.compare import segments_of
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_namespace, random_tokens
from tests.harness import redisutil

SEGMENTS = segments_of(BLOCK_BYTES, 4, torch.float32)
ROUNDS = 40  # the wrong copy is one of 3 a block's verification may read: missed 40 times in a row, p = 1e-7


def floats(seed: int, n: int) -> torch.Tensor:
    return torch.randn((n, BLOCK_BYTES // 4), generator=torch.Generator().manual_seed(seed)).view(torch.uint8)


@pytest.fixture(params=["fs", "redis"])
def shared(request, tmp_path):
    """The shared tier's settings: a shared folder, or a real redis-server."""
    if request.param == "fs":
        yield {"remote.backend": "fs", "remote.path": str(tmp_path / "shared")}
        return
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        yield {"remote.backend": "redis", "remote.url": url}


def open_store(tmp_path, name: str, shared: dict) -> BlockStore:
    return BlockStore(load_config(None, {"l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(tmp_path / name),
                                         "l2.write": "through", "remote.enabled": True, **shared}))


def test_a_wrong_shared_copy_is_found_while_l1_holds_a_right_one(tmp_path, shared):
    """Scenario: instance A stores a prompt's 4 blocks (L1, L2 and the shared tier, right KV).
    Instance B then writes another prompt's KV under block 2's key into the shared tier (a valid
    checksum). A's verifications of the prompt (honest recomputations) read each block's copy from
    L1, L2 or the shared tier at random: within ``ROUNDS`` the shared tier's wrong copy is
    read, counted against it, and deleted from every tier of A's and the shared tier, so another
    instance no longer loads it (B's own L1 and L2 copies stay until B samples them)."""
    ns = make_namespace(kv_dtype="float32")
    tokens = random_tokens("which", 4 * BLOCK_SIZE)
    kv = floats(1, 4)
    with open_store(tmp_path, "a", shared) as a, open_store(tmp_path, "b", shared) as b:
        epoch, chain = a.chain(ns, tokens)
        assert a.save_now(ns, epoch, chain, kv) == 4 and a.flush(30)
        wrong = kv.clone()
        wrong[2] = floats(99, 1)[0]
        assert b.save_now(ns, b.current_epoch(ns), b.chain(ns, tokens)[1], wrong) == 4 and b.flush(30)
        assert all(a.index.tiers_of(a.index.match_rows(ns.seed, epoch, chain)) == 7)  # l1 | l2 | remote
        found = None
        for n in range(1, ROUNDS + 1):
            res = a.prepare_verify(ns, epoch, chain, BLOCK_BYTES)
            for slot, m in zip(res.slots, res.metas):
                a.arena.data[slot, :BLOCK_BYTES] = kv[chain.keys.index(m.key)]
            if not all(r.ok for r in a.complete_verify(res, SEGMENTS, wait=True)):
                found = n
                break
        snap = a.snapshot()
        print(f"{shared['remote.backend']}: the wrong shared copy found in verification round {found}; {snap}")
        assert found is not None
        assert snap.get("verify_mismatches_remote") == 1 and not snap.get("verify_mismatches_l1") \
            and not snap.get("verify_mismatches_l2")
        assert a.lookup(ns, tokens).num_blocks == 2  # block 2 deleted from every tier
        assert snap.get("verify_checks_l1", 0) + snap.get("verify_checks_l2", 0) > 0  # the other copies read too
    with open_store(tmp_path, "c", shared) as c:  # a third instance, holding nothing of its own
        assert c.lookup(ns, tokens).num_blocks == 2  # the shared tier's wrong copy is gone
