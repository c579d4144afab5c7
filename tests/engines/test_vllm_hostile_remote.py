"""A real vLLM engine (CPU, tiny model) with a Redis shared tier, fed hostile values in Redis while
it serves: bad block values of every kind, bad epoch values and key types, junk announcements.

One engine start. Its L1 and L2 are small (40 blocks), so the prompts it stored first are soon held
by Redis only, and asking for them again reads Redis. Every prompt is LONG under its own cache salt
(its own keys, the same outputs), so one baseline run without kvstrata checks every answer.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import redis

from tests.harness import redisutil
from kvstrata.format.block import HEADER_SIZE, pack_header, payload_checksum, unpack_header
from kvstrata.config import load_config
from kvstrata.keys import extra_digest
from kvstrata.store.parts import open_keys
from engines.launchers import BS, LONG, StepEngine, gen

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

BAD_BLOCK = 4  # the block whose value is replaced; blocks 0-3 load, the rest is recomputed
BLOCK_CASES = ["truncated", "wrong_size", "other_key", "garbage", "wrong_type", "flipped"]
EPOCH_CASES = ["junk", "2^64", "negative", "megabyte", "hash", "messages"]
FILLERS = 3  # prompts stored after the block cases, pushing them out of L1 and L2


def hostile_config(tmp: Path, url: str) -> Path:
    """L1 and L2 of 40 blocks of the tiny model (64 KiB each); the shared tier is the Redis."""
    path = tmp / "hostile.yaml"
    path.write_text("\n".join([
        "l1:", "  size: 2560KiB", "l2:", f"  path: {tmp / 'l2'}", "  size: 2560KiB",
        "remote:", "  enabled: true", f"  url: {url}", "  timeout_ms: 500"]) + "\n")
    return path


def block_value(client: redis.Redis, case: str, name: str, other: str) -> None:
    """Replace the block value ``name`` the way ``case`` says (``other``: another block's value)."""
    value = client.get(name)
    assert value is not None and len(value) > HEADER_SIZE, f"{name} is not in Redis"
    if case == "truncated":
        client.set(name, value[: HEADER_SIZE + (len(value) - HEADER_SIZE) // 2])
    elif case == "wrong_size":  # a valid header and checksum for half the bytes
        meta = unpack_header(value)
        half = value[HEADER_SIZE : HEADER_SIZE + meta.size // 2]
        meta = meta._replace(size=len(half), checksum=payload_checksum(half))
        client.set(name, pack_header(meta) + half)
    elif case == "other_key":
        client.set(name, client.get(other))
    elif case == "garbage":
        client.set(name, os.urandom(len(value)))
    elif case == "wrong_type":
        client.delete(name)
        client.hset(name, "kv", "not a block")
    elif case == "flipped":
        data = bytearray(value)
        data[-5] ^= 0x10
        client.set(name, bytes(data))


def epoch_value(client: redis.Redis, case: str, key: str, seed_hex: str) -> None:
    if case == "junk":
        client.set(key, b"not an epoch \xff")
    elif case == "2^64":
        client.set(key, str(1 << 64))
    elif case == "negative":
        client.set(key, "-12")
    elif case == "megabyte":
        client.set(key, b"9" * (1 << 20))
    elif case == "hash":
        client.delete(key)
        client.hset(key, "epoch", "1")
    elif case == "messages":  # the channel: only a namespace makes an instance re-read
        for message in (str(1 << 64), "zz:1", b"\xff" * 40, b"7" * (1 << 20), f"{seed_hex}:{1 << 64}"):
            client.publish("kvstrata:epochs", message)


def test_engine_serves_every_request_right_while_redis_holds_hostile_values(model, baseline, tmp_path):
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        client = redis.Redis.from_url(url)
        config = hostile_config(tmp_path, url)
        keys = open_keys(load_config(config))  # the engine's key scheme
        with StepEngine(model, tmp_path, config, name="hostile") as engine:
            steps: list[dict] = []
            for case in BLOCK_CASES:
                steps += [gen(LONG, salt=f"block-{case}"), {"op": "sleep", "s": 0.3}]
            for i in range(FILLERS):
                steps += [gen(LONG, salt=f"filler-{i}"), {"op": "sleep", "s": 0.3}]
            out = engine.run(steps)
            epoch_keys = list(client.scan_iter("kvstrata:epoch:*"))
            assert len(epoch_keys) == 1, epoch_keys
            seed_hex = epoch_keys[0].decode().rsplit(":", 1)[1]
            root = keys.root_key(bytes.fromhex(seed_hex), int(client.get(epoch_keys[0])))
            for case in BLOCK_CASES:
                chain = keys.chain_keys(root, np.array(LONG, np.uint32), BS, extra_digest([f"salt:block-{case}"]),
                                        partial=False)
                names = [f"kvstrata:{{{k.hex()}}}:p" for k in chain.keys]
                assert all(client.exists(n) for n in names), f"{case}: the engine did not store every block"
                block_value(client, case, names[BAD_BLOCK], names[BAD_BLOCK + 2])
            # vLLM's own prefix cache reset: from here kvstrata answers
            block_cases = engine.run([{"op": "reset"}, *[gen(LONG, salt=f"block-{case}") for case in BLOCK_CASES]])[1:]
            epoch_cases = []
            for case in EPOCH_CASES:
                epoch_value(client, case, epoch_keys[0].decode(), seed_hex)
                epoch_cases += engine.run([{"op": "sleep", "s": 0.2}, gen(LONG, salt=f"epoch-{case}")])[1:]
            last, counters = engine.run([{"op": "reset"}, gen(LONG, salt="epoch-messages"), {"op": "counters"}])[1:]
        final_type = client.type(epoch_keys[0])
        final_epoch = client.get(epoch_keys[0]) if final_type == b"string" else None

    generated = [r for r in out + block_cases + epoch_cases + [last] if "tokens" in r]
    assert len(generated) == len(BLOCK_CASES) + FILLERS + len(BLOCK_CASES) + len(EPOCH_CASES) + 1
    assert all(r["tokens"] == baseline(LONG) for r in generated), "an answer differs from vLLM alone"
    for case, got in zip(BLOCK_CASES, block_cases):  # blocks before the bad one came from Redis, no more
        assert got["cached"] == BAD_BLOCK * BS, case
    for case, got in zip(EPOCH_CASES, epoch_cases):  # a fresh epoch each time: nothing old is served
        assert got["cached"] == 0, case
    assert last["cached"] == len(LONG) - 1  # and the shared tier still works after all that
    assert counters.get("remote_wrong_size") == 2  # truncated, and a header saying another size
    assert counters.get("remote_wrong_key") == 1
    assert counters.get("remote_bad_headers") == 1
    assert counters.get("checksum_failures") == 1
    assert counters.get("remote_wrong_type") == 2  # a block value and the epoch key
    assert counters.get("remote_bad_epochs") == 4  # junk, 2^64, negative, a megabyte
    assert counters.get("remote_bad_messages") == 4
    assert counters.get("hit_blocks_remote") == BAD_BLOCK * len(BLOCK_CASES)
    assert counters.get("remote_errors", 0) == 0 and counters.get("remote_circuit_opened", 0) == 0
    assert final_type == b"string" and final_epoch is not None and final_epoch.isdigit()  # repaired
