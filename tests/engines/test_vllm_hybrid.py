"""Hybrid models on the real vLLM engine with kvstrata (issue 28): vLLM's hybrid KV cache manager
stays on, and a prefix hit resumes every KV cache group at one block boundary.

Two presets of examples/make_tiny_model.py: ``hybrid-swa`` (Gemma 3 text: three sliding-window
layers of 256 tokens and one full-attention layer, fp32) and ``hybrid-ssm`` (Qwen3-Next: three
gated-delta-net layers, whose state is an SSM's, and one full-attention layer, bf16, the only dtype
vLLM's CPU kernel takes). Each runs a prompt cold, again after vLLM's own prefix cache is reset
(kvstrata's CPU tier), and in a fresh engine on the same disk tier; every output equals vLLM alone.
Without HMA (kvstrata before issue 28) the first ran with a quarter of its KV capacity and the
second could not start.
"""

from __future__ import annotations

import pytest

from engines.conftest import StepEngine, delta, disk_config, gen, ids, salt, tiny_model

pytest.importorskip("vllm")

# Per preset: a baseline engine and two kvstrata engines, one after the other, on 2 shared cores.
pytestmark = pytest.mark.timeout(900)

PROMPT = ids(21, 1600)
PRESETS = {  # preset -> (engine dtype, block size asked for, the groups vLLM makes)
    "hybrid-swa": ("float32", 128, ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]),
    "hybrid-ssm": ("bfloat16", 128, ["MambaSpec"] * 3 + ["FullAttentionSpec"]),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hybrid_model_keeps_hma_and_is_served_from_every_tier_with_vllms_outputs(preset, baseline, tmp_path):
    dtype, block_size, kinds = PRESETS[preset]
    model = tiny_model(preset)
    alone = baseline.engine(model, dtype, block_size).run([{"op": "kv_groups"}])[0]
    want = baseline(PROMPT, model=model, dtype=dtype, block_size=block_size)  # and closes that engine
    cfg = disk_config(tmp_path)
    with StepEngine(model, tmp_path, cfg, name=f"{preset}-a", dtype=dtype, block_size=block_size) as a:
        groups, cold, _, l1, other, counters = a.run([
            {"op": "kv_groups"}, gen(PROMPT), {"op": "reset"}, gen(PROMPT), gen(PROMPT, salt=salt()),
            {"op": "counters"}])
        log = a.tail(10**7)
    assert [g[0] for g in groups["groups"]] == kinds  # HMA on: one group per layer kind, not one for all
    assert groups == alone  # the same groups, block size and KV capacity as vLLM alone
    assert "Turning off hybrid kv cache manager" not in log
    bs = groups["groups"][0][1]
    assert {g[1] for g in groups["groups"]} == {bs}
    assert cold["cached"] == 0 and cold["tokens"] == want
    # Every group resumes at the last block boundary before the prompt's last token.
    assert l1["cached"] == (len(PROMPT) - 1) // bs * bs >= 0.9 * len(PROMPT), (l1["cached"], bs)
    assert l1["tokens"] == want
    assert other["cached"] == 0 and other["tokens"] == want  # another salt: nothing of the first
    assert counters["saved_blocks"] > 0 and counters.get("hit_blocks_l1", 0) > 0

    with StepEngine(model, tmp_path, cfg, name=f"{preset}-b", dtype=dtype, block_size=block_size) as b:
        before = b.counters()
        fresh, after = b.run([gen(PROMPT), {"op": "counters"}])
    assert fresh["cached"] == l1["cached"] and fresh["tokens"] == want  # from the disk tier, all groups
    assert delta(after, before).get("hit_blocks_l2", 0) > 0
