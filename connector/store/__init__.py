"""The tiered block store: index + L1 memory + backing tiers (L2 disk, the shared tier).

``BlockStore`` is the facade every caller uses; its primitives are listed in ``protocol.py``.
It composes one part per concern, each in its own module:

- ``parts.py``: the shared pieces (index, tiers, epochs, counters, save threads), built from the
  config, reading no block file.
- ``recovery.py``: L2's blocks into the index in a background thread (lookups adopt them by
  header meanwhile; ``wait_recovered``).
- ``lookup.py``: ``lookup`` / ``lookup_chain`` (and the pin of ``prepare_load``).
- ``load.py``: ``load`` into tensors, byte runs or L1.
- ``write.py``: ``prepare_store`` / ``complete_store`` and ``save``.
- ``evict.py``: L1 slots by LRU eviction and demotion, tier capacities, ``gc``.
- ``saver.py``: the bounded background queue and its threads.

``describe`` and ``descriptors`` (what a namespace is, kept beside its epoch) are here: they are
start-up and CLI calls, done through the epoch store (``describe.py`` says what is kept).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Callable, Iterable, Literal, Sequence, overload

import numpy as np
import torch

from ..config import StrataConfig
from ..describe import MAX_BYTES as DESCRIPTOR_MAX, decode as decode_descriptor, encode as encode_descriptor
from ..epochs import EpochStore
from ..index import BlockIndex
from ..keys import NO_EXTRA, BlockChain, Namespace
from ..metrics import Counters
from ..tiers import BlockTier, DiskTier, MemoryTier
from ..tiers.disk import IOV_MAX
from .evict import Evictor
from .load import Loader
from .lookup import Lookup
from .parts import open_parts
from .protocol import Arena, ByteRuns, Hit, Reservation
from .write import Payloads, Writer

__all__ = ["Arena", "BlockStore", "ByteRuns", "Hit", "Reservation"]

log = logging.getLogger(__name__)


class BlockStore:
    """The store protocol (see ``protocol.py``) over one index, L1 and the backing tiers."""

    def __init__(self, config: StrataConfig | None = None, *, l1_slot_bytes: int = 0,
                 l1_shared_path: str | None = None) -> None:
        """``l1_shared_path`` puts the L1 arena in a file other local processes can map (the
        engine's workers copy KV in and out of it); ``l1_slot_bytes`` fixes the slot size now
        instead of at the first save."""
        self.config = config or StrataConfig()
        self.parts = open_parts(self.config, l1_slot_bytes, l1_shared_path)
        self.evictor = Evictor(self.parts, demote=lambda metas, payloads: self.writer.write_backing(metas, payloads))
        self.writer = Writer(self.parts, self.evictor)
        self.lookups = Lookup(self.parts)
        self.loader = Loader(self.parts, self.writer, self.evictor)
        self.arena = Arena(self.parts.l1)
        if self.parts.recovery is not None:
            self.parts.recovery.start(then=self.evictor.after_recovery)

    # The shared pieces, for tools, checks and tests (engine glue uses the protocol only).
    @property
    def counters(self) -> Counters:
        return self.parts.counters

    @property
    def index(self) -> BlockIndex:
        return self.parts.index

    @property
    def epochs(self) -> EpochStore:
        return self.parts.epochs

    @property
    def l1(self) -> MemoryTier:
        return self.parts.l1

    @property
    def l2(self) -> DiskTier | None:
        return self.parts.l2

    @property
    def remote(self) -> BlockTier | None:
        return self.parts.remote

    @property
    def tiers(self) -> list[BlockTier]:
        return self.parts.tiers

    # ------------------------------------------------------------------ keys
    def chain(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA,
              *, partial: bool = True) -> tuple[int, BlockChain]:
        """Current epoch and the chained keys of ``tokens`` (full blocks, then the partial tail)."""
        return self.lookups.chain(ns, tokens, extra, partial=partial)

    def current_epoch(self, ns: Namespace) -> int:
        """The generation saves of ``ns`` go under (a lookup checks that it is confirmed)."""
        return self.parts.epochs.get(ns.seed)

    # ---------------------------------------------------------------- lookup
    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: bytes = NO_EXTRA,
               *, pin: bool = False) -> Hit:
        """The longest valid stored prefix of ``tokens``, possibly ending in a stored partial
        block. With ``pin`` (vLLM's ``prepare_load``) the hit's blocks are pinned until
        ``complete_load(hit)``; ``hit.tiers`` says where each was at lookup time."""
        self._serving()
        return self.lookups.lookup(ns, tokens, extra, pin=pin)

    def lookup_chain(self, ns: Namespace, epoch: int, chain: BlockChain, *, pin: bool = False) -> Hit:
        """``lookup`` for a chain the caller built (``keys.chain_digests``); no partial tails."""
        self._serving()
        return self.lookups.lookup_chain(ns, epoch, chain, pin=pin)

    def _serving(self) -> None:
        """Tell L2's background recovery, if still running, to make way for a request."""
        recovery = self.parts.recovery
        if recovery is not None and not recovery.done:
            recovery.note_request()

    def complete_load(self, hit: Hit) -> None:
        """Give back the pin of a pinned lookup (nothing for an unpinned one)."""
        if hit.lease is not None:
            self.parts.index.unpin(hit.lease)

    def stored_mask(self, ns: Namespace, epoch: int, chain: BlockChain) -> np.ndarray:
        """Which blocks of ``chain`` are validly stored now (bool per block)."""
        return self.parts.index.valid_mask(ns.seed, epoch, chain)

    # ------------------------------------------------------------------ load
    @overload
    def load(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor | ByteRuns | None = None, *,
             wait: Literal[True] = True) -> int: ...
    @overload
    def load(self, hit: Hit, out: None = None, *, wait: Literal[False],
             on_done: Callable[[int | None], None]) -> bool: ...

    def load(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor | ByteRuns | None = None, *,
             wait: bool = True, on_done: Callable[[int | None], None] | None = None) -> int | bool:
        """Copy the hit's blocks into ``out``; returns how many leading blocks are valid (the
        engine recomputes the rest).

        ``out`` is one uint8 row per block (a tensor ``[n, >= size]`` or a list), or ``ByteRuns``
        (SGLang's host pool: disk reads go straight into its runs, no L1 copy), or None: the
        blocks are made resident in L1 (staging; ``arena.slots(hit)`` then names their slots).
        Staging can be queued (``wait=False``): it runs on a save thread and ``on_done(n)``
        hears the blocks in L1 (None if the job failed); False when the queue is full."""
        self._serving()
        return self.loader.load(hit, out, wait=wait, on_done=on_done)

    # ----------------------------------------------------------------- store
    def prepare_store(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> Reservation:
        """Fresh L1 slots for the blocks of ``chain`` not stored yet (a prefix of them if L1 is
        full): the caller fills ``arena.data[slot, :size]`` for ``res.slots`` (``res.metas``
        name the blocks), then calls ``complete_store``. Nobody can see the slots until then."""
        return self.writer.prepare_store(ns, epoch, chain, size)

    def complete_store(self, res: Reservation, success: bool = True, *, wait: bool = False) -> int:
        """Publish the filled slots of ``res`` (the index sees them from now on) and write them
        through, on the save threads or, with ``wait``, before returning; or, with ``success``
        False (a slot was not filled), give the slots back. Returns the blocks published."""
        return self.writer.complete_store(res, success, wait=wait)

    @overload
    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads, *,
             wait: Literal[False] = False, on_done: Callable[[int], None] | None = None) -> bool: ...
    @overload
    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads | ByteRuns, *,
             wait: Literal[True]) -> int: ...

    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Payloads | ByteRuns, *,
             wait: bool = False, on_done: Callable[[int], None] | None = None) -> bool | int:
        """Store the blocks of ``chain`` not validly stored yet; ``src`` holds every block.

        Tensors (``src[i]`` is block i's bytes; a uint8 view is taken) are copied into L1 and
        written through from there. Queued by default: returns at once, False (and counted) when
        the queue is full; ``src`` must stay unchanged until ``on_done(blocks_stored)`` (0 if
        the job failed). With ``wait`` the save runs now and returns the blocks stored.
        ``ByteRuns`` (needs ``wait`` and ``direct_writes``) go straight to L2, bypassing L1."""
        return self.writer.save(ns, epoch, chain, src, wait=wait, on_done=on_done)

    @property
    def direct_writes(self) -> bool:
        """Whether ``save`` takes ``ByteRuns``, and ``complete_store(wait=True)`` writes L2 on the
        calling thread and the save threads together: L2 written through, no shared tier."""
        return self.writer.direct_writes

    @property
    def direct_reads(self) -> bool:
        """Whether ``load`` into ``ByteRuns`` reads disk blocks straight into them (an L2 exists)."""
        return self.parts.l2 is not None

    @property
    def max_runs(self) -> int:
        """The most runs one block of ``ByteRuns`` may have: one ``preadv``/``pwritev`` moves the
        block's header and its runs together."""
        return IOV_MAX - 1

    def wait_recovered(self, timeout: float | None = None) -> bool:
        """Wait until the background scan has brought every L2 block into the index (True), or
        ``timeout`` seconds (False). Serving never needs it (lookups find blocks by header); the
        figures of ``stats`` and the LRU order are complete only after it."""
        recovery = self.parts.recovery
        return recovery is None or recovery.wait(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued saves (tests, shutdown)."""
        return self.parts.saver.flush(timeout)

    # ------------------------------------------------- invalidation, gc, stats
    def invalidate(self, ns_seed: bytes) -> int | None:
        """Bump the namespace epoch: from now on no older entry is served. Returns the new epoch,
        or None when it could not be written where the other instances read it (the shared tier
        is unreachable): counted (``invalidation_failures``) and logged. This instance then serves
        nothing of the namespace until the new generation is written (retried at every use);
        the other instances go on with the old one until then."""
        epoch = self.parts.epochs.bump(ns_seed)
        if epoch is None:
            self.parts.counters.inc("invalidation_failures")
            log.error("kvstrata: namespace %s could not be invalidated: the new generation was not written to "
                      "the shared tier; this instance serves none of its blocks until it is (retried at every "
                      "lookup), other instances keep serving the old generation until then", ns_seed[:8].hex())
            return None
        self.parts.counters.inc("invalidations")
        log.info("kvstrata: namespace %s is now at generation %016x", ns_seed[:8].hex(), epoch)
        self.gc(only=[ns_seed])
        return epoch

    def gc(self, only: list[bytes] | None = None) -> dict[str, int]:
        """Reclaim unpinned entries of older epochs, then enforce every tier's capacity."""
        return self.evictor.gc(only)

    def namespaces(self) -> list[bytes]:
        return self.evictor.namespaces()

    def describe(self, ns: Namespace) -> None:
        """Record what ``ns`` is (model, weights version, KV dtype, layout, tenant) beside its epoch,
        where every store sharing the epochs reads it: ``kvstrata stats`` names the model, and
        ``kvstrata invalidate --model`` finds the namespace. Adapters call it once at start (it
        also creates the namespace's epoch, so the namespace is listed before its first block);
        never on a lookup or save path. Never raises: a failure is logged and costs names only."""
        blob = encode_descriptor(ns)
        self.parts.epochs.get(ns.seed)
        if blob is None:
            log.warning("kvstrata: namespace %s is too large to describe (over %d bytes); stats will "
                        "show its id only", ns.id, DESCRIPTOR_MAX)
            return
        self.parts.epochs.describe(ns.seed, blob)

    def descriptors(self, seeds: Iterable[bytes] | None = None) -> dict[bytes, Namespace]:
        """The recorded namespaces, by seed (default: every namespace the store knows), read back
        as untrusted input: a descriptor that does not hash to its namespace is skipped, logged and
        counted (``bad_descriptors``)."""
        out: dict[bytes, Namespace] = {}
        for seed in self.namespaces() if seeds is None else seeds:
            raw = self.parts.epochs.descriptor(seed)
            if raw is None:
                continue
            ns = decode_descriptor(raw, seed)
            if ns is None:
                self.parts.counters.inc("bad_descriptors")
                log.warning("kvstrata: ignoring the descriptor of namespace %s: %d bytes that do not describe "
                            "it (damaged, or not written by kvstrata)", seed[:8].hex(), len(raw))
            else:
                out[seed] = ns
        return out

    def resident(self) -> dict[str, int]:
        """``<tier>_resident_blocks`` and ``<tier>_resident_bytes`` for every tier: the gauges both
        adapters export. One vectorized count over the index (a byte per row), cheap enough for
        every engine step; unlike ``stats`` it reads nothing from disk or the network."""
        bits = self.parts.index.tiers_of(slice(None))  # type: ignore[arg-type]
        out: dict[str, int] = {}
        for tier in self.parts.tiers:
            out[f"{tier.name}_resident_blocks"] = int(np.count_nonzero(bits & tier.bit))
            out[f"{tier.name}_resident_bytes"] = int(tier.used_bytes)
        return out

    def stats(self) -> dict[str, object]:
        p = self.parts
        census = p.index.census([t.bit for t in p.tiers])  # vectorized: seconds saved at millions of blocks
        tiers = {t.name: {"blocks": census.per_tier[t.bit][0], "bytes": census.per_tier[t.bit][1],
                          "capacity_bytes": t.capacity_bytes} for t in p.tiers}
        spaces: dict[str, dict[str, dict[str, int]]] = {}
        for (seed, epoch), (blocks, nbytes) in sorted(census.per_epoch.items()):
            spaces.setdefault(seed[:8].hex(), {})[f"{epoch:016x}"] = {"blocks": blocks, "bytes": nbytes}
        seeds = sorted(set(census.seeds) | set(p.epochs.known()))
        current = {s[:8].hex(): f"{p.epochs.get(s):016x}" for s in seeds}
        described = {s[:8].hex(): asdict(ns) for s, ns in self.descriptors(seeds).items()}
        return {"tiers": tiers, "namespaces": spaces, "current_epochs": current,
                "descriptors": described, "counters": p.counters.snapshot()}

    def close(self) -> None:
        if self.parts.recovery is not None:
            self.parts.recovery.stop()
        self.parts.saver.close()
        self.parts.epochs.close()
        for tier in self.parts.tiers:
            tier.close()

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
