"""SGLang's weight updates made in memory as the storage backend sees them
(``kvstrata.adapters.sglang.weights``), without SGLang: ``WeightUpdates`` over two real stores on one
L2 folder (two servers of one host), and the hooks over stand-ins of SGLang's scheduler objects with
the call order of SGLang 0.5.23's ``SchedulerWeightUpdaterManager``. On two real servers:
tests/engines/test_sglang_weights.py."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from kvstrata.adapters.sglang.weights import WeightUpdates, hook, unwatch, watch
from kvstrata.config import load_config
from kvstrata.store import BlockStore
from tests.builders import make_namespace

NS = make_namespace(engine="sglang")


def open_store(l2: Path) -> BlockStore:
    """A started server's store: it reads (joins) the namespace's epoch at start, as the backend does."""
    store = BlockStore(load_config(None, {"l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(l2)}))
    store.describe(NS)
    return store


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[WeightUpdates, WeightUpdates]]:
    a, b = open_store(tmp_path / "l2"), open_store(tmp_path / "l2")
    try:
        yield WeightUpdates(a), WeightUpdates(b)
    finally:
        a.close()
        b.close()


def test_an_update_resets_at_the_first_use_after_the_flush_and_the_other_server_joins(pair):
    """Scenario: servers A and B share one epoch. A updates its weights: until SGLang's flush A
    serves and saves nothing; its first use after the flush starts a new weights generation, which
    B (old weights) has not joined. B's own update joins A's epoch instead of starting another."""
    a, b = pair
    old = a.epoch(NS)
    assert b.epoch(NS) == old
    a.updated()
    assert a.epoch(NS) is None and a.store.counters.get("invalidations") == 0  # the flush has not run
    a.flushed()
    new = a.epoch(NS)
    assert new not in (None, old) and a.store.joined(NS.seed) and a.store.counters.get("invalidations") == 1
    assert b.epoch(NS) == new and not b.store.joined(NS.seed)  # behind: serves and saves none of it
    b.updated()
    b.flushed()
    assert b.epoch(NS) == new and b.store.joined(NS.seed)
    assert b.store.counters.get("epoch_joins") == 1 and not b.store.counters.get("invalidations")
    assert a.epoch(NS) == new  # no new bump: A keeps what it stored


def test_an_update_made_of_several_calls_is_one_reset(pair):
    """Scenario: a bucketed update (``update_weights_from_tensor`` per bucket, each flushing)."""
    a, _ = pair
    for _ in range(3):
        a.updated()
        a.flushed()
    a.epoch(NS)
    a.epoch(NS)
    assert a.store.counters.get("invalidations") == 1


class Manager:
    """SGLang 0.5.23's ``SchedulerWeightUpdaterManager`` as far as the hook goes: an update calls
    ``flush_cache_after_weight_update`` once the weights changed, which flushes the radix cache
    (``scheduler.tree_cache.reset``) when the request asks for it and no request runs."""

    def __init__(self, running: bool = False) -> None:
        self.running = running
        self.scheduler = SimpleNamespace(tree_cache=SimpleNamespace(resets=0))
        self.scheduler.tree_cache.reset = self.count_reset
        self.seen: list[bool] = []  # whether the backend was off the store while SGLang flushed

    def count_reset(self) -> None:
        self.scheduler.tree_cache.resets += 1

    def flush_cache_after_weight_update(self, recv_req, success, message):
        self.seen.append(watched.stale)
        if recv_req.flush_cache and not self.running:
            self.scheduler.tree_cache.reset()
            return success, message
        return (False, "not flushed") if recv_req.flush_cache else (success, message)


watched: WeightUpdates  # the backend of the hook test


@pytest.fixture
def hooked(pair) -> Iterator[WeightUpdates]:
    global watched
    watched = pair[0]
    watch(watched)  # no SGLang here: the install fails (logged) and the stand-in is hooked instead
    assert hook(Manager) and hook(Manager)  # a second install is a no-op
    try:
        yield watched
    finally:
        unwatch(watched)


def test_the_hook_takes_the_backend_off_the_store_before_sglangs_flush_and_back_after_it(hooked, caplog):
    old = hooked.epoch(NS)
    manager = Manager()
    assert manager.flush_cache_after_weight_update(SimpleNamespace(flush_cache=True), True, "ok") == (True, "ok")
    assert manager.seen == [True] and manager.scheduler.tree_cache.resets == 1
    assert hooked.epoch(NS) not in (None, old)

    caplog.set_level(logging.WARNING, logger="kvstrata.adapters.sglang.weights")
    busy = Manager(running=True)  # the update's flush refused: SGLang's cache keeps the old weights' KV
    before = hooked.epoch(NS)
    busy.flush_cache_after_weight_update(SimpleNamespace(flush_cache=True), True, "ok")
    assert hooked.epoch(NS) is None and "without flushing its cache" in caplog.text
    busy.running = False
    busy.scheduler.tree_cache.reset()  # /flush_cache, once the requests are done
    assert hooked.epoch(NS) not in (None, before)
    assert hooked.store.counters.get("invalidations") == 2
