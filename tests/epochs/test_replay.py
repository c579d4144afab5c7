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
import time
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

    def open(self, name: str, **remote_overrides: object) -> BlockStore:
        """An instance with an L2 folder of its own (``tmp/name``): a new name is an empty disk."""
        remote = {"remote.backend": "redis", "remote.url": self.url} if self.kind == "redis" else {
            "remote.backend": "fs", "remote.path": str(self.tmp / "shared")}
        return BlockStore(load_config(None, {
            "l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(self.tmp / name / "l2"),
            "remote.enabled": True, "remote.invalidation_ms": 1, "remote.auth_key_file": str(self.key_file),
            **remote, **{f"remote.{k}": v for k, v in remote_overrides.items()}}))

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
        shutil.rmtree(self.tmp / "stolen-blocks", ignore_errors=True)
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

    def _value(self) -> bytes:
        return self.client.get(self._epoch_name()) if self.client is not None else (
            self._space / "epochs" / NS.seed.hex()).read_bytes()

    def counter(self) -> int:
        """The counter of the stored epoch value (its third field)."""
        return int(self._value().strip().split(b":")[2])

    def sealed(self) -> int:
        """The second the stored epoch value was sealed (its last field)."""
        return int(self._value().strip().split(b":")[3])

    def seal(self, *signed: int) -> bytes:
        """A value of an older format under the deployment secret, as an older release wrote it:
        ``(epoch,)`` before counters, ``(epoch, counter)`` before freshness."""
        auth = Auth(SECRET)
        kind, name = (b"epoch", self._epoch_name()) if self.kind == "redis" else (b"epoch:remote", NS.seed.hex())
        if len(signed) == 1:
            return auth.seal_text(kind, name, str(signed[0]).encode())
        tag = auth.tag(kind + b"+counter", name, b"%d:%d" % signed)
        return b"%d:%s:%d" % (signed[0], tag.hex().encode(), signed[1])


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


def test_a_value_written_back_with_the_floor_deleted_is_refused_by_a_fresh_instance_once_it_is_max_age_old(tier):
    """The issue's scenario (issue 50, part 1): A saves a prompt under E1; the attacker copies E1's
    value and blocks; A invalidates (E2). The attacker writes E1's value and the blocks back and
    deletes every floor record it can reach (the shared folder's ``.retired`` and the shared floor):
    only A's own disk still knows. B, a new container with an empty L2, has no floor of its own: it
    takes a value only if sealed at most ``remote.epoch_max_age_s`` ago, and E1's is older. It
    serves nothing, counts the value expired, and A then follows B's fresh epoch. The control, the
    window that remains: the same replay within ``epoch_max_age_s`` of the copy is served."""
    for max_age, served in ((1, 0), (3600, BLOCKS)):
        with tier.open(f"a{max_age}", epoch_max_age_s=max_age) as a:
            a.reset(NS.seed)  # a clean start for each round: a new epoch of its own
            assert save(a) == BLOCKS
            stolen = tier.steal()
            old = a.epochs.get(NS.seed)
            assert a.invalidate(NS.seed) is not None
        time.sleep(2.1)  # the stolen value is now over 1 s old (its seal counts whole seconds)
        tier.replay(stolen)
        tier.delete_shared_floor()
        with tier.open(f"b{max_age}", epoch_max_age_s=max_age) as b:
            assert hits(b) == served, max_age
            expired = b.counters.get("epoch_values_expired")
            assert (expired, b.epochs.get(NS.seed) != old) == ((1, True) if served == 0 else (0, False)), max_age
            now = b.epochs.get(NS.seed)
        if served == 0:
            with tier.open(f"a{max_age}", epoch_max_age_s=max_age) as a:  # its floor knows a higher counter
                assert hits(a) == 0 and a.epochs.get(NS.seed) not in (old, 0)
                settled = a.epochs.get(NS.seed)
            with tier.open(f"b{max_age}", epoch_max_age_s=max_age) as b:  # and every instance follows
                assert hits(b) == 0 and b.epochs.get(NS.seed) in (now, settled)


def test_an_epoch_value_in_use_is_sealed_again_so_a_live_fleet_never_sees_it_expire(tier):
    """A reads its epoch every ``invalidation_ms``; once the value is a quarter of ``epoch_max_age_s``
    old, A seals the same epoch again (next counter, the time now). A new container started after
    ``epoch_max_age_s`` then takes it, and shares A's blocks."""
    with tier.open("a", epoch_max_age_s=4) as a:
        assert save(a) == BLOCKS
        epoch, counter, sealed = a.epochs.get(NS.seed), tier.counter(), tier.sealed()
        for _ in range(5):
            time.sleep(1.05)
            assert hits(a) == BLOCKS
        assert a.epochs.get(NS.seed) == epoch and tier.counter() > counter and tier.sealed() > sealed
    with tier.open("b", epoch_max_age_s=4) as b:
        assert hits(b) == BLOCKS and b.counters.get("epoch_values_expired") == 0


def test_values_of_older_formats_are_taken_by_an_instance_with_its_floor_and_sealed_again(tier):
    """A deployment upgraded from values without a seal time (and from before counters): an
    instance that holds its floor takes the current value and seals it again with the time; a new
    container, with no floor of its own, refuses a value of an older format (it carries no time)
    once no floor record vouches for it either, as lost state: a fresh epoch."""
    with tier.open("a") as a:
        first = a.epochs.get(NS.seed)
        counter = tier.counter()
        assert counter >= 1 and tier.sealed() >= int(time.time()) - 5
    tier.write_epoch(tier.seal(first, counter))  # as the release before freshness wrote it
    with tier.open("a") as a:  # its own floor vouches: taken, and sealed again with the time
        assert a.epochs.get(NS.seed) == first and tier.counter() == counter + 1
        assert tier.sealed() >= int(time.time()) - 5
    with tier.open("b") as b:  # a new container takes the sealed value
        assert b.epochs.get(NS.seed) == first and b.counters.get("epoch_values_expired") == 0
    tier.delete_shared_floor()
    tier.write_epoch(tier.seal(first))  # before counters: counter 0 and no time
    with tier.open("c") as c:
        assert c.epochs.get(NS.seed) != first and c.counters.get("epoch_values_expired") == 1
        assert c.counters.get("remote_auth_epochs") == 0  # it passed its MAC: refused for its age


def test_an_l2_folders_own_epochs_never_expire_across_a_restart(tmp_path):
    """Freshness is the shared tier's: one host's L2 folder (``l2.authenticate``) holds its floor record
    on the same disk as its epochs, so a restart after hours idle keeps its epoch and its blocks."""
    from kvstrata.epochs.floor import open_epoch, seal_epoch
    from kvstrata.epochs.folder import FileEpochs

    auth, seed = Auth(SECRET), NS.seed
    epoch = FileEpochs(tmp_path, auth=auth, counter_prefix="l2").get(seed)
    path = tmp_path / seed.hex()
    _, counter, _ = open_epoch(auth, b"epoch:l2", seed.hex(), path.read_bytes())
    path.write_bytes(seal_epoch(auth, b"epoch:l2", seed.hex(), epoch, counter, int(time.time()) - 7 * 86400) + b"\n")
    again = FileEpochs(tmp_path, auth=auth, counter_prefix="l2")  # a restart: nothing in memory
    assert again.get(seed) == epoch
