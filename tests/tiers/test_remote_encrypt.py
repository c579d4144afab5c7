"""Confidential shared tier (``remote.encrypt``, ``l2.encrypt``): every block payload on Redis, in
the shared folder or in L2 is AES-256-GCM ciphertext under a per-namespace key of the deployment
secret. Whoever reads the tier without the secret (a `redis-cli --rdb` dump, the folder's files)
finds no payload byte; a holder reads the blocks back byte-equal; one flipped ciphertext bit is a
counted miss. Real redis-server and redis-cli, no engine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.config import ConfigError, RemoteConfig, load_config
from kvstrata.format.auth import ENV, Auth
from kvstrata.format.block import (HEADER_SIZE, NONCE_AT, NONCE_SIZE, NO_NONCE, TAG_AT, TAG_SIZE, is_sealed,
                                   payload_checksum, unpack_header)
from kvstrata.format.seal import Seal
from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16, tenant="acme")
SIZE = 2048
SECRET = b"s" * 24 + os.urandom(16).hex().encode()
KID = Auth(SECRET).key_id
TOKENS = np.random.default_rng(42).integers(0, 30000, 8 * 16, dtype=np.uint32)


def pattern_payloads(n: int = 8, size: int = SIZE) -> torch.Tensor:
    """Block bytes a reader of the tier would recognise: a line naming the block, then seeded
    random bytes (incompressible: an RDB dump LZF-compresses values, which would hide a repeated
    pattern even in plaintext)."""
    rng = np.random.default_rng(7)
    rows = [np.frombuffer(f"acme's confidential KV, block {i:03d}: ".encode() + rng.bytes(size), np.uint8)[:size]
            for i in range(n)]
    return torch.from_numpy(np.stack(rows).copy())


def secrets_in(blob: bytes, expected: torch.Tensor) -> list[str]:
    """Which known strings of the tenant's request ``blob`` holds: 96-byte runs of each payload,
    64 bytes of the prompt's tokens (as the store hashes them, uint32)."""
    found = [f"payload {i}" for i in range(len(expected)) if bytes(expected[i, 100:196].numpy()) in blob]
    return found + (["tokens"] if TOKENS[:16].tobytes() in blob else [])


def open_store(tmp: Path, name: str, encrypt: bool = True, **extra: object) -> BlockStore:
    tmp.mkdir(parents=True, exist_ok=True)
    key = tmp / "key"
    key.write_bytes(SECRET)
    overrides: dict[str, object] = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.enabled": False,
                                    "l2.path": str(tmp / name / "l2"), "remote.enabled": True,
                                    "remote.invalidation_ms": 1, "remote.auth_key_file": str(key),
                                    "remote.encrypt": encrypt, **extra}
    return BlockStore(load_config(None, overrides))


def backend(kind: str, tmp: Path, url: str | None) -> dict[str, object]:
    return ({"remote.url": url} if kind == "redis" else
            {"remote.backend": "fs", "remote.path": str(tmp / "shared")})


def save(store: BlockStore, expected: torch.Tensor) -> None:
    epoch, chain = store.chain(NS, TOKENS)
    assert store.save_now(NS, epoch, chain, expected) == len(expected)
    store.flush()


def load(store: BlockStore) -> tuple[int, int, torch.Tensor]:
    hit = store.lookup(NS, TOKENS)
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    return hit.num_blocks, store.load_into(hit, out), out


def rdb_dump(url: str, tmp: Path) -> bytes:
    """The server's whole dataset as `redis-cli --rdb` writes it (the real binary)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed: the dump cannot be taken")
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "dump.rdb"
    done = subprocess.run([cli, "-u", url, "--rdb", str(path)], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return path.read_bytes()


def folder_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink())


def stored_value(kind: str, store: BlockStore, tmp: Path, key: bytes, url: str | None) -> bytes:
    if kind == "redis":
        import redis

        return redis.Redis.from_url(url).get(f"kvstrata:{KID}:{{{key.hex()}}}:p")
    return store.remote.path(key).read_bytes()


def put_value(kind: str, tmp: Path, key: bytes, url: str | None, value: bytes) -> None:
    if kind == "redis":
        import redis

        redis.Redis.from_url(url).set(f"kvstrata:{KID}:{{{key.hex()}}}:p", value)
    else:
        (tmp / "shared" / f"auth-{KID}" / "blocks" / key.hex()[:2] / f"{key.hex()}.kvb").write_bytes(value)


@pytest.fixture(params=["redis", "fs"])
def kind(request) -> str:
    return request.param


# ------------------------------------------------------------------------ what leaves the process
def test_a_dump_of_an_encrypted_redis_holds_no_payload_and_no_tokens(tmp_path, redis_url):
    """Scenario: the same prompt stored MAC-only, then encrypted, on two Redis servers: the MAC-only
    dump shows every payload (the search works), the encrypted one none; both are served byte-equal."""
    expected = pattern_payloads()
    with redisutil.standalone(tmp_path / "plain-redis") as (plain_url, _port, _procs):
        for url, encrypt in ((plain_url, False), (redis_url, True)):
            with open_store(tmp_path, f"w-{encrypt}", encrypt, **{"remote.url": url}) as w:
                save(w, expected)
            with open_store(tmp_path, f"r-{encrypt}", encrypt, **{"remote.url": url}) as r:
                found, loaded, out = load(r)
                assert (found, loaded) == (8, 8) and torch.equal(out, expected)
                assert {k: v for k, v in r.counters.snapshot().items() if "auth" in k} == {}
        assert secrets_in(rdb_dump(plain_url, tmp_path / "plain"), expected) == [f"payload {i}" for i in range(8)]
    assert secrets_in(rdb_dump(redis_url, tmp_path / "sealed"), expected) == []


def test_the_shared_folder_and_l2_files_hold_no_payload_when_encrypted(tmp_path):
    expected = pattern_payloads()
    for encrypt in (False, True):
        root = tmp_path / str(encrypt)
        extra = {"remote.backend": "fs", "remote.path": str(root / "shared"), "l2.enabled": True,
                 "l2.path": str(root / "l2"), "l2.encrypt": encrypt, "l2.write": "through"}
        with open_store(root, "w", encrypt, **extra) as w:
            save(w, expected)
        with open_store(root, "r", encrypt, **{**extra, "l2.path": str(root / "l2-reader")}) as r:
            found, loaded, out = load(r)  # from the shared folder: the reader's L2 is empty
            assert (found, loaded) == (8, 8) and torch.equal(out, expected)
        with open_store(root, "w", encrypt, **extra) as again:  # from the writer's L2
            found, loaded, out = load(again)
            assert (found, loaded) == (8, 8) and torch.equal(out, expected)
            assert again.counters.get("l2_bytes_read") == 8 * SIZE
        leaked = {where: secrets_in(folder_bytes(root / where), expected) for where in ("shared", "l2")}
        if encrypt:
            assert leaked == {"shared": [], "l2": []}
        else:
            assert all(len(found) == 8 for found in leaked.values()), leaked


def test_sealed_values_carry_a_fresh_nonce_and_no_plaintext_checksum(tmp_path, kind, redis_url):
    expected = pattern_payloads()
    meta = EntryMeta(os.urandom(16), os.urandom(16), 1, 16, NS.seed, 7, SIZE, payload_checksum(bytes(expected[3].numpy())))
    with open_store(tmp_path, "w", **backend(kind, tmp_path, redis_url)) as w:
        assert w.remote.write(meta, expected[3])
        first = stored_value(kind, w, tmp_path, meta.key, redis_url)
        assert w.remote.write(meta, expected[3])  # the same block written again
        second = stored_value(kind, w, tmp_path, meta.key, redis_url)
    assert len(first) == len(second) == HEADER_SIZE + SIZE  # the nonce and tag live in the header
    for value in (first, second):
        header = unpack_header(value[:HEADER_SIZE])
        assert is_sealed(value) and header.checksum == payload_checksum(value[HEADER_SIZE:])
        assert header.checksum != payload_checksum(bytes(expected[3].numpy()))
        assert value[TAG_AT : TAG_AT + TAG_SIZE] != bytes(TAG_SIZE)
    nonces = {v[NONCE_AT : NONCE_AT + NONCE_SIZE] for v in (first, second)}
    assert len(nonces) == 2 and NO_NONCE not in nonces
    assert first[HEADER_SIZE:] != second[HEADER_SIZE:]


# ------------------------------------------------------------------------ what is refused
def test_a_flipped_ciphertext_bit_is_a_counted_miss(tmp_path, kind, redis_url):
    expected = pattern_payloads()
    where = backend(kind, tmp_path, redis_url)
    with open_store(tmp_path, "w", **where) as w:
        save(w, expected)
        key = w.chain(NS, TOKENS)[1].keys[5]
        value = bytearray(stored_value(kind, w, tmp_path, key, redis_url))
    value[HEADER_SIZE + 777] ^= 0x10  # the header (and its xxh3) untouched
    put_value(kind, tmp_path, key, redis_url, bytes(value))
    with open_store(tmp_path, "r", **where) as r:
        found, loaded, out = load(r)
        assert (found, loaded) == (8, 5) and torch.equal(out[:5], expected[:5])
        assert r.counters.get("remote_auth_blocks") == 1 and r.counters.get("remote_auth_failures") == 1
        assert r.counters.get("checksum_failures") == 0
    with open_store(tmp_path, "r2", **where) as r:  # the bad value was deleted; nothing else went
        assert load(r)[:2] == (5, 5)


@pytest.mark.parametrize("writer_encrypts", [False, True])
def test_mac_only_and_sealed_values_are_misses_to_each_other(tmp_path, kind, redis_url, writer_encrypts):
    """Scenario: instances of one secret, one encrypting and one not (a half-done rollout): each
    refuses the other's block values, counted, never serving ciphertext or plaintext it did not expect."""
    where = backend(kind, tmp_path, redis_url)
    with open_store(tmp_path, "w", writer_encrypts, **where) as w:
        save(w, pattern_payloads())
    with open_store(tmp_path, "r", not writer_encrypts, **where) as r:
        found, loaded, _ = load(r)
        assert loaded == 0 and r.counters.get("remote_auth_blocks") == 1


def test_a_large_batch_is_decrypted_on_the_pool_and_a_bad_value_stops_it(tmp_path, redis_url):
    """Scenario: 8 blocks of 256 KiB (a load of 2 MiB: ``_check_all`` decrypts on the thread pool)."""
    from kvstrata.tiers.redis import RedisTier

    auth, size = Auth(SECRET), 256 << 10
    tier = RedisTier(Counters(), RemoteConfig(url=redis_url), auth=auth, seal=Seal(auth))
    payload = torch.randint(0, 256, (8, size), dtype=torch.uint8)
    metas = [EntryMeta(os.urandom(16), os.urandom(16), i, 16, NS.seed, 7, size,
                       payload_checksum(bytes(payload[i].numpy()))) for i in range(8)]
    assert tier.write_many(metas, list(payload)) == [True] * 8
    out = torch.zeros_like(payload)
    assert tier.read_many(metas, list(out)) == 8 and torch.equal(out, payload)
    name = f"kvstrata:{KID}:{{{metas[6].key.hex()}}}:p"
    value = bytearray(tier.client.get(name))
    value[-1] ^= 1
    tier.client.set(name, bytes(value))
    assert tier.read_many(metas, list(torch.zeros_like(payload))) == 6
    assert tier.counters.get("remote_auth_blocks") == 1 and not tier.client.exists(name)
    tier.close()


# ------------------------------------------------------------------------ config
@pytest.mark.parametrize("setting", ["remote.encrypt", "l2.encrypt"])
def test_encrypt_without_a_secret_is_a_config_error_naming_the_key(tmp_path, redis_url, monkeypatch, setting):
    monkeypatch.delenv(ENV, raising=False)
    overrides: dict[str, object] = {"l1.size": "4MiB", "l2.path": str(tmp_path / "l2"), setting: True}
    if setting == "remote.encrypt":
        overrides.update({"remote.enabled": True, "remote.url": redis_url, "l2.enabled": False})
    with pytest.raises(ConfigError, match=f"{setting}: true needs a secret.*remote.auth_key_file"):
        BlockStore(load_config(None, overrides))
