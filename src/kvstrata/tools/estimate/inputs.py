"""The inputs of ``kvstrata estimate``, each with where it came from.

A flag first, then a file (``bench ttft``/``store``/``remote``/``serve``/``simulate --json`` output,
a model's ``config.json``), then a default or the formula that derived it. ``Gather`` collects
them in that order; bad files are an ``EstimateError`` naming the file, key and value.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any, NamedTuple

from kvstrata.config import parse_size

from kvstrata.tools.estimate.files import wanted, get, load_json, load_model_shape  # noqa: F401  (load_json, load_model_shape: the package's)
from kvstrata.tools.estimate.model import GB, TIERS, EstimateError, Hits, ModelShape, Params, predict

DEFAULT_MFU = 0.4  # prefill's usual share of peak dense FLOP/s on large GPUs: a rough default
# ``tokens_per_tier`` keys of ``bench serve``: vLLM's CacheHitSource values (kvstrata's vLLM adapter
# reports ``host`` for L1 and ``disk`` for blocks staged from its backing tier), SGLang's
# ``cached_tokens_details`` (``storage``: the kvstrata backend) and kvstrata's tier names.
TIER_ALIASES = {"device": "device", "native": "device", "gpu": "device", "local_cache_hit": "device",
                "l1": "l1", "host": "l1", "cpu": "l1", "l2": "l2", "disk": "l2", "l3": "l3",
                "remote": "l3", "redis": "l3", "shared": "l3", "p2p": "l3",
                "external_unspecified": "l1", "external_kv_transfer": "l1", "storage": "l1"}
UNSURE_TIER = ("external_unspecified", "external_kv_transfer", "storage")  # counted as L1: optimistic
# Mean per request under these names; ``bench serve`` gives totals (``settings.prompt_tokens`` over
# ``settings.requests``) and output tokens as throughput_tok_s / throughput_req_s instead.
WORKLOAD_KEYS = {"prompt_tokens": ("mean_prompt_tokens", "prompt_tokens_mean", "avg_prompt_tokens",
                                   "mean_input_tokens"),
                 "output_tokens": ("mean_output_tokens", "output_tokens_mean", "avg_output_tokens"),
                 "block_tokens": ("block_tokens", "block_size")}


class Input(NamedTuple):
    value: Any
    source: str


def _bandwidths(args: argparse.Namespace, block_bytes: float | None) -> dict[str, Input]:
    """GB/s per tier: a flag, else ``bench store`` / ``bench remote`` output, else absent."""
    out: dict[str, Input] = {}
    store = load_json(args.store_json) if args.store_json else None
    column, note = "", ""
    if store is not None and isinstance(store.get("by_block_size"), dict) and store["by_block_size"]:
        sizes = {}
        for label in store["by_block_size"]:
            try:
                sizes[label] = parse_size(label)
            except ValueError:
                raise EstimateError(f"{args.store_json}: key 'by_block_size.{label}': not a size") from None
        target = block_bytes or store.get("block_bytes") or 1
        label = min(sizes, key=lambda k: abs(math.log(sizes[k] / target)))
        column = f"by_block_size.{label}."
        note = f" (the measured block size nearest to {size_text(target)})" if block_bytes else ""
    for tier, flag, key, file in (("l1", args.l1_gbps, "l1_get_gbps", args.store_json),
                                  ("l2", args.l2_gbps, "disk_get_gbps", args.store_json),
                                  ("l3", args.l3_gbps, "strata_redis_get_gbps", args.remote_json)):
        if flag is not None:
            if flag <= 0:
                raise EstimateError(f"--{tier}-gbps: expected a number above 0, found {flag}")
            out[tier] = Input(flag, f"--{tier}-gbps")
        elif file and tier != "l3":
            assert store is not None
            out[tier] = Input(get(store, file, column + key, positive=True), f"{file} {column}{key}{note}")
        elif file:
            out[tier] = Input(get(load_json(file), file, key, positive=True), f"{file} {key}")
    return out


def _tier_hits(args: argparse.Namespace) -> dict[str, Input]:
    """Hit fraction per tier: a ``--hit-*`` flag, else ``simulate --json`` output, else absent."""
    out = {}
    if args.simulate_json:
        sim = load_json(args.simulate_json)
        if not isinstance(sim.get("tiers"), dict):
            raise EstimateError(f"{args.simulate_json}: key 'tiers' is missing "
                                "(not `kvstrata simulate --json` output?)")
        for tier in TIERS:
            if tier in sim["tiers"]:
                key = f"tiers.{tier}.hit_rate"
                out[tier] = Input(get(sim, args.simulate_json, key, hi=1.0), f"{args.simulate_json} {key}")
    for tier in TIERS:
        flag = getattr(args, f"hit_{tier}")
        if flag is not None:
            if not 0 <= flag <= 1:
                raise EstimateError(f"--hit-{tier}: expected a fraction in [0, 1], found {flag}")
            out[tier] = Input(flag, f"--hit-{tier}")
    return out


def _without_device(tiers: dict[str, float], device: float) -> dict[str, float]:
    """Take device-cache hits out of the fastest tiers first.

    ``simulate`` has no device cache, so its hits include what the engine's own (smaller, most
    recent) cache serves; those blocks are the ones L1 holds too.
    """
    left, out = device, {}
    for tier in TIERS:
        take = min(tiers.get(tier, 0.0), left)
        out[tier], left = tiers.get(tier, 0.0) - take, left - take
    return out


def _workload_value(measured: dict[str, Any], name: str) -> tuple[float, str] | None:
    """A workload figure of ``bench serve`` output and the key(s) it came from, if present."""
    dicts = [("", measured), *[(k + ".", v) for k, v in measured.items() if isinstance(v, dict)]]
    for where, obj in dicts:
        for key in WORKLOAD_KEYS[name]:
            if (v := number(obj, key)) is not None and v > 0:
                return v, where + key
    for where, obj in dicts:
        total, n = number(obj, "prompt_tokens"), number(obj, "requests")
        if name == "prompt_tokens" and total and n:
            return total / n, f"{where}prompt_tokens / {where}requests = {total:g} / {n:g}"
    results = [r for r in measured.get("results", []) if isinstance(r, dict)]
    for res in sorted(results, key=lambda r: r.get("config") != "baseline"):
        tok, req = number(res, "throughput_tok_s"), number(res, "throughput_req_s")
        if name == "output_tokens" and tok and req:
            return tok / req, f"{res.get('config')} throughput_tok_s / throughput_req_s = {tok:g} / {req:g}"
    return None


def hits_of_result(res: dict[str, Any]) -> tuple[Hits, str] | None:
    """A measured configuration's hit mix from ``tokens_per_tier`` (and ``hit_rate``), if present.

    ``tokens_per_tier`` holds cached tokens per source (vLLM's ``device``/``host``/``disk``/``p2p``/
    ``external_unspecified`` or kvstrata's tier names); the denominator is its ``prompt``/``total``
    entry, else cached plus ``computed``, else cached / ``hit_rate``.
    """
    tokens, rate = res.get("tokens_per_tier"), number(res, "hit_rate")
    fallback = None if rate is None else (Hits(l1=rate), "hit_rate (all counted as L1)")
    if not isinstance(tokens, dict) or not tokens:
        return fallback
    # A configuration whose backing tier is the shared one (bench serve's strata-remote) stages
    # its ``disk`` blocks from there.
    remote = "remote" in str(res.get("config", ""))
    cached: dict[str, float] = {}
    total, as_l1, ignored = None, [], []
    for key, v in tokens.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            ignored.append(key)
        elif key in ("prompt", "total", "prompt_tokens"):
            total = float(v)
        elif key.lower() in TIER_ALIASES:
            tier = "l3" if remote and key.lower() == "disk" else TIER_ALIASES[key.lower()]
            cached[tier] = cached.get(tier, 0.0) + float(v)
            if key.lower() in UNSURE_TIER and v:
                as_l1.append(key)
        elif key != "computed":
            ignored.append(key)
    if total is None:
        computed = number(tokens, "computed")
        total = (sum(cached.values()) + computed if computed is not None else number(res, "prompt_tokens")
                 or (sum(cached.values()) / rate if rate else None))
    if not total:
        return fallback
    notes = [(as_l1, "counted as L1"), (ignored, "ignored"), (["disk"] if remote and "disk" in tokens else [],
                                                              "counted as L3: staged from the shared tier")]
    note = "".join(f" ({', '.join(keys)} {what})" for keys, what in notes if keys)
    return Hits(**{k: v / total for k, v in cached.items()}), "tokens_per_tier" + note


def size_text(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


class Gather:
    """Collects ``inputs`` (value and source) in order: flags first, then files, then defaults."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.inputs: dict[str, Input] = {}
        self.notes: list[str] = []
        self.measured = load_json(args.measured) if args.measured else None
        if self.measured is not None and not isinstance(self.measured.get("results"), list):
            raise EstimateError(f"{args.measured}: key 'results' is missing or not a list "
                                "(not `python -m benchmarks serve --json` output?)")
        self.ttft = load_json(args.ttft_json) if args.ttft_json else None
        results = self.measured["results"] if self.measured else []
        self.baseline = next((r for r in results if isinstance(r, dict) and r.get("config") == "baseline"), None)

    def flag(self, name: str, *, lo: float = 0.0, hi: float = math.inf, positive: bool = True) -> Input | None:
        value = getattr(self.args, name)
        if value is None:
            return None
        option = "--" + name.replace("_", "-")
        if not lo <= value <= hi or (positive and value <= 0):
            raise EstimateError(f"{option}: expected {wanted(lo, hi, positive)}, found {value:g}")
        return Input(float(value), option)

    def ttft_value(self, key: str, required: bool = True) -> Input | None:
        if self.ttft is None:
            return None
        v = get(self.ttft, self.args.ttft_json, key, required=required, positive=True)
        return None if v is None else Input(v, f"{self.args.ttft_json} {key}")

    def workload(self) -> None:
        """P, O and B: a flag, else the ``--measured`` workload details, else bench ttft's figures."""
        defaults = {"prompt_tokens": self.ttft_value("details.prompt_tokens"),
                    "output_tokens": Input(0.0, "default (no --output-tokens)"),
                    "block_tokens": self.ttft_value("details.block_size", required=False)
                    or Input(128.0, "default (bench ttft's block size)")}
        for name, default in defaults.items():
            found = _workload_value(self.measured, name) if self.measured else None
            inp = self.flag(name) or (Input(found[0], f"{self.args.measured} {found[1]}") if found else default)
            if inp is None:
                raise EstimateError("the prompt length is unknown: give --prompt-tokens (or --ttft-json, --measured)")
            self.inputs[name] = inp

    def model(self) -> ModelShape | None:
        model = load_model_shape(self.args.model_config, self.args.kv_dtype) if self.args.model_config else None
        if (kvb := self.flag("kv_bytes_per_token")) is not None:
            self.inputs["kv_bytes_per_token"] = kvb
        elif model is not None:
            self.inputs["kv_bytes_per_token"] = Input(float(model.kv_bytes_per_token),
                                                      f"{model.path}: {model.kv_formula()}")
        if model is not None:
            self.inputs["params"] = Input(model.params_nonembed + model.params_embed,
                                          f"{model.path}: {model.params_nonembed / 1e6:.1f}M in layers (active: "
                                          f"attention + MLP) + {model.params_embed / 1e6:.1f}M embedding/LM head")
        return model

    def prefill(self, model: ModelShape | None) -> None:
        """T0 and R: flags, else bench ttft's cold run (T0: its fastest full hit), else peak FLOP/s."""
        args, P = self.args, self.inputs["prompt_tokens"].value
        overhead = self.flag("overhead_ms", positive=False)
        if overhead is None and self.ttft is not None and args.prefill_tok_s is None:
            full_hits = [inp for k in ("native_hit_ms", "l1_hit_ms") if (inp := self.ttft_value(k, required=False))]
            if full_hits:
                best = min(full_hits, key=lambda i: i.value)
                listed = ", ".join(f"{i.source.rsplit(' ', 1)[1]} {i.value:g}" for i in full_hits)
                overhead = Input(best.value, f"{args.ttft_json} min({listed}): a full hit's TTFT is the fixed cost")
        self.inputs["overhead_ms"] = T0 = overhead or Input(0.0, "default (no --overhead-ms)")
        rate = self.flag("prefill_tok_s")
        if rate is None and self.ttft is not None:
            cold, n = self.ttft_value("cold_ms"), self.ttft_value("details.prompt_tokens")
            assert cold is not None and n is not None
            if cold.value <= T0.value:
                raise EstimateError(f"{args.ttft_json}: key 'cold_ms': {cold.value:g} is not above the fixed "
                                    f"cost {T0.value:g} ms")
            rate = Input(n.value / ((cold.value - T0.value) / 1e3),
                         f"{args.ttft_json}: details.prompt_tokens / (cold_ms - T0) "
                         f"= {n.value:g} / ({cold.value:g} - {T0.value:g}) ms")
            if n.value != P:
                self.notes.append(f"the prefill rate was measured on {n.value:g} tokens and is applied to {P:g} "
                                  "(attention makes longer prompts slower per token)")
        elif rate is None and args.peak_tflops is not None:
            if model is None:
                raise EstimateError("--peak-tflops needs --model-config (FLOPs per token)")
            peak = self.flag("peak_tflops")
            mfu = self.flag("mfu", hi=1.0) or Input(DEFAULT_MFU, "default --mfu")
            assert peak is not None
            flops = model.flops_per_token(P)
            self.inputs["flops_per_token"] = Input(
                flops, f"{model.path}: 2 x {model.params_nonembed / 1e6:.1f}M + {model.layers} layers x "
                       f"{model.heads} heads x {model.attn_dims} (d_qk + d_v) x P {P:g}")
            rate = Input(peak.value * 1e12 * mfu.value / flops,
                         f"--peak-tflops {peak.value:g} x {mfu.source} {mfu.value:g} / FLOPs per token")
        if rate is None:
            raise EstimateError("the prefill rate is unknown: give --prefill-tok-s, --ttft-json, or "
                                "--peak-tflops with --model-config")
        self.inputs["prefill_tok_s"] = rate

    def tiers(self) -> None:
        """Load bandwidths per tier and the index lookup time."""
        kvb = self.inputs.get("kv_bytes_per_token")
        block_bytes = kvb.value * self.inputs["block_tokens"].value if kvb else None
        for tier, inp in _bandwidths(self.args, block_bytes).items():
            self.inputs[f"{tier}_gbps"] = inp
        if self.args.store_json:
            us = get(load_json(self.args.store_json), self.args.store_json, "lookup_us_per_1k_blocks",
                     required=False)
            if us is not None:
                self.inputs["lookup_us_per_block"] = Input(us / 1000, f"{self.args.store_json} "
                                                                      "lookup_us_per_1k_blocks / 1000")

    def hits(self) -> tuple[Hits, dict[str, float]]:
        """The hit mix of the prediction, and the tiers given as flags (they rule the comparison too)."""
        device = self.flag("hit_device", hi=1.0, positive=False)
        if device is None and self.baseline is not None and (found := hits_of_result(self.baseline)):
            device = Input(found[0].total, f"{self.args.measured} baseline {found[1]}")
        self.inputs["hit_device"] = device or Input(0.0, "default (no --hit-device)")
        given = _tier_hits(self.args)
        for tier in TIERS:
            self.inputs[f"hit_{tier}"] = given.get(tier, Input(0.0, "default"))
        h_dev = self.inputs["hit_device"].value
        tier_hits = {t: self.inputs[f"hit_{t}"].value for t in TIERS}
        if h_dev and any(not inp.source.startswith("--") for inp in given.values()):
            tier_hits = _without_device(tier_hits, h_dev)
            self.notes.append(f"simulate has no device cache: its hits include the device cache's {h_dev:.4g}, "
                              "taken out of the fastest tiers first")
        flags = {t: inp.value for t, inp in given.items() if inp.source.startswith("--")}
        return Hits(device=h_dev, **tier_hits), flags

    def params(self) -> Params:
        """The formulas' numbers; D is a flag, else calibrated on the measured baseline, else absent."""
        v = {k: inp.value for k, inp in self.inputs.items()}
        if (decode := self.flag("decode_tok_s")) is not None:
            self.inputs["decode_tok_s"] = decode
        params = Params(prompt_tokens=v["prompt_tokens"], output_tokens=v["output_tokens"],
                        prefill_tok_s=v["prefill_tok_s"], overhead_s=v["overhead_ms"] / 1e3,
                        decode_tok_s=decode.value if decode else None,
                        kv_bytes_per_token=v.get("kv_bytes_per_token", 0.0),
                        bandwidth={t: v[f"{t}_gbps"] * GB for t in TIERS if f"{t}_gbps" in v},
                        lookup_s_per_block=v.get("lookup_us_per_block", 0.0) * 1e-6,
                        block_tokens=int(v["block_tokens"]), staging=self.args.staging, overlap=self.args.overlap)
        why = "decode not modeled (no --decode-tok-s, or no output tokens and measured baseline to calibrate " \
              "on): the throughput gain is the prefill-only upper bound"
        thr = number(self.baseline, "throughput_req_s") if self.baseline else None
        if decode is None and thr and params.output_tokens:
            # A saturated server's seconds per request, minus its prefill work, is decode work.
            work = predict(params, Hits(device=v["hit_device"])).work_base_s
            if 1 / thr > work:
                self.inputs["decode_tok_s"] = Input(
                    params.output_tokens / (1 / thr - work),
                    f"{self.args.measured} baseline: O / (1/throughput_req_s - W_base without decode) = "
                    f"{params.output_tokens:g} / (1/{thr:g} - {work:.4g}) s (calibrated: the baseline's "
                    "throughput matches by construction)")
                params = replace(params, decode_tok_s=self.inputs["decode_tok_s"].value)
            else:
                why = (f"decode not modeled: the measured baseline ({thr:g} req/s) is faster than its predicted "
                       f"prefill work allows ({1 / work:.4g} req/s)")
        if params.decode_tok_s is None:
            self.notes.append(why)
        return params


def number(res: dict[str, Any], key: str) -> float | None:
    v = res.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
