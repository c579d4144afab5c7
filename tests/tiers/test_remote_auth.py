"""Authenticated shared tier: with a secret, every value read back from Redis or
the shared folder must carry a MAC under it. Each forgery below is what a host that can write
there (but holds no secret) can do with well-formed values and valid checksums; each must be a
miss, counted by kind, never an exception, never a wrong block. Real redis-server, no engine.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
import xxhash

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.format.auth import ENV, Auth
from kvstrata.format.block import HEADER, HEADER_SIZE, TAG_AT, TAG_SIZE, pack_header, payload_checksum, unpack_header
from kvstrata.config import ConfigError, load_config
from kvstrata.epochs.descriptors import encode as encode_descriptor

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
OTHER_NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16, tenant="other")
SIZE = 2048
SECRET_A = b"a" * 24 + os.urandom(16).hex().encode()
SECRET_B = b"b" * 24 + os.urandom(16).hex().encode()
KID_A, KID_B = Auth(SECRET_A).key_id, Auth(SECRET_B).key_id


def key_file(tmp: Path, secret: bytes, name: str = "key") -> Path:
    path = tmp / name
    path.write_bytes(secret + b"\n")
    path.chmod(0o600)
    return path


def open_store(tmp: Path, name: str, redis_url: str, secret: bytes | None = SECRET_A, **extra: object) -> BlockStore:
    overrides: dict[str, object] = {
        "l1.size": "4MiB", "l1.pin_memory": False, "l2.enabled": False, "remote.enabled": True,
        "remote.url": redis_url, "remote.invalidation_ms": 1, **extra}
    if secret is not None:
        overrides["remote.auth_key_file"] = str(key_file(tmp, secret, f"{name}.key"))
    return BlockStore(load_config(None, overrides))


def prompt(seed: int, n: int = 8 * 16) -> np.ndarray:
    return redisutil.random_prompt(seed, n)


payloads = redisutil.key_payloads


def load(store: BlockStore, tokens: np.ndarray, ns: Namespace = NS) -> tuple[int, int, torch.Tensor]:
    hit = store.lookup(ns, tokens)
    out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
    return hit.num_blocks, store.load_into(hit, out), out


def name(kid: str | None, key: bytes, kind: str) -> str:
    prefix = "kvstrata" if kid is None else f"kvstrata:{kid}"
    return f"{prefix}:{{{key.hex()}}}:{kind}"


def rewritten(header: bytes, payload: bytes | None = None, **changes) -> bytes:
    """``header`` with ``changes`` (and the checksum of ``payload``), its own xxh3 valid and its
    tag kept: well-formed, what a writer without the secret can make."""
    fields = list(HEADER.unpack(header[: HEADER.size]))
    meta = unpack_header(header)
    if payload is not None:
        changes["checksum"] = payload_checksum(payload)
    meta = meta._replace(**changes)
    order = ["key", "parent", "ns_seed", "fp", "checksum", "epoch", "size", "ntok"]
    for i, field in enumerate(order):
        fields[3 + i] = getattr(meta, field)
    body = HEADER.pack(*fields)
    return body + xxhash.xxh3_64_digest(body)


@pytest.fixture
def shared(tmp_path, redis_url):
    """A writer holding secret A stored an 8-block prompt; ``reader(name, secret)`` opens a fresh
    instance (secret A unless told), so its lookups and loads read what Redis holds."""
    s = redisutil.SharedPrompt(redis_url, lambda name, *a, **kw: open_store(tmp_path, name, redis_url, *a, **kw),
                               NS, prompt(1))
    yield s
    s.close()


def auth_counts(store: BlockStore) -> dict[str, int]:
    return {k: v for k, v in store.counters.snapshot().items() if "auth" in k}


# ------------------------------------------------------------------------ what is stored
def test_secret_holders_share_blocks_and_values_carry_macs(shared):
    b = shared.reader()
    found, loaded, out = load(b, shared.tokens)
    assert (found, loaded) == (8, 8) and torch.equal(out, shared.expected)
    assert auth_counts(b) == {} and b.counters.get("checksum_failures") == 0
    key = shared.chain.keys[0]
    entry = shared.client.get(name(KID_A, key, "i"))
    value = shared.client.get(name(KID_A, key, "p"))
    assert len(entry) == HEADER_SIZE + TAG_SIZE and entry[:HEADER_SIZE] == value[:HEADER_SIZE]
    assert value[TAG_AT : TAG_AT + TAG_SIZE] != bytes(TAG_SIZE)  # the tag sits in the header
    assert not shared.client.exists(name(None, key, "p"))  # the secret's own key space
    epoch_value = shared.client.get(f"kvstrata:{KID_A}:epoch:{NS.seed.hex()}")
    assert epoch_value.split(b":")[0] == str(shared.epoch).encode() and len(epoch_value.split(b":")[1]) == 32


# ------------------------------------------------------------------------ block forgeries
def test_payload_with_its_xxh3_recomputed_is_an_auth_miss_and_deleted(shared):
    key = shared.chain.keys[5]
    value = shared.client.get(name(KID_A, key, "p"))
    payload = bytes(reversed(value[HEADER_SIZE:]))
    shared.client.set(name(KID_A, key, "p"), rewritten(value[:HEADER_SIZE], payload) + payload)
    b = shared.reader()
    found, loaded, out = load(b, shared.tokens)
    assert (found, loaded) == (8, 5) and torch.equal(out[:5], shared.expected[:5])
    assert b.counters.get("remote_auth_blocks") == 1 and b.counters.get("remote_auth_failures") == 1
    assert b.counters.get("checksum_failures") == 0
    assert not shared.client.exists(name(KID_A, key, "p"))  # the writer may: it is the secret's space


def test_header_rewritten_to_another_namespace_is_an_auth_miss(shared):
    key = shared.chain.keys[5]
    value = shared.client.get(name(KID_A, key, "p"))
    shared.client.set(name(KID_A, key, "p"), rewritten(value[:HEADER_SIZE], ns_seed=OTHER_NS.seed)
                      + value[HEADER_SIZE:])
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_auth_blocks") == 1 and b.counters.get("remote_wrong_key") == 0


def test_index_entry_rewritten_to_another_namespace_or_epoch_is_an_auth_miss(shared):
    keys = shared.chain.keys
    entry = shared.client.get(name(KID_A, keys[5], "i"))
    shared.client.set(name(KID_A, keys[5], "i"), rewritten(entry[:HEADER_SIZE], ns_seed=OTHER_NS.seed)
                      + entry[HEADER_SIZE:])
    entry = shared.client.get(name(KID_A, keys[3], "i"))
    shared.client.set(name(KID_A, keys[6], "i"), rewritten(entry[:HEADER_SIZE], epoch=shared.epoch ^ 1)
                      + entry[HEADER_SIZE:])
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 5
    assert b.counters.get("remote_auth_entries") >= 1 and b.counters.get("remote_wrong_key") == 0


def test_valid_block_copied_to_another_key_is_an_auth_miss(shared):
    keys = shared.chain.keys
    shared.client.set(name(KID_A, keys[5], "p"), shared.client.get(name(KID_A, keys[2], "p")))
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (8, 5)
    assert b.counters.get("remote_auth_blocks") == 1 and b.counters.get("remote_wrong_key") == 0
    shared.client.set(name(KID_A, keys[4], "i"), shared.client.get(name(KID_A, keys[1], "i")))
    c = shared.reader("c")
    assert c.lookup(NS, shared.tokens).num_blocks == 4
    assert c.counters.get("remote_auth_entries") >= 1


def test_unsealed_values_of_the_old_format_are_auth_misses(shared):
    """A writer without the secret writes what kvstrata wrote before: a zero tag, a 128-byte entry."""
    keys = shared.chain.keys
    meta = unpack_header(shared.client.get(name(KID_A, keys[5], "i"))[:HEADER_SIZE])
    payload = bytes(SIZE)
    plain = pack_header(meta._replace(checksum=payload_checksum(payload)))
    shared.client.set(name(KID_A, keys[5], "p"), plain + payload)
    shared.client.set(name(KID_A, keys[6], "i"), pack_header(meta._replace(key=keys[6])))
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (6, 5)
    assert b.counters.get("remote_auth_blocks") == 1 and b.counters.get("remote_auth_entries") >= 1


# ------------------------------------------------------------------------ control values
def test_rewritten_epoch_value_is_an_auth_failure_and_a_fresh_epoch(shared):
    epoch_key = f"kvstrata:{KID_A}:epoch:{NS.seed.hex()}"
    sealed = shared.client.get(epoch_key)
    for forged in (str(shared.epoch ^ 7).encode(),  # a bare epoch, as an unauthenticated tier holds
                   str(shared.epoch ^ 7).encode() + sealed[sealed.index(b":"):]):  # another epoch, the old tag
        shared.client.set(epoch_key, forged)
        b = shared.reader(f"r{len(shared.opened)}")
        assert b.lookup(NS, shared.tokens).num_blocks == 0  # a fresh epoch: nothing older is served
        assert b.counters.get("remote_auth_epochs") == 1 and b.counters.get("remote_bad_epochs") == 0
        repaired = shared.client.get(epoch_key)
        assert repaired not in (forged, sealed) and b":" in repaired


def test_epoch_value_copied_from_another_namespace_is_an_auth_failure(tmp_path, redis_url, shared):
    with open_store(tmp_path, "other", redis_url) as other:
        other.current_epoch(OTHER_NS)
    other_value = shared.client.get(f"kvstrata:{KID_A}:epoch:{OTHER_NS.seed.hex()}")
    assert other_value is not None
    shared.client.set(f"kvstrata:{KID_A}:epoch:{NS.seed.hex()}", other_value)
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 0
    assert b.counters.get("remote_auth_epochs") == 1


def test_swapped_descriptor_is_an_auth_failure(tmp_path, redis_url, shared):
    with open_store(tmp_path, "desc", redis_url) as s:
        s.describe(NS)
        s.describe(OTHER_NS)
    a, o = (f"kvstrata:{KID_A}:ns:{ns.seed.hex()}" for ns in (NS, OTHER_NS))
    va, vo = shared.client.get(a), shared.client.get(o)
    assert va.startswith(encode_descriptor(NS) + b"\n")
    b = shared.reader()
    assert set(b.descriptors([NS.seed, OTHER_NS.seed])) == {NS.seed, OTHER_NS.seed}
    shared.client.set(a, vo)
    shared.client.set(o, encode_descriptor(OTHER_NS))  # unsealed
    c = shared.reader("c")
    assert c.epochs.descriptor(NS.seed) is None and c.epochs.descriptor(OTHER_NS.seed) is None
    assert c.counters.get("remote_auth_descriptors") == 2


def test_forged_announcements_are_counted_and_ignored(shared):
    b = shared.reader()
    assert b.lookup(NS, shared.tokens).num_blocks == 8
    channel = f"kvstrata:{KID_A}:epochs"
    redisutil.listening(b)
    for message in (NS.seed.hex(), f"{NS.seed.hex()}:{'0' * 32}", b"\xff" * 40):
        shared.client.publish(channel, message)
    deadline = time.monotonic() + 20
    while b.counters.get("remote_auth_messages") < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.counters.get("remote_auth_messages") == 3
    # a real announcement, from a holder of the secret, still works: a reset elsewhere is seen
    c = shared.reader("c")
    assert c.invalidate(NS.seed) is not None
    deadline = time.monotonic() + 5
    while b.lookup(NS, shared.tokens).num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.lookup(NS, shared.tokens).num_blocks == 0


# ------------------------------------------------------------------------ tenants: secrets apart
def test_two_secrets_on_one_redis_never_hit_each_other(tmp_path, redis_url, shared):
    """Tenant B (another secret) runs the same prompt, namespace and salt: it finds nothing of A's,
    stores its own, and each then hits its own blocks only. Values copied from A's key space into
    B's fail B's MAC, and B's planted into A's fail A's."""
    client = shared.client
    b = shared.reader("b", SECRET_B)
    assert load(b, shared.tokens)[:2] == (0, 0)
    epoch, chain = b.chain(NS, shared.tokens)
    mine = payloads(chain).flip(1)  # B's KV differs: were it served to A, A's check below fails
    assert b.save_now(NS, epoch, chain, mine) == 8
    b.flush()
    assert chain.keys != shared.chain.keys  # another epoch: B's space has its own epoch key
    a2, b2 = shared.reader("a2"), shared.reader("b2", SECRET_B)
    got = load(a2, shared.tokens)
    assert got[:2] == (8, 8) and torch.equal(got[2], shared.expected)
    got = load(b2, shared.tokens)
    assert got[:2] == (8, 8) and torch.equal(got[2], mine)
    assert auth_counts(a2) == {} and auth_counts(b2) == {}
    # B plants its values (valid under B's secret) at A's names, same keys: refused by A
    for ka, kb in zip(shared.chain.keys, chain.keys):
        for kind in "ip":
            value = client.get(name(KID_B, kb, kind))
            header = rewritten(value[:HEADER_SIZE], key=ka, epoch=shared.epoch,
                               parent=unpack_header(client.get(name(KID_A, ka, "i"))[:HEADER_SIZE]).parent)
            client.set(name(KID_A, ka, kind), header + value[HEADER_SIZE:])
    a3 = shared.reader("a3")
    assert load(a3, shared.tokens)[:2] == (0, 0)
    assert a3.counters.get("remote_auth_entries") >= 1


def test_blocks_planted_with_another_secret_at_the_right_names_are_auth_misses(tmp_path, redis_url, shared):
    """Tenant B knows A's prompt, namespace and epoch (Redis is readable) and writes A's blocks,
    with its own KV, under A's names: valid MACs, but under B's secret."""
    with BlockStore(load_config(None, {
            "l1.size": "4MiB", "l1.pin_memory": False, "l2.enabled": False, "remote.enabled": True,
            "remote.url": redis_url, "remote.key_prefix": f"kvstrata:{KID_A}",
            "remote.auth_key_file": str(key_file(tmp_path, SECRET_B, "b.key"))})) as planter:
        stored = planter.save_now(NS, shared.epoch, shared.chain, shared.expected.flip(1))
        planter.flush()
    assert stored == 8
    for key in shared.chain.keys:  # B's values, moved from B's space to A's names
        for kind in "ip":
            value = shared.client.get(f"kvstrata:{KID_A}:{KID_B}:{{{key.hex()}}}:{kind}")
            assert value is not None
            shared.client.set(name(KID_A, key, kind), value)
    b = shared.reader()
    assert load(b, shared.tokens)[:2] == (0, 0)
    assert b.counters.get("remote_auth_entries") == 1 and b.counters.get("remote_auth_failures") == 1


# ------------------------------------------------------------------------ no secret: as before
def test_without_a_secret_nothing_changes_and_the_start_says_unauthenticated(tmp_path, redis_url, caplog, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    client = redis.Redis.from_url(redis_url)
    with caplog.at_level(logging.WARNING, logger="kvstrata.store.parts"):
        with open_store(tmp_path, "plain", redis_url, None) as s:
            epoch, chain = s.chain(NS, prompt(3))
            assert s.save_now(NS, epoch, chain, payloads(chain)) == 8
            s.flush()
    lines = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(lines) == 1 and redis_url in lines[0] and "remote.auth_key_file" in lines[0]
    entry = client.get(name(None, chain.keys[0], "i"))
    assert len(entry) == HEADER_SIZE and entry[TAG_AT : TAG_AT + TAG_SIZE] == bytes(TAG_SIZE)
    assert client.get(f"kvstrata:epoch:{NS.seed.hex()}") == str(epoch).encode()
    with open_store(tmp_path, "plain2", redis_url, None) as r:
        assert load(r, prompt(3))[:2] == (8, 8)
        # an authenticated instance never reads the unauthenticated space
    with open_store(tmp_path, "sealed", redis_url) as a:
        assert load(a, prompt(3))[:2] == (0, 0)


def test_secret_from_the_environment(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv(ENV, SECRET_A.decode())
    with open_store(tmp_path, "env", redis_url, None) as s:
        epoch, chain = s.chain(NS, prompt(4))
        assert s.save_now(NS, epoch, chain, payloads(chain)) == 8
        s.flush()
    monkeypatch.delenv(ENV)
    with open_store(tmp_path, "file", redis_url) as r:  # the same secret from a file: the same space
        assert load(r, prompt(4))[:2] == (8, 8)


# ------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("case", ["missing", "short", "folder", "huge", "empty"])
def test_bad_key_file_is_a_config_error_naming_file_key_and_problem(tmp_path, case):
    path = tmp_path / "k"
    if case == "short":
        path.write_text("x" * 31)
    elif case == "folder":
        path.mkdir()
    elif case == "huge":
        path.write_bytes(b"x" * 5000)
    elif case == "empty":
        path.write_text("  \n")
    config = tmp_path / "kv.yaml"
    config.write_text(f"remote:\n  enabled: true\n  auth_key_file: {path}\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    text = str(err.value)
    assert str(config) in text and "remote.auth_key_file" in text and str(path) in text
    assert {"missing": "No such file", "short": "31 bytes", "folder": "directory", "huge": "over 4096",
            "empty": "0 bytes"}[case] in text


def test_short_secret_in_the_environment_fails_the_store_open(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv(ENV, "too short")
    with pytest.raises(ConfigError, match=f"\\${ENV}.*9 bytes"):
        open_store(tmp_path, "env", redis_url, None)


def test_l2_authenticate_needs_a_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match="l2.authenticate.*remote.auth_key_file"):
        BlockStore(load_config(None, {"l1.size": "4MiB", "l2.path": str(tmp_path / "l2"), "l2.authenticate": True}))


# ------------------------------------------------------------------------ the shared folder
def fs_store(tmp: Path, name: str, secret: bytes | None = SECRET_A) -> BlockStore:
    overrides: dict[str, object] = {
        "l1.size": "4MiB", "l1.pin_memory": False, "l2.enabled": False, "remote.enabled": True,
        "remote.backend": "fs", "remote.path": str(tmp / "shared"), "remote.invalidation_ms": 1}
    if secret is not None:
        overrides["remote.auth_key_file"] = str(key_file(tmp, secret, f"{name}.key"))
    return BlockStore(load_config(None, overrides))


def block_file(tmp: Path, kid: str, key: bytes) -> Path:
    return tmp / "shared" / f"auth-{kid}" / "blocks" / key.hex()[:2] / f"{key.hex()}.kvb"


def test_shared_folder_forgeries_are_auth_misses(tmp_path):
    with fs_store(tmp_path, "w") as w:
        epoch, chain = w.chain(NS, prompt(5))
        expected = payloads(chain)
        assert w.save_now(NS, epoch, chain, expected) == 8
        w.flush()
    keys = chain.keys
    with fs_store(tmp_path, "r0") as r:
        got = load(r, prompt(5))
        assert got[:2] == (8, 8) and torch.equal(got[2], expected)
    # block 5: payload changed, xxh3 recomputed; block 6: block 2's file copied to its name
    raw = block_file(tmp_path, KID_A, keys[5]).read_bytes()
    payload = bytes(reversed(raw[HEADER_SIZE:]))
    block_file(tmp_path, KID_A, keys[5]).write_bytes(rewritten(raw[:HEADER_SIZE], payload) + payload)
    with fs_store(tmp_path, "r1") as r:
        assert load(r, prompt(5))[:2] == (8, 5)
        assert r.counters.get("remote_auth_blocks") == 1 and r.counters.get("remote_auth_failures") == 1
        assert r.counters.get("checksum_failures") == 0
    assert not block_file(tmp_path, KID_A, keys[5]).exists()
    # block 3: block 2's valid payload and tag under block 3's own header (so that it is found)
    other = block_file(tmp_path, KID_A, keys[2]).read_bytes()
    mine = block_file(tmp_path, KID_A, keys[3]).read_bytes()
    fields = list(HEADER.unpack(mine[: HEADER.size]))
    fields[11] = other[TAG_AT : TAG_AT + TAG_SIZE]
    body = HEADER.pack(*fields)
    header = rewritten(body + xxhash.xxh3_64_digest(body), other[HEADER_SIZE:])
    block_file(tmp_path, KID_A, keys[3]).write_bytes(header + other[HEADER_SIZE:])
    with fs_store(tmp_path, "r2") as r:
        assert load(r, prompt(5))[:2] == (5, 3)
        assert r.counters.get("remote_auth_blocks") == 1
    # the epoch file rewritten: a fresh epoch, nothing older served
    epoch_file = tmp_path / "shared" / f"auth-{KID_A}" / "epochs" / NS.seed.hex()
    epoch_file.write_text(f"{epoch ^ 5}\n")
    with fs_store(tmp_path, "r3") as r:
        assert r.lookup(NS, prompt(5)).num_blocks == 0
        assert r.counters.get("remote_auth_epochs") == 1
    assert b":" in epoch_file.read_bytes()


def test_shared_folder_secrets_live_apart(tmp_path):
    for name, secret in (("a", SECRET_A), ("b", SECRET_B)):
        with fs_store(tmp_path, name, secret) as s:
            assert load(s, prompt(6))[:2] == (0, 0)  # never the other's
            epoch, chain = s.chain(NS, prompt(6))
            assert s.save_now(NS, epoch, chain, payloads(chain)) == 8
            s.flush()
    for name, secret in (("a2", SECRET_A), ("b2", SECRET_B)):
        with fs_store(tmp_path, name, secret) as s:
            assert load(s, prompt(6))[:2] == (8, 8) and auth_counts(s) == {}
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == sorted([f"auth-{KID_A}", f"auth-{KID_B}"])


# ------------------------------------------------------------------------ L2 with l2.authenticate
def test_l2_authenticate_macs_disk_blocks_and_epochs(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, SECRET_A.decode())

    def l2_store() -> BlockStore:
        return BlockStore(load_config(None, {"l1.size": "4MiB", "l1.pin_memory": False,
                                             "l2.path": str(tmp_path / "l2"), "l2.authenticate": True}))

    with l2_store() as s:
        epoch, chain = s.chain(NS, prompt(8))
        expected = payloads(chain)
        assert s.save_now(NS, epoch, chain, expected) == 8
        s.flush()
        path = s.l2.path(chain.keys[4])
    raw = path.read_bytes()
    assert raw[TAG_AT : TAG_AT + TAG_SIZE] != bytes(TAG_SIZE)
    payload = bytes(SIZE)
    path.write_bytes(rewritten(raw[:HEADER_SIZE], payload) + payload)
    with l2_store() as s:
        got = load(s, prompt(8))
        assert got[:2] == (8, 4) and torch.equal(got[2][:4], expected[:4])
        assert s.counters.get("l2_auth_blocks") == 1 and s.counters.get("l2_auth_failures") == 1
    assert not path.exists()
    epoch_file = tmp_path / "l2" / "epochs" / NS.seed.hex()
    assert epoch_file.read_text().startswith(f"{epoch}:")
    epoch_file.write_text(f"{epoch}\n")  # the right epoch, without its MAC
    with l2_store() as s:
        assert s.lookup(NS, prompt(8)).num_blocks == 0
        assert s.counters.get("l2_auth_epochs") == 1


def test_rejections_are_exported_by_kind_as_the_engines_metrics_show_them(shared):
    """The series both adapters export (``make_series``/``bind_series``/``feed_series`` on
    prometheus-client's classes, as vLLM's and SGLang's /metrics do): one child per tier and kind."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvstrata.adapters.figures import FigureCollector
    from kvstrata.metrics import bind_series, feed_series, make_series

    key = shared.chain.keys[5]
    value = shared.client.get(name(KID_A, key, "p"))
    payload = bytes(reversed(value[HEADER_SIZE:]))
    shared.client.set(name(KID_A, key, "p"), rewritten(value[:HEADER_SIZE], payload) + payload)
    shared.client.publish(f"kvstrata:{KID_A}:epochs", NS.seed.hex())  # unsealed
    b = shared.reader()
    registry = CollectorRegistry()
    make = {kind: partial(cls, registry=registry) for kind, cls in
            (("counter", Counter), ("gauge", Gauge), ("histogram", Histogram))}
    children = bind_series(make_series(make, ["engine"]), ["0"])
    collector = FigureCollector(b)
    assert load(b, shared.tokens)[:2] == (8, 5)
    deadline = time.monotonic() + 20
    while b.counters.get("remote_auth_messages") < 1 and time.monotonic() < deadline:
        shared.client.publish(f"kvstrata:{KID_A}:epochs", NS.seed.hex())
        time.sleep(0.05)
    feed_series(children, collector.collect())
    text = generate_latest(registry).decode()
    series = 'kvstrata_auth_failures_total{engine="0",kind="%s",tier="%s"} %s'
    assert series % ("blocks", "remote", "1.0") in text, text
    assert series % ("messages", "remote", f"{float(b.counters.get('remote_auth_messages'))}") in text
    for kind in ("entries", "epochs", "descriptors"):
        assert series % (kind, "remote", "0.0") in text
    assert series % ("blocks", "l2", "0.0") in text
