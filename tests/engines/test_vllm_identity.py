"""What changes a request's KV beyond its token ids, on real offline vLLM engines:
LoRA adapters by content and prompt embeddings by their rows.

Scenario (the holes found as a user would): an adapter name and id reused for other weights
(re-pointed at another folder, its files overwritten in place, a restart that numbers adapters
from 1 again) once loaded the old adapter's KV; mixed token + embedding prompts were keyed on their
placeholder ids, so other embeddings at the same positions loaded the first prompt's KV.

Each request is served after vLLM's own prefix cache is reset (``reset``, connector untouched), so
what it reuses comes from kvstrata alone, and its reference is the same engine's answer to the same
request under a fresh cache salt (nothing is stored under it: computed from its own inputs).
The keys themselves are checked against vLLM's hashing in tests/adapters/test_vllm_request_keys.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.launchers import BS, StepEngine, disk_config, ids, salt

pytestmark = pytest.mark.timeout(900)

PROMPT = ids(21, 400)  # 12 full blocks and a 16-token tail
MIXED = ids(22, 200)
AT = [40, 80]  # the embedding rows of the mixed prompts: blocks 1 and 2


def write_lora(folder: Path, seed: int) -> str:
    """A PEFT LoRA adapter (rank 8) of the tiny model on every layer's K and V projections, with
    weights drawn from ``seed``: it changes the KV, and its file size does not depend on the seed."""
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(4):
        for proj, out in (("k_proj", 128), ("v_proj", 128)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, 256, generator=gen) * 0.2
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.2
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"], "peft_type": "LORA",
        "base_model_name_or_path": "tiny", "bias": "none"}))
    return str(folder)


def served(engine: StepEngine, prompt: list[int], **step) -> tuple[dict, list[int]]:
    """``prompt`` served after vLLM's own prefix cache is reset (what it reuses is kvstrata's),
    and the reference: the same request under a fresh salt."""
    got, ref = engine.run([{"op": "reset", "connector": False}, {"op": "generate", "prompt": prompt, **step},
                           {"op": "generate", "prompt": prompt, **step, "salt": salt()}])[1:]
    return got, ref["tokens"]


def counters(engine: StepEngine) -> dict[str, int]:
    return engine.run([{"op": "counters"}])[0]


@pytest.fixture(scope="module")
def engine(model: str, tmp_path_factory: pytest.TempPathFactory):
    """One engine with LoRA and prompt embeddings on, a disk tier; its config, for a restart."""
    tmp = tmp_path_factory.mktemp("identity")
    cfg = disk_config(tmp)
    e = StepEngine(model, tmp, cfg, name="identity", lora=True, prompt_embeds=True)
    try:
        yield e, cfg, tmp
    finally:
        e.close()


def test_other_embeddings_at_the_same_positions_never_load_the_first_prompts_kv(engine):
    e, _, _ = engine
    first, first_ref = served(e, MIXED, embeds={"at": AT, "seed": 1})
    assert first["cached"] == 0 and first["tokens"] == first_ref
    other, other_ref = served(e, MIXED, embeds={"at": AT, "seed": 2})
    assert other_ref != first_ref  # the embeddings change the answer: a wrong hit would show
    # Block 0 holds the same rows in both (the ids' own embeddings): it may come from kvstrata;
    # nothing from the first embedding row on.
    assert other["cached"] <= AT[0] // BS * BS and other["tokens"] == other_ref
    # A plain prompt with 0 at those positions (what vLLM puts in all_token_ids there) shares nothing.
    zeros = [0 if AT[0] <= i < AT[1] else t for i, t in enumerate(MIXED)]
    plain, plain_ref = served(e, zeros)
    assert plain["cached"] == 0 and plain["tokens"] == plain_ref
    # And a mixed prompt after it takes nothing of it (block 0 again at most, from the first).
    third, third_ref = served(e, MIXED, embeds={"at": AT, "seed": 3})
    assert third["cached"] <= AT[0] // BS * BS and third["tokens"] == third_ref
    # The same embeddings again: everything but the last token comes from kvstrata.
    again, _ = served(e, MIXED, embeds={"at": AT, "seed": 1})
    assert again["cached"] == len(MIXED) - 1 and again["tokens"] == first_ref


def test_a_lora_name_and_id_reused_for_other_weights_never_load_the_old_adapters_kv(engine, model, tmp_path):
    e, cfg, tmp = engine
    a, b = write_lora(tmp_path / "a", 1), write_lora(tmp_path / "b", 2)
    first, ref_a = served(e, PROMPT, lora=["a", 1, a])
    assert first["cached"] == 0 and first["tokens"] == ref_a

    # Re-pointed: the same name and id now load adapter b (vLLM's load_inplace).
    repointed, ref_b = served(e, PROMPT, lora=["a", 1, b, None, True])
    assert ref_b != ref_a  # the adapters change the answer: a wrong hit would show
    assert repointed["cached"] == 0 and repointed["tokens"] == ref_b

    # a's files overwritten in place (same names and size) under the running engine: what vLLM
    # holds for id 1 is not known from the files any more, so kvstrata serves and stores nothing
    # for it until vLLM reloads the files ...
    write_lora(Path(a), 3)
    before = counters(e)
    stale, stale_ref = served(e, PROMPT, lora=["a", 1, a])
    after = counters(e)
    assert stale["cached"] == 0 and stale["tokens"] == stale_ref
    assert after.get("saved_blocks", 0) == before.get("saved_blocks", 0)
    # ... which load_inplace does: the new files are keyed anew, and the old adapter's KV is not served.
    reloaded, ref_c = served(e, PROMPT, lora=["a", 1, a, None, True])
    assert ref_c not in (ref_a, ref_b)
    assert reloaded["cached"] == 0 and reloaded["tokens"] == ref_c
    e.close()

    # A restart, numbering adapters from 1 again: a's current files load what was stored for them,
    # and b's, under another id, load b's; nothing of the old a.
    with StepEngine(model, tmp, cfg, name="identity-restart", lora=True) as restarted:
        now_a = restarted.run([{"op": "generate", "prompt": PROMPT, "lora": ["a", 1, a]}])[0]
        assert now_a["cached"] == len(PROMPT) - 1 and now_a["tokens"] == ref_c
        now_b, _ = served(restarted, PROMPT, lora=["a", 2, b])
        assert now_b["cached"] == len(PROMPT) - 1 and now_b["tokens"] == ref_b
