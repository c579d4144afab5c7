"""vLLM's own prefix cache across a reset: ``LocalCacheGuard``.

``reset_prefix_cache(reset_connector=True)`` follows a weight update. vLLM resets its own prefix
cache only when no request holds blocks (``BlockPool.reset_prefix_cache`` fails otherwise, and the
connector is reset anyway), so blocks computed with the old weights can stay cached and serve
local prefix hits afterwards. kvstrata must never store what such a hit leads to: the hit's KV, and
everything computed on top of it, belongs to the weights this instance has left.

The guard remembers, at each reset, which of vLLM's blocks were cached (by block id, with the hash
they held). A request whose local hit includes one of them, still holding that hash, stores nothing.
A block evicted since (its hash gone or replaced) is computed anew, so it no longer counts. When
vLLM's cache was really reset nothing is remembered and nothing costs.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class LocalCacheGuard:
    """Which of vLLM's cached blocks may hold KV from before this instance's last reset."""

    def __init__(self) -> None:
        # block id -> the hash it held at the reset; None: vLLM's blocks could not be read, so any
        # local hit after a reset is suspect
        self._stale: dict[int, Any] | None = {}

    def reset(self, kv_cache_manager: Any) -> None:
        """A reset now: remember the blocks vLLM still caches (its own reset ran just before)."""
        if kv_cache_manager is None:  # never bound: the scheduler has not run, nothing is cached
            self._stale = {}
            return
        blocks = getattr(getattr(kv_cache_manager, "block_pool", None), "blocks", None)
        if blocks is None:
            self._stale = None
            log.warning("kvstrata: cannot read vLLM's cached blocks; after this reset no request with a local prefix "
                        "hit is stored")
            return
        self._stale = {b.block_id: b.block_hash for b in blocks if b.block_hash is not None}
        if self._stale:
            log.warning("kvstrata: vLLM's prefix cache kept %d blocks through the reset (requests held them); kvstrata "
                        "stores nothing that reuses them", len(self._stale))

    def fresh(self, kv_cache_manager: Any, req_id: str, local_tokens: int, block_size: int) -> bool:
        """Whether the request's local prefix hit (``local_tokens``, from vLLM's own cache) holds no
        block cached before the last reset: only then may what it computes be stored."""
        if not self._stale or local_tokens < block_size:
            return self._stale is not None or local_tokens < block_size
        blocks = kv_cache_manager.block_pool.blocks
        n = local_tokens // block_size
        for ids in kv_cache_manager.get_block_ids(req_id):
            for block_id in ids[:n]:
                held = self._stale.get(block_id)
                if held is None:
                    continue
                if blocks[block_id].block_hash == held:
                    return False
                del self._stale[block_id]  # evicted since, and cached again for new KV
        return True
