"""The store's key scheme (``keys.hash``): which scheme and secret key a store's blocks, namespaces
apart per scheme, stores of two schemes (or two secrets) sharing one L2 folder, the legacy xxh3
keys, what ``kvstrata stats`` shows, and the config error. The schemes themselves: test_keys.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import xxhash
from rich.console import Console

from tests.builders import BLOCK_SIZE, load_hit, make_config, payloads_for, random_tokens, store_prompt
from kvstrata.format.auth import ENV as AUTH_ENV
from kvstrata.config import ConfigError, load_config
from kvstrata.epochs.descriptors import decode, encode
from kvstrata.keys import DEFAULT_KEY_SCHEME, Namespace, chain_keys, rooted_digests, root_key
from kvstrata.cli.stats_view import render
from kvstrata.store import BlockStore

SECRET_A = b"a" * 40
SECRET_B = b"b" * 40


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv(AUTH_ENV, raising=False)


def key_file(tmp_path, secret: bytes, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(secret)
    path.chmod(0o600)
    return str(path)


def test_a_store_keys_by_its_configured_scheme_keyed_by_the_secret_where_one_is_set(store_factory, ns, tmp_path,
                                                                                      monkeypatch):
    """Scenario: no secret, a key file (no shared tier configured: the secret still keys), the
    environment's secret, and ``keys.hash: xxh3`` (never keyed); the store's chains are exactly
    its scheme's over its namespace's root."""
    tokens = random_tokens("scheme", 3 * BLOCK_SIZE + 5)
    plain = store_factory()
    filed = store_factory({"remote.auth_key_file": key_file(tmp_path, SECRET_A, "a.key")})
    monkeypatch.setenv(AUTH_ENV, SECRET_A.decode())
    from_env = store_factory()
    legacy = store_factory(keys__hash="xxh3")
    assert [(s.keys.name, s.keys.keyed) for s in (plain, filed, from_env, legacy)] == [
        ("blake3", False), ("blake3", True), ("blake3", True), ("xxh3", False)]
    chains = {}
    for name, store in (("plain", plain), ("filed", filed), ("env", from_env)):
        epoch, chains[name] = store.chain(ns, tokens)
        assert chains[name] == store.keys.chain_keys(store.keys.root_key(ns.seed, epoch), tokens, BLOCK_SIZE)
    assert chains["filed"] == chains["env"]  # one secret, one set of keys
    assert not set(chains["plain"].keys) & set(chains["filed"].keys)


def test_a_set_secret_that_cannot_be_used_fails_the_store_even_without_a_shared_tier(tmp_path, monkeypatch):
    monkeypatch.setenv(AUTH_ENV, "short")
    with pytest.raises(ConfigError, match="at least 32"):
        BlockStore(make_config(tmp_path))


def test_stores_of_two_schemes_on_one_l2_folder_never_hit_each_others_blocks(store_factory, ns):
    """Scenario: a blake3 store and an xxh3 store share one L2 folder and are given the same
    namespace and prompts; each stores its own copy, each serves only its own, also from disk
    after a restart, and the folder holds two namespaces, each naming its scheme."""
    tokens = random_tokens("two schemes", 4 * BLOCK_SIZE + 3)
    b3, xx = store_factory(), store_factory(keys__hash="xxh3")
    for store in (b3, xx):
        store.describe(ns)
        # Counted: until its scan is done a store holds L2 at its upper bound and makes room by
        # evicting blocks (the other store's, adopted by the scan), which would turn hits into misses.
        assert store.wait_recovered(30)
    b3_chain, stored = store_prompt(b3, ns, tokens)
    assert stored == 5 and b3.flush(30)
    assert xx.lookup(ns, tokens).num_blocks == 0  # not even by header from the shared folder
    xx_chain, stored = store_prompt(xx, ns, tokens)
    assert stored == 5 and xx.flush(30)
    assert not set(b3_chain.keys) & set(xx_chain.keys)
    for store, chain in ((b3, b3_chain), (xx, xx_chain)):
        hit = store.lookup(ns, tokens)
        assert hit.chain.keys == chain.keys
    fresh = {"blake3": store_factory(), "xxh3": store_factory(keys__hash="xxh3")}  # from disk: L1 is empty
    for name, chain in (("blake3", b3_chain), ("xxh3", xx_chain)):
        store = fresh[name]
        hit = store.lookup(ns, tokens)
        assert hit.chain.keys == chain.keys and set(hit.tiers) == {store.tier_bits["l2"]}
        n, _ = load_hit(store, hit)
        assert n == 5
    store = fresh["blake3"]
    assert store.wait_recovered(30)
    described = store.stats()["descriptors"]
    assert sorted(d["key_scheme"] for d in described.values()) == ["blake3", "xxh3"]
    assert described[ns.id]["key_scheme"] == "blake3"


def test_stores_under_two_secrets_on_one_unauthenticated_l2_folder_never_hit_each_others_blocks(
        store_factory, ns, tmp_path):
    """Scenario: tenants with their own secrets on one host's L2 (not MAC'ed: ``l2.authenticate``
    off): their keys differ, so neither finds the other's blocks, even by header from disk."""
    tokens = random_tokens("two secrets", 3 * BLOCK_SIZE)
    a = store_factory({"remote.auth_key_file": key_file(tmp_path, SECRET_A, "a.key")})
    b = store_factory({"remote.auth_key_file": key_file(tmp_path, SECRET_B, "b.key")})
    _, stored = store_prompt(a, ns, tokens)
    assert stored == 3 and a.flush(30)
    assert b.lookup(ns, tokens).num_blocks == 0
    again = store_factory({"remote.auth_key_file": key_file(tmp_path, SECRET_A, "a2.key")})
    assert again.lookup(ns, tokens).num_blocks == 3  # the same secret from another file: found


def test_an_xxh3_store_keeps_the_keys_and_namespace_of_caches_written_before_schemes(store_factory, ns):
    """Scenario: ``keys.hash: xxh3`` given a namespace built as the adapters build it (the default
    scheme): the store takes it as the xxh3 namespace, whose seed and keys are those of the
    namespace before schemes existed, so blocks stored then are found; and the adapter's seed
    still names it (``invalidate``, ``joined``), as its descriptor does for ``kvstrata stats``."""
    assert ns.key_scheme == DEFAULT_KEY_SCHEME
    store = store_factory(keys__hash="xxh3")
    legacy = dataclasses.replace(ns, key_scheme="xxh3")
    legacy_json = dataclasses.asdict(legacy)
    del legacy_json["key_scheme"]
    assert legacy.seed == xxhash.xxh3_128_digest(json.dumps(legacy_json, sort_keys=True,
                                                            separators=(",", ":")).encode())
    tokens = random_tokens("legacy", 2 * BLOCK_SIZE + 4)
    epoch, chain = store.chain(ns, tokens)
    assert epoch == store.current_epoch(legacy)
    assert chain == chain_keys(root_key(legacy.seed, epoch), tokens, BLOCK_SIZE)
    digests = [bytes([i]) * 32 for i in range(3)]
    assert store.page_chain(ns, epoch, digests) == rooted_digests(root_key(legacy.seed, epoch), digests, BLOCK_SIZE)
    store.describe(ns)
    assert store.save_now(ns, epoch, chain, payloads_for(chain)) == 3
    assert store.lookup(legacy, tokens).num_blocks == 3  # the same namespace, however it is named
    assert [d.key_scheme for d in store.descriptors().values()] == ["xxh3"]
    assert store.namespaces() == [legacy.seed]
    assert store.joined(ns.seed)
    assert store.invalidate(ns.seed) is not None  # the adapter's seed
    assert store.current_epoch(legacy) != epoch and store.lookup(ns, tokens).num_blocks == 0


def test_stats_name_each_namespaces_key_scheme(store_factory, ns):
    store = store_factory()
    store.describe(ns)
    data = store.stats()
    assert data["descriptors"][ns.id]["key_scheme"] == "blake3"
    console = Console(record=True, width=200)
    render(data, console)
    assert "keys       blake3" in console.export_text()


def test_a_descriptor_from_before_key_schemes_reads_as_xxh3_and_an_unknown_scheme_as_none():
    legacy = Namespace("vllm", "m", "v1", "bfloat16", "l", 16, key_scheme="xxh3")
    blob = json.loads(encode(legacy))
    del blob["namespace"]["key_scheme"]  # as kvstrata wrote it before schemes
    assert decode(json.dumps(blob).encode(), legacy.seed) == legacy
    blob["namespace"]["key_scheme"] = "sha1"
    assert decode(json.dumps(blob).encode(), legacy.seed) is None
    blake = dataclasses.replace(legacy, key_scheme="blake3")
    assert decode(encode(blake), blake.seed) == blake and decode(encode(blake), legacy.seed) is None


def test_a_bad_keys_hash_is_a_config_error_naming_file_key_and_value(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("keys:\n  hash: sha1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and "keys.hash" in str(e.value) and "sha1" in str(e.value)
    assert "blake3" in str(e.value) and "xxh3" in str(e.value)  # what it may be
    path.write_text("keys:\n  hash: xxh3\n")
    assert load_config(path).keys.hash == "xxh3"
