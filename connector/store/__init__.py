"""The tiered block store: index + L1 memory + backing tiers (L2 disk, later shared tiers).

Primitives (all thread-safe):
- ``lookup(ns, tokens, extra)``: hash the prompt into chained keys and return the longest valid
  stored prefix, possibly ending in a stored partial block. Index only: backing tiers are asked for
  128-byte headers of blocks another process stored, never for payloads.
- ``load(hit, out)``: copy the hit's blocks into ``out``, fastest tier first, verifying checksums
  of bytes that come from outside the process. A bad copy is deleted, counted, and it and every
  block after it are reported as not loaded, so the engine recomputes them. L2 hits are promoted.
- ``save(ns, epoch, chain, payloads, on_done)``: queue a save and return at once; refused (and
  counted) when the queue is full. ``put`` is the same, synchronously.
- ``load_direct`` / ``put_direct``: the same for an engine's own memory given as byte runs per
  block (SGLang's host pool): disk reads and writes go straight between it and the files, with no
  L1 copy (L1-resident blocks are still served from L1).
- ``invalidate(ns)``: bump the namespace epoch; older entries are invisible from that instant.
- ``gc()``, ``stats()``, ``close()``.

Writes are copy-on-write: a block is copied into a fresh slot or file and only then committed to
the index, so a reader never sees a partial block.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from ..blockfmt import payload_checksum, payload_checksum_of
from ..config import StrataConfig, check_fits_one_block
from ..epochs import EpochStore, FileEpochs, MemoryEpochs
from ..index import BlockIndex, EntryMeta
from ..keys import NO_EXTRA, BlockChain, Namespace, as_tokens, block_key, chain_keys, root_key
from ..metrics import Counters
from .saver import Saver
from ..tiers import REMOTE_BACKENDS, BlockTier, DiskTier, MemoryTier

log = logging.getLogger(__name__)
_EVICT_BATCH = 16


class Reservation(NamedTuple):
    """L1 slots handed out for blocks being written; invisible until committed."""

    metas: list[EntryMeta]
    slots: list[int]


class Hit(NamedTuple):
    """A validated stored prefix. ``chain`` lists the blocks to load, in order."""

    ns: Namespace
    epoch: int
    chain: BlockChain
    tiers: list[int]  # tier bit set per block, at lookup time
    lease: int | None

    @property
    def num_blocks(self) -> int:
        return len(self.chain.keys)

    @property
    def num_tokens(self) -> int:
        return sum(self.chain.lengths)


def _byte_rows(payloads: Sequence[torch.Tensor] | torch.Tensor) -> Sequence[torch.Tensor] | torch.Tensor:
    """Blocks as uint8 rows: a 2-D tensor stays one tensor (batched copies), else one per block."""
    if isinstance(payloads, torch.Tensor):
        flat = payloads.reshape(payloads.shape[0], -1)
        return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    return [p.reshape(-1).view(torch.uint8) for p in payloads]


def _slice(chain: BlockChain, start: int, stop: int | None = None) -> BlockChain:
    return BlockChain(*(part[start:stop] for part in chain))


class BlockStore:
    def __init__(self, config: StrataConfig | None = None, *, l1_slot_bytes: int = 0,
                 l1_shared_path: str | None = None) -> None:
        """``l1_shared_path`` puts the L1 arena in a file other local processes can map (the
        engine's workers copy KV in and out of it); ``l1_slot_bytes`` fixes the slot size now
        instead of at the first save."""
        self.config = config = config or StrataConfig()
        if l1_slot_bytes:
            check_fits_one_block(config, l1_slot_bytes)
        self.counters = Counters()
        self.index = BlockIndex(key_bits=config.testing.key_bits, lease_s=config.lease_seconds)
        self.l1 = MemoryTier(self.counters, config.l1.size, l1_slot_bytes, config.l1.pin_memory,
                             l1_shared_path)
        self.backing: list[BlockTier] = []
        self.l2: DiskTier | None = None
        self.epochs: EpochStore = MemoryEpochs()
        if config.l2.enabled:
            self.l2 = DiskTier(self.counters, config.l2.path, config.l2.size, config.l2.fsync,
                               config.testing.l2_write_delay_ms / 1000)
            self.backing.append(self.l2)
            self.epochs = FileEpochs(config.l2.path / "epochs")
            self._recover(self.l2)
        self.remote: BlockTier | None = None
        if config.remote.enabled:  # the shared tier also holds the epochs every instance obeys
            floor = config.l2.path / "epochs" if config.l2.enabled else None  # the disk remembers
            self.remote, self.epochs = REMOTE_BACKENDS[config.remote.backend](self.counters, config.remote, floor)
            self.backing.append(self.remote)
        self._evict_lock = threading.Lock()
        self._saver = Saver(config.saves.queue_blocks, config.saves.threads)

    @property
    def tiers(self) -> list[BlockTier]:
        return [self.l1, *self.backing]

    def _recover(self, tier: DiskTier) -> None:
        """Rebuild the index from committed files (oldest first, for LRU); drop dead temp files."""
        found = sorted(tier.scan_files(), key=lambda item: item[2], reverse=True)  # newest first
        self.index.commit_many([meta for meta, _path, _mtime in found], tier.bit)
        if found:
            log.info("kvstrata: recovered %d blocks (%d bytes) from %s", len(found), tier.used_bytes, tier.root)

    # ------------------------------------------------------------------ lookup
    def chain(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA,
              *, partial: bool = True) -> tuple[int, BlockChain]:
        """Current epoch and the chained keys of ``tokens`` (full blocks, then the partial tail)."""
        epoch = self.epochs.get(ns.seed)
        return epoch, chain_keys(root_key(ns.seed, epoch), as_tokens(tokens), ns.block_size, extra, partial=partial)

    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA,
               *, pin: bool = False) -> Hit:
        tokens = as_tokens(tokens)
        epoch, chain = self.chain(ns, tokens, extra)
        if pin:  # validated and pinned in one index call: the common, whole-prompt hit is done
            rows_full, lease = self.index.match_pinned(ns.seed, epoch, chain)
        else:
            rows_full, lease = self.index.match_rows(ns.seed, epoch, chain), None
        n = len(rows_full)
        if n == len(chain.keys):
            self.counters.inc("lookups")
            self.counters.inc("lookup_hit_blocks", n)
            return Hit(ns, epoch, chain, self.index.tiers_of(rows_full).tolist(), lease)
        if lease is not None:  # adoption or a tail extends the hit: pin it all by key below
            self.index.unpin(lease)
        n += self._match(ns.seed, epoch, chain, n)  # blocks another process stored, by header
        hit = chain if n == len(chain.keys) else _slice(chain, 0, n)
        if n < len(chain.keys):
            tail = self._match_tail(ns, epoch, chain.parents[n], tokens[n * ns.block_size :], extra)
            if tail is not None:
                hit = BlockChain(*(a + b for a, b in zip(hit, tail)))
        return self._hit(ns, epoch, hit, pin)

    def lookup_chain(self, ns: Namespace, epoch: int, chain: BlockChain, *, pin: bool = False) -> Hit:
        """Like ``lookup`` for a chain built by the caller (``keys.chain_digests``): the longest
        valid stored prefix of ``chain``, from the index and tier headers only."""
        n = self._match(ns.seed, epoch, chain, 0)
        return self._hit(ns, epoch, _slice(chain, 0, n), pin)

    def _hit(self, ns: Namespace, epoch: int, chain: BlockChain, pin: bool) -> Hit:
        """The validated run ``chain`` as a Hit. With ``pin``, its rows are looked up by key and
        pinned in one index call: a block dropped since validation (its row possibly reused by
        another block) ends the hit there instead of being read under another block's row."""
        if pin:
            rows, lease = self.index.pin_keys(chain.keys)
        else:
            rows, lease = self.index.rows_of(chain.keys), None
            gone = np.flatnonzero(rows < 0)
            rows = rows[: gone[0]] if len(gone) else rows
        if len(rows) < len(chain.keys):
            chain = _slice(chain, 0, len(rows))
        self.counters.inc("lookups")
        self.counters.inc("lookup_hit_blocks", len(rows))
        return Hit(ns, epoch, chain, self.index.tiers_of(rows).tolist(), lease)

    def current_epoch(self, ns: Namespace) -> int:
        return self.epochs.get(ns.seed)

    def _match(self, seed: bytes, epoch: int, chain: BlockChain, start: int) -> int:
        """Leading valid run from ``start``; blocks other processes stored are adopted by header."""
        n = start
        total = len(chain.keys)
        while n < total:
            n += self.index.match(seed, epoch, chain, n)
            if n == total or not self._adopt(seed, epoch, chain, n):
                break
        return n - start

    def _adopt(self, seed: bytes, epoch: int, chain: BlockChain, i: int) -> bool:
        """Commit the blocks from ``i`` on that a backing tier holds under their keys (one batched
        header probe per tier: O(1) round trips for a remote tier)."""
        size = self._block_size(chain, i)
        for tier in self.backing:
            metas = tier.probe_many(chain.keys[i:])
            good = []
            for j, meta in enumerate(metas):
                k = i + j
                if (meta is None or meta.ns_seed != seed or meta.epoch != epoch or meta.parent != chain.parents[k]
                        or meta.fp != chain.fps[k] or meta.ntok != chain.lengths[k]):
                    break
                if meta.size != (size or meta.size):  # every block of a namespace has one size
                    self.counters.inc("adopt_wrong_size")
                    break
                size = meta.size
                good.append(meta)
            if good:
                self.index.commit_many(good, tier.bit)
                return self.index.match(seed, epoch, chain, i) > 0
        return False

    def _block_size(self, chain: BlockChain, i: int) -> int:
        """The byte size every block of ``chain`` must have (0: not known yet): the L1 slot size
        when it is fixed, else the size of the block before ``i``. A header from a backing tier
        claiming another size is forged or foreign: staged, it would fill part of a slot and leave
        the rest of it stale."""
        if self.l1.slot_bytes:
            return self.l1.slot_bytes
        if i:
            rows = self.index.rows_of(chain.keys[i - 1 : i])
            if len(rows) and rows[0] >= 0:
                meta = self.index.metas(rows[:1], chain.keys[i - 1 : i])[0]
                if meta is not None:
                    return meta.size
        return 0

    def _match_tail(self, ns: Namespace, epoch: int, parent: bytes, rest: np.ndarray,
                    extra: bytes) -> BlockChain | None:
        """A stored partial block after ``parent`` whose tokens begin ``rest``, longest first."""
        lengths = set(self.index.tail_lengths(parent))
        for tier in self.backing:
            lengths.update(tier.tail_lengths(parent))
        for ntok in sorted(lengths, reverse=True):
            if ntok >= ns.block_size or ntok > len(rest):
                continue
            key, fp = block_key(parent, rest[:ntok], extra)
            one = BlockChain([key], [parent], [fp], [ntok])
            if self._match(ns.seed, epoch, one, 0):
                return one
        return None

    def release(self, hit: Hit) -> None:
        if hit.lease is not None:
            self.index.unpin(hit.lease)

    # -------------------------------------------------------------------- load
    def load(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Copy the hit's blocks into ``out[i]``; returns how many leading blocks are valid."""
        keys = hit.chain.keys
        if not keys:
            return 0
        with self._leading(hit) as (rows, usable):
            bits = self.index.tiers_of(rows[:usable])
            slots = self.l1.slots_of(keys[:usable])
            run = 0
            while run < usable and bits[run] & self.l1.bit and slots[run] is not None:
                run += 1
            if run:
                self.l1.copy_out(slots[:run], out, self.index.meta(int(rows[0])).size)  # type: ignore[arg-type]
                self.counters.inc("hit_blocks_l1", run)
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
        rows, lease = self.index.pin_keys(hit.chain.keys)
        try:
            yield rows, len(rows)
        finally:
            if lease is not None:
                self.index.unpin(lease)

    def _count_failures(self, loaded: int, wanted: int) -> None:
        if loaded < wanted:
            self.counters.inc("load_failures")
            self.counters.inc("load_failed_blocks", wanted - loaded)

    def _fetch(self, rows: np.ndarray, keys: list[bytes], outs: list[torch.Tensor], promote: bool) -> int:
        """Read blocks into ``outs``: from L1 where resident, else from the first backing tier
        that has them, one batched ``read_many`` per run of blocks on the same tier. Bad copies are
        dropped by the tier and forgotten here. Returns how many leading blocks were read; with
        ``promote`` those read from backing tiers are copied into L1 (and from a remote tier, also
        written to L2 in the background: local tiers cache the shared one)."""
        metas = self.index.metas(rows, keys)
        bad = next((i for i, m in enumerate(metas) if m is None), None)
        if bad is not None:  # never read a row that is not the block asked for
            if self.index.rows_of(keys[bad : bad + 1])[0] == rows[bad]:
                self.counters.inc("load_blocks_dropped_meanwhile")  # found damaged by another reader
            else:  # the caller pins the rows, so this is a bug, not a race
                log.error("kvstrata: index row %d no longer holds block %s; not loaded", rows[bad], keys[bad].hex())
                self.counters.inc("row_key_mismatches")
            rows, metas = rows[:bad], metas[:bad]
        bits = self.index.tiers_of(rows).tolist()
        i = 0
        while i < len(rows):
            if bits[i] & self.l1.bit and self.l1.read(metas[i], outs[i]):
                self.counters.inc("hit_blocks_l1")
                i += 1
                continue
            tier = next((t for t in self.backing if bits[i] & t.bit), None)
            if tier is None:
                return i
            j = i + 1
            while j < len(rows) and bits[j] & tier.bit and not bits[j] & self.l1.bit:
                j += 1
            got = tier.read_many(metas[i:j], outs[i:j])
            if got:
                self.counters.inc(f"hit_blocks_{tier.name}", got)
                if promote:
                    stored = self._put_l1(metas[i : i + got], outs[i : i + got])
                    if tier is self.remote and self.l2 is not None and stored:
                        self._saver.submit(len(stored), lambda s=stored: self._write_through(s, [self.l2]))
            if got < j - i:
                self.index.drop_tier(keys[i + got], tier.bit)  # the tier dropped a bad copy
                bits[i + got] &= ~tier.bit
                i += got
                if not any(bits[i] & t.bit for t in self.backing):
                    return i
                continue  # another tier may still hold it
            i = j
        return len(rows)

    # -------------------------------------------------------------------- save
    def save(self, ns: Namespace, epoch: int, chain: BlockChain,
             payloads: Sequence[torch.Tensor] | torch.Tensor,
             on_done: Callable[[int], None] | None = None) -> bool:
        """Queue a save of ``chain``'s blocks; False (and counted) if the queue is full.

        ``payloads[i]`` is block i's bytes (a uint8 view is taken); they must stay unchanged until
        ``on_done(blocks_stored)`` is called.
        """
        n = len(chain.keys)
        reported = threading.Event()  # on_done runs exactly once, even when the job raises

        def report(k: int) -> None:
            if on_done is not None and not reported.is_set():
                reported.set()
                on_done(k)

        def job() -> None:
            stored = self._put_chain(ns, epoch, chain, payloads)
            report(len(stored))
            self._write_through(stored)

        if self._saver.submit(n, job, on_fail=lambda: report(0)):
            return True
        self.counters.inc("saves_dropped", n)
        return False

    def put(self, ns: Namespace, epoch: int, chain: BlockChain,
            payloads: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Synchronous save. Returns the number of blocks newly stored."""
        stored = self._put_chain(ns, epoch, chain, payloads)
        self._write_through(stored)
        return len(stored)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves (tests, shutdown)."""
        return self._saver.flush(timeout)

    def _metas(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> tuple[list[int], list[EntryMeta]]:
        """Indices and metadata of the blocks of ``chain`` that are not validly stored yet."""
        todo = np.flatnonzero(~self.index.valid_mask(ns.seed, epoch, chain)).tolist()
        return todo, [EntryMeta(chain.keys[i], chain.parents[i], chain.fps[i], chain.lengths[i], ns.seed,
                                epoch, size, 0, chain.lengths[i] < ns.block_size) for i in todo]

    def _put_chain(self, ns: Namespace, epoch: int, chain: BlockChain,
                   payloads: Sequence[torch.Tensor] | torch.Tensor) -> list[tuple[EntryMeta, int]]:
        if not chain.keys:
            return []
        rows = _byte_rows(payloads)
        if len(rows) != len(chain.keys):  # a shorter batch would be broadcast into the other slots
            raise ValueError(f"{len(rows)} payloads for a chain of {len(chain.keys)} blocks")
        todo, metas = self._metas(ns, epoch, chain, rows[0].numel() if len(rows) else 0)
        if not todo:
            return []
        if todo == list(range(todo[0], todo[0] + len(todo))):
            src = rows[todo[0] : todo[0] + len(todo)]  # a view: no gather copy
        else:
            src = [rows[i] for i in todo]
        stored = self._put_l1(metas, src)
        self.counters.inc("saved_blocks", len(stored))
        return stored

    def _put_l1(self, metas: list[EntryMeta], src: Sequence[torch.Tensor] | torch.Tensor) -> list[tuple[EntryMeta, int]]:
        """Copy blocks into fresh L1 slots (evicting LRU), then commit them. Returns (meta, row)."""
        res = self._reserve(metas)
        if not res.slots:
            return []
        self.l1.copy_in(res.slots, src[: len(res.slots)], res.metas[0].size)  # nobody sees them yet
        return self._publish(res)

    def _reserve(self, metas: list[EntryMeta]) -> Reservation:
        if not metas:
            return Reservation([], [])
        size = metas[0].size
        if any(m.size != size for m in metas) or not self.l1.fits(size):
            self.counters.inc("l1_too_large" if not self.l1.fits(size) else "l1_mixed_sizes")
            return Reservation([], [])
        with self._evict_lock:
            slots = self.l1.reserve(len(metas), size)
            while len(slots) < len(metas):
                victims = self.index.lru_victims(self.l1.bit, len(metas) - len(slots))
                if not victims:
                    self.counters.inc("l1_full", len(metas) - len(slots))
                    break
                for row in victims:
                    self._evict_l1(row)
                slots += self.l1.reserve(len(metas) - len(slots), size)
        return Reservation(metas[: len(slots)], slots)

    def _publish(self, res: Reservation) -> list[tuple[EntryMeta, int]]:
        self.l1.publish(res.metas, res.slots)
        stored = []
        for meta, row in zip(res.metas, self.index.commit_many(res.metas, self.l1.bit)):
            if row is None:
                self.l1.delete(meta.key)  # key collision: the first writer keeps the key
            else:
                stored.append((meta, row))
        return stored

    # ------------------------------------------- zero-copy writes and staging
    def reserve(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> Reservation:
        """Fresh L1 slots for the blocks of ``chain`` not stored yet (a prefix of them if L1 is
        full). Nobody can see the slots until ``commit``; the caller fills ``l1.data[slot]``."""
        _todo, metas = self._metas(ns, epoch, chain, size)
        return self._reserve(metas)

    def commit(self, res: Reservation) -> int:
        """Publish filled slots (index first sees them now) and queue their write-through."""
        if not res.slots:
            return 0
        stored = self._publish(res)
        self.counters.inc("saved_blocks", len(stored))
        writes_now = self.remote is not None or (self.l2 is not None and self.config.l2.write == "through")
        if stored and writes_now:  # the shared tier is always written through (see _write_through)
            if not self._saver.submit(len(stored), lambda: self._write_through(stored)):
                self.counters.inc("saves_dropped", len(stored))
        return len(stored)

    def commit_written(self, res: Reservation) -> int:
        """``commit``, then write the blocks through to L2 on this thread and the save threads
        (``_fan_out``) before returning, for a caller that would wait for the write-through
        anyway; needs ``direct_writes``. The blocks stay pinned in L1 while they are written."""
        assert self.l2 is not None and self.direct_writes, "commit_written needs L2 write-through"
        if not res.slots:
            return 0
        stored = self._publish(res)
        self.counters.inc("saved_blocks", len(stored))
        if not stored:
            return 0
        data = self.l1.data
        assert data is not None
        with self._pinned_slots(stored) as todo:
            written = self._write_l2_now([meta for meta, _slot in todo],
                                         lambda k: [memoryview(data[todo[k][1], : todo[k][0].size].numpy())])
        self.index.commit_many(written, self.l2.bit)
        self._enforce_capacity(self.l2)
        return len(stored)

    def abort(self, res: Reservation) -> None:
        """Give back slots of a reservation that will not be committed."""
        self.l1.release(res.slots)

    def stage(self, hit: Hit) -> int:
        """Make the hit's blocks resident in L1 (reading backing tiers, verifying checksums).

        Returns how many leading blocks are now in L1; the rest of the prefix is not usable.
        """
        keys = hit.chain.keys
        rows, lease = self.index.pin_keys(keys)
        if lease is None:
            return 0
        try:
            usable = len(rows)
            slots = self.l1.slots_of(keys[:usable])
            first = next((i for i, s in enumerate(slots) if s is None), usable)
            if first == usable:
                return usable
            todo = self.index.metas(rows[first:usable], keys[first:usable])
            if any(m is None for m in todo):
                return first
            res = self._reserve(todo)  # type: ignore[arg-type]
            if not res.slots:
                return first
            assert self.l1.data is not None
            views = [self.l1.data[s, : m.size] for s, m in zip(res.slots, res.metas)]
            n = len(res.slots)
            got = self._fetch(rows[first : first + n], keys[first : first + n], views, promote=False)
            if got < len(res.slots):
                self.l1.release(res.slots[got:])
                self.counters.inc("load_failures")
            stored = self._publish(Reservation(res.metas[:got], res.slots[:got]))
            if self.remote is not None and self.l2 is not None and stored:  # local copy of remote blocks
                self._saver.submit(len(stored), lambda: self._write_through(stored, [self.l2]))
            return first + got
        finally:
            self.index.unpin(lease)

    # ------------------------------- direct disk I/O on the caller's memory
    @property
    def direct_writes(self) -> bool:
        """Whether ``put_direct`` keeps the write semantics: L2 write-through and no shared tier
        (``on_evict`` writes L2 from L1 slots, and the shared tier is written from L1 too)."""
        return self.l2 is not None and self.config.l2.write == "through" and self.remote is None

    def load_direct(self, hit: Hit, dest: Callable[[int], Sequence[memoryview]],
                    from_l1: Callable[[int, int], None]) -> int:
        """Load the hit's blocks into the caller's memory with no staging copy.

        Block i comes from its L1 slot where resident (``from_l1(i, slot)`` copies it), else from
        the disk tier straight into ``dest(i)`` (the block's runs, ``meta.size`` bytes in all;
        one ``preadv``, checksum verified). Blocks only a shared tier holds, or whose disk copy
        failed while a shared tier holds them, are staged through L1 as in ``stage``. Returns how
        many leading blocks were loaded; ``dest`` of the first failed block holds garbage."""
        keys = hit.chain.keys
        if not keys:
            return 0
        with self._leading(hit) as (rows, usable):
            bits = self.index.tiers_of(rows[:usable]).tolist()
            slots = self.l1.slots_of(keys[:usable])
            l2_bit = self.l2.bit if self.l2 is not None else 0
            n = from_mem = 0
            while n < usable:
                slot = slots[n]
                if bits[n] & self.l1.bit and slot is not None:
                    from_l1(n, slot)
                    from_mem += 1
                elif bits[n] & l2_bit:
                    assert self.l2 is not None
                    meta = self.index.metas(rows[n : n + 1], keys[n : n + 1])[0]
                    if meta is None or not self.l2.read_views(meta, dest(n)):
                        self.index.drop_tier(keys[n], l2_bit)  # the tier dropped a bad copy
                        break
                else:
                    break
                n += 1
            if from_mem:
                self.counters.inc("hit_blocks_l1", from_mem)
            if n - from_mem:
                self.counters.inc("hit_blocks_l2", n - from_mem)
            if n < usable and self.remote is not None:
                n += self._load_staged(Hit(hit.ns, hit.epoch, _slice(hit.chain, n, usable), [], None), n, from_l1)
            self._count_failures(n, len(keys))
            return n

    def _load_staged(self, rest: Hit, first: int, from_l1: Callable[[int, int], None]) -> int:
        """Stage ``rest`` through L1 (other tiers), then copy it out; its rows are pinned."""
        got = self.stage(rest)
        slots = self.l1.slots_of(rest.chain.keys[:got])
        done = next((i for i, s in enumerate(slots) if s is None), got)
        for i in range(done):
            from_l1(first + i, slots[i])  # type: ignore[arg-type]
        return done

    def put_direct(self, ns: Namespace, epoch: int, chain: BlockChain, size: int,
                   src: Callable[[int], Sequence[memoryview]]) -> int:
        """Store the blocks of ``chain`` not validly stored yet straight from the caller's memory
        to the disk tier (needs ``direct_writes``): block i's bytes are the runs ``src(i)``,
        checksummed by streaming and written with one ``pwritev`` to a temp file, published by
        rename and committed to the index once all are written; L1 is bypassed. Blocks are
        written by this thread and idle save threads together (``_fan_out``); ``src`` must stay
        unchanged until this returns. Returns how many blocks were stored."""
        assert self.l2 is not None and self.direct_writes, "put_direct needs L2 write-through"
        todo, metas = self._metas(ns, epoch, chain, size)
        done = self._write_l2_now(metas, lambda k: src(todo[k]))
        stored = sum(row is not None for row in self.index.commit_many(done, self.l2.bit)) if done else 0
        self.counters.inc("saved_blocks", stored)
        self._enforce_capacity(self.l2)
        return stored

    def _write_l2_now(self, metas: list[EntryMeta], parts_of: Callable[[int], Sequence[memoryview]]) -> list[EntryMeta]:
        """Write block k (its bytes are the runs ``parts_of(k)``, checksummed as they stream) to
        L2 for every k, on this thread and the save threads together (``_fan_out``). Returns the
        metas written, with their checksums; the caller commits them."""
        assert self.l2 is not None
        l2, metas, ok = self.l2, list(metas), [False] * len(metas)
        self._make_room(l2, sum(l2.stored_bytes(m.size) for m in metas))

        def write(k: int) -> None:
            parts = parts_of(k)
            metas[k] = metas[k]._replace(checksum=payload_checksum_of(parts))
            ok[k] = l2.write_views(metas[k], parts)

        self._fan_out(len(metas), write)
        return [meta for meta, good in zip(metas, ok) if good]

    def _fan_out(self, n: int, fn: Callable[[int], None]) -> None:
        """Run ``fn(0)`` .. ``fn(n - 1)`` on this thread and up to ``saves.threads`` save threads,
        and return when every call has finished. File writes release the GIL, so the kernel's
        page-cache copies of different blocks overlap. Items are taken from a shared counter, so
        a save thread busy with queued saves just finds nothing left: this never waits for
        unrelated jobs, and is safe to call from a save thread."""
        helpers = min(self.config.saves.threads, n - 1)
        if helpers <= 0:
            for k in range(n):
                fn(k)
            return
        items = iter(range(n))
        cond = threading.Condition()
        finished = [0]

        def drain() -> None:
            while True:
                with cond:
                    k = next(items, None)
                if k is None:
                    return
                try:
                    fn(k)
                finally:
                    with cond:
                        finished[0] += 1
                        cond.notify_all()

        for _ in range(helpers):
            if not self._saver.submit(0, drain):
                break
        drain()
        with cond:
            cond.wait_for(lambda: finished[0] == n)

    def l1_slots(self, hit: Hit) -> list[int | None]:
        return self.l1.slots_of(hit.chain.keys)

    def submit(self, n_blocks: int, job: Callable[[], None],
               on_fail: Callable[[], None] | None = None) -> bool:
        """Run ``job`` on the background queue (False, and nothing queued, when it is full);
        ``on_fail`` runs if it raises."""
        return self._saver.submit(n_blocks, job, on_fail)

    def _evict_l1(self, row: int) -> None:
        meta = self.index.meta(row)
        demote = (self.l2 is not None and self.config.l2.write == "on_evict"
                  and not int(self.index.tiers_of(np.array([row]))[0]) & self.l2.bit)
        if demote:
            rows, lease = self.index.pin_keys([meta.key])  # the slot must not be reused mid-write
            try:
                slot = self.l1.slot_of(meta.key) if lease is not None else None
                if slot is not None and self.l1.data is not None:
                    self.write_backing([meta], [self.l1.data[slot, : meta.size]])
                    self.counters.inc("l1_demoted")
            finally:
                if lease is not None:
                    self.index.unpin(lease)
        if self.index.claim(meta.key, self.l1.bit):
            self.l1.delete(meta.key)
            self.counters.inc("l1_evicted")

    def _write_through(self, stored: list[tuple[EntryMeta, int]], tiers: list[BlockTier] | None = None) -> None:
        """Write L1-resident blocks to the backing tiers (default: all of them, if L2 is
        write-through; ``tiers`` picks some, e.g. L2 for blocks that came from the remote tier)."""
        if tiers is None and (self.l2 is None or self.config.l2.write != "through"):
            tiers = [self.remote] if self.remote is not None else []
        if not stored or tiers == []:
            return
        with self._pinned_slots(stored) as todo:
            if todo and self.l1.data is not None:
                self.write_backing([m for m, _ in todo], [self.l1.data[s, : m.size] for m, s in todo], tiers)
        for tier in self.backing:  # blocks pinned during the write could not be evicted then
            self._enforce_capacity(tier)

    @contextlib.contextmanager
    def _pinned_slots(self, stored: list[tuple[EntryMeta, int]]) -> Iterator[list[tuple[EntryMeta, int]]]:
        """``(meta, L1 slot)`` of the committed blocks still in L1, pinned inside the block so they
        are not evicted while written out (slots looked up under the pin: a block evicted before
        it is skipped, never misread)."""
        keys = [meta.key for meta, _ in stored]
        rows, lease = self.index.pin_keys(keys, leading=False)  # by key: a row may be reused by now
        try:
            slots = self.l1.slots_of(keys)
            yield [(meta, slot) for (meta, _), slot, row in zip(stored, slots, rows.tolist())
                   if slot is not None and row >= 0]
        finally:
            if lease is not None:
                self.index.unpin(lease)

    def write_backing(self, metas: list[EntryMeta], payloads: Sequence[torch.Tensor],
                      tiers: list[BlockTier] | None = None) -> int:
        """Checksum blocks and publish them on the backing tiers (default: all), then commit them.

        Used by write-through, demotion and the benchmark. Returns how many the first tier took.
        """
        metas = [m._replace(checksum=payload_checksum(memoryview(p[: m.size].numpy())))
                 for m, p in zip(metas, payloads)]
        first = 0
        for tier in self.backing if tiers is None else tiers:
            self._make_room(tier, sum(tier.stored_bytes(m.size) for m in metas))
            ok = tier.write_many(metas, list(payloads))
            done = [m for m, good in zip(metas, ok) if good]
            self.index.commit_many(done, tier.bit)
            self._enforce_capacity(tier)
            first = first or len(done)
        return first

    def _enforce_capacity(self, tier: BlockTier) -> None:
        self._make_room(tier, 0)

    def _make_room(self, tier: BlockTier, nbytes: int) -> None:
        """Evict least recently used blocks of ``tier`` until ``nbytes`` more fit in its capacity.

        Called before a batch is written, so a tier never holds more than its capacity (a disk
        tier also refuses a write its capacity has no room for: a concurrent writer may have
        taken the room meanwhile, and that block is then dropped, not the bound exceeded)."""
        while tier.used_bytes + nbytes > tier.capacity_bytes:
            victims = self.index.lru_victims(tier.bit, _EVICT_BATCH)
            dropped = 0
            for row in victims:
                if tier.used_bytes + nbytes <= tier.capacity_bytes:
                    return
                if self._drop_from(tier, row):
                    dropped += 1
                    self.counters.inc(f"{tier.name}_evicted")
            if not dropped:  # nothing evictable (all pinned or claimed by others meanwhile)
                return

    def _drop_from(self, tier: BlockTier, row: int) -> bool:
        meta = self.index.meta(row)
        if not self.index.claim(meta.key, tier.bit):
            return False
        tier.delete(meta.key)
        if meta.tail and isinstance(tier, DiskTier):
            tier.delete_tail_marker(meta.parent, meta.ntok, meta.key)
        return True

    # ------------------------------------------------------- invalidation, GC
    def invalidate(self, ns_seed: bytes) -> int:
        """Bump the namespace epoch: from now on no older entry is served. Returns the new epoch."""
        epoch = self.epochs.bump(ns_seed)
        self.counters.inc("invalidations")
        log.info("kvstrata: namespace %s is now at generation %016x", ns_seed[:8].hex(), epoch)
        self.gc(only=[ns_seed])
        return epoch

    def namespaces(self) -> list[bytes]:
        seeds = {meta.ns_seed for _, meta, _ in self.index.entries()}
        return sorted(seeds | set(self.epochs.known()))

    def gc(self, only: list[bytes] | None = None) -> dict[str, int]:
        """Reclaim unpinned entries of older epochs, then enforce every tier's capacity."""
        removed = Counter[str]()
        for seed in only or self.namespaces():
            for row in self.index.stale_rows(seed, self.epochs.get(seed)):
                bits = int(self.index.tiers_of(np.array([row]))[0])
                for tier in self.tiers:
                    if bits & tier.bit and self._drop_from(tier, row):
                        removed[tier.name] += 1
        for tier in self.backing:
            self._enforce_capacity(tier)
            swept = tier.sweep(self.config.lease_seconds)
            if swept:
                removed[tier.name] += swept
        self.counters.inc("gc_removed", sum(removed.values()))
        return dict(removed)

    # ------------------------------------------------------------------- stats
    def stats(self) -> dict[str, object]:
        tiers = {t.name: {"blocks": 0, "bytes": 0, "capacity_bytes": t.capacity_bytes} for t in self.tiers}
        spaces: dict[str, dict[str, dict[str, int]]] = {}
        for _row, meta, bits in self.index.entries():
            per_epoch = spaces.setdefault(meta.ns_seed[:8].hex(), {}).setdefault(
                f"{meta.epoch:016x}", {"blocks": 0, "bytes": 0})
            per_epoch["blocks"] += 1
            per_epoch["bytes"] += meta.size
            for t in self.tiers:
                if bits & t.bit:
                    tiers[t.name]["blocks"] += 1
                    tiers[t.name]["bytes"] += meta.size
        current = {s[:8].hex(): f"{self.epochs.get(s):016x}" for s in self.namespaces()}
        return {"tiers": tiers, "namespaces": spaces, "current_epochs": current,
                "counters": self.counters.snapshot()}

    def close(self) -> None:
        self._saver.close()
        self.epochs.close()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
