"""Block copies between per-layer KV tensors and arena slots, for the layouts engines use."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.worker import copy as blockcopy
from kvstrata.worker.copy import BlockLayout, block_dim

NUM_BLOCKS = 12

LAYOUTS = {
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head]
    "vllm_cpu": (NUM_BLOCKS, 2, 16, 128),
    # FlashAttention: [2, num_blocks, block_size, kv_heads, head]
    "flash_attn": (2, NUM_BLOCKS, 16, 2, 64),
    # MLA: [num_blocks, block_size, latent]
    "mla": (NUM_BLOCKS, 16, 96),
}


def make_caches(shape, device="cpu", layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
            for i in range(layers)}


def block(kv: torch.Tensor, b: int) -> torch.Tensor:
    return kv.movedim(block_dim(tuple(kv.shape), NUM_BLOCKS), 0)[b]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# How a slot holds the layout: the whole row; one rank's region inside a wider row (TP, PP stages);
# the whole row, copied one block per chunk of GPU staging.
FRAMING = {"whole": (0, 0, None), "region": (64, 192, None), "chunked": (0, 0, 1)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("framing", list(FRAMING))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_save_then_load_moves_exactly_the_chosen_blocks(layout, framing, device, monkeypatch):
    base, extra, chunk_blocks = FRAMING[framing]
    src = make_caches(LAYOUTS[layout], device, seed=1)
    dst = make_caches(LAYOUTS[layout], device, seed=2)
    before = {k: v.clone() for k, v in dst.items()}
    save, load = BlockLayout(src, NUM_BLOCKS, base), BlockLayout(dst, NUM_BLOCKS, base)
    assert save.nbytes == load.nbytes and save.signature() == load.signature()
    if chunk_blocks:
        monkeypatch.setattr(blockcopy, "STAGING_BYTES", chunk_blocks * save.nbytes)
    arena = torch.zeros((8, save.nbytes + extra), dtype=torch.uint8)
    save.save([3, 7, 0], arena, [5, 1, 2])
    load.load([5, 1, 2], arena, [9, 4, 6])
    load.wait_all()
    for name in src:
        for s, d in ((3, 9), (7, 4), (0, 6)):
            assert torch.equal(block(src[name], s).cpu(), block(dst[name], d).cpu())
        untouched = [b for b in range(NUM_BLOCKS) if b not in (9, 4, 6)]
        for b in untouched:
            assert torch.equal(block(dst[name], b), block(before[name], b))
    assert not arena[[0, 3, 4, 6, 7]].any()  # other slots untouched
    outside = torch.cat([arena[:, :base], arena[:, base + save.nbytes:]], dim=1)
    assert not outside.any()  # other ranks' regions of the slots untouched


def test_arena_slot_is_layers_concatenated_in_order():
    src = make_caches(LAYOUTS["vllm_cpu"], layers=2)
    layout = BlockLayout(src, NUM_BLOCKS)
    arena = torch.zeros((2, layout.nbytes), dtype=torch.uint8)
    layout.save([4], arena, [1])
    names = list(src)
    expected = torch.cat([src[n][4].reshape(-1).view(torch.uint8) for n in names])
    assert torch.equal(arena[1], expected)


def test_block_dim_errors_name_the_shape():
    with pytest.raises(ValueError, match=r"num_blocks=5.*\(2, 3\)"):
        block_dim((2, 3), 5)


def test_bench_copy_measures_both_sides_beside_the_bound(capsys):
    """``kvstrata bench copy`` (CPU here; the same command measures CUDA where there is a GPU)."""
    from kvstrata.cli.main import main

    assert main(["bench", "copy", "--device", "cpu", "--layers", "2", "--blocks", "16", "--hit", "4",
                 "--rounds", "2", "--layout", "flash_attn", "--layout", "mla", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in report["layouts"]] == ["flash_attn", "mla"]
    for r in report["layouts"]:
        assert r["hit_bytes"] == 4 * r["block_bytes"] > 0
        for key in ("save_over_bound", "load_over_bound", "per_block_over_save", "per_block_over_load",
                    "load_return_ms"):
            assert r[key] > 0


def test_runs_of_consecutive_slots_are_cut_at_the_limit():
    assert list(blockcopy._runs([5, 1, 2, 3, 9])) == [(0, 1), (1, 4), (4, 5)]
    assert list(blockcopy._runs([5, 1, 2, 3, 9], limit=2)) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert list(blockcopy._runs([])) == []
