"""Verified hits on the real vLLM engine (``verify.sample_rate: 1.0``): every request that would
hit computes its prefix instead, and the blocks it computes are compared with the stored ones.

One engine (the tiny dense model, in-process EngineCore, L1 and L2), in order:

1. honest traffic: 104 prompts stored, vLLM's own prefix cache reset, the prompts again in the
   other order (other batches and steps): 104 verified requests (208 blocks), none mismatched;
2. a planted block: another prompt's KV written through the store API under a victim's keys
   (valid checksums): the victim's request is answered as vLLM alone answers, every planted block
   is counted as a mismatch and deleted, and the next verification of the victim is clean;
3. a planted partial tail: another prompt's tail KV under the victim's tail key (its full blocks
   honest): the verified request compares the tail over its tokens, catches and deletes it, and a
   lookup of the victim (what the next engine would load) finds its full blocks only;
4. an identity hole: the weights change in the running engine (``reload_weights``, as an RL
   weight sync does) without the connector's reset (``reset_prefix_cache(reset_connector=False)``):
   the namespace is unchanged, so kvstrata holds old-weights KV under live keys. The verified
   request is answered as the new weights answer, the stale blocks are caught and deleted.

With the default ``sample_rate`` (0.001) these engines would serve the wrong blocks of 2 to 4:
the point is that the first one sampled is caught (the figures are in docs/consistency.md).
"""

from __future__ import annotations

import pytest

from engines.launchers import BS, StepEngine, delta, disk_config, gen, ids, salt, tiny_model

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

HONEST = [ids(700 + i, 2 * BS + 7) for i in range(104)]  # 104 prompts of 2 full blocks and a tail
DONOR, VICTIM = ids(920, 6 * BS), ids(921, 6 * BS + 3)  # seeds apart from HONEST's: no shared prefix
STALE = ids(922, 8 * BS)
TAIL = BS - 5  # a planted partial tail: 27 of 32 tokens
DONOR_T, VICTIM_T = ids(923, 2 * BS + TAIL), ids(924, 2 * BS + TAIL)
VICTIM_PREFIX = VICTIM_T[: 2 * BS] + ids(925, 9)  # stores the victim's full blocks (honest), not its tail


def plant_tail_steps() -> list[dict]:
    """The victim's full blocks computed and stored honestly, the donor (with its tail) too, the
    donor's tail planted under the victim's tail key, vLLM's own cache reset."""
    return [gen(VICTIM_PREFIX), gen(DONOR_T), {"op": "plant", "donor": DONOR_T, "victim": VICTIM_T, "tail": True},
            {"op": "sleep", "s": 1.0}, {"op": "reset", "connector": False}]


def mismatches(c: dict) -> int:
    return sum(v for k, v in c.items() if k.startswith("verify_mismatches_"))


def checks(c: dict) -> int:
    return sum(v for k, v in c.items() if k.startswith("verify_checks_"))


def test_verified_hits_pass_honest_blocks_and_catch_planted_and_stale_ones(model, tmp_path, baseline):
    cfg = disk_config(tmp_path, verify="{sample_rate: 1.0}")
    cfg.write_text(cfg.read_text().replace("128MiB", "512MiB"))  # the honest prompts evict nothing
    with StepEngine(model, tmp_path, cfg, name="verify") as engine:
        # 1. honest traffic
        (first,) = engine.run([{"op": "generate", "prompts": HONEST, "max_tokens": 4}])
        engine.run([{"op": "sleep", "s": 1.0}, {"op": "reset", "connector": False}])
        (before,) = engine.run([{"op": "counters"}])
        # in the other order: other batches, other steps than when they were stored
        (again,) = engine.run([{"op": "generate", "prompts": HONEST[::-1], "max_tokens": 4}])
        (after,) = engine.run([{"op": "counters"}])
        d = delta(after, before)
        assert checks(d) == 3 * len(HONEST), d  # every block and tail of every prompt, computed by the engine again
        assert mismatches(d) == 0, d
        assert again["cached"] == [0] * len(HONEST)  # a verified request loads nothing
        assert len(first["tokens"]) == len(HONEST)

        # 2. a planted block
        engine.run([gen(DONOR)])
        (planted,) = engine.run([{"op": "plant", "donor": DONOR, "victim": VICTIM}])
        assert planted["planted"] == 6
        (before,) = engine.run([{"op": "counters"}])
        (victim,) = engine.run([gen(VICTIM)])
        (after,) = engine.run([{"op": "counters"}])
        d = delta(after, before)
        assert victim["tokens"] == baseline(VICTIM) and victim["cached"] == 0
        assert mismatches(d) == 6 and checks(d) == 6, d
        assert d.get("verify_deleted_blocks") == 6, d
        # the victim's blocks as the engine computed them are stored now (its next request, after
        # vLLM's cache was reset, hits them): verified again, clean
        engine.run([gen(VICTIM), {"op": "sleep", "s": 1.0}, {"op": "reset", "connector": False}])
        (before,) = engine.run([{"op": "counters"}])
        (clean,) = engine.run([gen(VICTIM)])
        d = delta(engine.run([{"op": "counters"}])[0], before)
        assert checks(d) == 7 and mismatches(d) == 0, d  # its 6 blocks and its tail, as the engine computed them
        assert clean["tokens"] == baseline(VICTIM)

        # 3. a planted partial tail
        assert engine.run(plant_tail_steps())[2]["planted"] == 1
        (planted,) = engine.run([{"op": "lookup", "prompt": VICTIM_T}])
        (before,) = engine.run([{"op": "counters"}])
        victim, own = engine.run([gen(VICTIM_T), gen(VICTIM_T, salt=salt())])  # own: keyed apart, computed
        d = delta(engine.run([{"op": "counters"}])[0], before)
        (left,) = engine.run([{"op": "lookup", "prompt": VICTIM_T}])
        print(f"a planted tail: a lookup of the victim found {planted['tokens']} tokens before its verification "
              f"and {left['tokens']} after; {d}")
        assert planted["tokens"] == 2 * BS + TAIL  # the planted tail would be served
        assert victim["cached"] == 0 and victim["tokens"] == own["tokens"]
        assert mismatches(d) == 1 and checks(d) == 3 and d.get("verify_deleted_blocks") == 1, d
        assert left["tokens"] == 2 * BS  # its full blocks; the tail is gone

        # 4. an identity hole: new weights, same namespace (no connector reset)
        engine.run([gen(STALE), {"op": "sleep", "s": 1.0}])
        engine.run([{"op": "reload_weights", "seed": 3, "scale": 0.5, "unseen": True}, {"op": "reset", "connector": False}])
        (before,) = engine.run([{"op": "counters"}])
        stale, fresh = engine.run([gen(STALE), gen(STALE, salt=salt())])  # fresh: keyed apart, nothing stored
        d = delta(engine.run([{"op": "counters"}])[0], before)
        assert stale["tokens"] == fresh["tokens"] and stale["cached"] == 0
        assert stale["tokens"] != baseline(STALE)  # the new weights answer otherwise: stale KV would show
        assert mismatches(d) == 8 and checks(d) == 8, d


def test_without_verification_the_planted_block_and_the_stale_weights_are_served(model, tmp_path, baseline):
    """The other side of the test above (``sample_rate: 0``): the same planted block and the same
    unreset weight change are loaded and change the answers, and a planted tail is loaded. What
    verification catches is real."""
    cfg = disk_config(tmp_path, verify="{sample_rate: 0}")
    with StepEngine(model, tmp_path, cfg, name="unverified") as engine:
        engine.run([gen(DONOR)])
        assert engine.run([{"op": "plant", "donor": DONOR, "victim": VICTIM}])[0]["planted"] == 6
        (victim,) = engine.run([gen(VICTIM)])
        assert victim["cached"] >= 6 * BS - 1 and victim["tokens"] != baseline(VICTIM)
        engine.run([gen(STALE), {"op": "sleep", "s": 1.0}])
        engine.run([{"op": "reload_weights", "seed": 3, "scale": 0.5, "unseen": True}, {"op": "reset", "connector": False}])
        stale, fresh = engine.run([gen(STALE), gen(STALE, salt=salt())])
        assert stale["cached"] >= 8 * BS - 1 and stale["tokens"] != fresh["tokens"]
        assert engine.run(plant_tail_steps())[2]["planted"] == 1
        victim, own = engine.run([gen(VICTIM_T), gen(VICTIM_T, salt=salt())])
        print(f"unverified, a planted tail: {victim['cached']} tokens loaded, {TAIL - 1} of them the donor's; the "
              f"answer {'differs from' if victim['tokens'] != own['tokens'] else 'equals'} the engine's own")
        assert victim["cached"] == 2 * BS + TAIL - 1  # all but the last prompt token: the donor's tail loaded
        assert not checks(engine.run([{"op": "counters"}])[0])


def verified_clean(engine: StepEngine, prompts: list[list[int]], name: str) -> None:
    """``prompts`` computed in one batch, vLLM's own prefix cache reset, then the same batch again
    at ``sample_rate: 1.0``: 100+ blocks verified, none mismatched, the same outputs."""
    (first,) = engine.run([{"op": "generate", "prompts": prompts, "max_tokens": 4}])
    engine.run([{"op": "sleep", "s": 1.0}, {"op": "reset", "connector": False}])
    (before,) = engine.run([{"op": "counters"}])
    (again,) = engine.run([{"op": "generate", "prompts": prompts, "max_tokens": 4}])
    d = delta(engine.run([{"op": "counters"}])[0], before)
    print(f"{name}: {checks(d)} blocks verified, {mismatches(d)} mismatched; {d}")
    assert checks(d) >= 100 and mismatches(d) == 0, d
    assert again["tokens"] == first["tokens"]


# The other model kinds of the suite: (engine dtype, block size, prompts, tokens each). MLA: vLLM's CPU
# MLA backend takes block size 16 and no chunked prefill; hybrids: each KV cache group's blocks are
# compared (full attention, sliding window, SSM states at block boundaries), bf16 for the SSM (the
# only dtype vLLM's CPU GDN kernel takes).
KINDS = {"mla": ("float32", 16, 8, 16 * 16 + 5), "hybrid-swa": ("float32", 128, 10, 6 * 128 + 5),
         "hybrid-ssm": ("bfloat16", 128, 15, 8 * 128 + 5)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_honest_traffic_on_every_model_kind_verifies_clean(kind, tmp_path):
    """100+ blocks verified at ``sample_rate: 1.0`` on MLA and both hybrids: none mismatched (the
    tolerances of verify.compare hold on these kernels), every request answered as when it was
    computed cold in the same batch. The same batch, in the same order: vLLM's CPU MLA backend
    rotates some tokens' rotary dimensions as at other positions when requests share a prefill step
    (docs/consistency.md "Verified hits: calibration"), so on MLA another batch is not an honest
    recomputation, and verification flags it."""
    dtype, block_size, n, length = KINDS[kind]
    prompts = [ids(1000 + i, length) for i in range(n)]
    cfg = disk_config(tmp_path, verify="{sample_rate: 1.0}")
    with StepEngine(tiny_model(kind), tmp_path, cfg, name=kind, dtype=dtype, block_size=block_size) as engine:
        verified_clean(engine, prompts, kind)


def test_a_planted_identity_hole_is_caught_and_answered_as_vllm_alone(model, tmp_path):
    """One of the holes the identity work closed, reproduced (the test-only trial ``identity_hole:
    lora_version``, tests/harness/trials.py: a LoRA adapter keyed by name and path, not by content,
    as kvstrata keyed it before): an adapter rewritten in place under its name and path keeps its keys, so kvstrata holds
    KV of the old adapter under them. At ``sample_rate: 1.0`` the first request with the new
    adapter is verified: every block it would have loaded is a mismatch, deleted, and its answer is
    the new adapter's (the same request under a fresh salt: keyed apart, computed)."""
    from engines.test_vllm_identity import PROMPT, write_lora

    cfg = disk_config(tmp_path, verify="{sample_rate: 1.0}")
    with StepEngine(model, tmp_path, cfg, name="hole", lora=True, trials={"identity_hole": "lora_version"}) as engine:
        a = write_lora(tmp_path / "a", 1)
        (old,) = engine.run([gen(PROMPT, lora=["a", 1, a]), {"op": "sleep", "s": 1.0}])[:1]
        write_lora(tmp_path / "a", 3)  # other weights, same name, path and file size
        engine.run([{"op": "reset", "connector": False}])
        (before,) = engine.run([{"op": "counters"}])
        new, ref = engine.run([gen(PROMPT, lora=["a", 1, a, None, True]),
                               gen(PROMPT, lora=["a", 1, a, None, True], salt=salt())])
        d = delta(engine.run([{"op": "counters"}])[0], before)
    assert ref["tokens"] != old["tokens"]  # the rewritten adapter answers otherwise: its old KV would show
    assert new["tokens"] == ref["tokens"] and new["cached"] == 0
    blocks = -(-len(PROMPT) // BS)  # 12 full blocks and the 16-token tail
    assert mismatches(d) == blocks and checks(d) == blocks, d


def test_honest_traffic_with_an_eagle_head_verifies_clean(model, tmp_path, baseline):
    """EAGLE: the head's KV layer is in the target's one KV cache group (tests/engines/
    test_vllm_spec.py), so a verified block covers it too; 100+ blocks, 0 mismatches.

    Then honest prompts that share a prefix and go on differently (``DIVERGING``, issue 49): the
    head's KV in a block's last slot depends on the next token, so with blocks keyed on their
    tokens alone, the next prompt's verification flagged and deleted P's last block whenever its
    next token differed (P+X then P+Y, P then P+Y, long tails), 3 honest blocks. Keyed on the next
    token too (adapters/vllm/drafts.py), each is verified clean, over the blocks it would load.
    Last, a prefill chunked within a shared prefix: vLLM 0.32 writes the draft KV at the chunk's
    end from the prompt's last token, so the block holding it is not stored (stored, it was
    flagged: a relative error of 0.10 on the head's layer)."""
    from engines.test_vllm_spec import DIVERGING, diverging_steps, eagle_head

    spec = {"method": "eagle", "model": eagle_head(model, tmp_path / "head"), "num_speculative_tokens": 3}
    prompts = [ids(1100 + i, 8 * BS + 5) for i in range(13)]
    cfg = disk_config(tmp_path, verify="{sample_rate: 1.0}")
    filler, q = ids(1300, 3900), ids(1301, 8 * BS)  # [filler, Q+X]: over vLLM CPU's 4,096 tokens a step
    with StepEngine(model, tmp_path, cfg, name="eagle-verify", speculative=spec) as engine:
        verified_clean(engine, prompts, "eagle")
        runs = engine.run(diverging_steps({"op": "reset", "connector": False}, counted=True))
        chunked = engine.run([{"op": "generate", "prompts": [filler, q + ids(1302, 50)], "max_tokens": 4},
                              {"op": "sleep", "s": 1.0}, {"op": "reset", "connector": False},
                              {"op": "counters"}, gen(q + ids(1303, 50)), {"op": "counters"}])
    seen = {}  # per shape: (blocks verified, mismatched)
    for i, (name, (_, then, _)) in enumerate(DIVERGING.items()):
        before, done, after = runs[6 * i + 3 : 6 * i + 6]
        seen[name] = checks(d := delta(after, before)), mismatches(d)
        print(f"eagle, {name}: {seen[name][0]} blocks verified, {seen[name][1]} mismatched; {d}")
        assert done["cached"] == 0 and done["tokens"] == baseline(then), name
    assert seen == {name: (served, 0) for name, (_, _, served) in DIVERGING.items()}
    # Q+X's prefill was chunked at token 196 (the step's 4,096 less the filler's 3,900), and vLLM's
    # drafter wrote the draft KV at 195 from X's last token: block 6 was not stored, so Q+Y's
    # verification covers blocks 0 to 5, clean (stored, block 6 was flagged).
    before, done, after = chunked[3:]
    d = delta(after, before)
    print(f"eagle, a prefill chunked within Q: {checks(d)} blocks verified, {mismatches(d)} mismatched; {d}")
    assert (checks(d), mismatches(d)) == ((4096 - len(filler)) // BS, 0), d
    assert done["tokens"] == baseline(q + ids(1303, 50))
