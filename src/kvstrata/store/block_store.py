"""The tiered block store: index + L1 memory + backing tiers (L2 disk, the shared tier).

``BlockStore`` is the facade every caller uses; its primitives are listed in ``protocol.py``.
It composes one part per concern, each in its own module:

- ``parts.py``: the shared pieces (index, tiers, epochs, counters, save threads, key scheme),
  built from the config, reading no block file.
- ``scopes.py``: every namespace asked about, under the store's key scheme.
- ``recovery.py``: L2's blocks into the index in a background thread (lookups adopt them by
  header meanwhile; ``wait_recovered``).
- ``lookup.py``: ``lookup`` / ``lookup_chain`` (and the pin of ``prepare_load``).
- ``groups.py``: ``lookup_groups``, one boundary for all the KV-cache groups of a hybrid model.
- ``load.py``: ``load`` into tensors, byte runs or L1.
- ``write.py``: ``prepare_store`` / ``complete_store`` and ``save``.
- ``evict.py``: L1 slots by LRU eviction and demotion, tier capacities, ``gc``.
- ``bumps.py``: ``invalidate`` (a flush) and ``reset`` (an engine's, after new weights), and the
  namespaces' descriptors kept beside their epochs (``describe``).
- ``saver.py``: the bounded background queue and its threads.

``describe`` and ``descriptors`` (what a namespace is, kept beside its epoch) are here: they are
start-up and CLI calls, done through the epoch store (``epochs/descriptors.py`` says what is kept).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from kvstrata.config import StrataConfig
from kvstrata.epochs.base import EpochStore
from kvstrata.index import BlockIndex
from kvstrata.keys import NO_EXTRA, BlockChain, Extra, Namespace
from kvstrata.metrics import Counters, TierListener
from kvstrata.tiers import BlockTier, DiskTier, MemoryTier
from kvstrata.tiers.disk import IOV_MAX
from kvstrata.store.evict import Evictor
from kvstrata.store.keying import KeyMethods
from kvstrata.store.groups import GroupLookup
from kvstrata.store.load import Loader
from kvstrata.store.lookup import Lookup
from kvstrata.store.parts import open_parts
from kvstrata.store import report, served
from kvstrata.store.bumps import Bumps
from kvstrata.store.recovery import Recovery
from kvstrata.store.scopes import Scopes
from kvstrata.store.shares import TenantGauges
from kvstrata.store.protocol import Arena, ByteRuns, GroupHit, GroupRule, Hit, Reservation, StoreFigures
from kvstrata.verify.compare import Comparison, Segment
from kvstrata.store.verify import Verifier
from kvstrata.store.write import Payloads, Writer

log = logging.getLogger(__name__)


class BlockStore(KeyMethods):
    """The store protocol (``protocol.StoreProtocol``) over one index, L1 and the backing tiers.

    Every key is computed with the store's key scheme (``keys``, from ``keys.hash``), and every
    namespace it is given is taken under that scheme (``scopes.Scopes``)."""

    def __init__(self, config: StrataConfig | None = None, *, l1_slot_bytes: int = 0,
                 l1_shared_path: str | None = None, key_bits: int = 128) -> None:
        """``l1_shared_path`` puts the L1 arena in a file other local processes can map (the
        engine's workers copy KV in and out of it); ``l1_slot_bytes`` fixes the slot size now
        instead of at the first save. ``key_bits``: the index's key width, 128 in every
        deployment (no setting reaches it); narrower only where a test or ``kvstrata torture``
        forces index collisions, which validation must reject."""
        self.config = config or StrataConfig()
        self._parts = open_parts(self.config, l1_slot_bytes, l1_shared_path, key_bits)
        self._evictor = Evictor(self._parts)
        self._writer = Writer(self._parts, self._evictor)
        self._lookups = Lookup(self._parts)
        self._group_lookups = GroupLookup(self._parts)
        self._loader = Loader(self._parts, self._writer, self._evictor)
        self._arena = Arena(self._parts.l1)
        self._scopes = Scopes(self._parts.keys.name, self._parts.tenants)
        self._tenant_gauges = TenantGauges()
        self._bumps = Bumps(self._parts, self._evictor)
        self._verifier = Verifier(self._parts, self._evictor)
        if self._parts.recovery is not None:
            self._parts.recovery.start(then=self._evictor.after_recovery)

    # ------------------------------------------------ for engine glue: what the tiers are, figures
    @property
    def arena(self) -> Arena:
        """The read-only view of the L1 arena (slots, the shared file) for engines that copy KV in
        and out of its slots themselves."""
        return self._arena

    @property
    def tier_bits(self) -> dict[str, int]:
        """Each tier's name and its bit in ``Hit.tiers``, fastest first: ``l1``, then ``l2`` and
        ``remote`` where configured."""
        return {tier.name: tier.bit for tier in self._parts.tiers}

    def snapshot(self) -> dict[str, int]:
        """Every counter now (``metrics.METRICS`` names those the engines export)."""
        return self._parts.counters.snapshot()

    def figures(self, last: Mapping[str, int] | None = None) -> StoreFigures:
        """What an engine's metrics export: every counter now, the latency samples observed since
        the previous call (each handed out once), and the gauges of ``resident``, read only when a
        counter differs from ``last`` (the counters of the caller's previous report; None: always)."""
        return report.figures(self._parts, self._tenant_gauges, last)

    def listen(self, listener: TierListener) -> None:
        """``listener(tier name, metas, stored)`` hears every batch of blocks committed to
        (``stored``) or removed from a tier, on the thread that did it (vLLM's KV events)."""
        self._parts.counters.listen(listener)

    # The shared pieces, for tools, checks and tests; engine glue never uses them
    # (tests/test_protocol.py holds the adapters to the protocol).
    counters: Counters = property(lambda self: self._parts.counters)  # type: ignore[assignment]
    index: BlockIndex = property(lambda self: self._parts.index)  # type: ignore[assignment]
    epochs: EpochStore = property(lambda self: self._parts.epochs)  # type: ignore[assignment]
    l1: MemoryTier = property(lambda self: self._parts.l1)  # type: ignore[assignment]
    l2: DiskTier | None = property(lambda self: self._parts.l2)  # type: ignore[assignment]
    remote: BlockTier | None = property(lambda self: self._parts.remote)  # type: ignore[assignment]
    tiers: list[BlockTier] = property(lambda self: self._parts.tiers)  # type: ignore[assignment]

    @property
    def recovery(self) -> Recovery | None:
        """L2's background recovery (None without L2), for the CLI's progress."""
        return self._parts.recovery

    # ---------------------------------------------------------------- lookup
    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = NO_EXTRA,
               *, pin: bool = False) -> Hit:
        """The longest valid stored prefix of ``tokens``, possibly ending in a stored partial
        block. With ``pin`` (vLLM's ``prepare_load``) the hit's blocks are pinned until
        ``complete_load(hit)``; ``hit.tiers`` says where each was at lookup time. Timed
        (``lookup_seconds``)."""
        self._serving()
        started = time.perf_counter()
        hit = self._lookups.lookup(self._scopes.own(ns), tokens, extra, pin=pin)
        self._parts.counters.observe("lookup_seconds", time.perf_counter() - started)
        return hit

    def lookup_chain(self, ns: Namespace, epoch: int, chain: BlockChain, *, pin: bool = False) -> Hit:
        """``lookup`` for a chain the caller built (``page_chain``); no partial tails."""
        self._serving()
        started = time.perf_counter()
        hit = self._lookups.lookup_chain(self._scopes.own(ns), epoch, chain, pin=pin)
        self._parts.counters.observe("lookup_seconds", time.perf_counter() - started)
        return hit

    def lookup_groups(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra,
                      rules: Sequence[GroupRule], *, lo: int, hi: int, pin: bool) -> GroupHit:
        """For a hybrid model's KV-cache groups (one ``GroupRule`` each, keyed under
        ``KeyScheme.group_root``): the largest block boundary N, ``lo < N <= hi``, at which every group
        has the blocks it must load (full: ``[lo, N)``; window: those its window reaches; state:
        the block ending at N), and those blocks per group; one N for all, or a miss. With ``pin``
        each group's blocks are pinned until ``complete_load(hit.hits[g])``. Timed
        (``lookup_seconds``)."""
        self._serving()
        started = time.perf_counter()
        hit = self._group_lookups.lookup_groups(self._scopes.own(ns), tokens, extra, rules, lo=lo, hi=hi, pin=pin)
        self._parts.counters.observe("lookup_seconds", time.perf_counter() - started)
        return hit

    def _serving(self) -> None:
        """Tell L2's background recovery, if still running, to make way for a request."""
        recovery = self._parts.recovery
        if recovery is not None and not recovery.done:
            recovery.note_request()

    def complete_load(self, hit: Hit) -> None:
        """Give back the pin of a pinned lookup (nothing for an unpinned one)."""
        if hit.lease is not None:
            self._parts.index.unpin(hit.lease)

    def stored_mask(self, ns: Namespace, epoch: int, chain: BlockChain) -> np.ndarray:
        """Which blocks of ``chain`` are validly stored now (bool per block)."""
        return self._parts.index.valid_mask(self._scopes.own(ns).seed, epoch, chain)

    # ------------------------------------------------------------------ load
    # Each load is timed here, labelled by the outermost tier it may read (``load_seconds_<tier>``).
    def load_into(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Copy the hit's blocks into ``out``, one uint8 row per block (a tensor ``[n, >= size]``
        or a list); returns how many leading blocks are valid (the engine recomputes the rest)."""
        return self._timed(hit, lambda: self._loader.load_into(hit, out))

    def load_runs(self, hit: Hit, runs: ByteRuns) -> int:
        """Load the hit's blocks into the caller's memory (SGLang's host pool): L1-resident ones
        through ``runs.from_l1``, disk ones straight into ``runs.runs(i)`` (needs ``direct_reads``),
        the rest staged through L1. Returns how many leading blocks are valid."""
        return self._timed(hit, lambda: self._loader.load_runs(hit, runs))

    def stage(self, hit: Hit, *, local_copy: bool = True) -> int:
        """Make the hit's blocks resident in L1 (``arena.slots(hit)`` then names their slots);
        returns how many leading blocks are. Blocks read from the shared tier are also written to
        L2 in the background unless ``local_copy`` is False."""
        return self._timed(hit, lambda: self._loader.stage(hit, local_copy=local_copy))

    def stage_later(self, hit: Hit, on_done: Callable[[int | None], None], *, local_copy: bool = True) -> bool:
        """``stage`` on a save thread: ``on_done(n)`` hears how many leading blocks are in L1
        (None if the job failed); False, and nothing queued, when the queue is full. Timed from
        now to the end of the job (its wait in the queue included)."""
        self._serving()
        started, sample = time.perf_counter(), served.load_sample(self._parts, hit)

        def done(n: int | None) -> None:
            self._parts.counters.observe(sample, time.perf_counter() - started)
            on_done(n)

        return self._loader.stage_later(hit, done, local_copy=local_copy)

    def _timed(self, hit: Hit, load: Callable[[], int]) -> int:
        self._serving()
        started, sample = time.perf_counter(), served.load_sample(self._parts, hit)
        n = load()
        self._parts.counters.observe(sample, time.perf_counter() - started)
        return n

    def origins(self, hit: Hit) -> list[str]:
        """Per block of ``hit``, the tier a load serves it from now: ``l1`` where resident in an L1
        slot, else the first backing tier that holds it (``l1`` for a block no tier holds any
        more: the load stops before it)."""
        return served.origins(self._parts, hit)

    def count_served(self, origins: Sequence[str], tokens: Sequence[int], *, copied_from_l1: bool = True,
                     l1_bytes: int = 0) -> None:
        """The engine took the leading blocks of a hit: block i from tier ``origins[i]`` (see
        ``origins``) with ``tokens[i]`` of its tokens. Counts ``hit_tokens_<tier>``; with
        ``copied_from_l1`` (the engine copied the L1 blocks out of their slots itself, after a
        ``stage``) ``hit_blocks_l1`` for them (blocks of backing tiers were counted by the reads
        that brought them in, and ``load_into``/``load_runs`` count their own); ``l1_bytes_read``
        bytes the engine copied out of L1 slots; and ``served_tokens``, all of them."""
        served.count_served(self._parts, origins, tokens, copied_from_l1, l1_bytes)

    # ----------------------------------------------------------------- store
    def prepare_store(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> Reservation:
        """Fresh L1 slots for the blocks of ``chain`` not stored yet (a prefix of them if L1 is
        full): the caller fills ``arena.data[slot, :size]`` for ``res.slots`` (``res.metas``
        name the blocks), then calls ``complete_store``. Nobody can see the slots until then. No
        slots while this instance has not joined the namespace's epoch (see ``reset``)."""
        return self._writer.prepare_store(self._scopes.own(ns), epoch, chain, size)

    def complete_store(self, res: Reservation, success: bool = True, *, wait: bool = False) -> int:
        """Publish the filled slots of ``res`` (the index sees them from now on) and write them
        through, on the save threads or, with ``wait``, before returning; or, with ``success``
        False (a slot was not filled), give the slots back. Returns the blocks published."""
        return self._writer.complete_store(res, success, wait=wait)

    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads,
             on_done: Callable[[int], None] | None = None) -> bool:
        """Store the blocks of ``chain`` not validly stored yet, on a save thread: ``src[i]`` is
        block i's bytes (tensors; a uint8 view is taken), copied into L1 and written through from
        there. Returns at once: False (and counted) when the queue is full. ``src`` must stay
        unchanged until ``on_done(blocks_stored)`` (0 if the job failed). Also False (and counted,
        ``not_joined_saves``) while this instance has not joined the namespace's epoch."""
        return self._writer.save(self._scopes.own(ns), epoch, chain, src, on_done)

    def save_now(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads) -> int:
        """``save`` on the calling thread; returns the blocks stored."""
        return self._writer.save_now(self._scopes.own(ns), epoch, chain, src)

    def save_runs(self, ns: Namespace, epoch: int, chain: BlockChain, runs: ByteRuns) -> int:
        """Store the blocks of ``chain`` not validly stored yet straight from the caller's memory
        to L2, bypassing L1 (needs ``direct_writes``); returns the blocks stored."""
        return self._writer.save_runs(self._scopes.own(ns), epoch, chain, runs)

    # ---------------------------------------------------------- verified hits
    def prepare_verify(self, ns: Namespace, epoch: int, chain: BlockChain, size: int, *,
                       tails: bool = False) -> Reservation:
        """Scratch L1 slots for the full blocks of ``chain`` that *are* stored (``prepare_store``
        reserves the others), and with ``tails`` its stored partial blocks: the caller fills them
        with the blocks the engine computed for those keys, as for a save, then calls
        ``complete_verify``. Never published (``verify.py``)."""
        return self._verifier.prepare_verify(self._scopes.own(ns), epoch, chain, size, tails=tails)

    def complete_verify(self, res: Reservation, segments: Sequence[Segment], success: bool = True, *,
                        wait: bool = False) -> list[Comparison]:
        """Compare the filled scratch slots with the stored blocks (per ``segments``: each layer's
        part of a block, in its dtype; a partial block over its tokens' values, ``Segment.tokens``)
        and give the slots back; a stored block that differs is deleted from every tier, counted
        and logged (``verify.on_mismatch``). On a thread of its own, never the caller's (it reads
        and deletes from tiers): returns ``[]`` at once, or skips and counts it
        (``verify_skipped``) when ``verify.queue_blocks`` blocks already wait. ``wait``: on this
        thread, returning the comparisons (tests, tools). With ``success`` False (a slot was not
        filled) only the slots go back."""
        return self._verifier.complete_verify(res, segments, success, wait=wait)

    @property
    def direct_writes(self) -> bool:
        """Whether ``save_runs`` may be used, and ``complete_store(wait=True)`` writes L2 on the
        calling thread and the save threads together: L2 written through, no shared tier."""
        return self._writer.direct_writes

    @property
    def direct_reads(self) -> bool:
        """Whether ``load_runs`` reads disk blocks straight into the runs (an L2 exists)."""
        return self._parts.l2 is not None

    @property
    def max_runs(self) -> int:
        """The most runs one block of ``ByteRuns`` may have: one ``preadv``/``pwritev`` moves the
        block's header and its runs together."""
        return IOV_MAX - 1

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait until the background scan has brought every L2 block into the index (True), or
        ``timeout`` seconds (False). Serving never needs it (lookups find blocks by header); the
        figures of ``stats`` and the LRU order are complete only after it."""
        recovery = self._parts.recovery
        return recovery is None or recovery.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves (tests, shutdown)."""
        return self._parts.saver.flush(timeout)

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Wait until every queued comparison of verified hits is done (``complete_verify`` runs
        them on a thread of its own): settled figures for tests and tools."""
        return self._verifier.wait_idle(timeout)

    # ------------------------------------------------- invalidation, gc, stats
    def invalidate(self, ns_seed: bytes) -> int | None:
        """A flush (no weights changed: ``kvstrata invalidate``): bump the namespace epoch, keeping
        its generation, so that from now on no older entry is served, and every instance adopts
        the new epoch. Returns the new epoch, or None when it could not be written where the other
        instances read it (the shared tier is unreachable): counted (``invalidation_failures``) and
        logged. This instance then serves nothing of the namespace until the new epoch is written
        (retried at every use); the other instances go on with the old one until then."""
        return self._bumps.flush(self._scopes.seed(ns_seed))

    def reset(self, ns_seed: bytes) -> int | None:
        """The engine's reset after a weight update (vLLM's ``reset_prefix_cache(reset_connector=
        True)``, ``kvstrata invalidate --weights``): no older entry is served from now on, and the
        other instances, which may still hold the old weights, serve and save nothing of the
        namespace until each resets too (``joins``). If another instance's reset made the current
        epoch after this one last joined, this reset joins that epoch (counted, ``epoch_joins``)
        instead of starting yet another generation; otherwise it starts one (``invalidations``).
        Returns the epoch now joined, or None as ``invalidate``."""
        return self._bumps.reset(self._scopes.seed(ns_seed))

    def joined(self, ns_seed: bytes) -> bool:
        """Whether this instance serves and saves the namespace: False after a reset made
        elsewhere (another instance's new weights) until this instance resets itself."""
        return self._parts.epochs.joined(self._scopes.seed(ns_seed))

    def gc(self, only: list[bytes] | None = None) -> dict[str, int]:
        """Reclaim unpinned entries of older epochs, then enforce every tier's capacity."""
        return self._evictor.gc(only)

    def namespaces(self) -> list[bytes]:
        return self._evictor.namespaces()

    def describe(self, ns: Namespace) -> None:
        """Record what ``ns`` is (model, weights version, KV dtype, layout, tenant) beside its epoch,
        where every store sharing the epochs reads it: ``kvstrata stats`` names the model, and
        ``kvstrata invalidate --model`` finds the namespace. Adapters call it once at start (it
        also creates the namespace's epoch, so the namespace is listed before its first block);
        never on a lookup or save path. Never raises: a failure is logged and costs names only."""
        self._bumps.describe(self._scopes.own(ns))

    def descriptors(self, seeds: Iterable[bytes] | None = None) -> dict[bytes, Namespace]:
        """The recorded namespaces, by seed (default: every namespace the store knows), read back
        as untrusted input: a descriptor that does not hash to its namespace is skipped, logged and
        counted (``bad_descriptors``)."""
        return report.descriptors(self._parts, self.namespaces() if seeds is None else seeds)

    def resident(self) -> dict[str, int]:
        """``<tier>_resident_blocks`` and ``<tier>_resident_bytes`` for every tier, and
        ``namespaces_not_joined``: the gauges both adapters export. One vectorized count over the
        index (a byte per row), cheap enough for every engine step; unlike ``stats`` it reads
        nothing from disk or the network."""
        return report.resident(self._parts, self._tenant_gauges)

    def stats(self) -> dict[str, object]:
        """Tiers, blocks and bytes per namespace and epoch, current epochs, the namespaces this
        instance has not joined (``joined``), descriptors and counters (``kvstrata stats``)."""
        return {**report.stats(self._parts), "verify": self._verifier.figures()}

    def close(self) -> None:
        if self._parts.recovery is not None:
            self._parts.recovery.stop()
        self._parts.saver.close()
        self._verifier.close()  # queued comparisons, then what this process verified into the namespaces' records
        self._parts.epochs.close()
        for tier in self._parts.tiers:
            tier.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
