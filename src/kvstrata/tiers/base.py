"""tiers/base.py: ``BlockTier``, the medium interface every tier implements (L1 memory, L2 disk, L3).

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
- ``delete(key)``.
- ``probe_many`` / ``read_many`` / ``write_many``: the same for a run of blocks; a tier behind a
  network overrides them to cost O(1) round trips per call instead of one per block.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists in this PID namespace (unknown counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


class BlockTier(ABC):
    name: str = ""
    bit: int = 0

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

    def probe_many(self, keys: list[bytes]) -> list[EntryMeta | None]:
        """``probe`` for consecutive blocks; may stop early at the first missing one."""
        out: list[EntryMeta | None] = []
        for key in keys:
            out.append(self.probe(key))
            if out[-1] is None:
                break
        return out

    def read_many(self, metas: list[EntryMeta], outs: list[torch.Tensor]) -> int:
        """``read`` for consecutive blocks; returns how many leading blocks were read and verified."""
        for i, (meta, out) in enumerate(zip(metas, outs)):
            if not self.read(meta, out):
                return i
        return len(metas)

    def write_many(self, metas: list[EntryMeta], payloads: list[torch.Tensor]) -> list[bool]:
        return [self.write(m, p) for m, p in zip(metas, payloads)]

    def stored_bytes(self, size: int) -> int:
        """Bytes of ``capacity_bytes`` a block of ``size`` payload bytes takes here."""
        return size

    def tenant_usage(self) -> dict[str, tuple[int, int]] | None:
        """(bytes, blocks) per tenant, for a tier that accounts its tenants itself across instances
        (Redis with ``tenants.shares.remote``); None: this process's index is the account."""
        return None

    def footprint(self, payload_bytes: int, blocks: int) -> int:
        """Bytes of ``capacity_bytes`` that ``blocks`` blocks of ``payload_bytes`` in all take here."""
        return payload_bytes + blocks * self.stored_bytes(0)

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    def sweep(self, lease_s: float) -> int:
        """Enforce capacity over blocks other instances wrote too (shared tiers). Returns removals."""
        return 0

    def close(self) -> None:
        """Release resources; the tier's committed data stays."""
