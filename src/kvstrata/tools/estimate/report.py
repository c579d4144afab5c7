"""What ``kvstrata estimate`` prints: inputs, formulas, intermediate numbers, the prediction, and
with ``--measured`` the comparison of each measured configuration with its prediction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from kvstrata.tools.estimate.inputs import Input, hits_of_result, number, size_text
from kvstrata.tools.estimate.model import GB, EstimateError, Hits, Params, Prediction, predict, rounded


@dataclass
class Estimate:
    inputs: dict[str, Input]
    params: Params
    hits: Hits
    hits_source: str
    prediction: Prediction
    comparison: list[dict[str, Any]]
    notes: list[str]


def compare(measured: dict[str, Any], params: Params, input_hits: Hits, input_source: str,
             hit_flags: dict[str, float]) -> list[dict[str, Any]]:
    """Per measured configuration: predicted vs measured TTFT p50, throughput and gains over baseline.

    Each kvstrata configuration is predicted from its own measured hit mix, so the comparison tests
    the timing model (``--hit-*`` flags override single tiers); a result without hit data falls
    back to the input hits. The baseline keeps only its device-cache hits.
    """
    results = [r for r in measured["results"] if isinstance(r, dict)]
    rows = []
    for res in results:
        is_base = res.get("config") == "baseline"
        found = hits_of_result(res)
        if is_base:
            hits, source = Hits(device=found[0].total if found else input_hits.device), \
                (found[1] if found else "inputs")
        elif found:
            hits, source = replace(found[0], **hit_flags), found[1] + (" and --hit-* flags" if hit_flags else "")
        else:
            hits, source = input_hits, f"inputs ({input_source})"
        row: dict[str, Any] = {"config": res.get("config", "n/a"), "concurrency": res.get("concurrency"),
                               "hits_source": source, "hits": {k: rounded(v, 6) for k, v in
                                                               {"device": hits.device, **hits.tiers}.items()},
                               "measured_hit_rate": number(res, "hit_rate"),
                               "input_hit_rate": rounded(input_hits.device if is_base else input_hits.total, 6)}
        try:
            pred: Prediction | None = predict(params, hits)
        except EstimateError as e:
            pred, row["error"] = None, str(e)
        pred_ttft = pred_thr = None
        if pred is not None:
            pred_ttft = (pred.ttft_base_s if is_base else pred.ttft_s) * 1e3
            pred_thr = 1 / (pred.work_base_s if is_base else pred.work_s)
        meas_ttft, meas_thr = number(res, "ttft_p50_ms"), number(res, "throughput_req_s")
        row["ttft_p50_ms"] = _triple(meas_ttft, pred_ttft)
        row["throughput_req_s"] = _triple(meas_thr, pred_thr)
        base = next((b for b in results if b.get("config") == "baseline"
                     and b.get("concurrency") == res.get("concurrency")), None)
        if not is_base:
            row["ttft_gain"] = row["throughput_gain"] = _triple(None, None)
        if base is not None and not is_base:
            base_found = hits_of_result(base)
            base_pred = predict(params, Hits(device=base_found[0].total if base_found else input_hits.device))
            mb_ttft, mb_thr = number(base, "ttft_p50_ms"), number(base, "throughput_req_s")
            if meas_thr is None or mb_thr is None:  # tokens/s gives the same ratio
                meas_thr, mb_thr = number(res, "throughput_tok_s"), number(base, "throughput_tok_s")
            row["ttft_gain"] = _triple(mb_ttft / meas_ttft if mb_ttft and meas_ttft else None,
                                       None if pred is None else base_pred.ttft_base_s / pred.ttft_s)
            row["throughput_gain"] = _triple(meas_thr / mb_thr if meas_thr and mb_thr else None,
                                             None if pred is None else base_pred.work_base_s / pred.work_s)
        rows.append(row)
    return rows


def _triple(measured: float | None, predicted: float | None) -> dict[str, float | None]:
    """Measured, predicted and the relative error (predicted - measured) / measured."""
    err = None if measured is None or predicted is None or not measured else (predicted - measured) / measured
    return {"measured": rounded(measured), "predicted": rounded(predicted), "error": rounded(err, 3)}


LABELS = {"prompt_tokens": ("P", "prompt tokens"), "output_tokens": ("O", "output tokens"),
          "block_tokens": ("B", "tokens per block"), "kv_bytes_per_token": ("kv", "KV bytes per token"),
          "params": ("N", "parameters"), "overhead_ms": ("T0", "fixed per-request cost, ms"),
          "flops_per_token": ("F", "prefill FLOPs per token"), "prefill_tok_s": ("R", "prefill tokens/s"),
          "decode_tok_s": ("D", "decode tokens/s of the server"), "l1_gbps": ("bw_l1", "L1 load GB/s"),
          "l2_gbps": ("bw_l2", "L2 load GB/s"), "l3_gbps": ("bw_l3", "L3 load GB/s"),
          "lookup_us_per_block": ("t_lk", "index lookup us per block"),
          "hit_device": ("h_dev", "device prefix-cache hit"), "hit_l1": ("h_l1", "L1 hit"),
          "hit_l2": ("h_l2", "L2 hit"), "hit_l3": ("h_l3", "L3 hit")}

FORMULAS = [
    "T_compute = (1 - h_dev - h_l1 - h_l2 - h_l3) * P / R",
    "T_load_i  = h_i * P * kv / bw_i'   (1/bw_i' = 1/bw_i + 1/bw_l1 for L2, L3: staged through L1)",
    "T_lookup  = ceil(P / B) * t_lk",
    "TTFT_base = T0 + (1 - h_dev) * P / R",
    "TTFT      = T0 + T_lookup + T_compute + sum_i T_load_i",
    "W_base    = (1 - h_dev) * P / R + O / D            (server seconds per request)",
    "W         = T_lookup + T_compute + sum_i T_load_i + O / D",
    "gains     = TTFT_base / TTFT, W_base / W           (throughput of a prefill-bound server)",
]


def _formulas(p: Params) -> list[str]:
    out = list(FORMULAS)
    if not p.staging:
        out[1] = "T_load_i  = h_i * P * kv / bw_i   (--no-staging)"
    if p.overlap:
        out[4] = "TTFT      = T0 + T_lookup + max(T_compute, sum_i T_load_i)   (--overlap)"
        out[6] = "W         = T_lookup + T_compute + O / D   (--overlap: loads hidden behind compute)"
    if p.decode_tok_s is None:
        out[5] = "W_base    = (1 - h_dev) * P / R                   (decode not modeled)"
        out[6] = out[6].replace(" + O / D", "")
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, (int, float)) and (float(v).is_integer() or abs(v) >= 1e5):
        return f"{v:,.0f}"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def as_dict(e: Estimate) -> dict[str, Any]:
    return {"inputs": {k: {"value": rounded(v.value, 6) if isinstance(v.value, float) else v.value, "source": v.source}
                       for k, v in e.inputs.items()},
            "assumptions": {"staging": e.params.staging, "overlap": e.params.overlap},
            "formulas": _formulas(e.params),
            "hits_used": {k: rounded(v, 6) for k, v in {"device": e.hits.device, **e.hits.tiers}.items()},
            "prediction": e.prediction.as_dict(), "comparison": e.comparison, "notes": e.notes}


def print_text(e: Estimate) -> None:
    pr = e.prediction
    print("kvstrata estimate: one representative request, baseline (engine's own cache) vs kvstrata\n")
    print("inputs")
    for k, inp in e.inputs.items():
        sym, label = LABELS.get(k, (k, k))
        print(f"  {sym:<6}{label:<31}{_fmt(inp.value):>14}   {inp.source}")
    staging = "L2/L3 staged through L1" if e.params.staging else "L2/L3 loaded directly (--no-staging)"
    overlap = "loads overlap compute (--overlap)" if e.params.overlap else "loads serial with compute (no --overlap)"
    print(f"  assumptions: {staging}; {overlap}")
    print("\nformulas")
    for f in _formulas(e.params):
        print(f"  {f}")
    print("\nintermediate")
    print(f"  hits used   device {e.hits.device:.4g}, L1 {e.hits.l1:.4g}, L2 {e.hits.l2:.4g}, L3 {e.hits.l3:.4g}"
          f" (computed {max(0.0, 1 - e.hits.total):.4g})")
    base_compute = pr.ttft_base_s - e.params.overhead_s
    print(f"  T_compute   {pr.compute_s * 1e3:.4g} ms (baseline {base_compute * 1e3:.4g} ms)")
    for tier, s in pr.load_s.items():
        nbytes = getattr(e.hits, tier) * e.params.prompt_tokens * e.params.kv_bytes_per_token
        print(f"  T_load_{tier}   {s * 1e3:.4g} ms ({size_text(nbytes)} at {nbytes / s / GB:.4g} GB/s effective)")
    blocks = math.ceil(e.params.prompt_tokens / e.params.block_tokens)
    print(f"  T_lookup    {pr.lookup_s * 1e3:.4g} ms ({blocks} blocks)")
    if e.params.decode_tok_s:
        print(f"  O / D       {pr.decode_s * 1e3:.4g} ms")
    print(f"  W_base      {pr.work_base_s * 1e3:.4g} ms, W {pr.work_s * 1e3:.4g} ms")
    print("\nprediction")
    print(f"  TTFT        baseline {pr.ttft_base_s * 1e3:,.1f} ms, kvstrata {pr.ttft_s * 1e3:,.1f} ms: "
          f"gain {pr.ttft_gain:.3g}x")
    print(f"  throughput  baseline {1 / pr.work_base_s:.4g} req/s, kvstrata {1 / pr.work_s:.4g} req/s: "
          f"gain {pr.throughput_gain:.3g}x")
    for note in e.notes:
        print(f"  note: {note}")
    if e.comparison:
        _print_comparison(e.comparison)


def _cell(d: dict[str, Any] | None) -> str:
    """``measured / predicted / error%``, n/a for what is missing."""
    if not d:
        return "n/a"
    err = "n/a" if d["error"] is None else f"{round(d['error'] * 100, 1) + 0.0:+.1f}%"
    return " / ".join("n/a" if v is None else f"{v:.4g}" for v in (d["measured"], d["predicted"])) + f" / {err}"


def _print_comparison(rows: list[dict[str, Any]]) -> None:
    print("\nmeasured (bench serve) vs predicted: measured / predicted / error")
    print("  each row is predicted from its own measured hit mix; the model has no queueing, so at "
          "concurrency > 1 compare the gains first")
    print(f"  {'config':<14}{'conc':>5}  {'hit meas/input':<16}{'TTFT p50 ms':<28}{'TTFT gain':<24}"
          f"{'req/s':<26}{'throughput gain':<24}")
    for r in rows:
        hit = " / ".join("n/a" if v is None else f"{v:.3g}" for v in (r["measured_hit_rate"], r["input_hit_rate"]))
        print(f"  {str(r['config']):<14}{str(r['concurrency'] if r['concurrency'] is not None else 'n/a'):>5}  "
              f"{hit:<16}{_cell(r['ttft_p50_ms']):<28}{_cell(r.get('ttft_gain')):<24}"
              f"{_cell(r['throughput_req_s']):<26}{_cell(r.get('throughput_gain')):<24}")
        if "error" in r:
            print(f"    ({r['error']})")
        if r["hits_source"] != "tokens_per_tier":
            print(f"    (hits from {r['hits_source']})")
