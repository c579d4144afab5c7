"""kvstrata's reading of vLLM's KV cache groups (adapters/vllm/groups.py), on vLLM's own spec
classes: no engine starts. The layouts are those the hybrid presets of examples/make_tiny_model.py
get from vLLM 0.32's CPU build (docs/plans/hybrid-hma.md, "Measured here")."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec)

from kvstrata.adapters.vllm.groups import NULL_BLOCK, destinations, group_layouts, kind_of, real_positions  # noqa: E402
from kvstrata.config import ConfigError  # noqa: E402


def full(bs: int = 128) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32)


def window(bs: int = 128, w: int = 256, **kw) -> SlidingWindowSpec:  # noqa: ANN003
    return SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=w, **kw)


def mamba(mode: str = "align", bs: int = 256) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((3, 256), (4, 64, 64)), dtypes=(torch.bfloat16, torch.bfloat16),
                     page_size_padded=131072, mamba_cache_mode=mode)


def config(*specs, eagle: int | None = None, hash_block: int | None = None) -> KVCacheConfig:  # noqa: ANN002
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], s, is_eagle_group=(i == eagle)) for i, s in enumerate(specs)]
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    if hash_block is not None:
        cfg.hash_block_size = hash_block
    return cfg


def test_gemma3_shape_is_three_windows_and_one_full_group():
    layouts = group_layouts(config(window(), window(), window(), full(), hash_block=128))
    assert [(g.kind, g.window_tokens, g.block_size) for g in layouts] == [("window", 256, 128)] * 3 + [("full", 0, 128)]
    assert [g.page_bytes for g in layouts] == [131072] * 4
    assert len({g.tag for g in layouts}) == 4  # each group its own key chain


def test_qwen3_next_shape_states_are_stored_without_vllms_padding():
    layouts = group_layouts(config(mamba(), mamba(), mamba(), full(256), hash_block=256))
    assert [g.kind for g in layouts] == ["state"] * 3 + ["full"]
    # conv (3 x 256) and SSM (4 x 64 x 64) states in bf16, not the 131,072 bytes vLLM pads the page to
    assert layouts[0].page_bytes == (3 * 256 + 4 * 64 * 64) * 2


def test_tags_are_the_same_in_every_process_and_differ_by_layout():
    a = group_layouts(config(window(), full()))
    assert [g.tag for g in a] == [g.tag for g in group_layouts(config(window(), full()))]
    assert a[0].tag != group_layouts(config(window(w=512), full()))[0].tag  # another window
    assert a[0].tag != group_layouts(config(full(), full()))[0].tag  # another kind at that index
    # A tag names its own group only; the namespace is what covers the model's whole layout.


def test_mla_is_full_attention():
    assert kind_of(MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.float32)) == ("full", 0)


@pytest.mark.parametrize("specs, kw, words", [
    ((mamba("none"), full(256)), {}, "--enable-prefix-caching"),
    ((window(), full(), full()), {"eagle": 2}, "EAGLE/MTP"),
    ((window(bs=64), full(128)), {}, "different block sizes"),
    ((full(128),), {"hash_block": 64}, "different block sizes"),
    ((window(extra_retained_tokens=3), full()), {}, "retain extra tokens"),
    ((ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                attention_chunk_size=256),), {}, "ChunkedLocalAttentionSpec"),
])
def test_what_kvstrata_cannot_serve_right_is_refused_saying_why(specs, kw, words):
    with pytest.raises(ConfigError, match=words):
        group_layouts(config(*specs, **kw))


def test_saves_skip_the_null_block():
    table = [NULL_BLOCK, NULL_BLOCK, 7, 9, NULL_BLOCK, 11]  # a window's table: nothing kept before it
    assert real_positions(table, 0, 6).tolist() == [2, 3, 5]
    assert real_positions(table, 3, 5).tolist() == [3]
    assert real_positions(table, 4, 9).tolist() == [5]  # past the table: nothing


def test_a_load_into_a_null_or_missing_block_fails_closed():
    table = [NULL_BLOCK, 5, 6, 7]
    assert destinations(table, [1, 3]) == [5, 7]
    assert destinations(table, []) == []
    assert destinations(table, [0, 1]) is None  # vLLM keeps nothing there: the plan disagrees
    assert destinations(table, [3, 4]) is None  # past what vLLM allocated
