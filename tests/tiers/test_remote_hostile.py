"""Hostile values in a real redis-server: whoever can write there can put anything under kvstrata's
names. Each kind of bad value must be a counted miss (or ignored, or repaired), never an exception
in the engine, never a wrong block, and the shared tier keeps working for everything else.

The kinds: epoch values and key types; values checked against the block asked for and its
destination; errors labelled as what they are, failures always reported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from tests.harness import redisutil
from tests.harness.redisutil import redis_store
from kvstrata import BlockStore, Namespace
from kvstrata.format.block import HEADER, HEADER_SIZE, pack_header, payload_checksum, unpack_header
from kvstrata.config import load_config
from kvstrata.epochs.base import parse_epoch
from kvstrata.keys import FORMAT_VERSION
from kvstrata.store.saver import Saver

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 2048
EPOCH_KEY = f"kvstrata:epoch:{NS.seed.hex()}"


def open_store(tmp: Path, name: str, redis_url: str, **extra: object) -> BlockStore:
    """``redisutil.redis_store``, with room for 4 MiB of blocks and a breaker that opens after 2 errors."""
    return redis_store(tmp, name, redis_url, **{"l1.size": "4MiB", "remote.breaker.failures": 2, **extra})


def prompt(seed: int, n: int = 8 * 16) -> np.ndarray:
    return redisutil.random_prompt(seed, n)


payloads = redisutil.key_payloads


def p_name(key: bytes) -> str:
    return f"kvstrata:{{{key.hex()}}}:p"


def i_name(key: bytes) -> str:
    return f"kvstrata:{{{key.hex()}}}:i"


def t_name(parent: bytes) -> str:
    return f"kvstrata:{{{parent.hex()}}}:t"


@pytest.fixture
def shared(tmp_path, redis_url):
    """A writer stored an 8-block prompt in Redis; ``reader()`` opens a fresh instance that knows
    nothing of it locally, so its lookups and loads read what Redis holds."""
    s = redisutil.SharedPrompt(redis_url, lambda name, **kw: open_store(tmp_path, name, redis_url, **kw),
                               NS, prompt(1))
    yield s
    s.close()


def load(store: BlockStore, tokens: np.ndarray) -> tuple[int, int, torch.Tensor]:
    """(blocks found, blocks loaded, buffer) of a lookup and load of ``tokens``."""
    hit = store.lookup(NS, tokens)
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    return hit.num_blocks, store.load_into(hit, out), out


def forged(meta, **changes) -> tuple[bytes, bytes]:
    """(index entry, value) of a block whose header says ``changes``, with valid checksums: what a
    host with write access can put there, not a corruption the checksums would catch."""
    size = changes.get("size", meta.size)
    payload = bytes(range(256)) * (-(-size // 256))
    meta = meta._replace(**changes, checksum=payload_checksum(payload[:size]))
    header = pack_header(meta)
    return header, header + payload[:size]


# -------------------------------------------------------------- epoch values and key types
@pytest.mark.parametrize("kind", ["hash", "list", "set"])
def test_epoch_key_of_another_type_is_counted_and_replaced_not_an_error(tmp_path, shared, kind):
    """Scenario: someone turns the epoch key into a hash, list or set. GET-like commands fail
    with WRONGTYPE on it; the instance counts it, replaces it by a fresh epoch (old blocks
    become misses), and the shared tier keeps working: no breaker errors, no open circuit."""
    client = shared.client
    client.delete(EPOCH_KEY)
    {"hash": lambda: client.hset(EPOCH_KEY, "gen", "1"), "list": lambda: client.rpush(EPOCH_KEY, "1"),
     "set": lambda: client.sadd(EPOCH_KEY, "1")}[kind]()
    b = shared.reader("b")
    for _ in range(5):  # each lookup re-reads the epoch (invalidation_ms=1)
        assert b.lookup(NS, shared.tokens).num_blocks == 0
        time.sleep(0.002)
    assert client.type(EPOCH_KEY) == b"string"
    assert b.current_epoch(NS) == parse_epoch(client.get(EPOCH_KEY))
    counters = b.counters.snapshot()
    assert counters.get("remote_wrong_type") == 1
    assert counters.get("remote_errors", 0) == 0 and counters.get("remote_circuit_opened", 0) == 0
    epoch, chain = b.chain(NS, prompt(2))  # and the shared tier still carries blocks
    assert b.save_now(NS, epoch, chain, payloads(chain)) == 8
    b.flush()
    assert shared.reader("c").lookup(NS, prompt(2)).num_blocks == 8


def test_epoch_value_of_a_megabyte_is_replaced_without_reading_it_all(tmp_path, shared):
    """Scenario: the epoch key holds a megabyte of digits. Only its first bytes are read: the
    value is not an epoch, it is replaced and counted, and the instance never pulls the
    megabyte over the network (a 512 MB value would otherwise time out every read)."""
    client = shared.client
    client.set(EPOCH_KEY, b"7" * (1 << 20))
    before = client.info("stats")["total_net_output_bytes"]
    b = shared.reader("b")
    assert b.lookup(NS, shared.tokens).num_blocks == 0
    sent = client.info("stats")["total_net_output_bytes"] - before
    assert sent < 64 << 10, f"{sent} bytes sent for one epoch read"
    assert b.counters.get("remote_bad_epochs") == 1
    assert parse_epoch(client.get(EPOCH_KEY)) == b.current_epoch(NS)


@pytest.mark.parametrize("text", ["²", "١٢٣", "1" * 5000, "  42 ", b"\x00" * 10, "0x10", "+5", "1e3"])
def test_parse_epoch_answers_any_text_and_never_raises(text):
    """Scenario: text int() refuses although str.isdigit() accepts it (superscripts), digits
    of other scripts, 5000 digits (int() refuses over 4300), whitespace, NULs, other notations."""
    assert parse_epoch(text) == (42 if text == "  42 " else None)


def test_tail_set_of_another_type_is_replaced_when_a_tail_is_saved(tmp_path, redis_url):
    """Scenario: the tail set after a parent is a string before the writer saves its partial
    block. The SADD in the writer's pipeline fails with WRONGTYPE; the blocks must still be
    published (all of them, the tail included), the set replaced and the repair counted."""
    tokens = prompt(3, 4 * 16 + 5)
    with open_store(tmp_path, "writer", redis_url) as writer:
        epoch, chain = writer.chain(NS, tokens)
        client = redis.Redis.from_url(redis_url)
        client.set(t_name(chain.parents[-1]), b"not a set")
        assert writer.save_now(NS, epoch, chain, payloads(chain)) == 5
        writer.flush()
        assert writer.counters.get("remote_wrong_type") == 1
        assert writer.counters.get("remote_errors") == 0
    assert client.smembers(t_name(chain.parents[-1])) == {b"5"}
    with open_store(tmp_path, "reader", redis_url) as reader:
        longer = np.concatenate([tokens, prompt(4, 2)])  # its own tail differs: found by length
        assert reader.lookup(NS, longer).num_tokens == len(tokens)


def test_tail_set_of_another_type_is_a_counted_miss_when_read(tmp_path, shared):
    """Scenario: a reader looks for a partial block after a parent whose tail set is a hash:
    a counted miss, the key deleted, and no breaker error."""
    parent = shared.chain.keys[3]
    shared.client.hset(t_name(parent), "x", "1")
    b = shared.reader("b")
    query = np.concatenate([shared.tokens[: 4 * 16], prompt(5, 7)])
    assert b.lookup(NS, query).num_blocks == 4
    assert b.counters.get("remote_wrong_type") == 1 and b.counters.get("remote_errors") == 0
    assert not shared.client.exists(t_name(parent))


def test_tail_set_members_that_are_not_token_counts_are_skipped_and_counted(tmp_path, redis_url):
    """Scenario: besides a real tail length, the tail set holds junk, a negative number, zero,
    a 5000-digit number (int() raises on it) and a huge one. The real tail is still found."""
    tokens = prompt(6, 4 * 16 + 5)
    with open_store(tmp_path, "writer", redis_url) as writer:
        epoch, chain = writer.chain(NS, tokens)
        assert writer.save_now(NS, epoch, chain, payloads(chain)) == 5
        writer.flush()
    client = redis.Redis.from_url(redis_url)
    client.sadd(t_name(chain.parents[-1]), "abc", "-1", "0", "1" * 5000, str(1 << 64), "\xff")
    with open_store(tmp_path, "reader", redis_url) as reader:
        longer = np.concatenate([tokens, prompt(7, 2)])
        assert reader.lookup(NS, longer).num_tokens == len(tokens)
        assert reader.counters.get("remote_bad_tails") == 1


# -------------------------- values checked against the block asked for and its destination
@pytest.mark.parametrize("factor", [2, 0.5])
def test_header_size_is_checked_against_the_destination(shared, factor):
    """Scenario: block 5's index entry and value agree with each other (valid checksums) but say
    the block is twice (half) the size of the destination. Twice raised in the load; half filled
    half the buffer and called it loaded. Now: the lookup ends the hit at block 5 (its size is
    not the size of the blocks before it, counted), and blocks 0-4 load."""
    meta = unpack_header(shared.client.get(i_name(shared.chain.keys[5])))
    entry, value = forged(meta, size=int(SIZE * factor))
    shared.client.set(p_name(meta.key), value)
    shared.client.set(i_name(meta.key), entry)
    b = shared.reader()
    found, loaded, out = load(b, shared.tokens)
    assert (found, loaded) == (5, 5)
    assert torch.equal(out[:5], shared.expected[:5])
    assert b.counters.get("adopt_wrong_size") >= 1


def test_one_block_of_another_size_ends_the_hit_there_when_staged(tmp_path, redis_url, shared):
    """Scenario: as in the engines, L1 slots have the block size and hits are staged into L1.
    Block 5 says it is half a block: blocks 0-4 are staged. Before, the lookup adopted block 5
    anyway and the mixed sizes made the store stage none of the 8 (and a whole chain of
    half-size headers would be staged into half of each slot, the rest stale)."""
    meta = unpack_header(shared.client.get(i_name(shared.chain.keys[5])))
    entry, value = forged(meta, size=SIZE // 2)
    shared.client.set(p_name(meta.key), value)
    shared.client.set(i_name(meta.key), entry)
    overrides = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.path": str(tmp_path / "staged" / "l2"),
                 "remote.enabled": True, "remote.url": redis_url}
    with BlockStore(load_config(None, overrides), l1_slot_bytes=SIZE) as b:
        hit = b.lookup(NS, shared.tokens, pin=True)
        staged = b.stage(hit)
        b.complete_load(hit)
        assert b.counters.get("adopt_wrong_size") >= 1
    assert hit.num_blocks == 5 and staged == 5


def test_a_whole_chain_of_another_size_is_never_staged(tmp_path, redis_url, shared):
    """Scenario: every block of the prompt is re-published, well formed and checksummed, as half
    a block (a forger, or an instance with another KV layout under the same namespace). Staged
    into full-size L1 slots it would leave half of each slot stale: it must be a miss."""
    for key in shared.chain.keys:
        meta = unpack_header(shared.client.get(i_name(key)))
        entry, value = forged(meta, size=SIZE // 2)
        shared.client.set(p_name(key), value)
        shared.client.set(i_name(key), entry)
    overrides = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.path": str(tmp_path / "half" / "l2"),
                 "remote.enabled": True, "remote.url": redis_url}
    with BlockStore(load_config(None, overrides), l1_slot_bytes=SIZE) as b:
        hit = b.lookup(NS, shared.tokens, pin=True)
        b.complete_load(hit)
        assert hit.num_blocks == 0 and b.counters.get("adopt_wrong_size") >= 1


def test_value_naming_another_block_is_a_wrong_key(shared):
    """Scenario: block 5's value is replaced by block 2's (a valid value, of another block)."""
    keys = shared.chain.keys
    shared.client.set(p_name(keys[5]), shared.client.get(p_name(keys[2])))
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_wrong_key") == 1 and b.counters.get("checksum_failures") == 0
    assert not shared.client.exists(p_name(keys[5]))


def test_index_entry_naming_another_block_is_a_wrong_key(shared):
    """Scenario: block 5's index entry is block 2's. The chain ends there, counted."""
    keys = shared.chain.keys
    shared.client.set(i_name(keys[5]), shared.client.get(i_name(keys[2])))
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 5
    assert b.counters.get("remote_wrong_key") >= 1  # the lookup may probe from block 5 twice


def test_value_with_a_header_of_another_epoch_is_a_wrong_key(shared):
    """Scenario: block 5's value has the right key but another epoch in its header."""
    meta = unpack_header(shared.client.get(i_name(shared.chain.keys[5])))
    shared.client.set(p_name(meta.key), forged(meta, epoch=meta.epoch ^ 1, size=SIZE)[1])
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_wrong_key") == 1


@pytest.mark.parametrize("cut", [HEADER_SIZE + SIZE // 2, HEADER_SIZE + SIZE - 1])
def test_truncated_value_is_a_wrong_size(shared, cut):
    key = shared.chain.keys[5]
    shared.client.set(p_name(key), shared.client.get(p_name(key))[:cut])
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_wrong_size") == 1 and b.counters.get("checksum_failures") == 0


@pytest.mark.parametrize("value", [os.urandom(HEADER_SIZE + SIZE), b"x" * 40, b""])
def test_garbage_value_is_a_bad_header(shared, value):
    key = shared.chain.keys[5]
    shared.client.set(p_name(key), value)
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_bad_headers") == 1 and b.counters.get("checksum_failures") == 0


@pytest.mark.parametrize("entry", ["padded", "truncated", "garbage"])
def test_index_entry_that_is_not_exactly_a_header_is_a_bad_header(shared, entry):
    """Scenario: block 5's index entry has bytes after a valid header, is cut short, or is junk."""
    name = i_name(shared.chain.keys[5])
    good = shared.client.get(name)
    shared.client.set(name, {"padded": good + b"x" * 10, "truncated": good[:60],
                             "garbage": os.urandom(HEADER_SIZE)}[entry])
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 5
    assert b.counters.get("remote_bad_headers") >= 1  # the lookup may probe from block 5 twice


def test_value_of_another_format_version_is_a_miss_left_in_place(shared):
    """Scenario: block 5's value has a well-formed header of another format version: a miss,
    counted, and left alone (the disk tier leaves other versions' files alone too)."""
    key = shared.chain.keys[5]
    value = shared.client.get(p_name(key))
    fields = list(HEADER.unpack(value[: HEADER.size]))
    fields[1] = FORMAT_VERSION + 1
    body = HEADER.pack(*fields)
    import xxhash

    shared.client.set(p_name(key), body + xxhash.xxh3_64_digest(body) + value[HEADER_SIZE:])
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_bad_headers") == 1 and b.counters.get("checksum_failures") == 0
    assert shared.client.exists(p_name(key))


def test_value_of_another_type_is_counted_deleted_and_saved_again(tmp_path, shared):
    """Scenario: block 5's value is turned into a hash. MGET reads it as absent; the failed load
    asks its type once, counts it, deletes the block, and the reader's save publishes it again."""
    key = shared.chain.keys[5]
    shared.client.delete(p_name(key))
    shared.client.hset(p_name(key), "a", "b")
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_wrong_type") == 1 and b.counters.get("remote_missing") == 0
    assert not shared.client.exists(p_name(key), i_name(key))
    epoch, chain = b.chain(NS, shared.tokens)
    b.save_now(NS, epoch, chain, shared.expected)  # the engine recomputes and saves what it missed
    b.flush()
    found, loaded, out = load(shared.reader("c"), shared.tokens)
    assert (found, loaded) == (8, 8) and torch.equal(out, shared.expected)


def test_index_entry_of_another_type_is_a_miss_repaired_by_the_next_save(tmp_path, shared):
    """Scenario: block 5's index entry is a list. MGET reads it as absent: a miss (no error, no
    extra command per lookup), and the next save of the block replaces it."""
    key = shared.chain.keys[5]
    shared.client.delete(i_name(key))
    shared.client.rpush(i_name(key), "x")
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 5
    assert b.counters.get("remote_errors") == 0
    epoch, chain = b.chain(NS, shared.tokens)
    b.save_now(NS, epoch, chain, shared.expected)
    b.flush()
    assert shared.client.type(i_name(key)) == b"string"
    found, loaded, out = load(shared.reader("c"), shared.tokens)
    assert (found, loaded) == (8, 8) and torch.equal(out, shared.expected)


def test_a_flood_of_bad_values_logs_one_warning_naming_key_and_value(shared, caplog):
    """Scenario: every value of the prompt is garbage and it is asked for again and again: one
    warning per kind, naming the block and showing at most about 80 characters of the value."""
    junk = b"J" * 5000
    for key in shared.chain.keys:
        shared.client.set(i_name(key), junk)
    b = shared.reader()
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        for _ in range(5):
            assert b.lookup(NS, shared.tokens).num_blocks == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert shared.chain.keys[0].hex() in warnings[0] and "5000 bytes" in warnings[0]
    assert len(warnings[0]) < 300 and "remote_bad_headers" in warnings[0]
    assert b.counters.get("remote_bad_headers") == 5


# ------------------------------------- errors labelled as what they are, failures reported
def test_breaker_lets_programming_errors_through_and_counts_only_service_errors(shared):
    """Scenario: a bug inside a breaker-wrapped call must surface as itself, not as a miss
    labelled "circuit open"; a Redis or socket error is still a miss that counts toward opening."""
    b = shared.reader()
    breaker = b.remote.breaker

    def bug() -> None:
        raise KeyError("a bug, not an outage")

    for _ in range(3):
        with pytest.raises(KeyError):
            breaker.call(bug, None)
    assert b.counters.get("remote_errors") == 0
    assert breaker.call(lambda: "called", "skipped") == "called"  # the circuit is closed

    def outage() -> None:
        raise redis.ConnectionError("connection refused")

    def slow() -> None:
        raise TimeoutError("timed out")  # what a socket timeout is: an OSError

    assert breaker.call(outage, "miss") == "miss"
    assert breaker.call(slow, "miss") == "miss"
    assert b.counters.get("remote_errors") == 2  # failures=2: the circuit opens
    assert breaker.call(lambda: "called", "skipped") == "skipped"  # open: not even tried


def test_failed_save_job_calls_its_failure_callback_and_the_saver_goes_on():
    """Scenario: a save job raises. Whoever waits for it (an engine holding its buffers until
    on_done, a request waiting for staging) must hear back: ``on_fail`` runs exactly once, the
    queue drains, and the next job runs."""
    saver = Saver(max_blocks=8)
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("disk gone")

    try:
        assert saver.submit(2, broken, on_fail=lambda: calls.append("failed"))
        assert saver.submit(1, lambda: calls.append("next"), on_fail=lambda: calls.append("wrong"))
        assert saver.flush(timeout=5)
    finally:
        saver.close()
    assert calls == ["failed", "next"]


def test_subscriber_errors_are_logged_once_at_warning_per_outage(tmp_path, caplog):
    """Scenario: Redis dies while an instance is subscribed to the epoch channel. The loss is
    one warning (not one per reconnect attempt); the reconnection after the restart is another."""
    with redisutil.standalone(tmp_path / "redis") as (redis_url, port, procs):
        with caplog.at_level(logging.DEBUG, logger="kvstrata"):
            store = open_store(tmp_path, "a", redis_url, **{"remote.breaker.reset_ms": 100,
                                                      "remote.timeout_ms": 100})
            try:
                time.sleep(0.3)
                redisutil.stop(procs.pop())
                time.sleep(1.5)  # about a dozen reconnect attempts
                procs.append(redisutil.start(port, tmp_path / "redis"))
                deadline = time.monotonic() + 5
                while not any("connected again" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the subscriber did not reconnect"
                    time.sleep(0.05)
            finally:
                store.close()
    lost = [r for r in caplog.records if "subscriber" in r.getMessage() and "lost" in r.getMessage()
            or "reconnecting" in r.getMessage()]
    loud = [r for r in lost if r.levelno >= logging.WARNING]
    assert len(lost) >= 3, "expected several reconnect attempts"
    assert len(loud) == 1, [r.getMessage() for r in loud]


def test_hostile_values_never_raise_into_concurrent_lookups(tmp_path, shared):
    """Scenario: while four threads look up and load the prompt, another rewrites its keys with
    every kind of hostile value. No call raises; every loaded block is the right one."""
    keys, client = shared.chain.keys, shared.client
    meta = unpack_header(client.get(i_name(keys[0])))
    values = [b"", b"x", os.urandom(HEADER_SIZE + SIZE), forged(meta, size=SIZE * 2)[1],
              client.get(p_name(keys[1])), client.get(p_name(keys[3]))[:HEADER_SIZE + 7]]
    good = [unpack_header(client.get(i_name(k))) for k in keys]
    stop, errors = threading.Event(), []
    b = shared.reader()

    def reader() -> None:
        try:
            while not stop.is_set():
                found, loaded, out = load(b, shared.tokens)
                for i in range(loaded):
                    assert torch.equal(out[i], shared.expected[i]), f"block {i} is wrong"
        except Exception as e:  # noqa: BLE001 - any exception is the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    rng = np.random.default_rng(0)
    try:
        for _ in range(300):
            k = keys[int(rng.integers(8))]
            which = int(rng.integers(4))
            if which == 0:
                client.set(p_name(k), values[int(rng.integers(len(values)))])
            elif which == 1:
                client.set(i_name(k), values[int(rng.integers(len(values)))][:HEADER_SIZE + int(rng.integers(2))])
            elif which == 2:
                client.delete(p_name(k))
                client.hset(p_name(k), "f", "v")
            else:  # put the good block back, so that loads keep reaching the values after it
                j = keys.index(k)
                client.set(p_name(k), pack_header(good[j]) + shared.expected[j].numpy().tobytes())
                client.set(i_name(k), pack_header(good[j]))
            time.sleep(0.001)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors[:3]
    assert b.counters.get("remote_errors") == 0
