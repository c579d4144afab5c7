"""Speculative decoding on the real vLLM engine with kvstrata (issue 29): n-gram speculation.

vLLM's n-gram proposer (no draft model, so no draft KV) drafts 3 tokens from the request's own
context; the target model verifies them in one forward pass, so a step computes KV for draft
positions that may be rejected. kvstrata saves only positions whose tokens are known (never a
draft): a block completed by accepted drafts is saved in the request's next step. The tiny model's
greedy output soon repeats itself, so the proposer drafts, and vLLM accepts, most decode tokens.

Two engines with n-gram speculation, one after the other on one disk tier: the first runs a prompt
cold, again after vLLM's own prefix cache is reset (kvstrata's CPU tier), and a follow-up turn
(the prompt, its output, new tokens) whose blocks past the prompt were completed by the
speculating decode; the second, fresh, serves both from disk. Outputs equal vLLM alone without
speculation (``baseline``).
"""

from __future__ import annotations

import pytest

from engines.conftest import BS, StepEngine, delta, disk_config, gen, ids

pytest.importorskip("vllm")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPT = ids(81, 600)  # 18 full blocks and a 24-token tail
DECODE = 72  # output tokens: the decode completes blocks 18 and 19
PROMPT_BLOCKS = len(PROMPT) // BS + 1
NEW_TURN = ids(82, 40)  # the follow-up turn's own tokens


@pytest.fixture(scope="module")
def ngram_runs(model, baseline, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("spec")
    cfg = disk_config(tmp)
    runs: dict = {"alone": baseline(PROMPT, DECODE)}
    follow_up = PROMPT + runs["alone"] + NEW_TURN
    runs["alone_follow_up"] = baseline(follow_up)
    counters, stats, reset = {"op": "counters"}, {"op": "spec_stats"}, {"op": "reset"}
    with StepEngine(model, tmp, cfg, name="ngram", speculative=NGRAM) as first:
        runs["first"] = first.run([stats, gen(PROMPT, max_tokens=DECODE), stats, counters, reset,
                                   gen(PROMPT, max_tokens=DECODE), counters, stats, reset, gen(follow_up)])
    with StepEngine(model, tmp, cfg, name="ngram-fresh", speculative=NGRAM) as second:
        runs["fresh"] = second.run([gen(PROMPT, max_tokens=DECODE), counters, reset, gen(follow_up)])
    print("ngram: cached tokens", [r["cached"] for phase in ("first", "fresh") for r in runs[phase] if "cached" in r],
          "spec stats", [r for r in runs["first"] if "drafts" in r])
    return runs


@pytest.mark.timeout(600)
def test_ngram_speculation_stores_a_prompt_and_serves_it_from_cpu_memory_with_vllms_outputs(ngram_runs):
    stats0, cold, stats1, counted, _, again, served, stats2, _, _ = ngram_runs["first"]
    assert cold["cached"] == 0 and cold["tokens"] == ngram_runs["alone"]
    assert stats1["accepted_tokens"] - stats0.get("accepted_tokens", 0) > DECODE // 2  # speculation ran
    assert again["cached"] >= 0.9 * len(PROMPT) and again["cached"] == len(PROMPT) - 1
    assert again["tokens"] == ngram_runs["alone"]
    assert delta(served, counted).get("hit_blocks_l1") == PROMPT_BLOCKS  # what the speculating request stored
    assert stats2["drafts"] > stats1["drafts"]  # the loaded request speculates too


@pytest.mark.timeout(600)
def test_blocks_completed_by_accepted_drafts_are_served_to_the_next_turn(ngram_runs):
    """Scenario: a follow-up turn (the prompt, the speculating request's output, new tokens) after
    vLLM's own prefix cache is reset. Blocks 18 and 19 were completed during decode, mostly by
    accepted drafts, and saved in the step after; the follow-up loads them with the prompt's
    (blocks completed in a request's very last step are never saved: no step follows)."""
    follow = ngram_runs["first"][-1]
    assert follow["cached"] >= (len(PROMPT) // BS + 2) * BS, follow["cached"]
    assert follow["tokens"] == ngram_runs["alone_follow_up"]


@pytest.mark.timeout(600)
def test_fresh_speculating_engine_loads_both_from_disk_with_vllms_outputs(ngram_runs):
    from_disk, counters, _, follow = ngram_runs["fresh"]
    assert from_disk["cached"] == len(PROMPT) - 1 and from_disk["tokens"] == ngram_runs["alone"]
    assert counters["hit_blocks_l2"] == PROMPT_BLOCKS
    assert follow["cached"] == len(PROMPT) + DECODE + len(NEW_TURN) - 1  # as the first engine stored the whole turn
    assert follow["tokens"] == ngram_runs["alone_follow_up"]
