"""A real vLLM engine (CPU, tiny model) with an authenticated and encrypted Redis shared tier (a
secret, ``remote.encrypt: true``: every payload is AES-256-GCM ciphertext), fed forged values while
it serves, and sharing its Redis with a second tenant that holds another secret. Every answer equal
to vLLM alone's, with hits read from Redis, is the proof that encrypted blocks are served intact.

One engine start. Its L1 is small (40 blocks) and it has no disk tier, so the prompts it stored
first are soon held by Redis only, and asking for them again reads Redis. Every prompt is LONG
under its own cache salt (its own keys, the same outputs), so one baseline run without kvstrata
checks every answer. Each forgery is made with well-formed values and valid checksums, as a
host that can write to Redis but holds no secret can (and one flipped ciphertext bit): each must
be a miss, counted by kind.

The second tenant is a store in this process with secret B, on the same Redis, the same
namespace, prompt and salt as the engine (it reads the engine's namespace from Redis, as anyone
who can read there can): it never finds the engine's blocks, stores its own (other bytes), and
the engine never finds those; values it writes at the engine's names fail the engine's MAC.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
import xxhash

from tests.harness import redisutil
from kvstrata import BlockStore
from kvstrata.format.auth import Auth
from kvstrata.format.block import HEADER, HEADER_SIZE, is_sealed, payload_checksum, unpack_header
from kvstrata.format.seal import Seal
from kvstrata.config import load_config
from kvstrata.epochs.descriptors import decode as decode_descriptor
from kvstrata.keys import extra_digest
from kvstrata.store.parts import open_keys
from engines.launchers import BS, LONG, gen

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

SECRET_A = os.urandom(32).hex().encode()
SECRET_B = os.urandom(32).hex().encode()
KID = Auth(SECRET_A).key_id
BAD_BLOCK = 4  # the block whose values are forged; blocks 0-3 load, the rest is recomputed
CASES = ["xxh3", "namespace", "copied", "planted", "bitflip"]
FILLERS = 3  # prompts stored after the cases, pushing them out of L1


def auth_config(tmp: Path, url: str) -> Path:
    key = tmp / "a.key"
    key.write_bytes(SECRET_A + b"\n")
    key.chmod(0o600)
    path = tmp / "auth.yaml"
    path.write_text("\n".join([
        "l1:", "  size: 2560KiB", "l2:", "  enabled: false",
        "remote:", "  enabled: true", f"  url: {url}", "  timeout_ms: 500", f"  auth_key_file: {key}",
        "  encrypt: true"]) + "\n")
    return path


def rewritten(header: bytes, **changes: object) -> bytes:
    """``header`` with ``changes``, its own xxh3 valid and its AEAD tag and nonce kept."""
    fields = list(HEADER.unpack(header[: HEADER.size]))
    for i, field in enumerate(["key", "parent", "ns_seed", "fp", "checksum", "epoch", "size", "ntok"]):
        if field in changes:
            fields[3 + i] = changes[field]
    body = HEADER.pack(*fields)
    return body + xxhash.xxh3_64_digest(body)


def forge(client: redis.Redis, case: str, keys: list[bytes]) -> None:
    """Replace block ``BAD_BLOCK``'s values the way ``case`` says."""
    def name(key: bytes, kind: str) -> str:
        return f"kvstrata:{KID}:{{{key.hex()}}}:{kind}"

    p, i = name(keys[BAD_BLOCK], "p"), name(keys[BAD_BLOCK], "i")
    value = client.get(p)
    assert value is not None and len(value) > HEADER_SIZE, f"{case}: the engine did not store block {BAD_BLOCK}"
    assert is_sealed(value), f"{case}: the engine stored a plaintext block"
    if case == "xxh3":  # other KV (bytes), the checksum (of the stored bytes) recomputed
        payload = bytes(reversed(value[HEADER_SIZE:]))
        client.set(p, rewritten(value, checksum=payload_checksum(payload)) + payload)
    elif case == "namespace":  # the header rewritten to another namespace
        client.set(p, rewritten(value, ns_seed=os.urandom(16)) + value[HEADER_SIZE:])
    elif case == "copied":  # a valid block of the same prompt, copied to this key
        client.set(p, client.get(name(keys[BAD_BLOCK + 2], "p")))
    elif case == "planted":  # sealed under tenant B's secret (valid under B) for this very block, other KV
        b = Auth(SECRET_B)
        meta = unpack_header(value)
        sealed = bytearray(meta.size)
        header = Seal(b).seal(b"redis", meta, [memoryview(bytes(meta.size))], memoryview(sealed))
        client.set(p, header + bytes(sealed))
        client.set(i, header + b.tag(b"entry:redis", meta.key, header))
    elif case == "bitflip":  # one ciphertext bit flipped, the header untouched
        flipped = bytearray(value)
        flipped[HEADER_SIZE + 1000] ^= 0x04
        client.set(p, bytes(flipped))


def test_engine_refuses_forged_values_and_never_hits_another_tenants_blocks(model, baseline, vllm_engine, tmp_path):
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        client = redis.Redis.from_url(url)
        config = auth_config(tmp_path, url)
        keys = open_keys(load_config(config))  # the engine's key scheme, keyed by SECRET_A
        assert keys.keyed
        engine = vllm_engine(config, name="auth")
        steps: list[dict] = []
        for salt in [*(f"case-{c}" for c in CASES), "tenant", *(f"filler-{i}" for i in range(FILLERS))]:
            steps += [gen(LONG, salt=salt), {"op": "sleep", "s": 0.3}]
        out = engine.run(steps)
        before = engine.counters()

        epoch_keys = list(client.scan_iter(f"kvstrata:{KID}:epoch:*"))
        assert len(epoch_keys) == 1, epoch_keys
        epoch_key = epoch_keys[0].decode()
        seed = bytes.fromhex(epoch_key.rsplit(":", 1)[1])
        sealed_epoch = client.get(epoch_key)
        epoch = int(sealed_epoch.split(b":")[0])
        assert not list(client.scan_iter("kvstrata:{*")), "an authenticated engine wrote outside its key space"

        def keys_of(salt: str) -> list[bytes]:
            return keys.chain_keys(keys.root_key(seed, epoch), np.array(LONG, np.uint32), BS,
                                   extra_digest([f"salt:{salt}"]), partial=False).keys

        for case in CASES:
            forge(client, case, keys_of(f"case-{case}"))

        # Tenant B: another secret, the engine's namespace (read from Redis), the same prompt and salt
        raw = client.get(f"kvstrata:{KID}:ns:{seed.hex()}")
        ns = decode_descriptor(raw.rsplit(b"\n", 1)[0], seed)
        assert ns is not None
        key_b = tmp_path / "b.key"
        key_b.write_bytes(SECRET_B)
        with BlockStore(load_config(None, {"l1.size": "8MiB", "l1.pin_memory": False, "l2.enabled": False,
                                           "remote.enabled": True, "remote.url": url,
                                           "remote.auth_key_file": str(key_b), "remote.encrypt": True})) as tenant_b:
            tokens, extra = np.array(LONG, np.uint32), extra_digest(["salt:tenant"])
            assert tenant_b.lookup(ns, tokens, extra).num_blocks == 0  # never the engine's blocks
            b_epoch, chain = tenant_b.chain(ns, tokens, extra, partial=False)
            size = unpack_header(client.get(f"kvstrata:{KID}:{{{keys_of('tenant')[0].hex()}}}:i")).size
            garbage = torch.randint(0, 256, (len(chain.keys), size), dtype=torch.uint8)
            assert tenant_b.save_now(ns, b_epoch, chain, garbage) == len(chain.keys)
            tenant_b.flush()
            assert tenant_b.lookup(ns, tokens, extra).num_blocks == len(chain.keys)  # B hits its own
            b_counters = tenant_b.counters.snapshot()

        # vLLM's own prefix cache reset: from here kvstrata answers (L1 holds the fillers only)
        again = engine.run([{"op": "reset"}, *[gen(LONG, salt=f"case-{c}") for c in CASES],
                            gen(LONG, salt="tenant"), {"op": "counters"}])[1:]
        cases, tenant, mid = again[: len(CASES)], again[len(CASES)], again[-1]

        # A rewritten epoch (another epoch, the old tag) and forged announcements
        client.set(epoch_key, str(epoch ^ 99).encode() + sealed_epoch[sealed_epoch.index(b":"):])
        for message in (seed.hex(), f"{seed.hex()}:{'0' * 32}"):
            client.publish(f"kvstrata:{KID}:epochs", message)
        last, counters = engine.run([{"op": "sleep", "s": 0.3}, {"op": "reset"}, gen(LONG, salt="tenant"),
                                     {"op": "counters"}])[2:]

    generated = [r for r in out + cases + [tenant, last] if "tokens" in r]
    assert len(generated) == len(CASES) + 1 + FILLERS + len(CASES) + 2
    assert all(r["tokens"] == baseline(LONG) for r in generated), "an answer differs from vLLM alone"
    for case, got in zip(CASES, cases):  # the blocks before the forged one came from Redis, no more
        assert got["cached"] == BAD_BLOCK * BS, case
    assert tenant["cached"] == len(LONG) - 1  # its own blocks, from Redis, never tenant B's
    assert last["cached"] == 0  # the forged epoch was replaced by a fresh one: nothing older served
    grew = {k: v - before.get(k, 0) for k, v in mid.items() if v != before.get(k, 0)}
    # each case's block value fails its MAC at the load (the engine's index knows its own blocks,
    # so the planted index entry is not even read: the planted value is what is refused)
    assert grew.get("remote_auth_blocks") == len(CASES), grew
    assert grew.get("load_failures") == len(CASES), grew
    assert grew.get("hit_blocks_remote", 0) >= BAD_BLOCK * len(CASES) + len(LONG) // BS, grew
    assert counters.get("remote_auth_epochs", 0) >= 1
    assert counters.get("remote_auth_messages", 0) == 2
    kinds = ("remote_auth_blocks", "remote_auth_entries", "remote_auth_epochs", "remote_auth_messages")
    assert counters.get("remote_auth_failures") == sum(counters.get(k, 0) for k in kinds)
    assert counters.get("checksum_failures", 0) == 0 and counters.get("remote_wrong_key", 0) == 0
    assert counters.get("remote_errors", 0) == 0 and counters.get("remote_circuit_opened", 0) == 0
    assert not any("auth" in k for k in b_counters), b_counters  # B never even saw the engine's values
