"""Verified hits, the store's part: scratch slots for blocks the engine recomputes although they are
stored (``prepare_verify``), the comparison of each with its stored copy (``complete_verify``), and
what a mismatch does: the block deleted from every tier, counted, logged, and with
``verify.on_mismatch: quarantine`` the namespace served nothing more here until its epoch changes.

The adapters choose which requests are verified (``verify.sample_rate``) and make the engine
compute their prefix instead of loading it; they fill the scratch slots exactly as a save's, from
the blocks the engine computed, and name each layer's part of a block (``verify.compare.Segment``).
A scratch slot is never published: nobody but the comparison reads it, and it goes back to L1's
free slots once compared.

The comparison reads tiers (the stored copy), deletes from them (a mismatch) and writes the
verification record, so it never runs on the caller's thread, which is an engine's scheduler:
``complete_verify`` queues it for a thread of its own (``saver.Saver``'s bounded queue, at most
``verify.queue_blocks`` blocks waiting) and returns. A slow or hung tier holds up comparisons,
never a step: past the bound a verification is skipped, its slots given back, and counted
(``verify_skipped``), as are blocks whose stored copy no tier could read.

Which copy is compared: the stored block is read from a tier chosen at random among those that
hold it (L1, L2, the shared tier), then from the others if that read fails. Reading the copy a
load would use (L1 first) would leave a wrong shared-tier copy, the one every other instance
loads, unchecked for as long as this instance holds a right one in L1.

A partial block (a prompt's tail) is verified where the caller asks (``tails=True``) and its
segments say which token each value is of (``compare.TokenMap``): over its tokens' values only.

Counted per tier the stored block was read from (``verify_checks_<tier>``,
``verify_mismatches_<tier>``), per namespace in ``stats()["verify"]`` and in the namespace's
verification record beside its epoch (``verify/record.py``; ``kvstrata stats`` of any process reads
it), and each block's worst error is a sample of ``verify_error`` (a histogram). This process adds
to the record at once after a mismatch, at most every ``RECORD_EVERY_S`` after checks (at
``sample_rate`` 1.0 not a write per check), and at ``BlockStore.close`` (``close``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvstrata.index import EntryMeta
from kvstrata.keys import BlockChain, Namespace
from kvstrata.store.evict import Evictor
from kvstrata.store.parts import Parts
from kvstrata.store.protocol import Reservation
from kvstrata.store.saver import Saver
from kvstrata.verify.compare import TOLERANCES, Comparison, Segment, comparable, compare
from kvstrata.verify.record import Mismatch, Record, decode as decode_record, encode as encode_record, mismatch

log = logging.getLogger(__name__)
RECORD_EVERY_S = 10.0  # the most often a namespace's record is written for checks alone

# ``verify.tolerances`` names a KV dtype as vLLM's ``kv_cache_dtype`` does
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class Tally:
    """One namespace's verification figures in this process (``total``), and the part of them not
    yet added to its record beside the epoch (``pending``)."""

    total: Record = Record()
    pending: Record = Record()
    written: float = -float("inf")  # time.monotonic() of the last write of the record

    def add(self, checks: int, last: Mismatch | None = None) -> None:
        delta = Record(checks, int(last is not None), last)
        self.total, self.pending = self.total.added(delta), self.pending.added(delta)


@dataclass
class Verifier:
    parts: Parts
    evictor: Evictor
    _tallies: dict[bytes, Tally] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the tallies
    _writing: threading.Lock = field(default_factory=threading.Lock)  # one read-add-write of a record at a time
    _failing: bool = False  # a record write failed last time: say so once per failing spell
    rng: random.Random = field(default_factory=random.Random)  # which tier's copy is compared

    def __post_init__(self) -> None:
        tolerances = dict(TOLERANCES)
        for name, value in self.parts.config.verify.tolerances.items():
            tolerances[DTYPE_NAMES[name]] = value
        self.tolerances = tolerances
        self._queue = Saver(self.parts.config.verify.queue_blocks, threads=1, name="verify")

    # ------------------------------------------------------------ slots
    def prepare_verify(self, ns: Namespace, epoch: int, chain: BlockChain, size: int, *,
                       tails: bool = False) -> Reservation:
        """Scratch L1 slots for the blocks of ``chain`` that are validly stored now (what
        ``prepare_store`` leaves out): ``res.metas[i]`` names the block the caller copies into
        ``res.slots[i]``. Partial blocks only with ``tails`` (the caller's segments then say which
        token each value is of: past its tokens the engine's block holds other bytes). Never
        published; ``complete_verify`` gives the slots back."""
        if not chain.keys:
            return Reservation([], [])
        stored = self.parts.index.valid_mask(ns.seed, epoch, chain)
        bs = ns.block_size
        metas = [EntryMeta(chain.keys[i], chain.parents[i], chain.fps[i], chain.lengths[i], ns.seed, epoch, size, 0,
                           chain.lengths[i] < bs)
                 for i in np.flatnonzero(stored).tolist() if chain.lengths[i] == bs or (tails and chain.lengths[i] < bs)]
        return self.evictor.reserve_slots(metas)

    def complete_verify(self, res: Reservation, segments: Sequence[Segment], success: bool = True, *,
                        wait: bool = False) -> list[Comparison]:
        """Compare each filled scratch slot of ``res`` with the stored block of its key, give the
        slots back, and delete every stored block that differs (see the module docstring): on the
        comparison thread, returning at once (``[]``; skipped and counted when its queue is full),
        or, with ``wait``, on this thread, returning the comparisons made, in ``res`` order of the
        blocks compared. Blocks no tier holds any more, or whose stored copy cannot be read, are
        not compared."""
        parts = self.parts
        if not success or not res.slots or parts.l1.data is None:
            parts.l1.release(res.slots)
            return []
        if wait:
            return self._compare(res, segments)
        if not self._queue.submit(len(res.slots), lambda: self._compare(res, segments)):
            parts.l1.release(res.slots)
            parts.counters.inc("verify_skipped", len(res.slots))
            log.debug("kvstrata: %d blocks not verified: %d blocks already wait for their comparison "
                      "(verify.queue_blocks; a slow tier?)", len(res.slots), self.parts.config.verify.queue_blocks)
        return []

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued comparison is done (``BlockStore.wait_verified``)."""
        return self._queue.flush(timeout)

    def _compare(self, res: Reservation, segments: Sequence[Segment]) -> list[Comparison]:
        """The comparisons of ``res`` (see ``complete_verify``); its slots go back in any case."""
        try:
            return self._compare_slots(res, segments)
        finally:
            self.parts.l1.release(res.slots)

    def _compare_slots(self, res: Reservation, segments: Sequence[Segment]) -> list[Comparison]:
        parts = self.parts
        data = parts.l1.data
        assert data is not None
        keys = [m.key for m in res.metas]
        rows, lease = parts.index.pin_keys(keys, leading=False)  # each stored copy stays while read
        done: list[tuple[EntryMeta, str, Comparison]] = []
        unread = 0
        try:
            metas = parts.index.metas(np.maximum(rows, 0), keys)
            bits = parts.index.tiers_of(np.maximum(rows, 0)).tolist()
            stored = torch.empty(res.metas[0].size, dtype=torch.uint8)
            for i, (meta, row) in enumerate(zip(metas, rows.tolist())):
                if row < 0 or meta is None or meta.size != res.metas[i].size or meta.ntok != res.metas[i].ntok:
                    continue
                tokens = meta.ntok if res.metas[i].tail else None
                if not comparable(segments, tokens):
                    unread += 1
                    continue
                tier = self._read(meta, bits[i], stored)
                if tier is None:
                    unread += 1
                    continue
                done.append((meta, tier, compare(stored, data[res.slots[i], : meta.size], segments,
                                                 self.tolerances, tokens)))
        finally:
            if lease is not None:
                parts.index.unpin(lease)
        if unread:
            parts.counters.inc("verify_skipped", unread)
        for meta, tier, result in done:  # unpinned: a mismatching block's L1 copy can go at once
            self._count(meta, tier, result)
        self.record()
        return [result for _meta, _tier, result in done]

    def _read(self, meta: EntryMeta, bits: int, out: torch.Tensor) -> str | None:
        """The stored copy of ``meta`` into ``out``, from a tier chosen at random among those that
        hold it, then the others in turn if that read fails: that tier's name, or None if unread."""
        parts = self.parts
        holders = [tier for tier in parts.tiers if bits & tier.bit]
        if not holders:
            return None
        first = self.rng.randrange(len(holders))
        for tier in holders[first:] + holders[:first]:
            if tier.read(meta, out):
                return tier.name
            if tier is not parts.l1:
                parts.index.drop_tier(meta.key, tier.bit)  # the tier dropped a bad copy
        return None

    # -------------------------------------------------------- mismatches
    def _count(self, meta: EntryMeta, tier: str, result: Comparison) -> None:
        counters = self.parts.counters
        counters.inc(f"verify_checks_{tier}")
        counters.observe("verify_error", min(result.error, 1e9))
        if result.ok:
            with self._lock:
                self._tallies.setdefault(meta.ns_seed, Tally()).add(1)
            return
        counters.inc(f"verify_mismatches_{tier}")
        segment = int(result.worst)
        last = mismatch(time.time(), meta.key, tier, result.error, result.tolerance, segment)
        with self._lock:
            self._tallies.setdefault(meta.ns_seed, Tally()).add(1, last)
        removed = self.condemn(meta.key)
        quarantine = self.parts.config.verify.on_mismatch == "quarantine"
        log.error("kvstrata: verified hit MISMATCH: block %s of namespace %s (epoch %d), served from %s, differs "
                  "from the engine's own computation: relative error %.3g > %.3g in segment %d; writer unknown "
                  "(blocks carry no writer id). Deleted from %s%s. A key input is missing from the namespace "
                  "or the block was written wrong: see docs/consistency.md 'Verified hits'",
                  meta.key.hex(), meta.ns_seed.hex()[:16], meta.epoch, tier, result.error, result.tolerance, segment,
                  ", ".join(removed) or "no tier (already gone)",
                  "; the namespace is quarantined here until its epoch changes" if quarantine else "")
        if quarantine:
            self.parts.quarantine.hold(meta.ns_seed, meta.epoch)

    def condemn(self, key: bytes) -> list[str]:
        """Delete block ``key`` from every tier and hide it from lookups at once (``index.retire``:
        no epoch validates it any more, pinned or not). Backing copies are deleted now (a reader
        of one fails its read and recomputes); the L1 copy now unless pinned by a load, else when
        L1 evicts it. Returns the tiers it was deleted from."""
        parts = self.parts
        retired = parts.index.retire(key)
        if retired is None:
            return []
        meta, bits = retired
        removed = []
        for tier in parts.backing:
            if bits & tier.bit:
                tier.delete(key)
                if meta.tail and hasattr(tier, "delete_tail_marker"):
                    tier.delete_tail_marker(meta.parent, meta.ntok, key)
                parts.index.drop_tier(key, tier.bit)
                parts.counters.tier_changed(tier.name, [meta], False)
                removed.append(tier.name)
        if bits & parts.l1.bit and parts.index.claim(key, parts.l1.bit):
            parts.l1.delete(key)
            parts.counters.tier_changed(parts.l1.name, [meta], False)
            removed.insert(0, parts.l1.name)
        parts.counters.inc("verify_deleted_blocks")
        return removed

    def figures(self) -> dict[str, dict[str, object]]:
        """Per namespace (seed hex) in this process: checks, mismatches, the last mismatch, and
        whether quarantined. Every process's together: ``stats()["verified"]``, from the records."""
        held = self.parts.quarantine.seeds()
        with self._lock:
            return {seed.hex(): {**t.total.as_dict(), "quarantined": seed in held} for seed, t in self._tallies.items()}

    # ------------------------------------------------------------ records
    def record(self, force: bool = False) -> None:
        """Add what this process verified since its last write to each namespace's record beside
        its epoch: after a mismatch at once, after checks alone once ``RECORD_EVERY_S`` have passed
        since the last write, or now with ``force``. Never raises: a failure is logged, and what
        it would have added waits for the next write."""
        now = time.monotonic()
        with self._lock:
            due = {seed: t.pending for seed, t in self._tallies.items() if t.pending.checks
                   and (force or t.pending.mismatches or now - t.written >= RECORD_EVERY_S)}
            for seed in due:
                self._tallies[seed].pending, self._tallies[seed].written = Record(), now
        if not due:
            return
        with self._writing:  # this process's writers never race each other; other processes may
            for seed, delta in due.items():
                if not self._add_to_record(seed, delta):
                    with self._lock:
                        tally = self._tallies[seed]
                        tally.pending = delta.added(tally.pending)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued comparisons (waiting ``timeout`` at most), then write what every
        namespace's record still lacks (``BlockStore.close``)."""
        self._queue.close(timeout)
        self.record(force=True)

    def _add_to_record(self, seed: bytes, delta: Record) -> bool:
        """Read, add ``delta``, write back. Two processes doing so at once lose one's ``delta``
        (seconds of its checks): a lock shared by hosts would cost more than the figures are worth."""
        epochs = self.parts.epochs
        try:
            raw = epochs.verify_record(seed)
            stored = None if raw is None else decode_record(raw)
            if raw is not None and stored is None:
                self.parts.counters.inc("bad_verify_records")
                log.warning("kvstrata: the verification record of namespace %s held %d bytes that are not one "
                            "(damaged, or not written by kvstrata); replaced, its totals restart here",
                            seed[:8].hex(), len(raw))
            written = epochs.record_verify(seed, encode_record((stored or Record()).added(delta)))
        except OSError as e:  # the I/O edge: the record is for people, never worth an engine step
            log.log(logging.DEBUG if self._failing else logging.WARNING, "kvstrata: cannot read the verification "
                    "record of namespace %s (%s); kept for the next write", seed[:8].hex(), e)
            written = False
        self._failing = not written
        return written
