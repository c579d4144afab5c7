"""KV cache events for routers: which blocks kvstrata holds, on which tier, under vLLM's block hashes.

vLLM publishes ``BlockStored``/``BlockRemoved`` (``--kv-events-config``, a ZMQ publisher) for its
own GPU cache with ``medium="GPU"``; the connector's ``take_events()`` adds ours with the
``medium`` and ``locality`` of vLLM's own offloading tiers (``vllm.v1.kv_offload.base.Medium`` and
``Locality``, ``TIER_PLACE``): L1 ``CPU``/``LOCAL``, L2 ``STORAGE``/``LOCAL``, the shared tier
``STORAGE``/``REMOTE``. So a KV-aware router written for vLLM's events (llm-d's indexer, NVIDIA
Dynamo's router) learns that a prefix is still cheap on this instance after the GPU evicted it.

The store keys blocks on its own chained keys; routers need vLLM's (``request.block_hashes``,
converted as vLLM converts its own: ``maybe_convert_block_hash``). The scheduler side ``learn``s
the pair when it plans a save or a lookup finds blocks, and the store's tier listener
(``Counters.listen``) reports every batch committed to or removed from a tier, on whichever thread
did it; the batches queue here and become events in ``take()``, on the scheduler's thread, one
event per run of chained blocks and tier. A block is announced on a tier once (``BlockStored``)
and withdrawn when it leaves that tier (``BlockRemoved``); it is forgotten when it has left every
tier. Partial tail blocks have no vLLM hash and are never announced. Only built when vLLM's KV
events are enabled: otherwise nothing is learned and no listener is set.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import Locality, Medium

# kvstrata tier -> (medium, locality) as vLLM's own offloading tiers announce theirs
TIER_PLACE = {"l1": (Medium.CPU, Locality.LOCAL), "l2": (Medium.STORAGE, Locality.LOCAL),
              "remote": (Medium.STORAGE, Locality.REMOTE)}
MEDIUM = {tier: medium.value for tier, (medium, _) in TIER_PLACE.items()}  # as the event carries it
LOCALITY = {tier: locality.value for tier, (_, locality) in TIER_PLACE.items()}
_UNSTORED_STEPS = 1024  # a learned block never committed (L1 full, a failed copy) is forgotten after


@dataclass(slots=True)
class _Known:
    ext: Any  # vLLM's hash of the block, as its events carry it
    parent: Any  # vLLM's hash of the block before it, None for the first
    tokens: np.ndarray  # the block's token ids
    tiers: int = 0  # bits of the tiers it has been announced on


class KVEvents:
    def __init__(self, block_size: int, tier_bits: dict[str, int]) -> None:
        """``tier_bits``: each tier's bit in ``hit.tiers`` (the store's ``tier_bits``)."""
        self.block_size = block_size
        self._bits = tier_bits
        self._lock = threading.Lock()
        self._changes: list[tuple[str, Sequence[Any], bool]] = []  # filled on any thread
        self._known: dict[bytes, _Known] = {}  # scheduler thread only
        self._ready: list[KVCacheEvent] = []
        self._unstored: dict[bytes, int] = {}  # learned, not announced yet -> the step learned
        self._step = 0

    # ------------------------------------------------------ store listener
    def on_tier_change(self, tier: str, metas: Sequence[Any], stored: bool) -> None:
        """``Counters.listen`` target: queue the batch (any thread; resolved in ``take``)."""
        with self._lock:
            self._changes.append((tier, metas, stored))

    # ------------------------------------------------------ scheduler side
    def learn(self, keys: Sequence[bytes], block_hashes: Sequence[bytes], first: int, tokens: np.ndarray,
              tiers: Sequence[int] | None = None) -> None:
        """Pair the store keys of engine blocks ``first, first + 1, ...`` with vLLM's hashes of the
        same blocks (``request.block_hashes``; ``tokens`` is the request's token ids). ``tiers``
        (the bits of ``hit.tiers``) announces blocks found already stored, e.g. on disk after a
        restart; without it the commit that follows a save announces them."""
        bs = self.block_size
        announce: dict[str, list[bytes]] = {}
        for i, key in enumerate(keys):
            j = first + i
            if j >= len(block_hashes):
                break
            known = self._known.get(key)
            if known is None:
                known = self._known[key] = _Known(
                    maybe_convert_block_hash(block_hashes[j]),
                    maybe_convert_block_hash(block_hashes[j - 1]) if j else None, tokens[j * bs:(j + 1) * bs])
                self._unstored[key] = self._step
            if tiers is not None:
                for tier, bit in self._bits.items():
                    if tiers[i] & bit and not known.tiers & bit:
                        announce.setdefault(tier, []).append(key)
        for tier, tier_keys in announce.items():
            self._ready += self._stored(tier, tier_keys)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in the order the tiers changed."""
        with self._lock:
            changes, self._changes = self._changes, []
        out, self._ready = self._ready, []
        for tier, metas, stored in changes:
            keys = [m.key for m in metas if not m.tail]
            out += self._stored(tier, keys) if stored else self._removed(tier, keys)
        self._step += 1
        if not self._step % _UNSTORED_STEPS:
            old = [k for k, step in self._unstored.items() if step < self._step - _UNSTORED_STEPS]
            for key in old:
                del self._unstored[key]
                known = self._known.get(key)
                if known is not None and not known.tiers:
                    del self._known[key]
        return out

    def _stored(self, tier: str, keys: list[bytes]) -> list[KVCacheEvent]:
        """One ``BlockStored`` per run of chained blocks not announced on ``tier`` yet."""
        bit, events, run = self._bits[tier], [], []  # type: ignore[var-annotated]
        for key in keys:
            known = self._known.get(key)
            if known is None or known.tiers & bit:
                continue
            known.tiers |= bit
            self._unstored.pop(key, None)
            if run and known.parent != run[-1].ext:
                events.append(self._event(tier, run))
                run = []
            run.append(known)
        if run:
            events.append(self._event(tier, run))
        return events

    def _event(self, tier: str, run: list[_Known]) -> BlockStored:
        return BlockStored(block_hashes=[k.ext for k in run], parent_block_hash=run[0].parent,
                           token_ids=np.concatenate([k.tokens for k in run]).tolist(),
                           block_size=self.block_size, lora_id=None, medium=MEDIUM[tier], lora_name=None,
                           group_idx=0, locality=LOCALITY[tier])

    def _removed(self, tier: str, keys: list[bytes]) -> list[KVCacheEvent]:
        bit, hashes = self._bits[tier], []
        for key in keys:
            known = self._known.get(key)
            if known is None or not known.tiers & bit:
                continue
            known.tiers &= ~bit
            hashes.append(known.ext)
            if not known.tiers:
                del self._known[key]  # left every tier it was announced on
        return ([BlockRemoved(block_hashes=hashes, medium=MEDIUM[tier], group_idx=0, locality=LOCALITY[tier])]
                if hashes else [])
