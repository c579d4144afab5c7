"""``python -m benchmarks serve``: the trace-to-requests mapping and the replay's ordering, with no engine
(the real run on vLLM: tests/engines/test_bench_serve.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from kvstrata.tools import serving
from benchmarks import serve
from benchmarks.serve_engines import Result
from benchmarks.serve_workload import Scaling, block_tokens, build_turns, select, simulate_reference
from kvstrata.tools.trace import Request, load_trace

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "src" / "kvstrata" / "tools" / "data" / "conversation_sample.jsonl"
ALLOWED = np.arange(10, 3000)


def req(ts: int, ids: tuple[int, ...], inp: int | None = None, out: int = 100) -> Request:
    return Request(ts, inp if inp is not None else 512 * len(ids), out, ids)


def test_same_hash_id_gives_same_tokens_and_different_ids_differ():
    a, b = block_tokens(7, 64, ALLOWED), block_tokens(7, 64, ALLOWED)
    assert np.array_equal(a, b) and len(a) == 64
    assert not np.array_equal(a, block_tokens(8, 64, ALLOWED))
    assert set(a.tolist()) <= set(ALLOWED.tolist())


def test_prompts_share_exactly_their_common_hash_prefix():
    turns = build_turns([req(0, (1, 2, 3)), req(5, (1, 2, 4, 5)), req(9, (9, 2, 3))], Scaling(64), ALLOWED)
    p0, p1, p2 = (t.prompt for t in turns)
    assert p0[:128] == p1[:128] and p0[128:192] != p1[128:192]
    assert p0[:64] != p2[:64] and p0[64:192] == p2[64:192]  # same ids at another position: same tokens
    assert [t.session for t in turns] == [0, 0, 1]
    assert turns[1].arrival_s == 0.005


def test_lengths_are_scaled_by_block_tokens_and_capped():
    s = Scaling(block_tokens=64, max_prompt=200, max_output=10)
    turns = build_turns([req(0, (1, 2), inp=1000, out=40), req(0, (3, 4, 5, 6, 7), inp=2500, out=400)], s, ALLOWED)
    assert len(turns[0].prompt) == 125 and turns[0].max_tokens == 5  # 1000/8, 40/8
    assert len(turns[1].prompt) == 200 and turns[1].max_tokens == 10  # capped
    assert turns[0].hash_ids == (1,) and turns[1].hash_ids == (3, 4, 5)  # full blocks only
    assert len(build_turns([req(0, (1, 2), inp=1000)], Scaling(32), ALLOWED)[0].prompt) == 62


def test_sampled_conversations_are_whole_ordered_and_seeded():
    trace = load_trace(SAMPLE)
    picked = select(trace, 3, None, 0, seed=0)
    sessions = {r.session for r in picked}
    assert len(sessions) == 3
    assert picked == [r for r in trace if r.session in sessions]  # every turn, in trace order
    assert all(sum(r.session == s for r in picked) >= 2 for s in sessions)  # multi-turn only
    assert select(trace, 3, None, 0, seed=0) == picked
    assert any(select(trace, 3, None, 0, seed=s) != picked for s in (1, 2, 3))
    assert select(trace, None, 5, 10) == trace[10:15]


def test_simulate_reference_counts_full_blocks_served_by_an_unbounded_cache():
    turns = build_turns([req(0, (1, 2)), req(1, (1, 2, 3)), req(2, (4,))], Scaling(64), ALLOWED)
    # 128 + 192 + 64 prompt tokens; the second request finds blocks 1 and 2 (128 tokens)
    assert simulate_reference(turns, 64) == pytest.approx(128 / 384)


class FakeEndpoint:
    """Records overlap: no conversation may have two turns in flight (the replay's coroutines
    share one event loop, as with a real endpoint)."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.inflight, self.peak, self.order = set(), 0, []
        self.fail = fail

    def session(self) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    async def send(self, http: object, prompt: list[int], max_tokens: int) -> Result:
        key = prompt[0]
        assert key not in self.inflight, "two turns of one conversation in flight"
        self.inflight.add(key)
        self.peak = max(self.peak, len(self.inflight))
        self.order.append((key, len(prompt)))
        await asyncio.sleep(0.01)
        self.inflight.discard(key)
        if len(prompt) in self.fail:
            raise OSError("boom")
        return Result(1.0, 2.0, max_tokens, {"total": 0})


def _conversations(n: int, turns: int) -> list:
    # conversation c: ids (c+1, 500+c, ...), so its turns share their first two ids
    reqs = [req(t * 10 + c, (c + 1, 500 + c, *range(1000 + 100 * c, 1000 + 100 * c + t + 1)), inp=512 * (t + 3))
            for t in range(turns) for c in range(n)]
    return build_turns(sorted(reqs), Scaling(64), ALLOWED)


def test_concurrency_replay_keeps_each_conversation_in_order_and_one_turn_at_a_time():
    turns = _conversations(6, 3)
    ep = FakeEndpoint()
    rec = serve.replay_concurrency(ep, turns, 4, lambda: None)
    assert len(rec.results) == len(turns) and not rec.errors  # the fake raises on an overlap
    assert len({t.session for t in turns}) == 6 and 1 < ep.peak <= 4
    for key in {t.prompt[0] for t in turns}:
        lengths = [n for k, n in ep.order if k == key]  # turn t of a conversation is the longest yet
        assert len(lengths) == 3 and lengths == sorted(lengths)


def test_a_failed_request_is_counted_and_the_replay_goes_on():
    turns = _conversations(3, 2)
    rec = serve.replay_concurrency(FakeEndpoint(fail={len(turns[0].prompt)}), turns, 2, lambda: None)
    assert rec.errors and len(rec.errors) + len(rec.results) == len(turns)
    row = serve.summarize("baseline", 2, rec, 1.0, {})
    assert row["errors"] == len(rec.errors) and row["throughput_req_s"] == len(rec.results)


def test_recompute_bound_target_compares_throughput_with_what_hits_alone_allow():
    def row(config: str, req_s: float, recomputed: int) -> dict:
        return {"config": config, "concurrency": 8, "throughput_req_s": req_s, "ttft_p50_ms": 100.0,
                "hit_rate": 0.5, "tokens_recomputed": recomputed}

    def bound_check(ours_req_s: float) -> dict:
        checks = serve.ratios([row("baseline", 1.0, 30_000), row("strata-l1l2", ours_req_s, 20_000)], 0.5)
        return next(c for c in checks if c["target"].startswith("throughput vs baseline / recompute bound"))

    at_bound = bound_check(1.5)  # recomputing 2/3 of the baseline's tokens allows at most 1.5x
    assert at_bound["target"].endswith("(1.500)") and at_bound["value"] == 1.0 and at_bound["met"]
    short = bound_check(1.35)
    assert short["value"] == 0.9 and not short["met"]


def test_decode_aware_bound_keeps_the_decode_only_time_fixed():
    base = {"config": "baseline", "concurrency": 8, "throughput_req_s": 1.0, "ttft_p50_ms": 100.0,
            "hit_rate": 0.2, "tokens_recomputed": 30_000, "wall_s": 100.0, "prompt_wait_s": 60.0}
    ours = dict(base, config="strata-l1l2", tokens_recomputed=20_000, hit_rate=0.5)
    # 60 s with a prompt waiting shrink to 40 s, 40 s of decode only stay: 100 / 80 = 1.25x at most
    for req_s, value in ((1.25, 1.0), (1.125, 0.9)):
        checks = serve.ratios([base, dict(ours, throughput_req_s=req_s)], 0.5)
        c = next(c for c in checks if "decode-only time fixed" in c["target"])
        assert c["target"].startswith("throughput vs baseline / recompute bound, decode-only time fixed (1.250;")
        assert c["value"] == value and c["met"] == (value >= 0.95)


def test_hicache_is_a_reference_row_and_a_target_for_kvstrata():
    def row(config: str, req_s: float, recomputed: int) -> dict:
        return {"config": config, "concurrency": 16, "throughput_req_s": req_s, "ttft_p50_ms": 100.0,
                "hit_rate": 0.5, "tokens_recomputed": recomputed}

    for ours, met in ((0.96, True), (0.9, False)):  # against SGLang's host pool alone at 1.2 req/s
        checks = serve.ratios([row("baseline", 1.0, 30_000), row("hicache", 1.2, 20_000),
                               row("strata-l1l2", ours * 1.2, 20_000)], 0.5)
        ref = [c for c in checks if c["config"] == "hicache"]
        assert [c["target"] for c in ref] == ["throughput vs baseline / recompute bound (1.500)"]
        assert ref[0]["value"] == 0.8 and ref[0]["met"] is None  # reported, never judged
        vs = next(c for c in checks if c["target"].startswith("throughput vs hicache"))
        assert vs["config"] == "strata-l1l2" and vs["value"] == round(ours, 3) and vs["met"] is met


def test_hicache_config_is_refused_for_vllm():
    args = argparse.Namespace(configs="baseline,hicache", engine="vllm", redis_url=None)
    with pytest.raises(SystemExit, match="hicache runs with SGLang only"):
        serve._configs(args)
    assert serve._configs(argparse.Namespace(configs="strata-l1l2,hicache,baseline", engine="sglang",
                                             redis_url=None)) == ["baseline", "hicache", "strata-l1l2"]


def test_prompt_wait_is_the_union_of_the_times_before_first_tokens():
    turns = build_turns([req(0, (1,)), req(1, (2,)), req(2, (3,))], Scaling(64), ALLOWED)
    rec = serve.Record(turns)
    for i, (start, ttft) in enumerate(((0.0, 2000), (1.0, 2000), (5.0, 500))):
        rec.started[i] = start
        rec.results[i] = Result(ttft, ttft + 100, 4, {})
    assert serve.prompt_wait_s(rec) == pytest.approx(3.5)  # [0, 3] and [5, 5.5]


def test_timestamp_replay_sends_on_scaled_trace_time():
    turns = build_turns([req(0, (1,)), req(400, (2,))], Scaling(64), ALLOWED)
    ep = FakeEndpoint()
    start = time.monotonic()
    rec = serve.replay_timestamps(ep, turns, 0.5, lambda: None)
    assert len(rec.results) == 2 and rec.started[1] >= 0.19 and time.monotonic() - start < 5


def test_free_port_is_below_the_ephemeral_range_and_free():
    """Engine servers bind ephemeral ports of their own (torch.distributed, gloo) while they
    start: a port picked with bind(0) can be taken by one of them before the HTTP server binds it."""
    low = serving._ephemeral_range()[0]
    for _ in range(20):
        port = serving.free_port()
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_disagg_configs_and_their_comparisons():
    """``--disagg``: the P/D pair beside one kv_both server and one without a connector; its rows
    compare throughput and TTFT with both (no bound) and judge the decode server's loaded share."""
    args = argparse.Namespace(configs=None, engine="vllm", redis_url=None, disagg=True)
    assert serve._configs(args) == ["baseline", "strata-remote", "disagg"]
    with pytest.raises(SystemExit, match="disagg runs with vLLM only"):
        serve._configs(argparse.Namespace(configs="baseline,disagg", engine="sglang", redis_url=None))

    def row(config: str, req_s: float, p50: float, tiers: dict) -> dict:
        return {"config": config, "concurrency": 8, "throughput_req_s": req_s, "ttft_p50_ms": p50,
                "ttft_p90_ms": 2 * p50, "hit_rate": 0.5, "tokens_recomputed": 50, "prompt_tokens": 1000,
                "tokens_per_tier": tiers, "whole_prompt_hits": 0.9}

    checks = serve.ratios([row("baseline", 1.0, 400.0, {}), row("strata-remote", 1.5, 200.0, {"external_unspecified": 500}),
                           row("disagg", 1.2, 100.0, {"external_unspecified": 900, "device": 50})], 0.5)
    pd = {c["target"]: c for c in checks if c["config"] == "disagg"}
    assert pd["throughput vs baseline"]["value"] == 1.2 and pd["throughput vs strata-remote"]["value"] == 0.8
    assert pd["TTFT p50 vs baseline"]["value"] == 0.25 and pd["TTFT p90 vs strata-remote"]["value"] == 0.5
    assert all(c["met"] is None and c["bound"] is None for t, c in pd.items() if t.startswith(("throughput", "TTFT")))
    assert pd["prompt tokens the decode server loaded"]["value"] == 0.9  # device hits are vLLM's own
    assert pd["prompt tokens the decode server computed"]["value"] == 0.05
    whole = pd["decode legs that computed only the prompt's last token"]
    assert whole["value"] == 0.9 and whole["bound"] == 0.95 and whole["met"] is False


def test_verify_configs_differ_from_strata_l1l2_only_in_the_sample_rate(tmp_path):
    """strata-l1l2 writes ``verify.sample_rate: 0`` (not the default 0.001), so rate 0 is measured."""
    from benchmarks import serve_engines as engines
    from kvstrata.config import load_config

    s = engines.Settings("vllm", "m", 64, 1536, 1056, 1056, "auto", "2GiB", None, tmp_path, None, 60, 60)
    texts = {}
    for config, rate in engines.STRATA_L1L2.items():
        path = engines.strata_yaml(tmp_path / f"{config}.yaml", s, tmp_path, None, rate)
        assert load_config(path).verify.sample_rate == rate
        texts[config] = path.read_text().replace(f"sample_rate: {rate:g}", "")
    assert len(set(texts.values())) == 1 and set(engines.STRATA_L1L2) <= set(engines.CONFIGS)
    assert engines.STRATA_L1L2["strata-l1l2"] == 0


def test_verify_series_are_summed_per_tier_from_a_scrape():
    text = "\n".join([
        '# HELP kvstrata_verify_checks_total x',
        'kvstrata_verify_checks_total{engine="0",model_name="m",tier="l1"} 5.0',
        'kvstrata_verify_checks_total{engine="1",model_name="m",tier="l1"} 2.0',
        'kvstrata_verify_checks_total{engine="0",model_name="m",tier="l2"} 1.0',
        'kvstrata_verify_mismatches_total{engine="0",model_name="m",tier="l2"} 1.0',
        'kvstrata_verify_checks_created{engine="0",model_name="m",tier="l1"} 1.7e9'])
    assert serve.verify_series(text) == {"verify_checks_l1": 7.0, "verify_checks_l2": 1.0,
                                         "verify_mismatches_l2": 1.0}
    row = serve.verify_fields("strata-verify-1", serve.verify_series(text))
    assert row["verify_checks"] == 8 and row["verify_mismatches"] == 1 and row["verify_sample_rate"] == 1.0
    assert row["verify_checks_by_tier"] == {"l1": 7, "l2": 1}
    assert serve.verify_fields("baseline", None)["verify_checks"] is None


def test_verified_hits_are_judged_beside_rate_0_up_to_001_and_reported_as_a_cost_above():
    def row(config: str, rate: float, req_s: float, hit: float, checks: int, mismatches: int = 0) -> dict:
        return {"config": config, "concurrency": 8, "throughput_req_s": req_s, "ttft_p50_ms": 100.0 / req_s,
                "hit_rate": hit, "prompt_tokens": 64_000, "tokens_per_tier": {"host": 32_000, "device": 4_000},
                "verify_sample_rate": rate, "verify_checks": checks, "verify_mismatches": mismatches}

    results = [row("strata-l1l2", 0.0, 1.0, 0.5625, 0), row("strata-verify-0.01", 0.01, 0.99, 0.5575, 5),
               row("strata-verify-1", 1.0, 0.8, 0.0625, 500, 1)]
    checks = {(c["config"], c["target"]): c for c in serve.verify_ratios(results, 64)}
    sampled = {t: c for (config, t), c in checks.items() if config == "strata-verify-0.01"}
    assert sampled["throughput vs strata-l1l2 (verify 0)"]["value"] == 0.99
    assert sampled["throughput vs strata-l1l2 (verify 0)"]["met"] is True  # >= 0.98
    hit = sampled["hit rate change vs strata-l1l2 (verify 0)"]
    assert hit["value"] == -0.005 and hit["met"] is True and hit["bound"] == 0.01
    assert hit["expected"] == -0.005  # 0.01 x 32,000 / 64,000 served by kvstrata at rate 0
    assert hit["verified_share"] == 0.005  # 5 blocks of 64 tokens of 64,000
    assert sampled["blocks verified"]["bound"] is None and sampled["verify mismatches"]["met"] is True
    cost = {t: c for (config, t), c in checks.items() if config == "strata-verify-1"}
    assert cost["throughput vs strata-l1l2 (verify 0)"]["value"] == 0.8
    assert cost["throughput vs strata-l1l2 (verify 0)"]["bound"] is None  # the cost, not a target
    assert cost["TTFT p50 vs strata-l1l2 (verify 0)"]["value"] == 1.25
    assert cost["blocks verified"]["met"] is True and cost["verify mismatches"]["met"] is False
    assert not [c for c in serve.verify_ratios(results[:1], 64)]  # rate 0 alone: nothing to compare
    slow = serve.verify_ratios([results[0], dict(results[1], throughput_req_s=0.97)], 64)
    assert next(c for c in slow if c["target"].startswith("throughput"))["met"] is False
    lines = [serve.check_line(c) for c in serve.verify_ratios(results, 64)]
    assert any("-0.0050 (0.5625 -> 0.5575, expected -0.0050" in line and "-> met" in line for line in lines)
    assert any(line.endswith("verify mismatches: 1, target == 0 -> MISSED") for line in lines)


# ------------------------------------------------------------------------------------- --rounds N
def _row(config: str, req_s: float | None, hit: float = 0.5, rate: float | None = None, checks: int | None = None,
         mismatches: int | None = None, **kw: object) -> dict:
    return {"config": config, "concurrency": 8, "throughput_req_s": req_s, "ttft_p50_ms": req_s and 100.0 / req_s,
            "ttft_p90_ms": None, "ttft_p99_ms": None, "e2e_p50_ms": None, "throughput_tok_s": None,
            "hit_rate": hit, "prompt_tokens": 64_000, "tokens_per_tier": {"host": 32_000}, "errors": 0,
            "tokens_recomputed": int(64_000 * (1 - hit)), "verify_sample_rate": rate, "verify_checks": checks,
            "verify_mismatches": mismatches, "ttft_ms": [1.0], **kw}


def test_rounds_rotate_the_configurations():
    from benchmarks.serve_rounds import order

    assert [order(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                             ["a", "b", "c"]]


def test_rounds_compare_each_round_with_its_own_reference_and_report_the_median_and_range():
    """The reference drifts (1.0, 0.6, 0.9 req/s) and each round's verify run with it: the paired
    ratios are 0.99, 0.95, 1.01 (median 0.99, met), where the ratio of the medians would be
    0.855 / 0.9 = 0.95 (missed)."""
    from benchmarks import serve_rounds

    base, ours = (1.0, 0.6, 0.9), (0.99, 0.57, 0.909)
    results = []
    for n, (b, o, mism) in enumerate(zip(base, ours, (0, 1, 0)), 1):
        results += [_row("strata-l1l2", b, 0.5625, 0.0, 0, 0, round=n),
                    _row("strata-verify-0.01", o, 0.5625 - 0.001 * n, 0.01, 5 * n, 0),
                    _row("strata-verify-1", o * 0.8, 0.0625, 1.0, 500, mism)]
        results[-2]["round"] = results[-1]["round"] = n
    checks = serve_rounds.paired(results, lambda rs: serve.ratios(rs, 0.6, 64))
    by = {(c["config"], c["target"]): c for c in checks}
    tput = by["strata-verify-0.01", "throughput vs strata-l1l2 (verify 0)"]
    assert tput["rounds"] == [0.99, 0.95, 1.01] and tput["value"] == 0.99 and tput["met"] is True
    assert (tput["min"], tput["max"]) == (0.95, 1.01)
    assert serve.check_line(tput) == ("- c=8 strata-verify-0.01: throughput vs strata-l1l2 (verify 0): 0.990 "
                                      "[median of 3 paired rounds, 0.950..1.010], target >= 0.98 -> met")
    hit = by["strata-verify-0.01", "hit rate change vs strata-l1l2 (verify 0)"]
    assert hit["rounds"] == [-0.001, -0.002, -0.003] and hit["value"] == -0.002 and hit["met"] is True
    assert hit["expected"] == -0.005 and hit["note"].startswith("0.5625 -> 0.5605")  # the median round's note
    assert "[median of 3 paired rounds, -0.0030..-0.0010]" in serve.check_line(hit)
    # counts: the total over rounds, met only where every round met it
    mism = by["strata-verify-1", "verify mismatches"]
    assert mism["value"] == 1 and mism["met"] is False and mism["rounds"] == [0, 1, 0]
    assert serve.check_line(mism).endswith("verify mismatches: 1 [total of 3 rounds, per round 0..1], "
                                           "target == 0 -> MISSED")
    blocks = by["strata-verify-0.01", "blocks verified"]
    assert blocks["value"] == 30 and blocks["met"] is None and blocks["bound"] is None
    cost = by["strata-verify-1", "throughput vs strata-l1l2 (verify 0)"]
    assert cost["bound"] is None and cost["met"] is None and cost["value"] == 0.792
    assert len(checks) == len(serve.ratios([r for r in results if r["round"] == 1], 0.6, 64))


def test_rounds_merge_a_target_whose_name_carries_its_rounds_bound_and_skip_a_failed_round():
    from benchmarks import serve_rounds

    results = []
    for n, (base, ours, recomputed) in enumerate(((1.0, 1.6, 30_000), (1.0, None, 30_000), (0.8, 1.2, 32_000)), 1):
        results += [dict(_row("baseline", base, 0.2), tokens_recomputed=recomputed, round=n),
                    dict(_row("strata-l1l2", ours, 0.5), tokens_recomputed=20_000, round=n)]
    checks = serve_rounds.paired(results, lambda rs: serve.ratios(rs, 0.6))
    vs = next(c for c in checks if c["target"] == "throughput vs baseline")
    assert vs["rounds"] == [1.6, None, 1.5] and vs["value"] == 1.55 and vs["met"] is False  # bound 1.6
    assert "[median of 2 paired rounds, 1.500..1.600]" in serve.check_line(vs)
    bound = [c for c in checks if c["target"].startswith("throughput vs baseline / recompute bound (")]
    last = serve.ratios(results[4:], 0.6)  # round 3 alone: bound 1.6, speedup 1.5
    assert [c["value"] for c in last if c["target"] == "throughput vs baseline / recompute bound (1.600)"] == [
        bound[0]["rounds"][2]]
    assert len(bound) == 1 and bound[0]["rounds"][:2] == [1.067, None]  # 1.6 / 1.5
    assert bound[0]["value"] == round((1.067 + bound[0]["rounds"][2]) / 2, 4) and bound[0]["met"] is True


def test_median_rows_and_the_table_of_rounds():
    from benchmarks import serve_rounds

    rows = [_row("strata-l1l2", 1.0, 0.5, round=1, errors=0, tokens_per_tier={"host": 10, "disk": 4}),
            _row("strata-l1l2", 3.0, 0.7, round=2, errors=0, tokens_per_tier={"host": 30}),
            serve.failed("strata-l1l2", 8, 100, "boom") | {"round": 3}]
    med = serve_rounds.median_row(rows)
    assert med["round"] == "median" and med["rounds"] == 3 and med["config"] == "strata-l1l2"
    assert med["throughput_req_s"] == 2.0 and med["hit_rate"] == 0.6 and med["errors"] == 100
    assert med["tokens_per_tier"] == {"host": 20, "disk": 2}  # per key, over the rounds that ran
    assert med["ttft_ms"] == [1.0, 1.0] and med["error_samples"] == ["boom"]
    other = [_row("baseline", 0.5, round=n) for n in (2, 1, 3)]
    shown = serve_rounds.table(rows + other, ["baseline", "strata-l1l2"])
    assert [(r["config"], r["round"]) for r in shown] == [
        ("baseline", 1), ("baseline", 2), ("baseline", 3), ("baseline", "median"),
        ("strata-l1l2", 1), ("strata-l1l2", 2), ("strata-l1l2", 3), ("strata-l1l2", "median")]
    table = serve.markdown(shown).splitlines()
    assert table[0].startswith("| config | concurrency | round | TTFT p50 ms |")
    assert table[-1].startswith("| strata-l1l2 | 8 | median | 66.7 | - | - | - | 2.0 |")


def test_one_round_keeps_the_output_as_it_was():
    results = [_row("strata-l1l2", 1.0, 0.5625, 0.0, 0, 0), _row("strata-verify-0.01", 0.99, 0.5575, 0.01, 5, 0)]
    assert serve.markdown(results).splitlines()[0].startswith("| config | concurrency | TTFT p50 ms |")
    lines = [serve.check_line(c) for c in serve.ratios(results, 0.6, 64)]
    assert "- c=8 strata-verify-0.01: throughput vs strata-l1l2 (verify 0): 0.990, target >= 0.98 -> met" in lines
    assert not any("[" in line for line in lines)


@pytest.mark.parametrize("rounds", [1, 3])
def test_run_all_runs_every_round_rotated_each_server_fresh(monkeypatch, tmp_path, rounds):
    launched = []

    class Ep:
        def send_now(self, prompt: list[int], n: int) -> None:
            pass

        def tier_counts(self) -> None:
            return None

        def scrape(self) -> None:
            return None

    @contextlib.contextmanager
    def launch(s: object, config: str, folder: Path):
        launched.append(folder.name)
        folder.mkdir(parents=True)  # a fresh folder each run: a second run in one would fail here
        if config == "peer" and folder.name.endswith("r2"):
            raise RuntimeError("no start")
        yield Ep()

    turns = _conversations(2, 1)

    def replay(ep: object, ts: list, level: int, tick) -> serve.Record:
        rec = serve.Record(ts)
        for t in ts:
            rec.started[t.index], rec.results[t.index] = 0.0, Result(1.0, 2.0, 1, {"total": 0})
            tick()
        return rec

    monkeypatch.setattr(serve.engines, "launch", launch)
    monkeypatch.setattr(serve, "replay_concurrency", replay)
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    args = argparse.Namespace(block_tokens=64, time_scale=1.0)
    results = serve._run_all(None, ["baseline", "strata-l1l2", "peer"], [8], turns, args, tmp_path, ALLOWED, rounds)
    if rounds == 1:
        assert launched == ["baseline-c8", "strata-l1l2-c8", "peer-c8"]
        assert all("round" not in r for r in results)
        return
    assert launched == ["baseline-c8-r1", "strata-l1l2-c8-r1", "peer-c8-r1", "strata-l1l2-c8-r2", "peer-c8-r2",
                        "baseline-c8-r2", "peer-c8-r3", "baseline-c8-r3", "strata-l1l2-c8-r3"]
    assert [(r["config"], r["round"]) for r in results] == [(n.rsplit("-c8", 1)[0], int(n[-1])) for n in launched]
    failed = next(r for r in results if r["config"] == "peer" and r["round"] == 2)
    assert failed["errors"] == len(turns) and failed["throughput_req_s"] is None
