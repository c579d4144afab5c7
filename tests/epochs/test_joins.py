"""A reset made after a weight update is joined, not caught.

Instances share the epochs of a real redis-server, of a shared folder, or of one L2 folder. When
one of them changes its weights and resets (``BlockStore.reset``, what vLLM's
``reset_prefix_cache(reset_connector=True)`` calls), the others, which still hold the old weights,
serve and save nothing of the namespace until each resets too; their reset joins that epoch. A
flush (``kvstrata invalidate``, no weights changed) and a lost epoch are adopted by every instance
at once. Blocks carry their weights in their bytes (``payload``): a load is checked against the
weights the loader holds.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import redis
import torch
import yaml

from tests.harness import redisutil
from test_staleness import Shared as StalenessShared
from kvstrata import BlockStore, Namespace
from kvstrata.cli import main as cli
from kvstrata.config import load_config
from kvstrata.epochs.base import generation, new_epoch, new_generation
from kvstrata.metrics import SOURCES
from kvstrata.cli.stats_view import render

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 512
BLOCKS = 4
OLD, NEW = 1, 2  # the weights an instance holds: they are in every byte of the KV it computes

Opener = Callable[[str], BlockStore]


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, BLOCKS * 16, dtype=np.uint32)


def payload(chain, weights: int) -> torch.Tensor:
    rows = [np.frombuffer(k * (SIZE // 16), np.uint8) ^ np.uint8(weights) for k in chain.keys]
    return torch.from_numpy(np.stack(rows).copy())


def save(store: BlockStore, seed: int, weights: int) -> int:
    """What an engine does after computing prompt ``seed`` with ``weights``: blocks saved."""
    epoch, chain = store.chain(NS, prompt(seed))
    saved = store.save_now(NS, epoch, chain, payload(chain, weights))
    store.flush()
    return saved


def hits(store: BlockStore, seed: int) -> int:
    return store.lookup(NS, prompt(seed)).num_blocks


def loads(store: BlockStore, seed: int, weights: int) -> bool:
    """Whether ``store`` loads prompt ``seed`` whole, every block computed with ``weights``."""
    hit = store.lookup(NS, prompt(seed), pin=True)
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    try:
        n = store.load_into(hit, out)
    finally:
        store.complete_load(hit)
    return n == BLOCKS and torch.equal(out, payload(hit.chain, weights))


class Shared:
    """Instances of one kind of shared epoch state: ``open(name)`` a store, ``config(name)`` its
    YAML file (for the CLI), ``lose()`` deletes the namespace's epoch state."""

    def __init__(self, kind: str, tmp: Path, url: str | None, secret: bool = False) -> None:
        self.kind, self.tmp, self.url = kind, tmp, url
        self.key_file: Path | None = None
        if secret:  # a deployment secret: MAC'd epochs, with their floor records
            self.key_file = tmp / "secret"
            self.key_file.write_bytes(b"s" * 40)
            self.key_file.chmod(0o600)

    def overrides(self, name: str) -> dict[str, object]:
        if self.kind == "l2":  # one host's processes: one L2 folder, its epochs folder
            return {"l2.path": str(self.tmp / "l2")}
        remote = {"remote.backend": "redis", "remote.url": self.url} if self.kind == "redis" else {
            "remote.backend": "fs", "remote.path": str(self.tmp / "shared")}
        if self.key_file is not None:
            remote["remote.auth_key_file"] = str(self.key_file)
        return {"l2.path": str(self.tmp / name / "l2"), "remote.enabled": True, "remote.invalidation_ms": 1,
                "remote.timeout_ms": 2000, **remote}

    def open(self, name: str) -> BlockStore:
        """A started instance: as the adapters do, it describes its namespace at start, which
        reads (joins) the epoch current then."""
        store = BlockStore(load_config(None, {"l1.size": "1MiB", "l1.pin_memory": False, **self.overrides(name)}))
        store.describe(NS)
        return store

    def config(self, name: str) -> Path:
        tree: dict[str, dict[str, object]] = {}
        for key, value in self.overrides(name).items():
            section, field = key.split(".")
            tree.setdefault(section, {})[field] = value
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        return path

    def lose(self) -> None:
        """The epoch value deleted (``allkeys-lru`` evicted it, an operator removed it); its floor
        record, where there is one, stays."""
        if self.kind == "redis":
            client = redis.Redis.from_url(self.url)
            assert client.delete(*client.keys(f"kvstrata:*epoch:{NS.seed.hex()}")) == 1
        else:
            shared = self.tmp / ("l2" if self.kind == "l2" else "shared")
            (path,) = shared.glob(f"**/epochs/{NS.seed.hex()}")
            path.unlink()


@pytest.fixture(params=["redis", "fs", "l2"])
def shared(request, tmp_path) -> Iterator[Shared]:
    if request.param != "redis":
        yield Shared(request.param, tmp_path, None)
        return
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        yield Shared("redis", tmp_path, url)


def operator(shared: Shared, *args: str) -> None:
    """``kvstrata invalidate --all`` (the CLI function), on a store of its own."""
    assert cli.main(["invalidate", "--all", "--config", str(shared.config("operator")), *args]) == 0


def test_a_reset_elsewhere_is_joined_not_caught(shared):
    """Scenario: A and B share the store and serve P. A changes its weights
    and resets; B, still on the old weights, serves P again and a new prompt Q. A loads nothing B
    saved after A's reset; B serves nothing of A's new epoch and saves nothing (counted) until it
    resets itself; B's reset joins A's epoch (no new bump), and from then on they share again."""
    with shared.open("a") as a, shared.open("b") as b:
        assert save(b, 1, OLD) == BLOCKS
        assert loads(a, 1, OLD)
        epoch = a.reset(NS.seed)
        assert epoch is not None and a.joined(NS.seed) and a.counters.get("invalidations") == 1
        assert save(b, 1, OLD) == 0 and save(b, 2, OLD) == 0  # B's GPU cache serves P; Q is new
        assert not b.joined(NS.seed) and b.counters.get("not_joined_saves") == 2 * BLOCKS
        assert hits(a, 1) == 0 and hits(a, 2) == 0  # nothing B computed with the old weights
        assert save(a, 1, NEW) == BLOCKS and save(a, 2, NEW) == BLOCKS
        assert hits(b, 1) == 0 and hits(b, 2) == 0  # nor anything of A's epoch for B
        assert b.counters.get("not_joined_misses") == 2
        assert b.resident()["namespaces_not_joined"] == 1 and b.stats()["not_joined"] == [NS.seed[:8].hex()]
        assert b.reset(NS.seed) == epoch  # B now holds the new weights: it joins A's epoch
        assert b.counters.get("epoch_joins") == 1 and b.counters.get("invalidations") == 0
        assert b.joined(NS.seed) and b.resident()["namespaces_not_joined"] == 0
        assert a.current_epoch(NS) == epoch == b.current_epoch(NS)  # no new bump: A keeps its hits
        assert loads(a, 1, NEW) and loads(b, 1, NEW) and loads(b, 2, NEW)
        assert save(b, 3, NEW) == BLOCKS and loads(a, 3, NEW)


def test_an_operators_invalidate_is_adopted_by_every_instance_and_keeps_the_weights(shared):
    """``kvstrata invalidate`` changes no weights: both instances go on under its new epoch at
    once, without a reset, and the epoch keeps the weights generation of the one it replaced."""
    with shared.open("a") as a, shared.open("b") as b:
        a.reset(NS.seed)
        b.reset(NS.seed)
        assert save(a, 1, NEW) == BLOCKS and loads(b, 1, NEW)
        before = a.current_epoch(NS)
        operator(shared)
        assert hits(a, 1) == 0 and hits(b, 1) == 0  # the flush hides every older block
        after = a.current_epoch(NS)
        assert after != before and generation(after) == generation(before) and b.current_epoch(NS) == after
        assert a.joined(NS.seed) and b.joined(NS.seed)
        assert save(b, 2, NEW) == BLOCKS and loads(a, 2, NEW)
        assert a.counters.get("not_joined_misses") == b.counters.get("not_joined_misses") == 0


def test_invalidate_weights_leaves_every_instance_out_until_it_resets(shared, capsys):
    """``kvstrata invalidate --weights``: the weights were changed; every running instance serves
    and saves nothing until it resets itself, which joins the operator's epoch."""
    with shared.open("a") as a, shared.open("b") as b:
        assert save(a, 1, OLD) == BLOCKS and loads(b, 1, OLD)
        operator(shared, "--weights")
        assert "new weights" in capsys.readouterr().out
        with shared.open("fresh") as fresh:  # an instance started now has joined it
            epoch = fresh.current_epoch(NS)
            assert fresh.joined(NS.seed)
        assert save(a, 2, OLD) == 0 and hits(b, 1) == 0 and not a.joined(NS.seed) and not b.joined(NS.seed)
        assert a.reset(NS.seed) == epoch == b.reset(NS.seed)
        assert save(a, 2, NEW) == BLOCKS and loads(b, 2, NEW)


def test_lost_epoch_state_is_adopted_but_does_not_let_old_weights_back_in(shared):
    """The epoch state is deleted (evicted, flushed, an operator's rm) after A's reset, while B
    still holds the old weights. A adopts the fresh epoch (state loss costs hits, never
    availability) and so does a new instance; B stays out until its own reset."""
    with shared.open("a") as a, shared.open("b") as b:
        assert save(b, 1, OLD) == BLOCKS
        a.reset(NS.seed)
        assert hits(b, 1) == 0 and not b.joined(NS.seed)
        shared.lose()
        assert hits(a, 1) == 0 and a.joined(NS.seed)  # a fresh epoch, generation 0, adopted
        assert generation(a.current_epoch(NS)) == 0
        assert save(a, 1, NEW) == BLOCKS
        with shared.open("fresh") as fresh:
            assert loads(fresh, 1, NEW)
        assert save(b, 2, OLD) == 0 and hits(b, 1) == 0 and not b.joined(NS.seed)
        assert b.reset(NS.seed) == a.current_epoch(NS)
        assert loads(b, 1, NEW)


def wait_until(what: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def idle_peer_after_a_reset_and_a_lost_epoch(a: BlockStore, b: BlockStore, lose: Callable[[], None],
                                             deaf: bool) -> None:
    """The issue's scenario (issue 50, part 2): A and B serve P; A changes its weights and resets
    while B is idle (no lookup, no save); the epoch value is then lost (``allkeys-lru`` evicted it).
    B serves P and Q, then A serves P and Q: A loads nothing B computed, and B nothing of A's.
    ``deaf``: B hears no announcement (its subscriber gone, or a folder: none), so only what the
    lost epoch's replacement carries can keep B out."""
    assert save(b, 1, OLD) == BLOCKS and loads(a, 1, OLD)
    for store in (a, b):  # the start's L2 scan reads the epoch when it ends: over before B goes idle
        assert store.recovery is None or store.recovery.wait(10)
    if deaf:
        b.epochs.close()
        time.sleep(1.2)  # the subscriber's last round is over
    a.reset(NS.seed)
    if not deaf:  # B learns of it in the background, before any use: behind
        assert wait_until(lambda: not b.joined(NS.seed))
    lose()
    assert save(b, 1, OLD) == 0 and save(b, 2, OLD) == 0  # B's GPU cache serves P; Q is new
    assert not b.joined(NS.seed) and b.counters.get("not_joined_saves") == 2 * BLOCKS
    assert hits(a, 1) == 0 and hits(a, 2) == 0 and a.joined(NS.seed)
    assert save(a, 3, NEW) == BLOCKS and hits(b, 3) == 0
    assert b.reset(NS.seed) == a.current_epoch(NS) and loads(b, 3, NEW)


def test_an_idle_instance_learns_of_a_reset_as_it_is_announced(tmp_path):
    """Redis without a secret: the subscriber reads the epoch when the announcement arrives, so B,
    idle, is behind before the epoch is lost; the fresh epoch (generation 0) leaves it out."""
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        shared = Shared("redis", tmp_path, url)
        with shared.open("a") as a, shared.open("b") as b:
            idle_peer_after_a_reset_and_a_lost_epoch(a, b, shared.lose, deaf=False)
            assert generation(a.current_epoch(NS)) == 0  # no floor record: the fresh epoch is of generation 0


@pytest.mark.parametrize("kind", ["redis", "fs"])
def test_an_epoch_made_after_state_loss_keeps_the_newest_weights_generation_its_floor_knows(kind, tmp_path):
    """With a secret, B hears nothing (its subscriber closed; a folder has none). The floor record,
    which losing the epoch value leaves in place, names the newest epoch: the value made after the
    loss keeps its weights generation, so B, which never joined it, stays out."""
    if kind == "fs":
        shared = Shared("fs", tmp_path, None, secret=True)
        with shared.open("a") as a, shared.open("b") as b:
            idle_peer_after_a_reset_and_a_lost_epoch(a, b, shared.lose, deaf=True)
            assert generation(a.current_epoch(NS)) != 0
        return
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        shared = Shared("redis", tmp_path, url, secret=True)
        with shared.open("a") as a, shared.open("b") as b:
            idle_peer_after_a_reset_and_a_lost_epoch(a, b, shared.lose, deaf=True)
            assert generation(a.current_epoch(NS)) != 0


def test_a_flush_after_a_reset_does_not_let_in_an_instance_that_missed_the_reset(shared):
    """C holds the old weights and is idle while A resets and an operator flushes right after:
    the first epoch C reads is the flush's. It carries the reset's weights generation, so C
    serves and saves nothing of it (a flush adopted by C would let old weights in)."""
    with shared.open("a") as a, shared.open("c") as c:
        assert save(c, 1, OLD) == BLOCKS and loads(a, 1, OLD)
        a.reset(NS.seed)
        operator(shared)
        assert save(c, 2, OLD) == 0 and hits(c, 1) == 0 and not c.joined(NS.seed)
        assert a.joined(NS.seed) and save(a, 2, NEW) == BLOCKS and hits(c, 2) == 0
        assert hits(a, 2) == BLOCKS


def test_instances_that_reset_at_the_same_moment_end_on_one_epoch_both_joined(shared):
    """Every instance of a fleet (vLLM's data-parallel ranks, an RL loop's rollout workers)
    updates its weights and resets at once. The bumps are compare-and-sets: one reset makes the
    new epoch, the others join it, so no instance is left out and all share it at once."""
    with shared.open("a") as a, shared.open("b") as b:
        for round_ in range(6):
            start = threading.Barrier(2)
            epochs: dict[str, int | None] = {}

            def reset(name: str, store: BlockStore) -> None:
                start.wait()
                epochs[name] = store.reset(NS.seed)

            threads = [threading.Thread(target=reset, args=item) for item in (("a", a), ("b", b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert epochs["a"] == epochs["b"] is not None, (round_, epochs)
            assert a.joined(NS.seed) and b.joined(NS.seed)
            assert save(a, 10 + round_, NEW + round_) == BLOCKS and loads(b, 10 + round_, NEW + round_)
        assert a.counters.get("epoch_joins") + b.counters.get("epoch_joins") == 6


def test_every_lookup_and_save_of_the_store_refuses_a_namespace_not_joined(tmp_path):
    """The rule is the store's, whatever the glue calls: vLLM's ``lookup`` / ``lookup_groups`` /
    ``prepare_store``, SGLang's ``lookup_chain`` / ``save_now`` / ``save_runs``, the queued ``save``."""
    from kvstrata.keys import NO_EXTRA
    from kvstrata.store import ByteRuns, GroupRule

    shared = Shared("l2", tmp_path, None)
    rule = GroupRule("full", b"g0:full")
    with shared.open("a") as a, shared.open("b") as b:
        a.reset(NS.seed)
        epoch = b.current_epoch(NS)
        assert not b.joined(NS.seed)
        tokens = prompt(1)
        group = a.group_chain(NS, epoch, rule.tag, tokens)
        pages = a.page_chain(NS, epoch, [bytes([i]) * 16 for i in range(BLOCKS)])
        for chain in (a.chain(NS, tokens)[1], group, pages):
            assert a.save_now(NS, epoch, chain, payload(chain, NEW)) == BLOCKS
        assert b.lookup(NS, tokens).num_blocks == 0
        assert b.lookup_chain(NS, epoch, pages).num_blocks == 0
        assert b.lookup_groups(NS, tokens, NO_EXTRA, [rule], lo=0, hi=len(tokens), pin=False).boundary == 0
        assert b.counters.get("not_joined_misses") == 3
        chain = b.chain(NS, prompt(2))[1]
        assert b.prepare_store(NS, epoch, chain, SIZE).slots == []
        assert b.save(NS, epoch, chain, payload(chain, OLD)) is False
        assert b.save_now(NS, epoch, chain, payload(chain, OLD)) == 0
        rows = payload(chain, OLD).numpy()
        assert b.direct_writes
        assert b.save_runs(NS, epoch, chain, ByteRuns(SIZE, lambda i: [memoryview(rows[i])])) == 0
        b.flush()
        assert b.counters.get("not_joined_saves") == 4 * BLOCKS and not b.counters.get("saved_blocks")
        assert a.lookup(NS, prompt(2)).num_blocks == 0
        b.reset(NS.seed)
        assert b.lookup_chain(NS, epoch, pages).num_blocks == BLOCKS
        assert b.lookup_groups(NS, tokens, NO_EXTRA, [rule], lo=0, hi=len(tokens), pin=False).boundary == len(tokens)


def test_stats_say_which_namespaces_this_instance_has_not_joined(shared):
    from rich.console import Console

    with shared.open("a") as a, shared.open("b") as b:
        save(b, 1, OLD)
        a.reset(NS.seed)
        hits(b, 1)
        console = Console(record=True, width=200)
        render(b.stats(), console)
        assert "joined     no: another instance reset it after a weight update" in console.export_text()
        console = Console(record=True, width=200)
        render(a.stats(), console)
        assert "joined     no" not in console.export_text()


def test_the_join_state_is_exported_as_metrics():
    for source in ("not_joined_misses", "not_joined_saves", "epoch_joins", "namespaces_not_joined"):
        assert source in SOURCES, source
    assert SOURCES["namespaces_not_joined"][0].kind == "gauge"
    assert SOURCES["not_joined_saves"][0].name == "not_joined_saves_dropped"


# ------------------------------------------------------------ the rule, on epochs in a dict
class Dict(StalenessShared):
    """Epoch state in a dict that can be made unreachable (test_staleness's, reads never late),
    holding an epoch of a weights generation."""

    def __init__(self) -> None:
        super().__init__(refresh_s=0.0, bound_s=1.0)
        self.value = new_epoch(new_generation())


def test_a_reset_written_late_joins_a_reset_made_meanwhile_instead_of_replacing_it():
    """A resets while the shared state is unreachable; meanwhile another instance resets. When A's
    write goes out, its compare-and-set finds an epoch it did not replace: A joins it."""
    epochs, seed = Dict(), b"s" * 16
    old = epochs.get(seed)
    epochs.down = True
    assert epochs.reset(seed).epoch is None  # pending: saves go under A's new epoch meanwhile
    assert epochs.joined(seed) and generation(epochs.get(seed)) != generation(old)
    other = epochs.value = new_epoch(new_generation())  # B's reset
    epochs.down = False
    assert epochs.lookup_epoch(seed, time.monotonic()) == (other, True)
    assert epochs.joined(seed) and epochs.value == other


def test_a_flush_written_late_keeps_the_generation_of_what_it_replaces():
    """A flushes while the shared state is unreachable; meanwhile another instance resets (a new
    generation). A's flush, written later, is made again on top of that reset, keeping its
    generation: A, which never reset, is left out of it."""
    epochs, seed = Dict(), b"s" * 16
    epochs.get(seed)
    epochs.down = True
    assert epochs.bump(seed) is None
    other = epochs.value = new_epoch(new_generation())
    epochs.down = False
    epoch, confirmed = epochs.lookup_epoch(seed, time.monotonic())
    assert confirmed and epoch == epochs.value != other and generation(epoch) == generation(other)
    assert not epochs.joined(seed)
