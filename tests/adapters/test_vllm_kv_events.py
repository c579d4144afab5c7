"""The vLLM adapter's KV cache events on a real store, no engine: what the store's tier listener
announces when blocks are committed, evicted for capacity and invalidated (the events as a real
server publishes them: tests/engines/test_vllm_observability.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, payloads_for, random_tokens, store_prompt

from kvstrata.keys import BlockChain


def hashes(events: list[Any], kind: type, medium: str, locality: str | None = None) -> list[Any]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium
            and (locality is None or e.locality == locality) for h in e.block_hashes]


def test_capacity_evictions_withdraw_blocks_from_the_tier_they_left(store_factory, ns):
    """The store's tier listener and ``KVEvents`` together, on a real store: L1 holds 4 blocks, L2
    is written through; storing 8 blocks evicts the 4 oldest from L1 only."""
    pytest.importorskip("vllm")  # vLLM's event types; no engine runs
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import Locality, Medium  # what vLLM's own offloading tiers announce

    from kvstrata.adapters.vllm.events import KVEvents

    l1 = (Medium.CPU.value, Locality.LOCAL.value)
    l2 = (Medium.STORAGE.value, Locality.LOCAL.value)
    store = store_factory(l1__size=4 * BLOCK_BYTES)
    events = KVEvents(BLOCK_SIZE, store.tier_bits)
    store.listen(events.on_tier_change)
    tokens = random_tokens("evict", 8 * BLOCK_SIZE)
    _epoch, chain = store.chain(ns, tokens)
    block_hashes = [bytes([i + 1]) * 32 for i in range(8)]  # stand-ins for request.block_hashes
    vllm_hashes = [maybe_convert_block_hash(h) for h in block_hashes]  # as vLLM's events carry them
    second = BlockChain(*(p[4:] for p in chain))
    events.learn(chain.keys, block_hashes, 0, tokens)
    store_prompt(store, ns, tokens[: 4 * BLOCK_SIZE])
    ev = events.take()
    assert hashes(ev, BlockStored, *l1) == hashes(ev, BlockStored, *l2) == vllm_hashes[:4]
    assert [e for e in ev if isinstance(e, BlockStored)][0].token_ids == tokens[: 4 * BLOCK_SIZE].tolist()
    store.save_now(ns, _epoch, second, payloads_for(second))
    ev = events.take()
    assert hashes(ev, BlockStored, *l1) == vllm_hashes[4:]
    assert sorted(hashes(ev, BlockRemoved, *l1)) == vllm_hashes[:4]  # evicted from L1 ...
    assert not hashes(ev, BlockRemoved, *l2)  # ... and still on disk
    store.invalidate(ns.seed)
    ev = events.take()
    assert sorted(hashes(ev, BlockRemoved, *l2)) == vllm_hashes
    assert sorted(hashes(ev, BlockRemoved, *l1)) == vllm_hashes[4:]
    assert not events._known  # every block left every tier: nothing is remembered
