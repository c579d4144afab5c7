"""tiers/memory.py: L1, ``MemoryTier``: fixed-size slots in one preallocated CPU arena.

The arena is a single ``[num_slots, slot_bytes]`` uint8 tensor, allocated on first use, once the
block size is known: private memory (page-locked when CUDA is present and ``l1.pin_memory``), or a
shared file (``arena``) that the engine's worker processes map to copy blocks straight into and out
of slots. A private, unpinned arena's pages are backed by the OS as they are first touched; a pinned
one is backed in full at allocation, and a shared one when its file is created.

A slot table maps keys to slots; eviction is the store's decision (index LRU, pins respected), so
``write`` fails when no slot is free. Reads are plain copies, with no checksum: the arena is memory
of this host that only this store and, through a shared arena (a 0600 file), the engine's own
workers write; the checksum guards the bytes that went to a disk or over a network. Copies go
through numpy (a single-threaded memcpy per row, one scatter for a batch): torch's CPU copies use
its intra-op thread pool, which collapses when the engine's own threads load every core.

``reserve`` / ``copy_in`` / ``publish`` (or ``release``) and ``slots_of`` / ``copy_out`` are the
batched paths: one scatter or a row copy per block for a whole run, and slots handed to the engine's
workers to fill or read themselves.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters
from kvstrata.worker.arena import Prefaulter, create_shared_arena, release_shared_arena
from kvstrata.tiers.base import BlockTier

log = logging.getLogger(__name__)


def _is_rows(t: Sequence[torch.Tensor] | torch.Tensor, size: int, slot_bytes: int) -> bool:
    """A contiguous CPU ``[n, slot_bytes]`` uint8 tensor: one batched index op can move it."""
    return (isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.uint8
            and t.device.type == "cpu" and t.shape[1] == size == slot_bytes and t.is_contiguous())


class MemoryTier(BlockTier):
    name = "l1"
    bit = 1

    def __init__(self, counters: Counters, capacity: int, slot_bytes: int = 0, pin: bool = True,
                 shared_path: str | None = None) -> None:
        super().__init__(counters)
        self._capacity = capacity
        self._pin = pin and torch.cuda.is_available()
        self.shared_path = shared_path
        self._lock = threading.Lock()
        self._slots: dict[bytes, tuple[int, EntryMeta]] = {}
        self._free: list[int] = []
        self.data: torch.Tensor | None = None
        self._prefault: Prefaulter | None = None
        self.slot_bytes = 0
        if slot_bytes:
            self._allocate(slot_bytes)

    def _allocate(self, slot_bytes: int) -> None:
        num_slots = self._capacity // slot_bytes
        if self.shared_path:
            self.data, self._prefault = create_shared_arena(self.shared_path, num_slots, slot_bytes)
        else:
            self.data = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=self._pin)
        self.slot_bytes = slot_bytes
        self._free = list(range(num_slots - 1, -1, -1))
        log.info("kvstrata L1: %d slots of %d bytes (pinned=%s)", num_slots, slot_bytes, self._pin)

    @property
    def num_slots(self) -> int:
        return 0 if self.data is None else self.data.shape[0]

    def fits(self, size: int) -> bool:
        """Whether a block of ``size`` bytes can ever live here."""
        return size <= (self.slot_bytes or self._capacity)

    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool:
        with self._lock:
            if meta.key in self._slots:
                return True
            if self.data is None:
                self._allocate(meta.size)
            if not self._free or meta.size > self.slot_bytes:
                return False
            slot = self._free.pop()
        self._ahead([slot])
        # Copy outside the lock into a slot nobody can see yet (copy-on-write), then publish.
        assert self.data is not None
        self.data.numpy()[slot, : meta.size] = payload[: meta.size].numpy()
        with self._lock:
            self._slots[meta.key] = (slot, meta)
        return True

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        with self._lock:
            held = self._slots.get(meta.key)
        if held is None:
            return False
        assert self.data is not None
        out[: meta.size].numpy()[:] = self.data.numpy()[held[0], : meta.size]
        return True

    # Batched paths: one index_select / index_copy_ for many blocks instead of a copy per block.
    def reserve(self, n: int, size: int) -> list[int]:
        """Take up to ``n`` free slots for blocks of ``size`` bytes (invisible until ``publish``)."""
        with self._lock:
            if self.data is None:
                self._allocate(size)
            if size > self.slot_bytes:
                return []
            k = min(n, len(self._free))
            slots = self._free[len(self._free) - k :]
            del self._free[len(self._free) - k :]
        self._ahead(slots)
        return slots

    def _ahead(self, slots: list[int]) -> None:
        if self._prefault is not None and slots:
            self._prefault.ahead_of((max(slots) + 1) * self.slot_bytes)

    def copy_in(self, slots: list[int], payloads: Sequence[torch.Tensor] | torch.Tensor, size: int) -> None:
        """Row i of ``payloads`` (uint8, >= ``size`` bytes) goes to ``slots[i]`` (from ``reserve``)."""
        if self.data is None:
            raise RuntimeError("L1 copy_in before any slot was reserved: the arena is not allocated yet")
        dst = self.data.numpy()
        if _is_rows(payloads, size, self.slot_bytes):
            dst[slots] = payloads.numpy()  # type: ignore[union-attr]  # one batched scatter
        else:
            for slot, row in zip(slots, payloads):
                dst[slot, :size] = row[:size].numpy()

    def release(self, slots: list[int]) -> None:
        """Return reserved slots that were never published."""
        with self._lock:
            self._free.extend(slots)

    def publish(self, metas: list[EntryMeta], slots: list[int]) -> None:
        with self._lock:
            for meta, slot in zip(metas, slots):
                if meta.key in self._slots:
                    self._free.append(slot)
                else:
                    self._slots[meta.key] = (slot, meta)

    def slots_of(self, keys: list[bytes]) -> list[int | None]:
        with self._lock:
            return [None if (h := self._slots.get(k)) is None else h[0] for k in keys]

    def copy_out(self, slots: list[int], out: Sequence[torch.Tensor] | torch.Tensor, size: int) -> None:
        """Gather ``slots`` into the first ``len(slots)`` rows of ``out`` (``[n, >= size]``)."""
        if self.data is None:
            raise RuntimeError("L1 copy_out before any block was stored: the arena is not allocated yet")
        src = self.data.numpy()
        for i, slot in enumerate(slots):  # numpy row copies: memcpy speed, no thread pool
            out[i][:size].numpy()[:] = src[slot, :size]

    def slot_of(self, key: bytes) -> int | None:
        with self._lock:
            held = self._slots.get(key)
        return None if held is None else held[0]

    def probe(self, key: bytes) -> EntryMeta | None:
        with self._lock:
            held = self._slots.get(key)
        return None if held is None else held[1]

    def delete(self, key: bytes) -> None:
        with self._lock:
            held = self._slots.pop(key, None)
            if held is not None:
                self._free.append(held[0])

    def close(self) -> None:
        if self.shared_path:
            release_shared_arena(self.shared_path)  # mappings stay valid until their processes drop them

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.slot_bytes

    def footprint(self, payload_bytes: int, blocks: int) -> int:
        return blocks * self.slot_bytes  # a block takes a whole slot

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
