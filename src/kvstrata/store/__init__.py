"""The store: ``StoreProtocol`` (``protocol.py``), the contract the adapters hold, and ``BlockStore``
(``block_store.py``), the one implementation, composed of one part per concern."""

from kvstrata.store.block_store import BlockStore
from kvstrata.store.groups import GroupHit, GroupRule
from kvstrata.store.protocol import Arena, ByteRuns, Hit, Reservation, StoreProtocol

__all__ = ["Arena", "BlockStore", "ByteRuns", "GroupHit", "GroupRule", "Hit", "Reservation", "StoreProtocol"]
