"""The vLLM adapter's namespace (adapters/vllm/namespace.py) at several tensor-parallel degrees, on
vLLM's own KV cache spec classes: no engine starts.

An MLA model's latent is the same on every rank and stored once, so TP=1 and TP=2 instances of it
share one namespace; any other model's blocks hold every rank's shard, and its namespace names the
TP degree, byte for byte as before MLA was told apart (pinned seeds: stores written then stay
valid). The engines sharing an MLA model's blocks across TP degrees:
tests/engines/test_vllm_mla.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import make_config

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        MLAAttentionSpec)

from kvstrata.adapters.vllm import namespace  # noqa: E402

# The model's KV cache spec as vLLM's CPU build makes it for the presets of
# examples/make_tiny_model.py: mla (latent 512 + rope 64, one "head") and a Llama-like dense model.
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
DENSE = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
# Seeds of DENSE's namespace at TP=1 and TP=2 (device layout fixed below), computed by the adapter
# before MLA was told apart.
DENSE_SEEDS = {1: "8e7b8d7c28185013adad8d0d82d2132e", 2: "28bc5a9cd4b3552cae6a5799015b776d"}


@pytest.fixture(autouse=True)
def fixed_device(monkeypatch):
    """Seeds independent of this machine's CPU ISA (a part of the real layout)."""
    monkeypatch.setattr(namespace, "_device_layout", lambda vllm_config: "cpu:X86:amx=0:avx512=1")


def vllm_config(tp: int) -> SimpleNamespace:
    """What ``namespace_for`` reads of a ``VllmConfig``."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/models/m", revision=None, dtype=torch.float32),
        load_config=SimpleNamespace(download_dir=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def kv_cache_config(spec, replicas: int) -> KVCacheConfig:  # noqa: ANN001
    """Four layers of ``spec``; ``replicas``: vLLM's ``kv_tp_replicas`` (consecutive TP ranks that
    hold identical KV: the TP degree for MLA, 1 when the latent is sharded, e.g. by DCP)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    cfg.kv_tp_replicas = replicas
    return cfg


def ns_of(spec, tp: int, replicas: int, tmp_path):  # noqa: ANN001, ANN201
    cfg = make_config(tmp_path, namespace__model_version="v1")
    return namespace.namespace_for(vllm_config(tp), kv_cache_config(spec, replicas), cfg)


def test_mla_namespace_is_the_same_at_tp1_and_tp2(tmp_path):
    one, two = ns_of(MLA, 1, 1, tmp_path), ns_of(MLA, 2, 2, tmp_path)
    assert one == two and one.seed == two.seed
    assert two.world_size == 1 and two.layout.endswith(";mla")
    assert namespace.latent_shared(vllm_config(2), kv_cache_config(MLA, 2))


def test_other_models_namespace_names_the_tp_degree_as_before(tmp_path):
    one, two = ns_of(DENSE, 1, 1, tmp_path), ns_of(DENSE, 2, 1, tmp_path)
    assert one.seed != two.seed and (one.world_size, two.world_size) == (1, 2)
    assert (one.seed.hex(), two.seed.hex()) == (DENSE_SEEDS[1], DENSE_SEEDS[2])
    # KV heads replicated across ranks (fewer KV heads than ranks) is not MLA: still one shard per rank.
    assert ns_of(DENSE, 2, 2, tmp_path).seed.hex() == DENSE_SEEDS[2]
    assert not namespace.latent_shared(vllm_config(2), kv_cache_config(DENSE, 2))


def test_an_mla_latent_sharded_across_ranks_keeps_one_region_per_rank(tmp_path):
    """Scenario: decode context parallelism splits an MLA model's tokens across its TP ranks, so
    vLLM finds no replicas (``kv_tp_replicas`` 1): the ranks' blocks differ, each is stored."""
    sharded = ns_of(MLA, 2, 1, tmp_path)
    assert sharded.world_size == 2 and "mla" not in sharded.layout
    assert sharded.seed != ns_of(MLA, 1, 1, tmp_path).seed
    assert not namespace.latent_shared(vllm_config(2), kv_cache_config(MLA, 1))


def with_speculation(method: str, draft: str) -> SimpleNamespace:
    config = vllm_config(1)
    config.speculative_config = SimpleNamespace(method=method, draft_model_config=SimpleNamespace(model=draft,
                                                                                                  revision=None))
    return config


def test_a_draft_with_kv_is_part_of_the_namespace_and_ngram_is_not(tmp_path):
    """Scenario: EAGLE's head is one more attention layer in the target's KV cache group, so its KV
    is in every stored block: engines with different heads (same shapes) must not exchange blocks,
    while n-gram speculation keeps no KV and shares the blocks of an engine without speculation."""
    drafts = []
    for name in ("head-a", "head-b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(name.encode() * 1000)
        drafts.append(str(folder))
    cfg = make_config(tmp_path, namespace__model_version="v1")
    kv = kv_cache_config(DENSE, 1)
    seed = {key: namespace.namespace_for(config, kv, cfg).seed.hex() for key, config in {
        "alone": vllm_config(1), "ngram": with_speculation("ngram", "/models/m"),
        "a": with_speculation("eagle", drafts[0]), "a again": with_speculation("eagle", drafts[0]),
        "b": with_speculation("eagle", drafts[1]), "a as eagle3": with_speculation("eagle3", drafts[0])}.items()}
    assert seed["alone"] == seed["ngram"] == DENSE_SEEDS[1]
    assert seed["a"] == seed["a again"]
    assert len({seed["alone"], seed["a"], seed["b"], seed["a as eagle3"]}) == 4
