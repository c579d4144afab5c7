"""``StrataStorage``: the SGLang HiCache storage backend (the "L3") over one kvstrata store.

One instance per scheduler process (one per TP/PP rank), each with its own store (``open_store``)
over the shared L2 folder. Owns the backend API SGLang calls (``batch_exists``, ``batch_get_v1``,
``batch_set_v1``, the legacy flat-page methods, ``clear``, ``get_stats``) and the choice of data path.

Keys. SGLang names a page by a hex SHA-256 chained over the previous page's key and the page's
token ids (and the request's extra key and cache salt), so one page key already stands for the
whole prefix before it. kvstrata keys each page by that digest alone, seeded by the namespace and
its epoch (``key = H(root || digest)`` under the store's key scheme, a chain of one rooted at the
namespace), and the index confirms a hit by key and fingerprint; the parent check is SGLang's own,
inside its SHA-256.
Keys never depend on the prefix keys SGLang may pass (``hicache_storage_pass_prefix_keys``): when
SGLang asks storage for the continuation of a prefix its device or host cache still holds, it
passes the ancestors of its last cached node without that node's own pages (SGLang 0.5.23,
``get_prefix_hash_values``), so a chain over them would miss every such page.
The same keys serve the zero-copy interface (``interface_v1: 1``, the shipped config) and the
legacy flat-page methods.

Data path (zero-copy interface). When kvstrata's L1 is smaller than the host pool
(``bypass_l1``), a page not resident in L1 moves between the pool and its disk file with no copy
in between: one ``preadv``/``pwritev`` per page whose buffers are the page's runs in the pool
(``PageRows.runs``: one per layer and K/V in ``layer_first``, one per K/V in ``page_first``) and a
streaming xxh3 checksum, so the files are byte-identical to those written through L1. A larger
L1 is a cache behind the pool, and pages go through it (copied into L1 slots, then to disk).

Every payload that comes from disk is checksummed by the store: a corrupt or missing page is
reported as failed (with every page after it) and never served. ``clear()`` bumps the namespace
epoch, which hides everything stored before, in every process sharing the L2 folder.

A weight update made in memory (``update_weights_from_*``) is the store's reset of the weights kind
(``weights.py``: hooked on SGLang's scheduler, since SGLang tells a backend nothing of it): every
call takes its epoch from ``WeightUpdates.epoch``, and serves and saves nothing while it is None.

Verified hits (``verify.sample_rate``, ``verify.py``): a sampled ``batch_exists`` reports the
stored pages as not stored, and their write-back is compared with the stored copies instead of
skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstrata.config import ConfigError
from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import ByteRuns, Hit, StoreProtocol, open_store

from kvstrata.adapters.versions import check_engine_version
from kvstrata.adapters.sglang.metrics import StorageSeries, series_labels
from kvstrata.adapters.sglang.namespace import digests_of, load_strata_config, namespace_for
from kvstrata.adapters.sglang.pages import PageRows
from kvstrata.adapters.sglang.verify import Fill, PageChecks
from kvstrata.adapters.sglang.weights import WeightUpdates, unwatch, watch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

log = logging.getLogger(__name__)


@dataclass
class StrataStorageMetrics(StorageMetrics):
    """SGLang's storage metrics (page counts and GB/s per call since the last report) plus
    kvstrata's own counters (cumulative)."""

    counters: dict[str, int] = field(default_factory=dict)


class _CallLog:
    """Per-call page counts and bandwidths, drained by ``get_stats`` (several threads append)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._m = StorageMetrics()

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            getattr(self._m, f"{kind}_pgs").append(pages)
            getattr(self._m, f"{kind}_bandwidth").append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain(self, counters: dict[str, int]) -> StrataStorageMetrics:
        with self._lock:
            m, self._m = self._m, StorageMetrics()
        return StrataStorageMetrics(m.prefetch_pgs, m.backup_pgs, m.prefetch_bandwidth,
                                    m.backup_bandwidth, counters)


class StrataStorage(HiCacheStorage):
    """kvstrata as a HiCache storage backend. See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        if storage_config.tp_rank == 0:  # once per engine, in its log
            check_engine_version("sglang")
        extra = storage_config.extra_config or {}
        self.config = load_strata_config(extra)
        self.v1 = bool(extra.get("interface_v1", 0))  # the zero-copy interface, else flat pages
        # MLA ranks hold the same pages: only the writer stores them, every rank reads.
        self.writer = getattr(storage_config, "is_storage_writer",
                              not storage_config.is_mla_model or storage_config.tp_rank == 0)
        self.store: StoreProtocol = open_store(self.config)
        self.rows: PageRows | None = None
        self.ns: Namespace | None = None
        self.bypass_l1 = False  # set by register_mem_pool_host
        self.checks: PageChecks | None = None  # verified hits (a writer with verify.sample_rate > 0)
        self._calls = _CallLog()
        self._series: StorageSeries | None = None  # made at the first get_stats with metrics on
        self.weights = WeightUpdates(self.store)  # SGLang's weight updates: the store's reset
        watch(self.weights)
        log.info("kvstrata: SGLang storage backend for %s (tp %d/%d, %s interface, writer=%s)",
                 storage_config.model_name, storage_config.tp_rank, storage_config.tp_size,
                 "zero-copy" if self.v1 else "legacy flat-page", self.writer)

    def register_mem_pool_host(self, mem_pool_host: "HostKVCache") -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.rows = PageRows(mem_pool_host, self.store.max_runs)
        self.ns = namespace_for(self.storage_config, self.config, self.rows, self.v1)
        self.store.describe(self.ns)  # kvstrata stats / invalidate --model name the model
        # An L1 smaller than the host pool would mostly hold pages the pool still has (both are
        # LRU over the same pages), so its copy is pure cost: pages then go straight between
        # the pool and the disk tier. An L1 at least that large is a real cache behind the pool.
        self.bypass_l1 = (self.rows.direct and self.store.direct_reads
                          and self.store.arena.capacity_bytes < self.rows.pool_bytes)
        log.info("kvstrata: namespace %s (%s), %d-byte pages, %s", self.ns.id, self.ns.layout,
                 self.rows.page_bytes, "direct disk I/O" if self.bypass_l1 else "through L1")
        if self.writer:  # a reader's sampled query would cost hits and compare nothing
            self.checks = PageChecks.for_pool(self.store, self.rows, mem_pool_host.layout,
                                              getattr(mem_pool_host, "layer_num", 0), self.config.verify.sample_rate)

    def register_mem_host_pool_v2(self, host_pool: "HostKVCache", host_pool_name: str) -> None:
        """SGLang's hybrid models (sliding-window or Mamba pools beside the KV pool) register their
        other host pools here, then call ``batch_*_v2`` with per-pool hit rules. StrataStorage keys
        and restores the KV pool alone, so it refuses at attach time (SGLang fails the start with
        this message) rather than serve attention KV without the state that goes with it. The KV
        pool itself comes through here too (every model: SGLang registers each of its host pool
        entries), and is the one ``register_mem_pool_host`` took."""
        if host_pool_name == "kv" or host_pool is getattr(self, "mem_pool_host", None):
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        raise ConfigError(
            f"kvstrata: StrataStorage does not serve SGLang's hybrid host pool "
            f"{str(getattr(host_pool_name, 'value', host_pool_name))!r} "
            f"({type(host_pool).__name__}) yet: a hit would restore attention KV without that pool's "
            "sliding-window or Mamba state. Serve this model with vLLM and StrataConnector, or without "
            "--hicache-storage-backend")

    # -------------------------------------------------------------- keys
    def _require_pool(self) -> tuple[PageRows, Namespace]:
        """The host pool's rows and the namespace, both set by ``register_mem_pool_host``."""
        if self.rows is None or self.ns is None:
            raise RuntimeError("kvstrata: register_mem_pool_host() was not called")
        return self.rows, self.ns

    def _chain(self, keys: Sequence[str],
               extra_info: HiCacheStorageExtraInfo | None = None) -> tuple[int, BlockChain] | None:
        """Current epoch and the kvstrata keys of ``keys``: one chain of one page each, rooted at
        the namespace (see the module docstring: SGLang's keys are chained already, and the
        prefix keys it passes are not always the pages before ``keys``). None while a weight
        update waits for SGLang's cache flush (``WeightUpdates.epoch``): nothing is served or saved."""
        ns = self._require_pool()[1]
        epoch = self.weights.epoch(ns)
        return None if epoch is None else (epoch, self.store.page_chain(ns, epoch, digests_of(keys)))

    # -------------------------------------------------------------- queries
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Length of the leading run of ``keys`` stored and valid (index and tier headers only); 0
        for a query sampled for verification, and never past a page hidden from an earlier one."""
        if not keys:
            return 0
        keyed = self._chain(keys, extra_info)
        if keyed is None:
            return 0
        epoch, chain = keyed
        assert self.ns is not None
        stored = self.store.lookup_chain(self.ns, epoch, chain).num_blocks
        return stored if self.checks is None else self.checks.answer(keys, stored)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -------------------------------------------------------------- zero-copy path
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load the leading stored run of ``keys`` into the host pool; page i starts at
        ``host_indices[i * page_size]``. A page that fails (and every later one) is False.

        L1-resident pages are copied once from their slots. With ``bypass_l1`` the others are
        read from disk straight into the pool (one ``preadv`` per page over its runs, checksum
        verified); otherwise they are staged (read and checksummed) into L1 slots first, which
        promotes them. The hit stays pinned meanwhile, so no slot or file is reused under us.
        A failed page's memory in the pool may have been partly overwritten; SGLang frees the
        host indices of pages reported False without reading them."""
        if not keys:
            return []
        self._require_pool()
        start = time.perf_counter()
        keyed = self._chain(keys, extra_info)
        if keyed is None:
            return [False] * len(keys)
        epoch, chain = keyed
        hit = self.store.lookup_chain(self.ns, epoch, chain, pin=True)
        try:
            origin = self.store.origins(hit)  # before the load promotes pages into L1
            starts = self.rows.page_starts(host_indices, hit.num_blocks) if self.bypass_l1 and hit.num_blocks else None
            if starts is not None:
                rows, arena = self.rows, self.store.arena
                loaded = self.store.load_runs(hit, ByteRuns(
                    rows.page_bytes, lambda i: rows.runs(starts[i]),
                    lambda i, slot: rows.copy_slot(arena.data, slot, starts[i])))  # type: ignore[arg-type]
            else:
                loaded = self._get_staged(hit, host_indices)
        finally:
            self.store.complete_load(hit)
        staged = starts is None  # pages copied out of L1 slots here: all of them, or the resident ones
        from_l1 = loaded if staged else origin[:loaded].count("l1")
        self.store.count_served(origin[:loaded], [self.rows.page_size] * loaded, copied_from_l1=staged,
                                l1_bytes=from_l1 * self.rows.page_bytes)
        self._calls.record("prefetch", loaded, loaded * self.rows.page_bytes, time.perf_counter() - start)
        log.debug("kvstrata: loaded %d of %d pages", loaded, len(keys))
        return [i < loaded for i in range(len(keys))]

    def _get_staged(self, hit: Hit, host_indices: torch.Tensor) -> int:
        """Pages on disk are read into L1 slots, then every page is copied from its slot."""
        assert self.rows is not None
        arena = self.store.arena
        loaded = self.store.stage(hit) if hit.num_blocks else 0
        slots = arena.slots(hit)[:loaded]
        if None in slots:  # not expected while pinned; never serve what is not there
            loaded = slots.index(None)
            slots = slots[:loaded]
        if loaded:
            assert arena.data is not None
            self.rows.scatter_from(arena.data, slots, host_indices)  # type: ignore[arg-type]
        return loaded

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices``; True where the page is stored afterwards.

        With ``bypass_l1`` (and L2 write-through, no shared tier) pages not stored yet go from
        the pool straight to disk: one ``pwritev`` of header + the page's runs per file, published
        by rename, then committed. Otherwise they are copied once into fresh L1 slots, committed,
        and written through from there. Either way the disk copies exist before this returns, so
        every process sharing the disk tier sees them then (as the legacy path, ``save(wait=True)``, does).
        Pages hidden from a sampled query are compared with their stored copies (``_verify``)."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)
        self._require_pool()
        start = time.perf_counter()
        keyed = self._chain(keys, extra_info)
        if keyed is None:  # the host pool may hold KV of the weights SGLang has left
            return [False] * len(keys)
        epoch, chain = keyed
        rows, data = self.rows, self.store.arena.data
        starts = rows.page_starts(host_indices, len(keys)) if self.bypass_l1 and self.store.direct_writes else None
        if starts is not None:
            self.store.save_runs(self.ns, epoch, chain, ByteRuns(rows.page_bytes, lambda i: rows.runs(starts[i])))
        else:
            self._set_staged(epoch, chain, host_indices, len(keys))
        stored = self._verify(keys, epoch, chain, lambda slots, pages: rows.gather_into(
            data, slots, pages, host_indices, len(keys)))  # type: ignore[arg-type]
        self._calls.record("backup", len(keys), len(keys) * self.rows.page_bytes, time.perf_counter() - start)
        return stored

    def _set_staged(self, epoch: int, chain: BlockChain, host_indices: torch.Tensor, n: int) -> None:
        assert self.rows is not None and self.ns is not None
        res = self.store.prepare_store(self.ns, epoch, chain, self.rows.page_bytes)
        if not res.slots:
            return
        where = {key: i for i, key in enumerate(chain.keys)}
        pages = [where[meta.key] for meta in res.metas]
        data = self.store.arena.data
        assert data is not None
        try:
            self.rows.gather_into(data, res.slots, pages, host_indices, n)
        except BaseException:
            self.store.complete_store(res, False)
            raise
        # Written through before returning (by this and the save threads where the store allows).
        self.store.complete_store(res, wait=True)

    def _put(self, keys: Sequence[str], payloads: torch.Tensor | Sequence[torch.Tensor],
             extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        keyed = self._chain(keys, extra_info)
        if keyed is None:
            return [False] * len(keys)
        epoch, chain = keyed
        assert self.ns is not None
        self.store.save_now(self.ns, epoch, chain, payloads)
        data = self.store.arena.data

        def fill(slots: Sequence[int], pages: Sequence[int]) -> None:
            for slot, page in zip(slots, pages):
                flat = payloads[page].reshape(-1)
                data[slot, : flat.numel()] = flat  # type: ignore[index]

        return self._verify(keys, epoch, chain, fill)

    def _verify(self, keys: Sequence[str], epoch: int, chain: BlockChain, fill: Fill) -> list[bool]:
        """After a write-back's save: its pages hidden from a sampled query compared with their stored
        copies (skipped by the save as stored). True where a page is stored, and for a compared page
        whatever the outcome: SGLang stops backing up a node at a page reported False, and the
        pages after it are no less worth storing (a mismatching page is deleted, not replaced)."""
        assert self.ns is not None
        checked = self.checks.write_back(self.ns, epoch, keys, chain, fill) if self.checks is not None else []
        stored = self.store.stored_mask(self.ns, epoch, chain).tolist()
        for i in checked:
            stored[i] = True
        return stored

    # -------------------------------------------------------------- legacy path (flat pages)
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill ``target_locations[i]`` (flat page tensors) for the leading stored run."""
        if not keys:
            return []
        self._require_pool()
        keyed = self._chain(keys, None)
        if keyed is None:
            return [None] * len(keys)
        epoch, chain = keyed
        hit = self.store.lookup_chain(self.ns, epoch, chain, pin=True)
        try:
            origin = self.store.origins(hit)
            loaded = self.store.load_into(hit, [t.reshape(-1).view(torch.uint8) for t in target_locations[: hit.num_blocks]])
        finally:
            self.store.complete_load(hit)
        rows = self.rows
        assert rows is not None
        self.store.count_served(origin[:loaded], [rows.page_size] * loaded, copied_from_l1=False,
                                l1_bytes=origin[:loaded].count("l1") * rows.page_bytes)
        return [t if i < loaded else None for i, t in enumerate(target_locations[: len(keys)])]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if not self.writer:
            return True
        return all(self._put(keys, [v.reshape(-1).view(torch.uint8) for v in values], None))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -------------------------------------------------------------- control
    def clear(self) -> bool:
        """A flush (the store's ``invalidate``): nothing stored before is served again, by any
        process, and every instance adopts the new epoch at once.

        Not the engine reset kind (the store's ``reset``, after which other instances serve nothing
        until they reset too), because SGLang 0.5.23 calls a storage backend's ``clear`` only when
        no weights change: the admin endpoint ``POST /hicache/storage-backend/clear``
        (``Scheduler.clear_hicache_storage_wrapped``) and a PD role switch
        (``disaggregation/role_switch.py``, best effort, on every rank). As the reset kind, a role
        switch or an operator's clear on one instance would take every other instance off the store
        until each updated its weights. Weight updates reach the store through ``weights.py``."""
        if self.ns is None:
            return False
        return self.store.invalidate(self.ns.seed) is not None  # the store logs it either way

    def get_stats(self) -> StrataStorageMetrics:
        """SGLang's storage metrics since the last call (its radix cache calls this every step,
        only with ``--enable-metrics``) and, in the same pass, the ``kvstrata_*`` series."""
        counters = self.store.snapshot()
        if self._series is None and self.storage_config.enable_storage_metrics:
            self._series = StorageSeries(self.store, series_labels(self.storage_config))
        if self._series is not None:
            self._series.update(counters)
        return self._calls.drain(counters)

    def close(self) -> None:
        unwatch(self.weights)
        self.store.close()  # waits for queued saves
