"""The medium interface every tier implements (L1 memory, L2 disk, and later shared tiers).

A tier stores opaque payloads under a key, next to the metadata the index needs to revalidate
them. The index decides *what* is valid; a tier only answers *whether it still holds those bytes*:

- ``write(meta, payload)``: copy-on-write publish. The bytes go to a fresh place and become
  visible only when complete; a crash leaves either nothing or the whole block. Returns False
  (and counts why) instead of raising on an I/O error.
- ``read(meta, out)``: fill ``out`` (a 1-D uint8 CPU tensor of ``meta.size`` bytes) and verify it against ``meta``
  (for tiers that leave the process: the payload checksum). False on a missing, short or corrupt
  copy, which the tier also deletes.
- ``probe(key)``: the committed metadata of a block another process may have stored, read from
  the tier's own header, never from the payload. None if absent or unreadable.
- ``tail_lengths(parent)``: token counts of partial blocks stored after ``parent``.
- ``delete(key)``; ``scan()`` yields every committed block's metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from ..index import EntryMeta
from ..metrics import Counters


class BlockTier(ABC):
    name: str = ""
    bit: int = 0
    verifies: bool = True  # whether reads check the payload checksum (tiers outside the process)

    def __init__(self, counters: Counters) -> None:
        self.counters = counters

    @abstractmethod
    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool: ...

    @abstractmethod
    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool: ...

    @abstractmethod
    def probe(self, key: bytes) -> EntryMeta | None: ...

    def tail_lengths(self, parent: bytes) -> list[int]:
        return []

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    @abstractmethod
    def scan(self) -> Iterator[EntryMeta]: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    def close(self) -> None:
        """Release resources; the tier's committed data stays."""
