"""The store: ``StoreProtocol`` (``protocol.py``), the contract the adapters hold, with the types it
passes around, and ``BlockStore`` (``block_store.py``), the one implementation, composed of one
part per concern. Engine glue opens a store with ``open_store`` and sees only the protocol; tools
and tests that look inside (counters, index, tiers) use ``BlockStore``."""

from __future__ import annotations

from kvstrata.config import StrataConfig
from kvstrata.store.block_store import BlockStore
from kvstrata.store.protocol import (TOLERANCES, Arena, ByteRuns, Comparison, GroupHit, GroupRule, Hit, Reservation,
                                     Segment, StoreFigures, StoreProtocol, TokenMap)

__all__ = ["Arena", "BlockStore", "ByteRuns", "Comparison", "GroupHit", "GroupRule", "Hit", "Reservation",
           "Segment", "StoreFigures", "StoreProtocol", "TOLERANCES", "TokenMap", "open_store"]


def open_store(config: StrataConfig | None = None, *, l1_slot_bytes: int = 0,
               l1_shared_path: str | None = None) -> StoreProtocol:
    """A store over the tiers ``config`` names (default: the built-in config), as engine glue holds
    it. ``l1_shared_path`` puts the L1 arena in a file other local processes can map (the engine's
    workers copy KV in and out of it); ``l1_slot_bytes`` fixes the slot size now instead of at the
    first save."""
    return BlockStore(config, l1_slot_bytes=l1_slot_bytes, l1_shared_path=l1_shared_path)
