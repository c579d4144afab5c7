"""Content addressing: golden vectors, determinism across processes, namespace separation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.keys import Namespace, block_key, chain_keys, extra_digest, group_root, root_key

NS = Namespace("vllm", "tiny-llama", "v1", "bfloat16", "4x[2,128,128]", 16)


def test_golden_vectors_pin_the_key_function():
    """Scenario: any change to hashing, byte order or namespace encoding breaks stored caches."""
    assert NS.seed.hex() == "31c4ea70cffcf7c8f76bcd09ad74df50"
    chain = chain_keys(root_key(NS.seed, 0), np.arange(40), 16)
    assert [k.hex() for k in chain.keys] == [
        "6e3997c479d5d31d1eae8d1eb0b6ea3d",
        "1ed6a363aea63d56595e5abe5c3fa79e",
        "a56969c9068abce16e04aa1d46f4ae4e",
    ]
    assert chain.fps == [950064705329706438, 8047961313426143572, 11969863604200898538]
    assert chain.lengths == [16, 16, 8]
    assert extra_digest(["lora:7", "salt:a"]).hex() == "4067c37d9e3b2f9ae451e87f2590075c"
    with_extra = chain_keys(root_key(NS.seed, 3), np.arange(40), 16, extra_digest(["lora:7"]))
    assert with_extra.keys[0].hex() == "819b36f0c6d3139c47e25a4a7e64b401"


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
        "ns = Namespace('vllm', 'tiny-llama', 'v1', 'bfloat16', '4x[2,128,128]', 16); "
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
