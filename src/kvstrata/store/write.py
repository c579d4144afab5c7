"""The write path: ``prepare_store`` / ``complete_store`` and ``save``, its one-call form.

Every write takes one route: blocks not validly stored yet are copied into fresh L1 slots
(``prepare_store``; the caller or ``save`` fills them), published to the index
(``complete_store``), then written through to the backing tiers, on the save threads or, with
``wait``, before returning. L2 is written at once when configured ``write: through``, else when L1
evicts the block (``evict.py`` demotes it); the shared tier is always written through. The one
other route, for a caller's memory given as ``ByteRuns``, writes straight to L2 and bypasses L1
(``direct_writes`` says whether the store allows it). Writes are copy-on-write: a block is visible
only once its bytes are complete.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from kvstrata.format.block import payload_checksum_of
from kvstrata.index import EntryMeta
from kvstrata.keys import BlockChain, Namespace
from kvstrata.tiers import BlockTier
from kvstrata.store.evict import Evictor
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import ByteRuns, Reservation

Stored = list[tuple[EntryMeta, int]]  # committed blocks and their index rows
Payloads = Sequence[torch.Tensor] | torch.Tensor


def _byte_rows(payloads: Payloads) -> Payloads:
    """Blocks as uint8 rows: a 2-D tensor stays one tensor (batched copies), else one per block."""
    if isinstance(payloads, torch.Tensor):
        flat = payloads.reshape(payloads.shape[0], -1)
        return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return [parts.reshape(-1).view(torch.uint8) for parts in payloads]


class Writer:
    def __init__(self, parts: Parts, evictor: Evictor) -> None:
        self.parts = parts
        self.evictor = evictor

    @property
    def direct_writes(self) -> bool:
        """Whether ``ByteRuns`` writes keep the write semantics: L2 write-through and no shared
        tier (``on_evict`` writes L2 from L1 slots, and the shared tier is written from L1 too)."""
        return self.parts.l2_written_through and self.parts.remote is None

    def refused(self, ns: Namespace, blocks: int) -> bool:
        """Whether saves of ``ns`` are refused now: while a reset made elsewhere has left this
        instance behind (it holds other weights: ``joins``), its blocks are written nowhere,
        counted (``not_joined_saves``)."""
        if not blocks or self.parts.epochs.joined(ns.seed):
            return False
        self.parts.counters.inc("not_joined_saves", blocks)
        return True

    # ------------------------------------------------------------------ save
    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads,
             on_done: Callable[[int], None] | None = None) -> bool:
        """Store ``chain``'s blocks not stored yet, on a save thread. See ``BlockStore.save``."""
        n = len(chain.keys)
        if self.refused(ns, n):
            return False
        reported = threading.Event()  # on_done runs exactly once, even when the job raises

        def report(k: int) -> None:
            if on_done is not None and not reported.is_set():
                reported.set()
                on_done(k)

        queued = time.perf_counter()

        def job() -> None:
            self.parts.counters.observe("save_queue_wait_seconds", time.perf_counter() - queued)
            stored = self._put_chain(ns, epoch, chain, src)
            report(len(stored))
            self.write_through(stored)

        if self.parts.saver.submit(n, job, on_fail=lambda: report(0)):
            return True
        self.parts.counters.inc("saves_dropped", n)
        return False

    def save_now(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads) -> int:
        """``save`` on the calling thread; returns the blocks stored."""
        if self.refused(ns, len(chain.keys)):
            return 0
        stored = self._put_chain(ns, epoch, chain, src)
        self.write_through(stored)
        return len(stored)

    def _todo(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> tuple[list[int], list[EntryMeta]]:
        """Indices and metadata of the blocks of ``chain`` that are not validly stored yet."""
        todo = np.flatnonzero(~self.parts.index.valid_mask(ns.seed, epoch, chain)).tolist()
        return todo, [EntryMeta(chain.keys[i], chain.parents[i], chain.fps[i], chain.lengths[i], ns.seed,
                                epoch, size, 0, chain.lengths[i] < ns.block_size) for i in todo]

    def _put_chain(self, ns: Namespace, epoch: int, chain: BlockChain, payloads: Payloads) -> Stored:
        if not chain.keys:
            return []
        rows = _byte_rows(payloads)
        if len(rows) != len(chain.keys):  # a shorter batch would be broadcast into the other slots
            raise ValueError(f"{len(rows)} payloads for a chain of {len(chain.keys)} blocks")
        todo, metas = self._todo(ns, epoch, chain, rows[0].numel() if len(rows) else 0)
        if not todo:
            return []
        if todo == list(range(todo[0], todo[0] + len(todo))):
            src = rows[todo[0] : todo[0] + len(todo)]  # a view: no gather copy
        else:
            src = [rows[i] for i in todo]
        stored = self.put_l1(metas, src)
        self.parts.counters.inc("saved_blocks", len(stored))
        return stored

    def put_l1(self, metas: list[EntryMeta], src: Payloads) -> Stored:
        """Copy blocks into fresh L1 slots (evicting LRU), then commit them."""
        res = self.evictor.reserve_slots(metas)
        if not res.slots:
            return []
        self.parts.l1.copy_in(res.slots, src[: len(res.slots)], res.metas[0].size)  # nobody sees them yet
        return self.publish(res)

    def publish(self, res: Reservation) -> Stored:
        """Make filled slots visible: L1 first, then the index."""
        parts = self.parts
        parts.l1.publish(res.metas, res.slots)
        stored = []
        for meta, row in zip(res.metas, parts.index.commit_many(res.metas, parts.l1.bit)):
            if row is None:
                parts.l1.delete(meta.key)  # key collision: the first writer keeps the key
            else:
                stored.append((meta, row))
        if stored:
            parts.counters.inc("l1_bytes_written", sum(meta.size for meta, _ in stored))
            parts.counters.tier_changed(parts.l1.name, [meta for meta, _ in stored], True)
        return stored

    # ----------------------------------------- slots the caller fills itself
    def prepare_store(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> Reservation:
        if self.refused(ns, len(chain.keys)):
            return Reservation([], [])
        _todo, metas = self._todo(ns, epoch, chain, size)
        return self.evictor.reserve_slots(metas)

    def complete_store(self, res: Reservation, success: bool = True, *, wait: bool = False) -> int:
        """See ``BlockStore.complete_store``."""
        parts = self.parts
        if not success:
            parts.l1.release(res.slots)
            return 0
        if not res.slots:
            return 0
        stored = self.publish(res)
        parts.counters.inc("saved_blocks", len(stored))
        if wait and self.direct_writes:
            self._write_l2_pinned(stored)
            return len(stored)
        if stored and (parts.remote is not None or parts.l2_written_through):
            # the shared tier is always written through (see write_through)
            queued = time.perf_counter()

            def job() -> None:
                parts.counters.observe("save_queue_wait_seconds", time.perf_counter() - queued)
                self.write_through(stored)

            if not parts.saver.submit(len(stored), job):
                parts.counters.inc("saves_dropped", len(stored))
        if wait:
            parts.saver.flush()
        return len(stored)

    def _write_l2_pinned(self, stored: Stored) -> None:
        """Write committed L1 blocks to L2 on this thread and the save threads, pinned in L1
        meanwhile, and commit the copies that were written."""
        parts = self.parts
        if not stored:
            return
        assert parts.l2 is not None and parts.l1.data is not None
        data = parts.l1.data
        with self._pinned_slots(stored) as todo:
            written = self._write_l2_now([meta for meta, _slot in todo],
                                         lambda k: [memoryview(data[todo[k][1], : todo[k][0].size].numpy())])
        self.evictor.commit(written, parts.l2)
        self.evictor.enforce_capacity(parts.l2)

    # ------------------------------------------- direct from caller memory
    def save_runs(self, ns: Namespace, epoch: int, chain: BlockChain, src: ByteRuns) -> int:
        """Write the blocks of ``chain`` not validly stored yet straight from the caller's runs to
        L2: each is checksummed by streaming, written with one ``pwritev`` to a temp file and
        published by rename; all are committed to the index once written. L1 is bypassed. The
        runs must stay unchanged until this returns."""
        if self.refused(ns, len(chain.keys)):
            return 0
        parts = self.parts
        if not self.direct_writes or parts.l2 is None:
            raise ValueError("direct writes need L2 written through and no shared tier (see direct_writes)")
        todo, metas = self._todo(ns, epoch, chain, src.size)
        done = self._write_l2_now(metas, lambda k: src.runs(todo[k]))
        stored = self.evictor.commit(done, parts.l2)
        parts.counters.inc("saved_blocks", stored)
        self.evictor.enforce_capacity(parts.l2)
        return stored

    def _write_l2_now(self, metas: list[EntryMeta], parts_of: Callable[[int], Sequence[memoryview]]) -> list[EntryMeta]:
        """Write block k (its bytes are the runs ``parts_of(k)``, checksummed as they stream) to
        L2 for every k, on this thread and the save threads together (``Saver.fan_out``). Returns
        the metas written, with their checksums; the caller commits them."""
        assert self.parts.l2 is not None
        l2, metas, ok = self.parts.l2, list(metas), [False] * len(metas)
        self.evictor.make_room(l2, sum(l2.stored_bytes(m.size) for m in metas), metas[0].ns_seed if metas else None)

        def write(k: int) -> None:
            parts = parts_of(k)
            metas[k] = metas[k]._replace(checksum=payload_checksum_of(parts))
            ok[k] = l2.write_views(metas[k], parts)

        self.parts.saver.fan_out(len(metas), write)
        return [meta for meta, good in zip(metas, ok) if good]

    # ------------------------------------------------- L1 to backing tiers
    def write_through(self, stored: Stored, tiers: list[BlockTier] | None = None) -> None:
        """Write L1-resident blocks to the backing tiers (default: all of them, if L2 is
        write-through; ``tiers`` picks some, e.g. L2 for blocks that came from the remote tier)."""
        parts = self.parts
        if tiers is None and not parts.l2_written_through:
            tiers = [parts.remote] if parts.remote is not None else []
        if not stored or tiers == []:
            return
        with self._pinned_slots(stored) as todo:
            if todo and parts.l1.data is not None:
                self.evictor.write_backing([m for m, _ in todo], [parts.l1.data[s, : m.size] for m, s in todo], tiers)
        for tier in parts.backing:  # blocks pinned during the write could not be evicted then
            self.evictor.enforce_capacity(tier)

    @contextlib.contextmanager
    def _pinned_slots(self, stored: Stored) -> Iterator[list[tuple[EntryMeta, int]]]:
        """``(meta, L1 slot)`` of the committed blocks still in L1, pinned inside the block so they
        are not evicted while written out (slots looked up under the pin: a block evicted before
        it is skipped, never misread)."""
        index = self.parts.index
        keys = [meta.key for meta, _ in stored]
        rows, lease = index.pin_keys(keys, leading=False)  # by key: a row may be reused by now
        try:
            slots = self.parts.l1.slots_of(keys)
            yield [(meta, slot) for (meta, _), slot, row in zip(stored, slots, rows.tolist())
                   if slot is not None and row >= 0]
        finally:
            if lease is not None:
                index.unpin(lease)
