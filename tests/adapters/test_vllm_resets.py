"""vLLM's own prefix cache across a reset (adapters/vllm/resets.py ``LocalCacheGuard``), on vLLM's
real ``BlockPool``: no engine starts.

Scenario: ``reset_prefix_cache(reset_connector=True)`` after a weight update resets kvstrata, but
vLLM's own cache survives when requests hold blocks (its reset fails and the connector is reset
anyway). A request whose local prefix hit includes such a block computes on the old weights' KV,
and kvstrata must store nothing of it; once vLLM has evicted those blocks, hits are fresh again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402

from kvstrata.adapters.vllm.resets import LocalCacheGuard  # noqa: E402

BS = 32


def cached_blocks(pool: BlockPool, n: int, tag: int) -> list:
    """``n`` of the pool's blocks, full and cached under hashes of ``tag``."""
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        b.set_block_hash(make_block_hash_with_group_id(BlockHash(bytes([tag, i]) * 16), 0))
    return blocks


def manager(pool: BlockPool, tables: dict[str, list]) -> SimpleNamespace:
    """What the guard reads of vLLM's KV cache manager: its pool and the requests' block ids."""
    return SimpleNamespace(block_pool=pool, get_block_ids=lambda rid: ([b.block_id for b in tables[rid]],))


def test_a_local_hit_on_blocks_cached_before_the_reset_is_not_stored_until_they_are_evicted():
    pool = BlockPool(16, True, BS)
    old = cached_blocks(pool, 3, 1)
    mgr = manager(pool, {"r": old})
    guard = LocalCacheGuard()
    guard.reset(mgr)  # vLLM's own reset failed: the blocks keep their hashes
    assert not guard.fresh(mgr, "r", 3 * BS, BS)
    assert guard.fresh(mgr, "r", BS - 1, BS)  # no full block from vLLM's cache: nothing reused
    for i, b in enumerate(old):  # evicted since, and cached again for KV computed after the reset
        b.reset_hash()
        b.set_block_hash(make_block_hash_with_group_id(BlockHash(bytes([3, i]) * 16), 0))
    assert guard.fresh(mgr, "r", 3 * BS, BS)


def test_after_a_real_reset_of_vllms_cache_nothing_is_remembered():
    pool = BlockPool(16, True, BS)
    blocks = cached_blocks(pool, 2, 1)
    for b in blocks:
        b.reset_hash()  # what BlockPool.reset_prefix_cache does when it succeeds
    mgr = manager(pool, {"r": blocks})
    guard = LocalCacheGuard()
    guard.reset(mgr)
    assert guard.fresh(mgr, "r", 2 * BS, BS)


def test_a_manager_without_a_readable_pool_stores_no_local_hit_after_a_reset():
    guard = LocalCacheGuard()
    assert guard.fresh(SimpleNamespace(), "r", 4 * BS, BS)  # no reset yet
    guard.reset(SimpleNamespace())
    assert not guard.fresh(SimpleNamespace(), "r", 4 * BS, BS)
    assert guard.fresh(SimpleNamespace(), "r", BS - 1, BS)
