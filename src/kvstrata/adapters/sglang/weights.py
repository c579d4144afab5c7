"""SGLang's weight updates made in memory, as the storage backend sees them: the reset of the weights
kind (``WeightUpdates``) and the hooks that tell it (``watch``).

Why hooks. SGLang 0.5.23 tells a storage backend nothing of a weight update: its
``update_weights_from_disk/tensor/distributed/ipc`` calls (and their HTTP endpoints) flush its radix
tree and host pool, never the backend, and the namespace cannot see the change (it fingerprints the
weight files). Without a reset this server would load KV of the weights it has left, and save KV of
its new weights where the servers still on the old ones load it. So, in the scheduler process
(one per TP rank), kvstrata wraps the one method every such update calls once the served model's
weights have changed, just before SGLang flushes its cache:
``SchedulerWeightUpdaterManager.flush_cache_after_weight_update``; and, at the first update, the
radix cache's ``reset`` (the flush itself: ``/flush_cache``, the update's own flush, a PD role switch).

The rule, per backend:

- An update marks the weights *updated* and SGLang's caches *stale* (they may hold KV of the old
  weights). It runs on the scheduler thread between batches: nothing was computed with the new
  weights yet.
- While stale, the backend serves and saves nothing: what SGLang would write back may be of the old
  weights, and until the reset a page loaded would be one of the old weights too. The update's own flush (SGLang's default,
  ``flush_cache: true``) ends it at once; an update without one (``flush_cache: false``, or refused
  because requests were running) leaves it until SGLang's cache is flushed (``/flush_cache``).
- The first storage call after that makes the reset (``StoreProtocol.reset``): a new weights
  generation, which the other servers serve and save nothing of until they reset too, or, when
  another server reset first, that server's epoch joined (``epochs/joins.py``). One reset per
  update however many calls the update takes (bucketed ``update_weights_from_tensor``). Every save
  and lookup reads its epoch under the same lock as that reset, so none of the new weights' KV goes
  under the old epoch, and none of the old under the new.

Limits: weights changed by other means (bytes written by a peer between ``begin_weight_update`` and
``end_weight_update`` without an ``update_weights_from_*`` call, an update that failed half-way, after
which SGLang flushes nothing either) are not seen; an update of the draft model alone resets too
(hits lost, nothing wrong). A reset is trusted to mean "this server now holds the latest weights"
(docs/consistency.md).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

from kvstrata.keys import Namespace
from kvstrata.store import StoreProtocol

log = logging.getLogger(__name__)


class WeightUpdates:
    """One backend's view of the weight updates of its server (see the module docstring).
    Thread-safe: SGLang calls the backend from its prefetch and backup threads, and the hooks run
    on the scheduler thread."""

    def __init__(self, store: StoreProtocol) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._updated = False  # weights changed since the last reset
        self._stale = False  # SGLang's caches may hold KV of the weights it has left

    def updated(self) -> None:
        """SGLang changed the served weights in memory (its caches are not flushed yet)."""
        with self._lock:
            self._updated = self._stale = True

    def flushed(self) -> None:
        """SGLang emptied its radix tree, host pool and storage queues."""
        with self._lock:
            self._stale = False

    @property
    def stale(self) -> bool:
        """Whether the backend is off the store, waiting for SGLang's cache flush."""
        with self._lock:
            return self._stale

    def epoch(self, ns: Namespace) -> int | None:
        """The epoch a lookup or save of ``ns`` uses now, after the reset a weight update calls for;
        None while SGLang's caches may still hold KV of the old weights (serve and save nothing)."""
        with self._lock:  # the epoch is read under the lock the reset is made under
            if self._stale:
                return None
            if self._updated:
                self.store.reset(ns.seed)  # logged and counted by the store, failed or not
                self._updated = False
            return self.store.current_epoch(ns)


# The backends of this process (one per scheduler process, more after a detach and attach).
_live: "weakref.WeakSet[WeightUpdates]" = weakref.WeakSet()
_hooked: bool | None = None  # None: not tried yet in this process
_hook_lock = threading.Lock()
_MARK = "kvstrata_watches"  # set on the wrappers installed here: a second install is a no-op


def watch(updates: WeightUpdates) -> bool:
    """Tell ``updates`` of this process's weight updates and cache flushes (the hooks are installed
    at the first call). False when SGLang's weight-update path could not be hooked (logged)."""
    global _hooked
    with _hook_lock:
        if _hooked is None:
            _hooked = _hook_sglang()
        _live.add(updates)
        return _hooked


def unwatch(updates: WeightUpdates) -> None:
    _live.discard(updates)


def _hook_sglang() -> bool:
    try:
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    except ImportError as e:
        log.warning("kvstrata: cannot hook SGLang's weight updates (%s): a weight update made in memory is not "
                    "seen, so give each weights version its own namespace (namespace.model_version)", e)
        return False
    return hook(SchedulerWeightUpdaterManager)


def hook(manager: type) -> bool:
    """Wrap ``manager.flush_cache_after_weight_update`` (SGLang's ``SchedulerWeightUpdaterManager``,
    whose ``scheduler`` holds the radix cache as ``tree_cache``) so that every update tells the
    watched backends, before SGLang's flush. False if the class has no such method."""
    original = getattr(manager, "flush_cache_after_weight_update", None)
    if original is None:
        log.warning("kvstrata: %s has no flush_cache_after_weight_update: a weight update made in memory is not "
                    "seen, so give each weights version its own namespace (namespace.model_version)",
                    manager.__name__)
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def flush_cache_after_weight_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        watched = list(_live)
        if watched:
            _watch_flushes(getattr(getattr(self, "scheduler", None), "tree_cache", None))
            for updates in watched:
                updates.updated()
        try:
            return original(self, *args, **kwargs)
        finally:
            if any(updates.stale for updates in watched):
                log.warning("kvstrata: SGLang updated its weights without flushing its cache (flush_cache false, "
                            "or requests were running): kvstrata serves and saves nothing until it is flushed "
                            "(/flush_cache)")

    setattr(flush_cache_after_weight_update, _MARK, True)
    manager.flush_cache_after_weight_update = flush_cache_after_weight_update  # type: ignore[attr-defined]
    log.info("kvstrata: watching SGLang's weight updates (%s.flush_cache_after_weight_update)", manager.__name__)
    return True


def _watch_flushes(tree: Any) -> None:
    """Wrap the radix cache's ``reset`` (once): after it, SGLang's caches hold nothing of old weights."""
    if tree is None:
        log.error("kvstrata: cannot find SGLang's radix cache to watch its flushes: after this weight update "
                  "kvstrata serves and saves nothing until the server restarts")
        return
    reset = tree.reset
    if getattr(reset, _MARK, False):
        return

    @functools.wraps(reset)
    def watched_reset(*args: Any, **kwargs: Any) -> Any:
        out = reset(*args, **kwargs)  # stops and joins the storage threads, drops their queues
        for updates in list(_live):
            updates.flushed()
        return out

    setattr(watched_reset, _MARK, True)
    tree.reset = watched_reset
