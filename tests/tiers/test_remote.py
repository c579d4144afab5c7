"""The shared tier (L3) on real Redis (standalone and Cluster) and on a shared folder."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.config import load_config

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 2048


payloads = redisutil.key_payloads  # block bytes derived from each key


def store(tmp: Path, name: str, remote: dict) -> BlockStore:
    overrides = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.path": str(tmp / name / "l2"),
                 **{f"remote.{k}": v for k, v in remote.items()}, "remote.enabled": True}
    return BlockStore(load_config(None, overrides))


def prompt(seed: int, n: int = 64 * 16 + 5) -> np.ndarray:
    return redisutil.random_prompt(seed, n)


@pytest.fixture(params=["redis", "cluster", "fs"])
def backend(request, tmp_path):
    with redisutil.shared_backend(request.param, tmp_path) as settings:
        yield settings


def test_second_instance_hits_and_loads_what_the_first_stored(tmp_path, backend):
    """Scenario: two instances with their own L1 and L2 share only the remote tier."""
    a, b = store(tmp_path, "a", backend), store(tmp_path, "b", backend)
    tokens = prompt(1)
    epoch, chain = a.chain(NS, tokens)
    expected = payloads(chain)
    a.save_now(NS, epoch, chain, expected)
    hit = b.lookup(NS, tokens)
    assert hit.num_tokens == len(tokens)  # every block, the partial tail included
    out = torch.zeros_like(expected)
    assert b.load_into(hit, out) == len(chain.keys)
    assert torch.equal(out, expected)
    assert b.counters.get("hit_blocks_remote") == len(chain.keys)
    b.flush()
    again = b.lookup(NS, tokens)  # promoted: now local
    assert all(t & b.l1.bit for t in again.tiers)
    assert b.l2 is not None and all(b.l2.path(k).exists() for k in chain.keys)
    a.close()
    b.close()


def test_invalidation_reaches_the_other_instance_within_the_bound(tmp_path, backend):
    a, b = store(tmp_path, "a", backend), store(tmp_path, "b", backend)
    tokens = prompt(2)
    epoch, chain = a.chain(NS, tokens)
    a.save_now(NS, epoch, chain, payloads(chain))
    assert b.lookup(NS, tokens).num_blocks == len(chain.keys)
    a.invalidate(NS.seed)
    start = time.monotonic()
    while b.lookup(NS, tokens).num_blocks:
        assert time.monotonic() - start < 1.0, "B still serves the old epoch"
        time.sleep(0.005)
    bound = 0.1 if backend["backend"] == "redis" else 1.0
    assert time.monotonic() - start <= bound
    a.close()
    b.close()


def test_lookup_of_a_64_block_prefix_costs_at_most_two_round_trips(tmp_path, redis_url):
    a, b = store(tmp_path, "a", {"url": redis_url}), store(tmp_path, "b", {"url": redis_url})
    tokens = prompt(3, 64 * 16 + 5)
    epoch, chain = a.chain(NS, tokens)
    a.save_now(NS, epoch, chain, payloads(chain))
    server = redis.Redis.from_url(redis_url)
    server.ping()
    b.lookup(NS, prompt(99))  # connections are open, as between requests
    time.sleep(0.1)  # and the cached epoch is stale, so it is checked again
    server.config_resetstat()
    hit = b.lookup(NS, tokens)  # epoch check included (a GET when the cached epoch is stale)
    stats = server.info("commandstats")
    calls = {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config|resetstat")}
    assert hit.num_blocks == 65 and sum(calls.values()) <= 2, calls
    a.close()
    b.close()


def test_the_shared_tier_parses_replies_with_hiredis(tmp_path, redis_url):
    """kvstrata[redis] brings hiredis; without it a 3,000-token L3 load spent 1.8x as long in
    redis-py's pure-Python parser (the install would still work, only slower: this catches that)."""
    from redis._parsers import _HiredisParser

    from kvstrata.tiers.redis_client import connect

    client = connect(load_config(None, {"remote.enabled": True, "remote.url": redis_url}).remote)
    conn = client.connection_pool.get_connection()
    try:
        assert isinstance(conn._parser, _HiredisParser), type(conn._parser)
    finally:
        client.connection_pool.release(conn)
        client.close()


def test_payload_evicted_by_redis_is_a_miss_not_an_error(tmp_path, redis_url):
    a, b = store(tmp_path, "a", {"url": redis_url}), store(tmp_path, "b", {"url": redis_url})
    tokens = prompt(4, 8 * 16)
    epoch, chain = a.chain(NS, tokens)
    a.save_now(NS, epoch, chain, payloads(chain))
    server = redis.Redis.from_url(redis_url)
    server.delete(f"kvstrata:{{{chain.keys[5].hex()}}}:p")  # what allkeys-lru may do
    hit = b.lookup(NS, tokens)
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    assert b.load_into(hit, out) == 5
    assert torch.equal(out[:5], payloads(chain)[:5])
    a.close()
    b.close()


def test_corrupted_remote_payload_is_dropped_and_counted(tmp_path, redis_url):
    a, b = store(tmp_path, "a", {"url": redis_url}), store(tmp_path, "b", {"url": redis_url})
    tokens = prompt(5, 8 * 16)
    epoch, chain = a.chain(NS, tokens)
    a.save_now(NS, epoch, chain, payloads(chain))
    server = redis.Redis.from_url(redis_url)
    name = f"kvstrata:{{{chain.keys[3].hex()}}}:p"
    value = bytearray(server.get(name))
    value[-7] ^= 0xFF
    server.set(name, bytes(value))
    server.set(f"kvstrata:{{{chain.keys[6].hex()}}}:i", b"garbage header")  # never trusted
    hit = b.lookup(NS, tokens)
    assert hit.num_blocks == 6  # the garbage index entry ends the chain
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    assert b.load_into(hit, out) == 3
    assert b.counters.get("checksum_failures") == 1
    assert not server.exists(name)
    a.close()
    b.close()


def test_dead_redis_never_fails_a_request_and_hits_resume_after_restart(tmp_path):
    with redisutil.standalone(tmp_path / "redis") as (url, port, procs):
        cfg = {"url": url, "timeout_ms": 100, "breaker.reset_ms": 200, "breaker.max_backoff_ms": 400}
        a = store(tmp_path, "a", cfg)
        tokens = prompt(6, 16 * 16)
        epoch, chain = a.chain(NS, tokens)
        a.save_now(NS, epoch, chain, payloads(chain))
        redisutil.stop(procs.pop())
        b = store(tmp_path, "b", cfg)  # starts while Redis is down
        start = time.monotonic()
        for _ in range(20):
            assert b.lookup(NS, tokens).num_blocks == 0  # no error, just a miss
        e2, c2 = b.chain(NS, prompt(7, 4 * 16))
        assert b.save_now(NS, e2, c2, payloads(c2)) == 4  # local tiers keep working
        assert time.monotonic() - start < 3.0  # one timeout, then the breaker skips Redis
        assert b.counters.get("remote_circuit_opened") >= 1
        procs.append(redisutil.start(port, tmp_path / "redis"))  # empty: the restart lost everything
        fresh = prompt(8, 16 * 16)
        deadline = time.monotonic() + 10
        while True:  # A's breaker may still be open: its saves resume after the backoff
            # each request reads A's epoch again: a first read that timed out on a loaded machine
            # left the lost one, which B (finding the key gone) never uses
            e3, c3 = a.chain(NS, fresh)
            a.save_now(NS, e3, c3, payloads(c3))
            if b.lookup(NS, fresh).num_blocks:
                break
            assert time.monotonic() < deadline, "hits did not resume after Redis came back"
            a.index.drop_tier(c3.keys[0], 0xFF)  # forget the local copy so the next put publishes again
            a.l1.delete(c3.keys[0])
            time.sleep(0.1)
        a.close()
        b.close()


def test_circuit_closes_once_redis_is_back_without_waiting_out_the_backoff(tmp_path):
    """Scenario: Redis dies long enough for the breaker's backoff to grow (here its first step is
    already a minute), then comes back. The epoch subscriber, connected again, sends the trial
    call itself: the circuit closes within seconds, with no request to pay for it, and the next
    save reaches Redis (before, saves were dropped until the backoff ran out)."""
    with redisutil.standalone(tmp_path / "redis") as (url, port, procs):
        a = store(tmp_path, "a", {"url": url, "timeout_ms": 100, "breaker.reset_ms": 60_000})
        redisutil.listening(a)
        redisutil.stop(procs.pop())
        tokens = prompt(9, 4 * 16)
        while not a.counters.get("remote_circuit_opened"):
            assert a.lookup(NS, tokens).num_blocks == 0
        assert a.remote.breaker.call(lambda: "called", "skipped") == "skipped"  # open: not even tried
        procs.append(redisutil.start(port, tmp_path / "redis"))
        deadline = time.monotonic() + 20  # the subscriber retries every min(5 s, reset_ms)
        while not a.counters.get("remote_circuit_closed"):
            assert time.monotonic() < deadline, "the circuit stayed open after Redis came back"
            time.sleep(0.05)
        before = a.counters.get("remote_bytes_written")
        epoch, chain = a.chain(NS, tokens)
        a.save_now(NS, epoch, chain, payloads(chain))
        assert a.counters.get("remote_bytes_written") - before == 4 * SIZE
        assert redis.Redis.from_url(url).exists(f"kvstrata:{{{chain.keys[3].hex()}}}:i")
        a.close()


def test_an_open_circuit_is_tried_and_closed_by_the_subscriber_with_no_request(tmp_path, redis_url):
    """Scenario: the circuit opened (three failed calls; Redis itself stayed up, and so did the
    subscriber's connection) and then no request comes. The subscriber makes the half-open trial
    when it is due: the circuit closes after the backoff by itself, and the first request after
    it pays no trial (before, the first request made it, and paid its timeout if it hung)."""
    a = store(tmp_path, "a", {"url": redis_url, "breaker.reset_ms": 300})
    redisutil.listening(a)

    def outage() -> None:
        raise OSError("unreachable")

    for _ in range(3):
        assert a.remote.breaker.call(outage, "miss") == "miss"
    assert a.counters.get("remote_circuit_opened") == 1
    deadline = time.monotonic() + 10
    while not a.counters.get("remote_circuit_closed"):
        assert time.monotonic() < deadline, "nobody tried the open circuit"
        time.sleep(0.05)
    assert a.remote.breaker.call(lambda: "called", "skipped") == "called"
    a.close()


def test_fs_gc_keeps_capacity_and_spares_leased_blocks(tmp_path):
    shared = {"backend": "fs", "path": str(tmp_path / "shared"), "size": 20 * (SIZE + 128)}
    a = store(tmp_path, "a", shared)
    for seed in range(4):
        epoch, chain = a.chain(NS, prompt(10 + seed, 10 * 16))
        a.save_now(NS, epoch, chain, payloads(chain))
    files = list((tmp_path / "shared" / "blocks").glob("*/*.kvb"))
    assert len(files) == 40
    assert a.remote is not None and a.remote.sweep(lease_s=3600) == 0  # all leased (fresh)
    assert a.remote.sweep(lease_s=0) == 20
    assert len(list((tmp_path / "shared" / "blocks").glob("*/*.kvb"))) == 20
    a.close()


@pytest.mark.parametrize("backend", ["redis", "fs"], indirect=True)
def test_engine_save_path_publishes_to_the_shared_tier_without_l2(tmp_path, backend):
    """Scenario: `l2.enabled: false` with a shared tier, and blocks saved the way the vLLM
    connector saves them (reserve L1 slots, fill them, commit). The commit must reach the shared
    tier: before, it was written through only when L2 was on and write-through."""
    def no_l2(name: str) -> BlockStore:
        overrides = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.enabled": False,
                     "l2.path": str(tmp_path / name / "l2"),
                     **{f"remote.{k}": v for k, v in backend.items()}, "remote.enabled": True}
        return BlockStore(load_config(None, overrides), l1_slot_bytes=SIZE)

    tokens = prompt(7, 8 * 16)
    with no_l2("a") as a, no_l2("b") as b:
        epoch, chain = a.chain(NS, tokens)
        res = a.prepare_store(NS, epoch, chain, SIZE)
        assert len(res.slots) == 8
        a.l1.data[res.slots] = payloads(chain)
        assert a.complete_store(res) == 8
        a.flush()
        hit = b.lookup(NS, tokens)
        assert hit.num_blocks == 8
        out = torch.zeros((8, SIZE), dtype=torch.uint8)
        assert b.load_into(hit, out) == 8
        assert torch.equal(out, payloads(chain))
