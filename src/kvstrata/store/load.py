"""``load``: a hit's blocks into a destination (tensors, the caller's byte runs, or L1 itself).

Each load pins the hit's keys for its duration (``_leading``), so no block it reads is evicted
or has its row or slot reused meanwhile, whatever lease the hit holds. Blocks come from L1 where
resident (one batched copy for the leading L1 run), else from the first backing tier that holds
them, one batched ``read_many`` per run of blocks on the same tier, checksums verified. A bad
copy is dropped by its tier and forgotten here, and the load stops before it. Blocks read from a
backing tier into tensors or into L1 are kept in L1 (promoted); those read from the shared tier
are also written to L2 in the background: the local tiers cache the shared one.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from kvstrata.store.evict import Evictor
from kvstrata.store.lookup import chain_slice
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import ByteRuns, Hit, Reservation
from kvstrata.store.write import Writer

log = logging.getLogger(__name__)


class Loader:
    def __init__(self, parts: Parts, writer: Writer, evictor: Evictor) -> None:
        self.parts = parts
        self.writer = writer
        self.evictor = evictor

    # ------------------------------------------------------------ tensors
    def load_into(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Copy the hit's blocks into ``out[i]``; returns how many leading blocks are valid."""
        parts = self.parts
        keys = hit.chain.keys
        if not keys:
            return 0
        with self._leading(hit) as (rows, usable):
            bits = parts.index.tiers_of(rows[:usable])
            slots = parts.l1.slots_of(keys[:usable])
            run = 0
            while run < usable and bits[run] & parts.l1.bit and slots[run] is not None:
                run += 1
            if run:
                parts.l1.copy_out(slots[:run], out, parts.index.meta(int(rows[0])).size)  # type: ignore[arg-type]
                parts.counters.inc("hit_blocks_l1", run)
            if run < usable:
                outs = [out[i] for i in range(run, usable)]
                usable = run + self._fetch(rows[run:usable], keys[run:usable], outs, promote=True)
            self._count_failures(usable, len(keys))
            return usable

    @contextlib.contextmanager
    def _leading(self, hit: Hit) -> Iterator[tuple[np.ndarray, int]]:
        """The index rows of the leading run of the hit's keys still stored, and its length; they
        are looked up and pinned in one index call and stay pinned inside the block (a second pin
        where the hit holds a lease already: the load never depends on that lease's deadline)."""
        index = self.parts.index
        rows, lease = index.pin_keys(hit.chain.keys)
        try:
            yield rows, len(rows)
        finally:
            if lease is not None:
                index.unpin(lease)

    def _count_failures(self, loaded: int, wanted: int) -> None:
        if loaded < wanted:
            self.parts.counters.inc("load_failures")
            self.parts.counters.inc("load_failed_blocks", wanted - loaded)

    def _fetch(self, rows: np.ndarray, keys: list[bytes], outs: list[torch.Tensor], promote: bool) -> int:
        """Read blocks into ``outs``: from L1 where resident, else from the first backing tier
        that has them. Returns how many leading blocks were read; with ``promote`` those read from
        backing tiers are copied into L1 (and from the shared tier, also written to L2)."""
        parts = self.parts
        metas = parts.index.metas(rows, keys)
        bad = next((i for i, m in enumerate(metas) if m is None), None)
        if bad is not None:  # never read a row that is not the block asked for
            if parts.index.rows_of(keys[bad : bad + 1])[0] == rows[bad]:
                parts.counters.inc("load_blocks_dropped_meanwhile")  # found damaged by another reader
            else:  # the caller pins the rows, so this is a bug, not a race
                log.error("kvstrata: index row %d no longer holds block %s; not loaded", rows[bad], keys[bad].hex())
                parts.counters.inc("row_key_mismatches")
            rows, metas = rows[:bad], metas[:bad]
        bits = parts.index.tiers_of(rows).tolist()
        i = 0
        while i < len(rows):
            if bits[i] & parts.l1.bit and parts.l1.read(metas[i], outs[i]):
                parts.counters.inc("hit_blocks_l1")
                i += 1
                continue
            tier = next((t for t in parts.backing if bits[i] & t.bit), None)
            if tier is None:
                return i
            j = i + 1
            while j < len(rows) and bits[j] & tier.bit and not bits[j] & parts.l1.bit:
                j += 1
            got = tier.read_many(metas[i:j], outs[i:j])
            if got:
                parts.counters.inc(f"hit_blocks_{tier.name}", got)
                if promote:
                    stored = self.writer.put_l1(metas[i : i + got], outs[i : i + got])
                    if tier is parts.remote and parts.l2 is not None and stored:
                        parts.saver.submit(len(stored), lambda s=stored: self.writer.write_through(s, [parts.l2]))
            if got < j - i:
                parts.index.drop_tier(keys[i + got], tier.bit)  # the tier dropped a bad copy
                bits[i + got] &= ~tier.bit
                i += got
                if not any(bits[i] & t.bit for t in parts.backing):
                    return i
                continue  # another tier may still hold it
            i = j
        return len(rows)

    # ------------------------------------------------------------ L1
    def stage(self, hit: Hit, local_copy: bool = True) -> int:
        """Make the hit's blocks resident in L1 (reading backing tiers, verifying checksums).
        Returns how many leading blocks are now in L1; the rest of the prefix is not usable.
        With ``local_copy``, blocks read from the shared tier are written to L2 too."""
        parts = self.parts
        keys = hit.chain.keys
        rows, lease = parts.index.pin_keys(keys)
        if lease is None:
            return 0
        try:
            usable = len(rows)
            slots = parts.l1.slots_of(keys[:usable])
            first = next((i for i, s in enumerate(slots) if s is None), usable)
            if first == usable:
                return usable
            todo = parts.index.metas(rows[first:usable], keys[first:usable])
            if any(m is None for m in todo):
                return first
            res = self.evictor.reserve_slots(todo)  # type: ignore[arg-type]
            if not res.slots:
                return first
            assert parts.l1.data is not None
            views = [parts.l1.data[s, : m.size] for s, m in zip(res.slots, res.metas)]
            n = len(res.slots)
            got = self._fetch(rows[first : first + n], keys[first : first + n], views, promote=False)
            if got < len(res.slots):
                parts.l1.release(res.slots[got:])
                parts.counters.inc("load_failures")
            stored = self.writer.publish(Reservation(res.metas[:got], res.slots[:got]))
            # a local copy of the blocks that came from the shared tier
            if local_copy and parts.remote is not None and parts.l2 is not None and stored:
                parts.saver.submit(len(stored), lambda: self.writer.write_through(stored, [parts.l2]))
            return first + got
        finally:
            parts.index.unpin(lease)

    def stage_later(self, hit: Hit, on_done: Callable[[int | None], None], local_copy: bool = True) -> bool:
        """``stage`` on a save thread; ``on_done(n)`` hears how many leading blocks are in L1, or
        None if the job raised. False (and nothing queued) when the queue is full."""
        missing = sum(s is None for s in self.parts.l1.slots_of(hit.chain.keys))
        return self.parts.saver.submit(missing, lambda: on_done(self.stage(hit, local_copy)),
                                       on_fail=lambda: on_done(None))

    # ------------------------------------------------------ caller's memory
    def load_runs(self, hit: Hit, runs: ByteRuns) -> int:
        """Load the hit's blocks into the caller's memory with no staging copy.

        Block i comes from its L1 slot where resident (``runs.from_l1(i, slot)`` copies it), else
        from the disk tier straight into ``runs.runs(i)`` (one ``preadv``, checksum verified).
        Blocks only a shared tier holds, or whose disk copy failed while a shared tier holds
        them, are staged through L1 as in ``stage``. Returns how many leading blocks were loaded;
        the runs of the first failed block hold garbage."""
        parts = self.parts
        from_l1 = runs.from_l1
        if from_l1 is None:
            raise ValueError("a load into ByteRuns needs from_l1, for blocks resident in L1")
        keys = hit.chain.keys
        if not keys:
            return 0
        with self._leading(hit) as (rows, usable):
            bits = parts.index.tiers_of(rows[:usable]).tolist()
            slots = parts.l1.slots_of(keys[:usable])
            l2_bit = parts.l2.bit if parts.l2 is not None else 0
            n = from_mem = 0
            while n < usable:
                slot = slots[n]
                if bits[n] & parts.l1.bit and slot is not None:
                    from_l1(n, slot)
                    from_mem += 1
                elif bits[n] & l2_bit:
                    assert parts.l2 is not None
                    meta = parts.index.metas(rows[n : n + 1], keys[n : n + 1])[0]
                    if meta is None or not parts.l2.read_views(meta, runs.runs(n)):
                        parts.index.drop_tier(keys[n], l2_bit)  # the tier dropped a bad copy
                        break
                else:
                    break
                n += 1
            if from_mem:
                parts.counters.inc("hit_blocks_l1", from_mem)
            if n - from_mem:
                parts.counters.inc("hit_blocks_l2", n - from_mem)
            if n < usable and parts.remote is not None:
                rest = Hit(hit.ns, hit.epoch, chain_slice(hit.chain, n, usable), [], None)
                n += self._stage_rest(rest, n, from_l1)
            self._count_failures(n, len(keys))
            return n

    def _stage_rest(self, rest: Hit, first: int, from_l1: Callable[[int, int], None]) -> int:
        """Stage ``rest`` through L1 (other tiers), then copy it out; its rows are pinned."""
        got = self.stage(rest)
        slots = self.parts.l1.slots_of(rest.chain.keys[:got])
        done = next((i for i, s in enumerate(slots) if s is None), got)
        for i in range(done):
            from_l1(first + i, slots[i])  # type: ignore[arg-type]
        return done
