"""Epoch state in a real redis-server can be lost or damaged; that may cost hits, never correctness.

Each scenario stores a prompt under one epoch, invalidates it from another instance, then
loses the epoch state the way the world does (the key deleted or evicted, a restart without
persistence with the blocks restored, FLUSHDB, a value that is not an epoch, an old
epoch restored), and checks that no instance ever loads a block of the invalidated
epoch again, from Redis or from its local disk.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.harness import redisutil
from tests.harness.redisutil import redis_store
from kvstrata import BlockStore, Namespace
from kvstrata.epochs.base import new_epoch
from kvstrata.store import recovery

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 1024
EPOCH_KEY = f"kvstrata:epoch:{NS.seed.hex()}"


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, 4 * 16, dtype=np.uint32)


def store_prompt(store: BlockStore) -> list[bytes]:
    import torch

    epoch, chain = store.chain(NS, tokens())
    rows = [np.frombuffer(k * (SIZE // 16), np.uint8) for k in chain.keys]
    assert store.save_now(NS, epoch, chain, torch.from_numpy(np.stack(rows).copy())) == 4
    store.flush()
    return chain.keys


def invalidated_elsewhere(tmp: Path, url: str) -> None:
    """A second instance (own disk, so its GC deletes nothing of the writer's) bumps the epoch."""
    with redis_store(tmp, "bumper", url) as bumper:
        bumper.invalidate(NS.seed)


def hits(tmp: Path, name: str, url: str) -> int:
    with redis_store(tmp, name, url) as store:
        return store.lookup(NS, tokens()).num_blocks


@pytest.fixture
def server(tmp_path):
    with redisutil.standalone(tmp_path / "redis") as (url, port, procs):
        yield url, port, procs


def test_deleted_epoch_key_never_revives_an_invalidated_epoch(tmp_path, server):
    """Scenario: the epoch key is deleted (as allkeys-lru eviction or an operator would) after
    an invalidation. Neither a fresh instance (Redis blocks) nor the writer's own disk serves
    the old blocks."""
    url, _, _ = server
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)
    invalidated_elsewhere(tmp_path, url)
    client = redis.Redis.from_url(url)
    assert client.delete(EPOCH_KEY) == 1
    assert hits(tmp_path, "fresh", url) == 0  # from Redis
    assert hits(tmp_path, "writer", url) == 0  # from the writer's local disk
    assert client.get(EPOCH_KEY) is not None  # a fresh epoch was created


def test_redis_restart_without_persistence_never_revives_an_invalidated_epoch(tmp_path, server):
    """Scenario: Redis restarts without persistence and the blocks are restored (a cache warmer,
    a replica) but the epoch key is not: nothing of the invalidated epoch is loaded."""
    url, port, procs = server
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)
    client = redis.Redis.from_url(url)
    dumped = {k: client.dump(k) for k in client.scan_iter("kvstrata:{*")}
    invalidated_elsewhere(tmp_path, url)
    redisutil.stop(procs[0])
    procs[0] = redisutil.start(port, tmp_path / "redis")
    client = redis.Redis.from_url(url)
    for k, v in dumped.items():
        client.restore(k, 0, v)
    assert client.get(EPOCH_KEY) is None
    assert hits(tmp_path, "fresh", url) == 0
    assert hits(tmp_path, "writer", url) == 0


def test_flushdb_never_revives_an_invalidated_epoch_from_local_disk(tmp_path, server, monkeypatch):
    """Scenario: FLUSHDB after an invalidation; the writer's own disk still holds the old
    blocks. A restart of the writer on that disk loads none of them. (Its recovery is held
    before the reclaim of older epochs, which would delete them and make the miss vacuous.)"""
    monkeypatch.setattr(recovery, "PAUSE_S", 60.0)  # close() stops the wait at once
    url, _, _ = server
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)
    invalidated_elsewhere(tmp_path, url)
    redis.Redis.from_url(url).flushdb()
    with redis_store(tmp_path, "writer", url) as again:
        assert len(list(again.l2.scan_files())) == 4  # still on disk
        assert again.lookup(NS, tokens()).num_blocks == 0


def test_a_second_reset_after_the_key_was_lost_hides_the_blocks_it_should(tmp_path, server):
    """Scenario: the key is lost after a reset; a second reset must hand out an epoch that
    never had blocks (INCR handed out 1 again), so it hides the blocks stored since."""
    url, _, _ = server
    invalidated_elsewhere(tmp_path, url)
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)  # under the epoch of the first reset
        assert writer.lookup(NS, tokens()).num_blocks == 4
        redis.Redis.from_url(url).delete(EPOCH_KEY)
        writer.invalidate(NS.seed)
        assert writer.lookup(NS, tokens()).num_blocks == 0
    assert hits(tmp_path, "fresh", url) == 0


def test_a_restored_old_epoch_is_refused_by_the_instances_that_saw_it_replaced(tmp_path, server):
    """Scenario: Redis comes back from a snapshot taken before an invalidation, so the epoch key
    names the epoch the old blocks were written under. The writer saw that epoch
    replaced (in memory and in its disk's floor); it refuses it, starts a new epoch, and
    counts the rollback."""
    url, _, _ = server
    client = redis.Redis.from_url(url)
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)
        snapshot = client.get(EPOCH_KEY)
        writer.invalidate(NS.seed)
    client.set(EPOCH_KEY, snapshot)  # the restore; the old blocks are still on the writer's disk
    with redis_store(tmp_path, "writer", url) as again:
        assert again.lookup(NS, tokens()).num_blocks == 0
        assert again.counters.get("remote_epoch_rollbacks") == 1
    assert client.get(EPOCH_KEY) != snapshot


@pytest.mark.parametrize("value", [b"not a number", str(1 << 64).encode(), b"-3", b"0", b"\xff\xfe"])
def test_an_epoch_value_that_is_not_a_valid_epoch_is_replaced_not_fatal(tmp_path, server, value):
    """Scenario: the epoch key holds garbage, 2^64, a negative number, zero, or invalid UTF-8.
    Lookups go on (no exception), the old blocks are misses, and the value is replaced by a
    valid epoch that every instance then shares."""
    url, _, _ = server
    client = redis.Redis.from_url(url)
    with redis_store(tmp_path, "writer", url) as writer:
        store_prompt(writer)
    client.set(EPOCH_KEY, value)
    with redis_store(tmp_path, "a", url) as a, redis_store(tmp_path, "b", url) as b:
        assert a.lookup(NS, tokens()).num_blocks == 0
        assert a.counters.get("remote_bad_epochs") == 1
        assert b.current_epoch(NS) == a.current_epoch(NS)
    assert int(client.get(EPOCH_KEY)) == a.current_epoch(NS)


def test_a_forged_announcement_cannot_set_an_epoch(tmp_path, server):
    """Scenario: a message on the epochs channel carries a huge or malformed value. Instances
    only re-read Redis on an announcement, so lookups go on and serve the current epoch."""
    url, _, _ = server
    with redis_store(tmp_path, "writer", url, **{"remote.invalidation_ms": 60_000}) as writer:
        store_prompt(writer)
        current = writer.current_epoch(NS)
        client = redis.Redis.from_url(url)
        redisutil.listening(writer)
        for message in (f"{NS.seed.hex()}:{1 << 64}", "zz:1", "\xff", f"{NS.seed.hex()}:0"):
            client.publish("kvstrata:epochs", message)
        deadline = time.monotonic() + 30  # the subscriber thread reads them (slow on a loaded machine)
        while writer.counters.get("remote_bad_messages") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # and the last two, which are well-formed
        assert writer.lookup(NS, tokens()).num_blocks == 4
        assert writer.current_epoch(NS) == current
        assert writer.counters.get("remote_bad_messages") >= 2


def test_a_reset_announced_while_the_subscriber_was_away_is_seen_once_it_listens_again(tmp_path, server):
    """Scenario: the connection of an instance's epoch subscriber drops (a Redis restart, a proxy
    idle timeout, CLIENT KILL) and another instance resets the namespace before it is back: the
    announcement reaches nobody. The instance re-reads its namespaces when it listens again, not
    only after remote.invalidation_ms (a minute here), so it serves nothing of the old epoch."""
    url, _, _ = server
    client = redis.Redis.from_url(url)
    with redis_store(tmp_path, "writer", url, **{"remote.invalidation_ms": 60_000}) as writer:
        store_prompt(writer)
        redisutil.listening(writer)
        assert writer.lookup(NS, tokens()).num_blocks == 4
        assert client.client_kill_filter(_type="pubsub") == 1
        client.set(EPOCH_KEY, str(new_epoch()))  # the reset; its announcement went to nobody
        deadline = time.monotonic() + 10  # the subscriber marks the namespaces once it hears it listens
        while writer.lookup(NS, tokens()).num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.lookup(NS, tokens()).num_blocks == 0
        assert writer.current_epoch(NS) == int(client.get(EPOCH_KEY))


def test_volatile_lru_evicts_blocks_and_never_the_epoch_or_its_floor(tmp_path):
    """The recommended policy (docs/shared-tier.md): every block's keys carry a TTL, control state
    none, and Redis runs ``volatile-lru`` with a ``maxmemory`` of 1 MB over what it held at start,
    while 3 MB of blocks are written. Blocks are evicted; the epoch key and the floor record never
    are, so no instance sees its epoch lost. The control, ``block_ttl_s: 0``: with no TTL anywhere
    Redis evicts nothing and refuses the writes over its bound (saves are dropped, never served)."""
    import torch

    key_file = tmp_path / "secret"
    key_file.write_bytes(b"v" * 40)
    key_file.chmod(0o600)
    with redisutil.standalone(tmp_path / "redis") as (url, _, _):
        client = redis.Redis.from_url(url)
        for ttl in (604800, 0):
            client.flushdb()
            client.config_set("maxmemory", 0)
            client.config_resetstat()
            with redis_store(tmp_path, f"w{ttl}", url, **{"remote.auth_key_file": str(key_file),
                                                          "remote.block_ttl_s": ttl, "l2.enabled": False}) as w:
                epoch = w.current_epoch(NS)
                client.config_set("maxmemory", client.info("memory")["used_memory"] + 2**20)
                client.config_set("maxmemory-policy", "volatile-lru")
                for seed in range(1, 769):  # 768 prompts of 4 blocks of 1 KiB: 3 MiB of payload
                    e, chain = w.chain(NS, np.random.default_rng(seed).integers(0, 30000, 64, dtype=np.uint32))
                    rows = [np.frombuffer(k * (SIZE // 16), np.uint8) for k in chain.keys]
                    w.save_now(NS, e, chain, torch.from_numpy(np.stack(rows).copy()))
                w.flush()
                control = [n for n in client.scan_iter() if b":epoch:" in n or b":floor:" in n]
                evicted = client.info("stats")["evicted_keys"]
                if ttl:
                    assert evicted > 1000 and w.counters.get("remote_bytes_written") >= 3 * 2**20
                    assert len(control) == 2 and all(client.ttl(n) == -1 for n in control)
                    assert w.current_epoch(NS) == epoch  # never lost
                    assert w.lookup(NS, np.random.default_rng(768).integers(0, 30000, 64, dtype=np.uint32)
                                    ).num_blocks == 4  # the newest blocks are there
                else:
                    assert evicted == 0 and w.counters.get("remote_bytes_written") < 2 * 2**20
