"""Epochs that cannot be replayed (issue 42, part 3): with a secret, a writer without it can only
delete or spoil values, never bring back an epoch that was replaced.

The attacker can write the shared tier (raw redis-py, plain file operations) but holds no secret.
It keeps copies of what was there before an invalidation (the MAC'd epoch value, the blocks), and
after it writes them back and deletes the retired-epoch floor it can find; a freshly started
instance with an empty L2 (a new container) must serve nothing of the old epoch. Real
redis-server, the shared folder; no engine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import redis
import torch

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.config import load_config
from kvstrata.format.auth import Auth

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SECRET = b"r" * 24 + os.urandom(16).hex().encode()
KID = Auth(SECRET).key_id
BLOCKS = 4


class Tier:
    """One shared tier (``kind``: "redis" or "fs") and what an attacker without the secret does to it."""

    def __init__(self, kind: str, tmp: Path, url: str | None) -> None:
        self.kind, self.tmp, self.url = kind, tmp, url
        self.client = redis.Redis.from_url(url) if url else None
        self.key_file = tmp / "key"
        self.key_file.write_bytes(SECRET + b"\n")
        self.key_file.chmod(0o600)

    def open(self, name: str) -> BlockStore:
        """An instance with an L2 folder of its own (``tmp/name``): a new name is an empty disk."""
        remote = {"remote.backend": "redis", "remote.url": self.url} if self.kind == "redis" else {
            "remote.backend": "fs", "remote.path": str(self.tmp / "shared")}
        return BlockStore(load_config(None, {
            "l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(self.tmp / name / "l2"),
            "remote.enabled": True, "remote.invalidation_ms": 1, "remote.auth_key_file": str(self.key_file),
            **remote}))

    # ------------------------------------------------------------------ the attacker's side
    @property
    def _space(self) -> Path:
        return self.tmp / "shared" / f"auth-{KID}"

    def _epoch_name(self) -> str:
        return f"kvstrata:{KID}:epoch:{NS.seed.hex()}"

    def steal(self) -> dict[str, bytes]:
        """Copies of the epoch value and of every block, as a dump taken now would hold them."""
        if self.client is not None:
            names = [n for n in self.client.scan_iter(match=f"kvstrata:{KID}:{{*") if n.count(b":") >= 3]
            dump = {n.decode(): self.client.dump(n) for n in names}
            dump["epoch"] = self.client.get(self._epoch_name())
            return dump
        shutil.copytree(self._space / "blocks", self.tmp / "stolen-blocks")
        return {"epoch": (self._space / "epochs" / NS.seed.hex()).read_bytes()}

    def replay(self, stolen: dict[str, bytes]) -> None:
        """Write the stolen copies back and delete the plain retired-epoch floor (the shared
        folder's ``.retired``; Redis has none in the shared tier)."""
        if self.client is not None:
            for name, value in stolen.items():
                if name != "epoch":
                    self.client.restore(name, 0, value, replace=True)
            self.client.set(self._epoch_name(), stolen["epoch"])
            return
        shutil.copytree(self.tmp / "stolen-blocks", self._space / "blocks", dirs_exist_ok=True)
        (self._space / "epochs" / NS.seed.hex()).write_bytes(stolen["epoch"])
        (self._space / "epochs" / f"{NS.seed.hex()}.retired").unlink(missing_ok=True)

    def write_epoch(self, value: bytes) -> None:
        if self.client is not None:
            self.client.set(self._epoch_name(), value)
        else:
            (self._space / "epochs" / NS.seed.hex()).write_bytes(value + b"\n")

    def delete_epoch(self) -> None:
        if self.client is not None:
            assert self.client.delete(self._epoch_name()) == 1
        else:
            (self._space / "epochs" / NS.seed.hex()).unlink()

    def delete_shared_floor(self) -> None:
        if self.client is not None:
            assert self.client.delete(f"kvstrata:{KID}:floor:{NS.seed.hex()}") == 1
        else:
            (self._space / "epochs" / f"{NS.seed.hex()}.floor").unlink()

    def counter(self) -> int:
        """The counter of the stored epoch value (its last field)."""
        raw = self.client.get(self._epoch_name()) if self.client is not None else (
            self._space / "epochs" / NS.seed.hex()).read_bytes()
        return int(raw.strip().split(b":")[2])


@pytest.fixture(params=["redis", "fs"])
def tier(request, tmp_path) -> Iterator[Tier]:
    if request.param == "fs":
        yield Tier("fs", tmp_path, None)
        return
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        yield Tier("redis", tmp_path, url)


def tokens() -> np.ndarray:
    return np.random.default_rng(42).integers(0, 30000, BLOCKS * 16, dtype=np.uint32)


def save(store: BlockStore) -> int:
    epoch, chain = store.chain(NS, tokens())
    rows = torch.from_numpy(np.stack([np.frombuffer(k * 64, np.uint8) for k in chain.keys]).copy())
    saved = store.save_now(NS, epoch, chain, rows)
    store.flush()
    return saved


def hits(store: BlockStore) -> int:
    return store.lookup(NS, tokens()).num_blocks


def test_a_replayed_epoch_value_is_refused_by_a_fresh_instance_with_an_empty_disk(tier):
    """Scenario: A saves a prompt under epoch E1; the attacker copies E1's MAC'd value and the
    blocks; A invalidates (E2). The attacker writes E1's value and the blocks back and deletes the
    plain retired-epoch floor. B, a new container (empty L2) on the same shared tier, looks the
    prompt up: it must serve nothing of E1, count the refused replay, and every instance then
    agrees on an epoch newer than both."""
    with tier.open("a") as a:
        assert save(a) == BLOCKS
        with tier.open("witness") as w:
            assert hits(w) == BLOCKS  # the stolen copies are servable ones
        stolen = tier.steal()
        old = a.epochs.get(NS.seed)
        assert a.invalidate(NS.seed) is not None
    tier.replay(stolen)  # nobody runs: no instance that saw E1 replaced can repair it first
    with tier.open("b") as b:
        assert hits(b) == 0
        assert b.counters.get("epoch_replays_refused") == 1
        now = b.epochs.get(NS.seed)
        assert now != old
    with tier.open("a") as a:
        assert hits(a) == 0 and a.epochs.get(NS.seed) == now  # A follows the repair, it does not fight it


def test_an_instance_with_its_local_floor_refuses_a_complete_old_snapshot(tier):
    """Scenario: the attacker writes back the old value *and* deletes the shared floor (every
    shared copy of the newer counter gone). A, restarted on its own disk, still refuses it: its
    floor in L2's folder holds the newer counter."""
    with tier.open("a") as a:
        assert save(a) == BLOCKS
        stolen = tier.steal()
        old = a.epochs.get(NS.seed)
        assert a.invalidate(NS.seed) is not None
    tier.replay(stolen)
    tier.delete_shared_floor()
    with tier.open("a") as a:
        assert hits(a) == 0 and a.epochs.get(NS.seed) != old
        assert a.counters.get("epoch_replays_refused") == 1


def test_deleting_every_copy_loses_the_epoch_never_revives_an_older_one(tier):
    """Scenario: the epoch value and the shared floor are deleted (nothing written back). A fresh
    instance starts a new epoch above nothing it knows; the old blocks are misses."""
    with tier.open("a") as a:
        assert save(a) == BLOCKS
        old = a.epochs.get(NS.seed)
        assert a.invalidate(NS.seed) is not None
    tier.delete_epoch()
    tier.delete_shared_floor()
    with tier.open("b") as b:
        assert hits(b) == 0 and b.epochs.get(NS.seed) != old
        assert b.counters.get("epoch_replays_refused") == 0


def test_epoch_values_carry_a_rising_counter_and_the_format_before_counters_is_read_as_counter_zero(tier):
    """Scenario: a deployment upgraded from values without a counter. The old value (its MAC over
    the epoch alone) is still the current epoch, with no floor anywhere; after the next
    invalidation it is a replay like any older value."""
    auth = Auth(SECRET)
    with tier.open("a") as a:
        first = a.epochs.get(NS.seed)
        counters = [tier.counter()]
        a.invalidate(NS.seed)
        counters.append(tier.counter())
        assert counters[1] > counters[0] >= 1
    tier.delete_shared_floor()  # no floor anywhere, and no retired epoch either: as before the upgrade
    shutil.rmtree(tier.tmp / "a")
    (tier._space / "epochs" / f"{NS.seed.hex()}.retired").unlink(missing_ok=True)
    legacy = (auth.seal_text(b"epoch", tier._epoch_name(), str(first).encode()) if tier.kind == "redis" else
              auth.seal_text(b"epoch:remote", NS.seed.hex(), str(first).encode()))
    tier.write_epoch(legacy)
    with tier.open("b") as b:
        assert b.epochs.get(NS.seed) == first and b.counters.get("remote_auth_epochs") == 0
        b.invalidate(NS.seed)
    tier.write_epoch(legacy)
    with tier.open("b") as b:
        assert b.epochs.get(NS.seed) != first and b.counters.get("epoch_replays_refused") == 1
