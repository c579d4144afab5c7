"""Content addressing: golden vectors of both key schemes, determinism across processes (and
secrets), namespace separation, the blake3 scheme's construction."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.keys import (DEFAULT_KEY_SCHEME, SCHEMES, Namespace, block_key, chain_keys, extra_digest, group_root,
                           key_scheme, root_key)

# The module functions (root_key, chain_keys, ...) are the xxh3 scheme's, and NS an xxh3 namespace:
# the vectors below are the keys kvstrata wrote before key schemes, kept under ``keys.hash: xxh3``.
NS = Namespace("vllm", "tiny-llama", "v1", "bfloat16", "4x[2,128,128]", 16, key_scheme="xxh3")
NS_B3 = dataclasses.replace(NS, key_scheme="blake3")
SECRET = b"kvstrata-golden-secret-0123456789abcdef"


def test_golden_vectors_pin_the_key_function():
    """Scenario: any change to hashing, byte order or namespace encoding breaks stored caches."""
    assert NS.seed.hex() == "31c4ea70cffcf7c8f76bcd09ad74df50"  # as before schemes: the field is left out
    chain = chain_keys(root_key(NS.seed, 0), np.arange(40), 16)
    assert [k.hex() for k in chain.keys] == [
        "6e3997c479d5d31d1eae8d1eb0b6ea3d",
        "1ed6a363aea63d56595e5abe5c3fa79e",
        "a56969c9068abce16e04aa1d46f4ae4e",
    ]
    assert chain.fps == [950064705329706438, 8047961313426143572, 11969863604200898538]
    assert chain.lengths == [16, 16, 8]
    assert extra_digest(["lora:7", "salt:a"]).hex() == "80fa3df83a8b84c30e73a4872d522e22"
    with_extra = chain_keys(root_key(NS.seed, 3), np.arange(40), 16, extra_digest(["lora:7"]))
    assert with_extra.keys[0].hex() == "af57cfebf8b4f09bea4aa4f09320b137"


def test_golden_vectors_pin_the_group_roots():
    """Scenario: a hybrid model's groups each chain under ``group_root(root, tag)``; changing how
    the root and the tag are combined would orphan every stored group block."""
    root = root_key(NS.seed, 0)
    assert group_root(root, b"g0:Full").hex() == "ea9d29115e03cf3f75851cf083c8b42f"
    swa = group_root(root, b"g1:SWA(256)")
    assert swa.hex() == "d99896ef79d799a55631cb2acf7fb7e6"
    chain = chain_keys(swa, np.arange(40), 16, partial=False)
    assert [k.hex() for k in chain.keys] == ["7b76870dac0ac655b292a303646ec97c", "0987a64bc263cf1466bc59dcbc97cfbc"]
    assert chain.fps == [2295852528726080954, 220745246427166888]
    assert chain.parents[0] == swa


def test_group_chains_share_no_key_with_each_other_or_the_plain_chain():
    tokens = np.arange(64)
    root = root_key(NS.seed, 0)
    plain = set(chain_keys(root, tokens, 16).keys)
    full = set(chain_keys(group_root(root, b"g0"), tokens, 16).keys)
    swa = set(chain_keys(group_root(root, b"g1"), tokens, 16).keys)
    other_epoch = set(chain_keys(group_root(root_key(NS.seed, 1), b"g0"), tokens, 16).keys)
    assert len(plain | full | swa | other_epoch) == 4 * 4


def test_keys_are_identical_in_another_process_with_another_hash_seed():
    code = (
        "import numpy as np; from kvstrata.keys import *; "
        "ns = Namespace('vllm', 'tiny-llama', 'v1', 'bfloat16', '4x[2,128,128]', 16, key_scheme='xxh3'); "
        "print(','.join(k.hex() for k in chain_keys(root_key(ns.seed, 0), np.arange(40), 16).keys))"
    )
    expected = ",".join(k.hex() for k in chain_keys(root_key(NS.seed, 0), np.arange(40), 16).keys)
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert out.stdout.strip() == expected


@pytest.mark.parametrize("field,value", [
    ("engine", "sglang"), ("model", "other"), ("model_version", "v2"), ("kv_dtype", "float16"),
    ("layout", "4x[2,128,64]"), ("block_size", 32), ("rank", 1), ("world_size", 2),
    ("tenant", "acme"), ("format_version", 2),
])
def test_every_namespace_field_changes_the_seed(field, value):
    other = dataclasses.replace(NS, **{field: value})
    assert other.seed != NS.seed


def test_epoch_and_extra_keys_change_every_key():
    tokens = np.arange(32)
    base = chain_keys(root_key(NS.seed, 0), tokens, 16).keys
    assert not set(base) & set(chain_keys(root_key(NS.seed, 1), tokens, 16).keys)
    assert not set(base) & set(chain_keys(root_key(NS.seed, 0), tokens, 16, extra_digest(["salt"])).keys)


def test_partial_block_has_its_own_identity_and_full_blocks_ignore_it():
    tokens = np.arange(40)
    with_tail = chain_keys(root_key(NS.seed, 0), tokens, 16)
    without = chain_keys(root_key(NS.seed, 0), tokens, 16, partial=False)
    assert without.keys == with_tail.keys[:2]
    key8, fp8 = block_key(with_tail.keys[1], tokens[32:40])
    assert (key8, fp8) == (with_tail.keys[2], with_tail.fps[2])
    key7, _ = block_key(with_tail.keys[1], tokens[32:39])
    assert key7 != key8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=80), st.integers(1, 80))
def test_chain_prefix_property(tokens, cut):
    """Keys of a prefix's full blocks are exactly the first keys of the whole prompt's chain."""
    root = root_key(NS.seed, 0)
    whole = chain_keys(root, np.array(tokens, dtype=np.uint64), 16)
    head = chain_keys(root, np.array(tokens[:cut], dtype=np.uint64), 16, partial=False)
    assert whole.keys[: len(head.keys)] == head.keys
    assert whole.parents[0] == root
    assert whole.parents[1:] == whole.keys[:-1]
    assert sum(whole.lengths) == len(tokens)


def test_chain_digests_chains_external_page_keys():
    from kvstrata.keys import chain_digests

    root = root_key(NS.seed, 0)
    digests = [bytes([i]) * 32 for i in range(4)]
    chain = chain_digests(root, digests, 16)
    assert chain.parents == [root, *chain.keys[:-1]]
    assert chain_digests(root, digests[:2], 16).keys == chain.keys[:2]
    other = chain_digests(root, [digests[0], b"x" * 32, *digests[2:]], 16)
    assert other.keys[0] == chain.keys[0] and not set(other.keys[1:]) & set(chain.keys)


# ------------------------------------------------------------------ the blake3 scheme
@pytest.mark.parametrize("secret,vectors", [
    (None, {
        "root": "347ba95432cd05050ad1c69616ba0095",
        "keys": ["2058ada2bc24dfa4371d63ecee98a5d9", "13434f9be8df2d2d5a957e31e4ca82ba",
                 "463c3d4339af29e40798bd88a7412398"],
        "fps": [12166210574311057556, 9539463414595388638, 9075834864966873315],
        "extra": "676984e361383e815f1148d87b9e6aab",
        "group": "17b6473281e3e19605642a8983c526b8",
        "swa": "c9cf0aac54a5375c33f7bb149c90e3dd",
        "swa_keys": ["f0f04fc3d66fc8b604512e6447dc1f17", "462491a3e0d9c79137a06620daac8513"],
        "swa_fps": [14135775904622266368, 1608211840696907096],
        "pages": ["24308c3c0d31e1d5879c7045e6a02201", "daada88f3389a24faa1f5b9710a430c5"],
        "page_fps": [4544899024323593351, 15642898146192106873],
    }),
    (SECRET, {
        "root": "7df5711cf9644798011bb681e24b8b02",
        "keys": ["3c8ae85d3dc394953b87a7d475ba08bf", "a73e2e9eaf64a9639a2a1f91f9fbd114",
                 "e2de24b4e542113173fc26e90ec3807b"],
        "fps": [15960394586678083504, 11038983330897540711, 15082213260520944662],
        "extra": "2851d2d9b4bffad404a35359f170241f",
        "group": "3520f19fe822fdd3d84de42d6a3bd7cd",
        "swa": "76f2d8b1ac9196f7e2d2bd92332e418f",
        "swa_keys": ["bc1601ffb52fbb58cc7aa6d5e0a8f5e1", "6874c587790ee9adc8558b850f3dbaf5"],
        "swa_fps": [4335671792940690913, 7664404749676805511],
        "pages": ["08e8471471955675f78b2b040414ee1c", "32a2c22914b64f63ae2c84a2b1409451"],
        "page_fps": [1712793351444960773, 9973702177282722018],
    }),
], ids=["unkeyed", "keyed"])
def test_golden_vectors_pin_the_blake3_scheme(secret, vectors):
    """Scenario: the default scheme's keys (namespace seed, block -1, token blocks, extra
    digests, group roots and chains, SGLang's rooted pages), unkeyed and under a secret: any
    change orphans every block stored under it."""
    assert NS_B3.seed.hex() == "12b36ac93fc680d56478e0cdccfbfc9f"  # unkeyed: the namespace's public name
    keys = key_scheme("blake3", secret)
    root = keys.root_key(NS_B3.seed, 0)
    assert root.hex() == vectors["root"]
    chain = keys.chain_keys(root, np.arange(40), 16)
    assert [k.hex() for k in chain.keys] == vectors["keys"]
    assert chain.fps == vectors["fps"] and chain.lengths == [16, 16, 8]
    with_extra = keys.chain_keys(keys.root_key(NS_B3.seed, 3), np.arange(40), 16, extra_digest(["lora:7"]))
    assert with_extra.keys[0].hex() == vectors["extra"]
    assert keys.group_root(root, b"g0:Full").hex() == vectors["group"]
    swa = keys.group_root(root, b"g1:SWA(256)")
    assert swa.hex() == vectors["swa"]
    group = keys.chain_keys(swa, np.arange(40), 16, partial=False)
    assert [k.hex() for k in group.keys] == vectors["swa_keys"] and group.fps == vectors["swa_fps"]
    pages = keys.rooted_digests(root, [bytes([i]) * 32 for i in range(2)], 16)
    assert [k.hex() for k in pages.keys] == vectors["pages"] and pages.fps == vectors["page_fps"]
    assert pages.parents == [root, root]


def test_blake3_keys_are_one_keyed_call_per_block_split_into_key_and_fingerprint():
    """Scenario: the construction the docs state, rebuilt from the blake3 package alone: the key
    derived from the secret, a second key for roots, and block i's 24 output bytes as its key and
    its little-endian fingerprint, over (key of block i-1, token ids, extra digest)."""
    import blake3

    master = blake3.blake3(SECRET, derive_key_context="kvstrata 2026-12 block keys v1").digest()
    blocks_key = blake3.blake3(b"blocks", key=master).digest()
    roots_key = blake3.blake3(b"roots", key=master).digest()
    root = blake3.blake3(b"epoch:" + NS_B3.seed + (5).to_bytes(8, "little"), key=roots_key).digest(16)
    keys = key_scheme("blake3", SECRET)
    assert keys.root_key(NS_B3.seed, 5) == root
    tokens = np.arange(100, 116, dtype=np.uint32)
    out = blake3.blake3(root + tokens.astype("<u4").tobytes() + extra_digest(["salt:x"]), key=blocks_key).digest(24)
    chain = keys.chain_keys(root, tokens, 16, extra_digest(["salt:x"]))
    assert chain.keys == [out[:16]] and chain.fps == [int.from_bytes(out[16:], "little")]
    assert keys.block_key(root, tokens, extra_digest(["salt:x"])) == (out[:16], chain.fps[0])
    assert keys.group_root(root, b"g0") == blake3.blake3(b"group:" + root + b"g0", key=roots_key).digest(16)
    seed = blake3.blake3(json.dumps({**dataclasses.asdict(NS_B3)}, sort_keys=True, separators=(",", ":")).encode(),
                         derive_key_context="kvstrata 2026-12 namespace seed v1").digest(16)
    assert NS_B3.seed == seed


def test_keyed_blake3_keys_differ_under_another_secret_and_without_one():
    tokens = np.arange(64)
    chains = [key_scheme("blake3", s).chain_keys(key_scheme("blake3", s).root_key(NS_B3.seed, 0), tokens, 16)
              for s in (None, SECRET, SECRET[:-1] + b"g")]
    assert len({k for c in chains for k in c.keys}) == 3 * 4
    assert len({f for c in chains for f in c.fps}) == 3 * 4
    assert [key_scheme("blake3", s).keyed for s in (None, SECRET)] == [False, True]
    assert not key_scheme("xxh3", SECRET).keyed  # xxh3 ignores it: its keys stay those of old caches
    assert key_scheme("xxh3", SECRET).chain_keys(root_key(NS.seed, 0), tokens, 16) == chain_keys(
        root_key(NS.seed, 0), tokens, 16)


def test_keyed_blake3_keys_are_identical_in_another_process_with_the_same_secret():
    code = (
        "import sys, numpy as np; from kvstrata.keys import *; "
        "ns = Namespace('vllm', 'tiny-llama', 'v1', 'bfloat16', '4x[2,128,128]', 16); "
        "k = key_scheme('blake3', sys.argv[1].encode()); "
        "c = k.chain_keys(k.group_root(k.root_key(ns.seed, 2), b'g1'), np.arange(40), 16); "
        "print(ns.seed.hex(), ','.join(x.hex() for x in c.keys), c.fps)"
    )
    keys = key_scheme("blake3", SECRET)
    c = keys.chain_keys(keys.group_root(keys.root_key(NS_B3.seed, 2), b"g1"), np.arange(40), 16)
    expected = f"{NS_B3.seed.hex()} {','.join(x.hex() for x in c.keys)} {c.fps}"
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code, SECRET.decode()], capture_output=True, text=True,
                             check=True, env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert out.stdout.strip() == expected


def test_the_scheme_names_the_namespace_and_two_schemes_never_share_one():
    """Scenario: the key scheme is a namespace field: the default is the config's default, every
    scheme gives the same namespace another seed, and an unknown scheme is refused."""
    from typing import get_args

    from kvstrata.config import KeysConfig, StrataConfig

    assert set(get_args(KeysConfig.model_fields["hash"].annotation)) == set(SCHEMES)  # one registry
    assert Namespace("e", "m", "v", "d", "l", 16).key_scheme == DEFAULT_KEY_SCHEME == StrataConfig().keys.hash
    seeds = {dataclasses.replace(NS, key_scheme=name).seed for name in SCHEMES}
    assert len(seeds) == len(SCHEMES)
    with pytest.raises(ValueError, match="md5"):
        Namespace("e", "m", "v", "d", "l", 16, key_scheme="md5")
    with pytest.raises(ValueError, match="md5"):
        key_scheme("md5")


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_scheme_keeps_the_chain_properties(name):
    """The prefix property, partial tails apart from full blocks, extra digests and epochs
    changing every key, and ``block_key`` agreeing with the chain, for each scheme."""
    keys = key_scheme(name, SECRET)
    root = keys.root_key(NS_B3.seed, 0)
    tokens = np.arange(40)
    whole = keys.chain_keys(root, tokens, 16)
    assert keys.chain_keys(root, tokens[:32], 16, partial=False).keys == whole.keys[:2]
    assert whole.parents == [root, *whole.keys[:-1]]
    assert keys.block_key(whole.keys[1], tokens[32:40]) == (whole.keys[2], whole.fps[2])
    assert keys.block_key(whole.keys[1], tokens[32:39])[0] != whole.keys[2]
    assert not set(whole.keys) & set(keys.chain_keys(keys.root_key(NS_B3.seed, 1), tokens, 16).keys)
    assert not set(whole.keys) & set(keys.chain_keys(root, tokens, 16, extra_digest(["salt"])).keys)
    digests = [bytes([i]) * 32 for i in range(3)]
    chained = keys.chain_digests(root, digests, 16)
    assert chained.parents == [root, *chained.keys[:-1]] and keys.chain_digests(root, digests[:2], 16).keys == \
        chained.keys[:2]
    assert keys.rooted_digests(root, digests[1:], 16).keys == keys.rooted_digests(root, digests, 16).keys[1:]
