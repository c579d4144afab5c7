"""Hybrid models on the real vLLM engine with kvstrata: vLLM's hybrid KV cache manager (HMA)
stays on, and a prefix hit resumes every KV cache group at one block boundary.

Two presets of examples/make_tiny_model.py: ``hybrid-swa`` (Gemma 3 text: three sliding-window
layers of 256 tokens and one full-attention layer, fp32) and ``hybrid-ssm`` (Qwen3-Next: three
gated-delta-net layers, whose state is an SSM's, and one full-attention layer, bf16, the only dtype
vLLM's CPU kernel takes). Each runs a prompt cold, again after vLLM's own prefix cache is reset
(kvstrata's CPU tier), in a fresh engine on the same disk tier, and in an instance that shares
only the Redis tier, with an L1 small enough that two other prompts evict it; every output equals
vLLM alone. Prompts of 1,000, 200 and 100 tokens (not a multiple of the block size, shorter than
the window, shorter than a block) resume at the last block boundary before their last token or miss.
Two attacks on the stored units of salted copies, on disk and in Redis: one sliding-window or SSM
unit at the hit's boundary deleted, and one full-attention unit there replaced by another model's
namespace's (a valid header naming it): the hit shrinks or misses, and outputs stay vLLM's.
Without HMA (kvstrata before ``lookup_groups``) the first ran with a quarter of its KV capacity and the
second could not start.

Random weights have near-tied logits, and in bf16 a different compute path (a hit recomputes 64
tokens where a cold run computes 1,600) can flip a greedy token with no KV wrong. So the prompt is
the one of a few whose greedy tokens lead the runner-up by at least ``GAP`` in logprob, as vLLM alone
computes them, for the most steps from the first; outputs must be equal token for token over those
steps (all 8 in fp32, at least ``MIN_CLEAR`` in bf16). Wrong KV (an SSM state of another boundary,
a window block of another prompt) moves logits by far more than that.
"""

from __future__ import annotations

import pytest

import redis as _redis

from tests.harness import redisutil
from engines.launchers import StepEngine, delta, disk_config, gen, ids, salt, tiny_model
from kvstrata.format.block import HEADER_SIZE, pack_header, unpack_header
from kvstrata.keys import Namespace

pytest.importorskip("vllm")

# Per preset: a baseline engine and three kvstrata engines, one after the other, on 2 shared cores.
pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")]

GAP = 0.03  # logprob lead of a greedy token over the runner-up, with vLLM alone
MIN_CLEAR = 3  # greedy tokens compared at least
# Prompt lengths beside the 1,600 of the main prompt: not a multiple of the block size (128), shorter
# than the sliding window (256), shorter than one block (a miss: nothing to resume).
ODD_LENGTHS = (1000, 200, 100)
PRESETS = {  # preset -> (engine dtype, block size asked for, the groups vLLM makes)
    "hybrid-swa": ("float32", 128, ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"]),
    "hybrid-ssm": ("bfloat16", 128, ["MambaSpec"] * 3 + ["FullAttentionSpec"]),
}
L1_PROMPTS = 1.5  # the shared-tier instance's L1, in prompts' worth of L1 slots: two other prompts evict one


def clear_prompt(alone: StepEngine, n: int = 1600, seeds: range = range(21, 41)) -> tuple[list[int], int, list[int]]:
    """The prompt of ``seeds`` whose greedy tokens, as vLLM alone computes them, lead the runner-up
    by ``GAP`` for the most steps from the first one, that number of steps, and those tokens."""
    outs = alone.run([gen(ids(s, n), logprobs=2) for s in seeds])

    def clear(out: dict) -> int:
        gaps = [top[0] - top[1] for top in out["top"]]
        return next((i for i, g in enumerate(gaps) if g < GAP), len(gaps))

    seed, out = max(zip(seeds, outs), key=lambda pair: clear(pair[1]))
    if clear(out) < MIN_CLEAR:
        pytest.fail(f"no prompt of seeds {seeds} leads by {GAP} for {MIN_CLEAR} steps: {[clear(o) for o in outs]}")
    return ids(seed, n), clear(out), out["tokens"][:clear(out)]


def foreign(path_or_value: bytes, ns_seed: bytes) -> bytes:
    """A stored unit (header and payload) as another namespace would have written it: its header
    names ``ns_seed``, with a valid header checksum; the payload is untouched."""
    meta = unpack_header(path_or_value[:HEADER_SIZE])
    return pack_header(meta._replace(ns_seed=ns_seed)) + path_or_value[HEADER_SIZE:]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hybrid_model_keeps_hma_and_is_served_from_every_tier_with_vllms_outputs(preset, baseline, tmp_path):
    dtype, block_size, kinds = PRESETS[preset]
    model = tiny_model(preset)
    engine = baseline.engine(model, dtype, block_size)
    alone = engine.run([{"op": "kv_groups"}])[0]
    prompt, steps, _ = clear_prompt(engine)
    odd = [clear_prompt(engine, n, range(41, 49)) for n in ODD_LENGTHS]  # (prompt, steps, vLLM alone's tokens)
    print(f"{preset}: outputs compared over {steps} greedy tokens; {[o[1] for o in odd]} at {ODD_LENGTHS} tokens")
    want = baseline(prompt, model=model, dtype=dtype, block_size=block_size)[:steps]  # and closes that engine
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        remote = f"\n  enabled: true\n  url: {url}"
        cfg = disk_config(tmp_path, remote=remote)
        attacked, planted = salt(), salt()
        with StepEngine(model, tmp_path, cfg, name=f"{preset}-a", dtype=dtype, block_size=block_size) as a:
            groups, start, cold, stored, _, l1, other, counters, keys = a.run([
                {"op": "kv_groups"}, {"op": "counters"}, gen(prompt), {"op": "counters"}, {"op": "reset"}, gen(prompt),
                gen(prompt, salt=attacked), {"op": "counters"}, {"op": "group_keys", "prompt": prompt, "salt": attacked}])
            *odd_runs, plants = a.run([*(gen(o[0]) for o in odd), gen(prompt, salt=planted), {"op": "reset"},
                                       *(gen(o[0]) for o in odd), {"op": "group_keys", "prompt": prompt, "salt": planted}])
            log = a.tail(10**7)
        bs = groups["groups"][0][1]
        boundary = l1["cached"] // bs - 1  # the last full block of the hit
        client = _redis.Redis.from_url(url)
        # Attack 1: the salted copy loses one unit of one sliding-window or SSM group at the
        # boundary of the hit, on disk and in Redis: the hit must shrink (or miss), never mix.
        g = next(i for i, kind in enumerate(keys["kinds"]) if kind != "full")
        victim = keys["keys"][g][boundary]
        gone = [f.unlink() or f for f in (tmp_path / "l2" / "blocks").glob(f"*/{victim}.kvb")]
        gone += [client.delete(k) and k for k in client.scan_iter(f"*{victim}*")]
        # Attack 2: another salted copy's full-attention unit at the boundary is replaced, on disk
        # and in Redis, by one that another model's namespace wrote (a valid header naming that
        # namespace, the same key): it is not this namespace's block, so the hit shrinks again.
        full = plants["kinds"].index("full")
        other_ns = Namespace("vllm", "another-model", "1", dtype, "cpu", bs).seed
        target = plants["keys"][full][boundary]
        forged = [f.write_bytes(foreign(f.read_bytes(), other_ns)) and f
                  for f in (tmp_path / "l2" / "blocks").glob(f"*/{target}.kvb")]
        forged += [client.set(k, foreign(client.get(k), other_ns)) and k
                   for k in client.scan_iter(f"*{target}*") if client.type(k) == b"string"]
        with StepEngine(model, tmp_path, cfg, name=f"{preset}-b", dtype=dtype, block_size=block_size) as b:
            before = b.counters()
            fresh, hurt, foreign_hit, after = b.run([gen(prompt), gen(prompt, salt=attacked), gen(prompt, salt=planted),
                                                     {"op": "counters"}])
        # A second instance on the shared tier alone (no disk tier), with an L1 of about 1.5
        # prompts: the prompt from Redis, then two others that evict it from L1, then it again.
        shared = tmp_path / "shared.yaml"
        # The L1 slots one prompt takes, as the cold run wrote them (the slot size and the units a prompt
        # stores per group follow vLLM's page sizes, which move with vLLM and transformers releases).
        small_l1 = int(L1_PROMPTS * delta(stored, start)["l1_bytes_written"])
        shared.write_text(f"l1:\n  size: {small_l1}\nl2:\n  enabled: false\nremote:{remote}\n")
        with StepEngine(model, tmp_path, shared, name=f"{preset}-c", dtype=dtype, block_size=block_size) as c:
            start = c.counters()
            first, mid, *_, again, end = c.run([gen(prompt), {"op": "counters"}, gen(ids(101, 1600)),
                                                gen(ids(102, 1600)), {"op": "reset"}, gen(prompt), {"op": "counters"}])
    print(f"{preset}: groups {groups['groups']}, {groups['num_blocks']} KV blocks (alone {alone['num_blocks']}); "
          f"cached tokens: L1 {l1['cached']}, L2 {fresh['cached']}, attacked {hurt['cached']} / {foreign_hit['cached']}, "
          f"odd lengths {[(len(o[0]), r['cached']) for o, r in zip(odd, odd_runs[len(odd) + 2:])]}, "
          f"shared tier {first['cached']}, after eviction {again['cached']} of {len(prompt)}")
    assert [g[0] for g in groups["groups"]] == kinds  # HMA on: one group per layer kind, not one for all
    assert groups == alone  # the same groups, block size and KV capacity as vLLM alone
    assert "Turning off hybrid kv cache manager" not in log
    assert {g[1] for g in groups["groups"]} == {bs}
    assert cold["cached"] == 0 and cold["tokens"][:steps] == want
    # Every group resumes at the last block boundary before the prompt's last token.
    assert l1["cached"] == (len(prompt) - 1) // bs * bs >= 0.9 * len(prompt), (l1["cached"], bs)
    assert l1["tokens"][:steps] == want
    assert other["cached"] == 0 and other["tokens"][:steps] == want  # another salt: nothing of the first
    # Odd lengths: cold, then from kvstrata up to the last block boundary before the last token.
    for (p, clear, alone_tokens), cold_run, hit in zip(odd, odd_runs[:len(odd)], odd_runs[len(odd) + 2:]):
        assert cold_run["tokens"][:clear] == alone_tokens and hit["tokens"][:clear] == alone_tokens, len(p)
        assert hit["cached"] == (len(p) - 1) // bs * bs, (len(p), hit["cached"])
    assert counters["saved_blocks"] > 0 and counters.get("hit_blocks_l1", 0) > 0
    assert fresh["cached"] == l1["cached"] and fresh["tokens"][:steps] == want  # from the disk tier, all groups
    assert len(gone) >= 2 and len(forged) >= 3, (gone, forged)  # on disk, and Redis' index entry and payload
    for attacked_run in (hurt, foreign_hit):
        assert attacked_run["cached"] < l1["cached"] and attacked_run["cached"] % bs == 0, attacked_run["cached"]
        assert attacked_run["tokens"][:steps] == want
    assert delta(after, before).get("hit_blocks_l2", 0) > 0
    for served in (first, again):  # from Redis, every group
        assert served["cached"] == l1["cached"] and served["tokens"][:steps] == want
    assert delta(mid, start).get("hit_blocks_remote", 0) > 0 and not delta(mid, start).get("hit_blocks_l1")
    assert delta(end, mid).get("hit_blocks_remote", 0) > 0  # evicted from L1: from the shared tier again
