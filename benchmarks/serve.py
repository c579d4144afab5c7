"""``python -m benchmarks serve``: a Mooncake trace replayed against real servers, one per configuration.

Every configuration (``serve_engines.CONFIGS``) serves the same turns (``serve_workload``) from a
fresh server with fresh store folders, one server at a time, with identical engine settings and a
device KV cache too small for the working set. Each server first answers one untimed request
unrelated to the trace. Requests go out at a fixed concurrency, or on the trace's timestamps;
either way a conversation's turn waits for its previous turn to finish (the next turn's prompt
extends the previous one, as a chat client's would). A failed request is counted, never fatal.

Output: the scaling and settings, a markdown table per run (TTFT p50/p90/p99, end-to-end p50,
requests/s, output tokens/s, hit rate, prompt tokens per tier, verified blocks and mismatches,
errors), the ratios kvstrata's targets (``TARGETS``) are stated in, and with ``--json`` one JSON
object as the last stdout line.

Verified hits (``verify_ratios``): ``strata-verify-*`` are ``strata-l1l2`` with another
``verify.sample_rate`` (``serve_engines.STRATA_L1L2``; ``strata-l1l2`` runs with 0). Up to
``VERIFY_TARGET_RATE`` they are held to ``VERIFY_TARGETS`` beside ``strata-l1l2``; above it the same
figures are printed as the cost of verifying. A verified request loses its hit: the hit rate is
expected to drop by the rate times the share of prompt tokens kvstrata served at rate 0, printed
beside the measured drop and beside the share of prompt tokens the verified blocks hold.

``--rounds N``: every configuration N times, interleaved, each comparison the median of its paired
per-round values (``serve_rounds``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvstrata.tools.trace import load_trace
from benchmarks import serve_disagg
from benchmarks import serve_engines as engines
from benchmarks import serve_rounds
from benchmarks import ttft
from benchmarks.serve_workload import Scaling, Turn, allowed_tokens, build_turns, select, simulate_reference

log = logging.getLogger(__name__)

DEFAULT_CONFIGS = {"vllm": "baseline,strata-l1l2,peer,lmcache", "sglang": "baseline,strata-l1l2,peer"}
STRATA = ("strata-l1l2", "strata-remote")
# (name, other, metric, bound): the targets kvstrata is held to beside each other configuration, per concurrency
TARGETS = (("throughput vs baseline", "baseline", "throughput_req_s", 1.6),
           ("TTFT p50 vs baseline", "baseline", "ttft_p50_ms", 0.5),
           ("throughput vs peer", "peer", "throughput_req_s", 1.2),
           ("throughput vs lmcache", "lmcache", "throughput_req_s", 1.2),
           # SGLang: kvstrata's storage writes (every page) must cost little beside the host pool alone
           ("throughput vs hicache (host pool, no storage)", "hicache", "throughput_req_s", 0.95))
# configs whose recompute bound is printed for reference (what the engine reaches without kvstrata)
REFERENCES = ("hicache", "peer", "lmcache")
# verified hits beside strata-l1l2 (verify.sample_rate 0): (name, metric, bound, how the bound
# reads) at rates up to VERIFY_TARGET_RATE; above it, the same rows with no bound (the cost)
VERIFY_REFERENCE = "strata-l1l2"
VERIFY_TARGET_RATE = 0.01
VERIFY_SERIES = ("verify_checks", "verify_mismatches")  # kvstrata_<name>_total{tier=...} in vLLM's /metrics
VERIFY_TARGETS = (("throughput vs strata-l1l2 (verify 0)", "throughput_req_s", 0.98, ">="),
                  ("TTFT p50 vs strata-l1l2 (verify 0)", "ttft_p50_ms", None, "<="),
                  ("hit rate change vs strata-l1l2 (verify 0)", "hit_rate", 0.01, "|x| <="))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--model", required=True, help="local model folder")
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--sessions", type=int, default=None,
                   help="replay all turns of K conversations sampled with --seed (default 16, unless --requests)")
    p.add_argument("--requests", type=int, default=None, help="a plain slice of N requests instead")
    p.add_argument("--start", type=int, default=0, help="first request of the slice")
    p.add_argument("--seed", type=int, default=0, help="conversation sampling seed")
    p.add_argument("--concurrency", default="8,16", help="comma list of in-flight request limits")
    p.add_argument("--timestamps", action="store_true", help="send on the trace's timestamps instead")
    p.add_argument("--time-scale", type=float, default=0.02,
                   help="with --timestamps: trace seconds are multiplied by this (default %(default)s)")
    p.add_argument("--configs", default=None,
                   help="comma list of baseline,hicache,strata-l1l2,strata-verify-0.01,strata-verify-1,"
                        "strata-remote,peer,lmcache,disagg (hicache: SGLang's host pool, no storage backend; "
                        "strata-verify-R: strata-l1l2 with verify.sample_rate R, every other kvstrata config "
                        "runs with 0; default: "
                        "vllm: baseline,strata-l1l2,peer,lmcache; sglang: baseline,strata-l1l2,peer; "
                        "plus strata-remote when --redis-url is given)")
    p.add_argument("--disagg", action="store_true",
                   help="vLLM: prefill/decode split through the store, 1 prefill + 1 decode server on one Redis "
                        "behind kvstrata.tools.pd_router (config disagg), against one kv_both server and one "
                        "without a connector (default configs then: baseline,strata-remote,disagg)")
    p.add_argument("--redis-url", default=None,
                   help="Redis for strata-remote (flushed first); without it, strata-remote (when "
                        "listed) starts a private redis-server")
    p.add_argument("--block-tokens", type=int, default=64,
                   help="tokens per trace block (the trace's are 512), also the engine block/page size; "
                        "input and output lengths are scaled by it/512 (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=3072, help="prompt cap after scaling")
    p.add_argument("--max-output-tokens", type=int, default=32, help="output cap after scaling")
    p.add_argument("--device-tokens", type=int, default=8192,
                   help="device KV cache of every server, in tokens (vLLM --num-gpu-blocks-override, "
                        "SGLang --max-total-tokens; default %(default)s)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="vLLM --max-num-batched-tokens / SGLang --chunked-prefill-size of every server "
                        "(default: max prompt + max output, so a prompt is rarely split: vLLM's "
                        "ExampleConnector crashes loading a prompt it saved in chunks)")
    p.add_argument("--l1-size", default="2GiB", help="kvstrata CPU tier (LMCache's CPU tier is the same)")
    p.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="SGLang: HiCache host pool / device pool (default %(default)s). SGLang's own host "
                   "pool sits before any storage backend: when device + host hold the working set, storage "
                   "(kvstrata or the file backend) is never read")
    p.add_argument("--dtype", default="auto", help="model dtype of every server")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request and per server start")
    p.add_argument("--lmcache-dir", default=None, help="LMCache install folder (default .venv-lmcache)")
    p.add_argument("--sglang-python", default=None, help="interpreter with sglang (default .venv-sglang)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configurations N times, in an order rotated each round, each server fresh; "
                        "per configuration each round's figures and their median, every comparison the median "
                        "(and range) of the per-round ratios within a round (default %(default)s)")
    p.add_argument("--work", default=None, help="work folder (default: a temporary one, removed)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    p.add_argument("--plot", default=None, help="write a PNG: TTFT CDF and throughput bars")


# ------------------------------------------------------------------------------------------ replay
class Record:
    """What one replay collected (written by its coroutines, on one event loop)."""

    def __init__(self, turns: list[Turn]) -> None:
        self.results: dict[int, engines.Result] = {}
        self.errors: dict[int, str] = {}
        self.started: dict[int, float] = {}
        self.turns = turns
        self.t0 = time.perf_counter()

    def dump(self, path: Path) -> None:
        """One line per request (for looking into a run kept with ``--work``)."""
        with open(path, "w") as f:
            for t in self.turns:
                r = self.results.get(t.index)
                f.write(json.dumps({"index": t.index, "session": t.session, "prompt": len(t.prompt),
                                    "max_tokens": t.max_tokens, "start_s": round(self.started.get(t.index, -1), 3),
                                    "ttft_ms": r and round(r.ttft_ms, 1), "e2e_ms": r and round(r.e2e_ms, 1),
                                    "cached": r and r.cached, "error": self.errors.get(t.index)}) + "\n")


async def _send(http: Any, ep: engines.Endpoint, turn: Turn, rec: Record, tick: Callable[[], None]) -> None:
    rec.started[turn.index] = time.perf_counter() - rec.t0
    try:
        rec.results[turn.index] = await ep.send(http, turn.prompt, turn.max_tokens)
    except Exception as e:  # an I/O edge: any failure is one failed request
        rec.errors[turn.index] = f"{type(e).__name__}: {e}"
    tick()


def replay_concurrency(ep: engines.Endpoint, turns: list[Turn], limit: int, tick: Callable[[], None]) -> Record:
    """``limit`` senders (coroutines); each takes the earliest turn whose conversation has nothing
    in flight."""
    return asyncio.run(_concurrency(ep, turns, limit, tick))


async def _concurrency(ep: engines.Endpoint, turns: list[Turn], limit: int, tick: Callable[[], None]) -> Record:
    rec, pending, busy, cv = Record(turns), list(turns), set(), asyncio.Condition()

    async def take() -> Turn | None:
        async with cv:
            while pending:
                for i, t in enumerate(pending):
                    if t.session not in busy:
                        busy.add(t.session)
                        return pending.pop(i)
                await cv.wait()
            return None

    async def sender(http: Any) -> None:
        while (t := await take()) is not None:
            await _send(http, ep, t, rec, tick)
            async with cv:
                busy.discard(t.session)
                cv.notify_all()

    async with ep.session() as http:
        await asyncio.gather(*(sender(http) for _ in range(limit)))
    return rec


def replay_timestamps(ep: engines.Endpoint, turns: list[Turn], scale: float, tick: Callable[[], None]) -> Record:
    """Each turn at its scaled trace time, or when its conversation's previous turn ends if later."""
    return asyncio.run(_timestamps(ep, turns, scale, tick))


async def _timestamps(ep: engines.Endpoint, turns: list[Turn], scale: float, tick: Callable[[], None]) -> Record:
    rec, t0 = Record(turns), time.monotonic()
    by_session: dict[int, list[Turn]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)

    async def conversation(http: Any, ts: list[Turn]) -> None:
        for t in ts:
            await asyncio.sleep(max(0.0, t0 + t.arrival_s * scale - time.monotonic()))
            await _send(http, ep, t, rec, tick)

    async with ep.session() as http:
        await asyncio.gather(*(conversation(http, ts) for ts in by_session.values()))
    return rec


# ----------------------------------------------------------------------------------------- summary
def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def prompt_wait_s(rec: Record) -> float:
    """Seconds of the replay during which at least one request waited for its first token (the
    union of [sent, sent + TTFT]): time a cache can shorten. The rest of the wall time only
    decodes, whatever the cache holds."""
    spans = sorted((rec.started[i], rec.started[i] + r.ttft_ms / 1000) for i, r in rec.results.items()
                   if i in rec.started)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(config: str, concurrency: int | None, rec: Record, wall_s: float,
              tiers: dict[str, float], verify: dict[str, float] | None = None) -> dict[str, Any]:
    """One row of the report. ``verify``: the run's verified blocks and mismatches per tier
    (``serve_engines.verify_series``), None where the server exports none."""
    ok = [rec.results[i] for i in sorted(rec.results)]
    ttfts = [r.ttft_ms for r in ok]
    prompt = sum(len(rec.turns[i].prompt) for i in rec.results)
    cached = sum(r.cached.get("total", 0) for r in ok)
    # requests that computed nothing of their prompt but its last token (what a decode leg should do)
    whole = sum(r.cached.get("total", 0) >= len(rec.turns[i].prompt) - 1 for i, r in rec.results.items())
    if not tiers:  # SGLang: per request, by where the tokens were found
        for r in ok:
            for k, v in r.cached.items():
                if k != "total" and v:
                    tiers[k] = tiers.get(k, 0) + v
    return {"config": config, "concurrency": concurrency,
            "ttft_p50_ms": _pct(ttfts, 50), "ttft_p90_ms": _pct(ttfts, 90), "ttft_p99_ms": _pct(ttfts, 99),
            "e2e_p50_ms": _pct([r.e2e_ms for r in ok], 50),
            "throughput_req_s": round(len(ok) / wall_s, 4) if wall_s else None,
            "throughput_tok_s": round(sum(r.output_tokens for r in ok) / wall_s, 2) if wall_s else None,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "tokens_per_tier": {k: int(v) for k, v in sorted(tiers.items()) if v},
            "errors": len(rec.errors), "requests": len(rec.turns), "prompt_tokens": prompt,
            "cached_tokens": cached, "tokens_recomputed": prompt - cached, "wall_s": round(wall_s, 2),
            "whole_prompt_hits": round(whole / len(ok), 4) if ok else None,
            "prompt_wait_s": round(min(prompt_wait_s(rec), wall_s), 2),
            "ttft_ms": [round(x, 1) for x in ttfts],
            "error_samples": sorted(set(rec.errors.values()))[:3], **verify_fields(config, verify)}


def verify_fields(config: str, verify: dict[str, float] | None) -> dict[str, Any]:
    """A row's verified hits: its ``verify.sample_rate`` (kvstrata's CPU + disk configs), blocks
    compared and mismatches in all and per tier (None: not exported)."""
    rate = engines.STRATA_L1L2.get(config)
    if verify is None:
        return {"verify_sample_rate": rate, "verify_checks": None, "verify_mismatches": None}
    by = {name: {k[len(name) + 1:]: int(v) for k, v in verify.items() if k.startswith(name + "_") and v}
          for name in VERIFY_SERIES}
    return {"verify_sample_rate": rate, "verify_checks": sum(by["verify_checks"].values()),
            "verify_mismatches": sum(by["verify_mismatches"].values()),
            "verify_checks_by_tier": by["verify_checks"], "verify_mismatches_by_tier": by["verify_mismatches"]}


def failed(config: str, concurrency: int | None, n: int, why: str) -> dict[str, Any]:
    return {"config": config, "concurrency": concurrency, "ttft_p50_ms": None, "ttft_p90_ms": None,
            "ttft_p99_ms": None, "e2e_p50_ms": None, "throughput_req_s": None, "throughput_tok_s": None,
            "hit_rate": None, "tokens_per_tier": {}, "errors": n, "requests": n, "ttft_ms": [],
            "error_samples": [why[-500:]]}


def ratios(results: list[dict[str, Any]], reference: float, block_tokens: int | None = None) -> list[dict[str, Any]]:
    """Every target (``TARGETS``, the P/D pair's, verified hits'), per concurrency and kvstrata config, with its
    measured value (``block_tokens``: the share of prompt tokens the verified blocks hold)."""
    out = []
    for r in results:
        if r["config"] not in STRATA + REFERENCES or r["throughput_req_s"] is None:
            continue
        peers = {o["config"]: o for o in results if o["concurrency"] == r["concurrency"]}
        if r["config"] in REFERENCES:
            out += _bounds(r, peers.get("baseline"), reference=True)
            continue
        for name, other, metric, bound in TARGETS:
            o = peers.get(other)
            if not o or not o[metric] or r[metric] is None:
                continue
            value = r[metric] / o[metric]
            ok = value <= bound if metric.startswith("ttft") else value >= bound
            out.append({"config": r["config"], "concurrency": r["concurrency"], "target": name,
                        "value": round(value, 3), "bound": bound, "met": ok})
        out += _bounds(r, peers.get("baseline"))
        if r["hit_rate"] is not None:
            out.append({"config": r["config"], "concurrency": r["concurrency"],
                        "target": "served fraction vs 0.9 x simulate", "value": r["hit_rate"],
                        "bound": round(0.9 * reference, 4), "met": r["hit_rate"] >= 0.9 * reference})
    return out + serve_disagg.ratios(results) + verify_ratios(results, block_tokens)


def verify_ratios(results: list[dict[str, Any]], block_tokens: int | None = None) -> list[dict[str, Any]]:
    """Each ``strata-verify-*`` run beside ``strata-l1l2`` at its concurrency (``VERIFY_TARGETS``):
    throughput and TTFT p50 ratios; the hit-rate change with ``expected`` (rate x the share of
    prompt tokens kvstrata's tiers served at rate 0) and ``verified_share`` (prompt tokens in the
    verified blocks); blocks verified; mismatches (target 0). Bounds hold up to
    ``VERIFY_TARGET_RATE``; above it the rows are the cost, unbounded, and a verified block is
    required (the check ran)."""
    out: list[dict[str, Any]] = []
    for r in results:
        rate = r.get("verify_sample_rate")
        if not rate or r["throughput_req_s"] is None:
            continue
        bounded = rate <= VERIFY_TARGET_RATE

        def add(target: str, value: float | None, bound: float | None, op: str, note: str = "") -> None:
            met = serve_rounds.judge(value, bound, op)
            out.append({"config": r["config"], "concurrency": r["concurrency"], "target": target, "value": value,
                        "bound": bound, "op": op, "met": met, "note": note})

        base = next((o for o in results if o["config"] == VERIFY_REFERENCE and o["concurrency"] == r["concurrency"]
                     and o["throughput_req_s"]), None)
        for name, metric, bound, op in VERIFY_TARGETS if base else ():
            if r[metric] is None or not base[metric]:
                continue
            if metric != "hit_rate":
                add(name, round(r[metric] / base[metric], 3), bound if bounded else None, op)
                continue
            loaded = serve_disagg.loaded_fraction(base)
            expected = None if loaded is None else round(-rate * loaded, 4)
            share = None
            if block_tokens and r.get("verify_checks") is not None and r.get("prompt_tokens"):
                share = round(r["verify_checks"] * block_tokens / r["prompt_tokens"], 4)
            note = ", ".join([f"{base[metric]} -> {r[metric]}",
                              *([f"expected {expected:+.4f} ({rate:g} x {loaded:.4f} served by kvstrata at 0)"]
                                if expected is not None else []),
                              *([f"verified blocks hold {share:.4f} of prompt tokens"] if share is not None else [])])
            add(name, round(r[metric] - base[metric], 4), bound if bounded else None, op, note)
            out[-1].update(expected=expected, verified_share=share)
        if r.get("verify_checks") is not None:
            add("blocks verified", r["verify_checks"], None if bounded else 0, ">")
            add("verify mismatches", r["verify_mismatches"], 0, "==")
    return out


def _bounds(r: dict[str, Any], base: dict[str, Any] | None, reference: bool = False) -> list[dict[str, Any]]:
    """Throughput over the baseline's as a fraction of what the tokens recomputed allow (target
    0.95), and the same with the baseline's decode-only time held fixed. ``met`` is None for a
    ``reference`` row (another engine path, printed beside ours)."""
    if not (base and base["throughput_req_s"] and r.get("tokens_recomputed") and base.get("tokens_recomputed")):
        return []
    # On a prefill-bound server throughput follows the prompt tokens it recomputes: hits alone
    # allow at most baseline's recomputed tokens / ours.
    bound = base["tokens_recomputed"] / r["tokens_recomputed"]
    speedup = r["throughput_req_s"] / base["throughput_req_s"]
    rows = [(f"throughput vs baseline / recompute bound ({bound:.3f})", speedup / bound)]
    wall, wait = base.get("wall_s"), base.get("prompt_wait_s")
    if wall and wait is not None:
        # A server that also decodes: only the baseline's time with a prompt waiting shrinks with
        # the tokens recomputed; the rest (decode only) stays as it was.
        bound_d = wall / (wall - wait + wait / bound)
        rows.append((f"throughput vs baseline / recompute bound, decode-only time fixed ({bound_d:.3f}; "
                     f"{wall - wait:.0f} of {wall:.0f} s)", speedup / bound_d))
    return [{"config": r["config"], "concurrency": r["concurrency"], "target": name, "value": round(value, 3),
             "bound": 0.95, "met": None if reference else value >= 0.95} for name, value in rows]


def markdown(results: list[dict[str, Any]]) -> str:
    sources = sorted({k for r in results for k in r["tokens_per_tier"]})
    verified = any(r.get("verify_checks") is not None for r in results)
    rounds = any("round" in r for r in results)
    head = ["config", "concurrency", *(["round"] if rounds else []), "TTFT p50 ms", "p90", "p99", "e2e p50 ms",
            "req/s", "out tok/s", "hit rate", *[f"tokens {s}" for s in sources],
            *(["verified blocks", "mismatches"] if verified else []), "errors"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:,.1f}" if isinstance(v, float) and v >= 10 else str(v)

    for r in results:
        cells = [r["config"], "timestamps" if r["concurrency"] is None else r["concurrency"],
                 *([r.get("round")] if rounds else []), r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"],
                 r["e2e_p50_ms"], r["throughput_req_s"], r["throughput_tok_s"], r["hit_rate"],
                 *[r["tokens_per_tier"].get(s, 0) for s in sources],
                 *([r.get("verify_checks"), r.get("verify_mismatches")] if verified else []), r["errors"]]
        rows.append("| " + " | ".join(f(c) for c in cells) + " |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(13, 5))
    for r in results:
        xs = sorted(r["ttft_ms"])
        if xs:
            label = f"{r['config']} c={r['concurrency'] or 'ts'}"
            cdf.step([x / 1000 for x in xs], np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    cdf.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    cdf.grid(alpha=0.3)
    cdf.legend(fontsize=7)
    levels = list(dict.fromkeys(r["concurrency"] for r in results))
    configs = list(dict.fromkeys(r["config"] for r in results))
    width = 0.8 / max(1, len(configs))
    for j, c in enumerate(configs):
        vals = [next((r["throughput_req_s"] or 0 for r in results if r["config"] == c and r["concurrency"] == lv), 0)
                for lv in levels]
        bars.bar(np.arange(len(levels)) + j * width, vals, width, label=c)
    bars.set_xticks(np.arange(len(levels)) + 0.4 - width / 2, [f"c={lv}" if lv else "timestamps" for lv in levels])
    bars.set(ylabel="requests/s", title="throughput")
    bars.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------- run
def _configs(args: argparse.Namespace) -> list[str]:
    disagg = getattr(args, "disagg", False)
    text = args.configs or ("baseline,strata-remote,disagg" if disagg else
                            DEFAULT_CONFIGS[args.engine] + (",strata-remote" if args.redis_url else ""))
    wanted = [c.strip() for c in text.split(",") if c.strip()]
    if unknown := set(wanted) - set(engines.CONFIGS):
        raise SystemExit(f"bench serve: unknown configs {sorted(unknown)} (known: {','.join(engines.CONFIGS)})")
    if args.engine == "sglang" and (only := set(wanted) & {"lmcache", "disagg"}):
        raise SystemExit(f"bench serve: {','.join(sorted(only))} runs with vLLM only")
    if args.engine == "vllm" and (only := set(wanted) & set(engines.SGLANG_ONLY)):
        raise SystemExit(f"bench serve: {','.join(sorted(only))} runs with SGLang only")
    return [c for c in engines.CONFIGS if c in wanted]


def _tokenizer_vocab(model: str) -> tuple[int, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = min(len(tok), cfg.get("vocab_size") or len(tok))
    return vocab, list(tok.all_special_ids)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    configs = _configs(args)
    if args.block_tokens < 1 or (args.engine == "vllm" and args.block_tokens % 32):
        raise SystemExit("bench serve: --block-tokens must be a positive multiple of 32 with vLLM on CPU")
    levels: list[int | None] = [None] if args.timestamps else [int(c) for c in args.concurrency.split(",") if c]
    if not levels or any(c is not None and c < 1 for c in levels):
        raise SystemExit("bench serve: --concurrency needs positive integers")
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise SystemExit("bench serve: --rounds needs a positive integer")
    sessions = None if args.requests else (args.sessions or 16)
    scaling = Scaling(args.block_tokens, args.max_prompt_tokens, args.max_output_tokens)
    reqs = select(load_trace(args.trace), sessions, args.requests, args.start, args.seed)
    if not reqs:
        raise SystemExit("bench serve: no requests selected")
    vocab, special = _tokenizer_vocab(args.model)
    allowed = allowed_tokens(vocab, special)
    turns = build_turns(reqs, scaling, allowed)
    reference = simulate_reference(turns, args.block_tokens)
    device = args.device_tokens // args.block_tokens * args.block_tokens
    settings = engines.Settings(
        engine=args.engine, model=str(Path(args.model).resolve()), block_tokens=args.block_tokens,
        device_tokens=device, max_model_len=args.max_prompt_tokens + args.max_output_tokens,
        max_batched_tokens=args.max_batched_tokens or args.max_prompt_tokens + args.max_output_tokens, dtype=args.dtype,
        l1_size=args.l1_size, redis_url=args.redis_url,
        lmcache_dir=Path(args.lmcache_dir).resolve() if args.lmcache_dir else ttft.lmcache_dir(args),
        sglang_python=args.sglang_python, start_timeout=args.timeout, request_timeout=args.timeout,
        hicache_ratio=args.hicache_ratio)
    prompt_total = sum(len(t.prompt) for t in turns)
    what = (f"{sessions} conversations (seed {args.seed})" if sessions
            else f"requests {args.start}..{args.start + len(reqs) - 1}")
    header = [
        f"# python -m benchmarks serve: {args.engine}, {Path(args.model).name}, {len(turns)} requests from {what} "
        f"of {Path(args.trace).name}",
        f"- scaling: {args.block_tokens} tokens per trace block (x{scaling.factor:g} of 512) for inputs and "
        f"outputs; prompts capped at {args.max_prompt_tokens}, outputs at {args.max_output_tokens} (EOS ignored); "
        f"{prompt_total:,} prompt tokens, mean {prompt_total / len(turns):,.0f}, "
        f"{sum(t.max_tokens for t in turns):,} output tokens",
        f"- device KV cache: {device} tokens ({device // args.block_tokens} blocks of {args.block_tokens}) in every "
        f"server, at most {settings.max_batched_tokens} tokens per step; distinct prompt tokens "
        f"{len({h for t in turns for h in t.hash_ids}) * args.block_tokens:,}",
        f"- kvstrata / LMCache CPU tier {args.l1_size}; "
        + ("on trace timestamps x%g" % args.time_scale if args.timestamps else f"concurrency {args.concurrency}"),
        f"- simulate (real index, unbounded cache, same requests): {reference:.1%} of prompt tokens served",
        *([f"- {rounds} rounds, the configurations' order rotated each round; comparisons: the median of the "
           f"per-round paired ratios [min..max]"] if rounds > 1 else []),
    ]
    print("\n".join(header), flush=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kvstrata-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    results = _run_all(settings, configs, levels, turns, args, work, allowed, rounds)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    if rounds > 1:
        shown = serve_rounds.table(results, configs)
        medians = [r for r in shown if r["round"] == "median"]
        checks = serve_rounds.paired(results, lambda rs: ratios(rs, reference, args.block_tokens))
    else:
        shown = medians = results
        checks = ratios(results, reference, args.block_tokens)
    print()
    print(markdown(shown))
    print()
    for c in checks:
        print(check_line(c))
    if args.plot:
        plot(medians, args.plot, header[0].lstrip("# "))
        print(f"plot: {args.plot}")
    if args.json:
        summary = {"results": [{k: v for k, v in r.items() if k not in ("ttft_ms",)} for r in results],
                   **({"medians": [{k: v for k, v in r.items() if k != "ttft_ms"} for r in medians]}
                      if rounds > 1 else {}),
                   "targets": checks, "simulate_unbounded_hit_rate": round(reference, 4),
                   "settings": {"engine": args.engine, "model": settings.model, "requests": len(turns),
                                "sessions": sessions, "block_tokens": args.block_tokens,
                                "device_tokens": device, "max_batched_tokens": settings.max_batched_tokens,
                                "max_prompt_tokens": args.max_prompt_tokens,
                                "max_output_tokens": args.max_output_tokens, "prompt_tokens": prompt_total,
                                "l1_size": args.l1_size, "hicache_ratio": args.hicache_ratio,
                                "timestamps": args.timestamps, "disagg": getattr(args, "disagg", False),
                                "rounds": rounds,
                                "time_scale": args.time_scale if args.timestamps else None}}
        print(json.dumps(summary))
    return 0 if all(r["errors"] == 0 for r in results) else 1


def check_line(c: dict[str, Any]) -> str:
    """One printed comparison: its value, and its bound and verdict when it has one."""
    value = c["value"]

    def fmt(v: Any) -> str:
        return str(v) if isinstance(v, int) else f"{v:+.4f}" if c.get("op") == "|x| <=" else f"{v:.3f}"

    shown = fmt(value) + (f" (TTFT change {value - 1:+.0%})" if "TTFT" in c["target"] else "")
    shown += serve_rounds.span(c, fmt)
    shown += f" ({c['note']})" if c.get("note") else ""
    line = f"- c={c['concurrency'] or 'ts'} {c['config']}: {c['target']}: {shown}"
    if c["bound"] is None:  # a comparison printed for reference, with no bound
        return line
    op = c.get("op") or ("<=" if "TTFT" in c["target"] else ">=")
    return (f"{line}, target {op} {c['bound']} -> "
            f"{'reference' if c['met'] is None else 'met' if c['met'] else 'MISSED'}")


def _run_all(s: engines.Settings, configs: list[str], levels: list[int | None], turns: list[Turn],
             args: argparse.Namespace, work: Path, allowed: np.ndarray, rounds: int = 1) -> list[dict[str, Any]]:
    """Each configuration at each level from a fresh server; with ``rounds`` > 1 all of them
    ``rounds`` times (round by round, the configurations rotated: ``serve_rounds.order``), each
    row with its ``round`` (from 1)."""
    from tqdm import tqdm

    rng = np.random.default_rng(1 << 33)  # the warm-up prompt: no trace block can produce it
    warm = allowed[rng.integers(0, len(allowed), 2 * args.block_tokens + 7)].tolist()
    results = []
    bar = tqdm(total=len(turns) * len(configs) * len(levels) * rounds, file=sys.stderr, unit="req", dynamic_ncols=True)
    lock = threading.Lock()
    sent = [0]  # requests of the current run done, so a failed run can complete its share

    def tick() -> None:
        with lock:
            sent[0] += 1
            bar.update(1)

    try:
        for round_, level in ((n, lv) for n in range(rounds) for lv in levels):
            for config in serve_rounds.order(configs, round_):
                name = (f"{config}-c{level}" if level else f"{config}-ts") + (f"-r{round_ + 1}" if rounds > 1 else "")
                bar.set_description(f"{name}: starting")
                sent[0] = 0
                try:
                    with engines.launch(s, config, work / name) as ep:
                        ep.send_now(warm, 4)
                        before, before_verify = ep.tier_counts(), verify_counts(ep)
                        bar.set_description(name)
                        start = time.perf_counter()
                        rec = (replay_timestamps(ep, turns, args.time_scale, tick) if level is None
                               else replay_concurrency(ep, turns, level, tick))
                        wall = time.perf_counter() - start
                        rec.dump(work / name / "requests.jsonl")
                        time.sleep(1.0)  # the engine's stats reach /metrics after its next step
                        after = ep.tier_counts()
                        verified = _verified(ep, warm[:7], before_verify)
                    tiers = ({k: v - before.get(k, 0.0) for k, v in after.items()} if after is not None
                             and before is not None else {})
                    results.append(summarize(config, level, rec, wall, tiers, verified))
                except Exception as e:  # a server that cannot start fails its run, not the bench
                    log.error("%s: %s", name, e)
                    log.debug("%s", traceback.format_exc())
                    results.append(failed(config, level, len(turns), f"{type(e).__name__}: {e}"))
                    bar.update(len(turns) - sent[0])
                if rounds > 1:
                    results[-1]["round"] = round_ + 1
    finally:
        bar.close()
    return results


def _verified(ep: engines.Endpoint, flush: list[int], before: dict[str, float] | None) -> dict[str, float] | None:
    """The run's verified blocks and mismatches (``verify_counts`` since ``before``). A
    block is compared once every writer reported its copy, which may be after the last request's
    step: one more untimed request (``flush``: shorter than a block, so nothing of it can hit or be
    verified; sent after the tier counts were read) gives the engine the steps that report it."""
    if before is None:
        return None
    with contextlib.suppress(Exception):  # an I/O edge: the counts are read all the same
        ep.send_now(flush, 2)
    time.sleep(1.0)
    after = verify_counts(ep)
    return None if after is None else {k: v - before.get(k, 0.0) for k, v in after.items()}


def verify_counts(ep: engines.Endpoint) -> dict[str, float] | None:
    """Cumulative verified blocks and mismatches of ``ep`` (``verify_series``); None where
    ``Endpoint.scrape`` gives nothing (SGLang, a dead server)."""
    text = ep.scrape()
    return None if text is None else verify_series(text)


def verify_series(metrics_text: str) -> dict[str, float]:
    """``kvstrata_verify_checks_total`` and ``kvstrata_verify_mismatches_total`` from a Prometheus
    scrape, summed per tier under the store's counter names (``verify_checks_l1``, ...)."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for name in VERIFY_SERIES:
            if line.startswith(f"kvstrata_{name}_total{{"):
                labels, value = line.rsplit(" ", 1)
                tier = labels.split('tier="', 1)[1].split('"', 1)[0] if 'tier="' in labels else "all"
                out[f"{name}_{tier}"] = out.get(f"{name}_{tier}", 0.0) + float(value)
    return out
