"""``kvstrata estimate``: a transparent model of the TTFT and throughput gains of kvstrata.

One representative request of ``P`` prompt tokens and ``O`` output tokens. A fraction ``h_dev`` of
its prompt is in the engine's own device prefix cache (in both runs); with kvstrata, fractions
``h_l1``, ``h_l2``, ``h_l3`` are loaded from the tiers instead of being computed::

    T_compute = (1 - h_dev - h_l1 - h_l2 - h_l3) * P / R           R: prefill tokens/s
    T_load    = sum_i h_i * P * kv_bytes_per_token / bw_i'          1/bw_i' = 1/bw_i + 1/bw_l1 for
                                                                   L2/L3 (staged through L1)
    TTFT_base = T0 + (1 - h_dev) * P / R                           T0: fixed per-request cost
    TTFT      = T0 + T_lookup + T_compute + T_load                 (--overlap: max(T_compute, T_load))
    W_base    = (1 - h_dev) * P / R + O / D                        server seconds per request
    W         = T_lookup + T_compute + T_load + O / D              (--overlap: without T_load)
    gains     = TTFT_base / TTFT and W_base / W                    (a prefill-bound server)

Assumptions: prefill costs the same per token whatever the prompt's length and cached context
(attention's growth with context is ignored); loads are serial with compute unless ``--overlap``;
L2/L3 blocks pass through L1 first, as in the vLLM adapter, unless ``--no-staging``; a request
never waits for another (no queueing, no batching effects on R); decode costs the server ``O / D``
seconds per request, D being the whole server's decode tokens/s.

Every input is printed with where it came from (a flag, a file and key, a default, or the
formula that derived it), then the intermediate numbers. With ``--measured`` (``bench serve
--json``), each kvstrata configuration is predicted from its own measured hit mix and compared
with what was measured. Bad input files are a ``ValueError`` naming the file, key and value.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

TIERS = ("l1", "l2", "l3")
GB = 1e9
DEFAULT_MFU = 0.4  # prefill's usual share of peak dense FLOP/s on large GPUs: a rough default
DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2,
               "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1}
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


class EstimateError(ValueError):
    """An input the user has to fix; the message names the file or flag, the key and the value."""


class Input(NamedTuple):
    value: Any
    source: str


# -- input files ---------------------------------------------------------------------------------

def load_json(path: str) -> dict[str, Any]:
    """The last line of ``path`` that parses as a JSON object (commands may print progress first)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise EstimateError(f"{path}: cannot read ({e.strerror})") from None
    for line in reversed(text.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    try:
        obj = json.loads(text)  # a pretty-printed file
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        return obj
    raise EstimateError(f"{path}: no line is a JSON object")


def get(obj: dict[str, Any], path: str, key: str, *, required: bool = True, lo: float = 0.0,
        hi: float = math.inf, positive: bool = False) -> float | None:
    """The number at dotted ``key`` of ``obj``, checked against [lo, hi] (and > 0 if ``positive``)."""
    value: Any = obj
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            if required:
                raise EstimateError(f"{path}: key '{key}' is missing")
            return None
        value = value[part]
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < lo or value > hi or (positive and value <= 0):
        raise EstimateError(f"{path}: key '{key}': expected {_wanted(lo, hi, positive)}, found {value!r}")
    return float(value)


def _wanted(lo: float, hi: float, positive: bool) -> str:
    if positive and hi == math.inf:
        return "a number above 0"
    return f"a number in [{lo:g}, {hi:g}]" + (" above 0" if positive else "")


# -- model shape ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a Hugging Face ``config.json``."""

    path: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    dtype_bytes: int
    mla_dims: int  # kv_lora_rank + qk_rope_head_dim for MLA models, else 0
    attn_dims: int  # per head and (query, key) pair: QK^T over d_qk plus AV over d_v
    params_nonembed: int  # active (per token) parameters of the layers: attention + MLP/experts
    params_embed: int

    @property
    def kv_bytes_per_token(self) -> int:
        if self.mla_dims:
            return self.layers * self.mla_dims * self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_formula(self) -> str:
        if self.mla_dims:
            return (f"{self.layers} layers x {self.mla_dims} (kv_lora_rank + qk_rope_head_dim, MLA) x "
                    f"{self.dtype_bytes} B ({self.dtype})")
        return (f"2 (K,V) x {self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} head_dim x "
                f"{self.dtype_bytes} B ({self.dtype})")

    def flops_per_token(self, prompt_tokens: float) -> float:
        """Prefill FLOPs per prompt token, averaged over a causal prompt of ``prompt_tokens``.

        2 per active layer parameter (the embedding is a lookup; logits are computed for the last
        token only), plus attention: 2 FLOPs per dimension for each (query, key) pair, P/2 keys per
        query on average.
        """
        return 2 * self.params_nonembed + self.layers * self.heads * self.attn_dims * prompt_tokens


def load_model_shape(path: str, kv_dtype: str | None = None) -> ModelShape:
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    cfg = load_json(str(file))
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # multimodal wrappers keep the language model's shape here

    def num(key: str, default: float | None = None) -> int:
        if key not in cfg or cfg[key] is None:
            if default is None:
                raise EstimateError(f"{file}: key '{key}' is missing")
            return int(default)
        return int(get(cfg, str(file), key, positive=True))  # type: ignore[arg-type]

    hidden, layers, heads = num("hidden_size"), num("num_hidden_layers"), num("num_attention_heads")
    kv_heads = num("num_key_value_heads", heads)
    head_dim = num("head_dim", hidden // heads)
    dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if str(dtype).lower() not in DTYPE_BYTES:
        where = "--kv-dtype" if kv_dtype else f"{file}: key 'torch_dtype'/'dtype'"
        raise EstimateError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    if "kv_lora_rank" in cfg:  # MLA (DeepSeek V2/V3): one compressed latent per token and layer
        rank, rope = num("kv_lora_rank"), num("qk_rope_head_dim")
        nope, v_dim = num("qk_nope_head_dim", head_dim - rope), num("v_head_dim", head_dim)
        q_rank = int(cfg.get("q_lora_rank") or 0)
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
        mla_dims, attn_dims = rank + rope, nope + rope + v_dim
    else:
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        mla_dims, attn_dims = 0, 2 * head_dim
    dense_mlp = 3 * hidden * num("intermediate_size", 4 * hidden)  # gated: gate, up, down
    experts_per_tok = int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 0)
    if experts_per_tok:
        moe_inter = num("moe_intermediate_size", cfg.get("intermediate_size") or 4 * hidden)
        shared = int(cfg.get("n_shared_experts") or 0) * 3 * hidden * moe_inter
        shared += 3 * hidden * int(cfg.get("shared_expert_intermediate_size") or 0)
        moe_mlp = experts_per_tok * 3 * hidden * moe_inter + shared
        dense_layers = min(layers, int(cfg.get("first_k_dense_replace") or 0))
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    vocab = num("vocab_size")
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return ModelShape(str(file), layers, heads, kv_heads, head_dim, str(dtype).lower(),
                      DTYPE_BYTES[str(dtype).lower()], mla_dims, attn_dims, layers * attn + mlp_total, embed)


# -- the model -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hits:
    """Fractions of the prompt's tokens served by each cache (the rest is computed)."""

    device: float = 0.0
    l1: float = 0.0
    l2: float = 0.0
    l3: float = 0.0

    @property
    def tiers(self) -> dict[str, float]:
        return {"l1": self.l1, "l2": self.l2, "l3": self.l3}

    @property
    def total(self) -> float:
        return self.device + self.l1 + self.l2 + self.l3


@dataclass(frozen=True)
class Params:
    """The numbers the formulas use; seconds, bytes and bytes per second."""

    prompt_tokens: float
    output_tokens: float
    prefill_tok_s: float
    overhead_s: float = 0.0
    decode_tok_s: float | None = None  # None: decode not modeled
    kv_bytes_per_token: float = 0.0
    bandwidth: dict[str, float] = field(default_factory=dict)  # tier -> bytes/s
    lookup_s_per_block: float = 0.0
    block_tokens: int = 128
    staging: bool = True
    overlap: bool = False

    def seconds_per_byte(self, tier: str) -> float:
        t = 1.0 / self.bandwidth[tier]
        if tier != "l1" and self.staging:
            t += 1.0 / self.bandwidth["l1"]
        return t


class Prediction(NamedTuple):
    ttft_base_s: float
    ttft_s: float
    compute_s: float
    load_s: dict[str, float]
    lookup_s: float
    decode_s: float
    work_base_s: float
    work_s: float

    @property
    def ttft_gain(self) -> float:
        return self.ttft_base_s / self.ttft_s

    @property
    def throughput_gain(self) -> float:
        return self.work_base_s / self.work_s

    def as_dict(self) -> dict[str, Any]:
        return {"ttft_base_ms": _r(self.ttft_base_s * 1e3), "ttft_ms": _r(self.ttft_s * 1e3),
                "compute_ms": _r(self.compute_s * 1e3),
                "load_ms": {k: _r(v * 1e3) for k, v in self.load_s.items()},
                "lookup_ms": _r(self.lookup_s * 1e3), "decode_ms": _r(self.decode_s * 1e3),
                "work_base_s": _r(self.work_base_s), "work_s": _r(self.work_s),
                "throughput_base_req_s": _r(1 / self.work_base_s), "throughput_req_s": _r(1 / self.work_s),
                "ttft_gain": _r(self.ttft_gain), "throughput_gain": _r(self.throughput_gain)}


def predict(p: Params, hits: Hits) -> Prediction:
    """Baseline (device cache only) and kvstrata timings of one request; see the module docstring."""
    if hits.total > 1 + 1e-9:
        raise EstimateError(f"hit fractions add up to {hits.total:.4f} > 1 ({hits})")
    P, R = p.prompt_tokens, p.prefill_tok_s
    compute_base = (1 - hits.device) * P / R
    compute = max(0.0, 1 - hits.total) * P / R
    load = {}
    for tier, h in hits.tiers.items():
        if h > 0:
            if tier not in p.bandwidth or (p.staging and "l1" not in p.bandwidth):
                raise EstimateError(f"{tier} hit fraction is {h} but no {tier} bandwidth is known: give "
                                    f"--{tier}-gbps or --{'remote' if tier == 'l3' else 'store'}-json")
            load[tier] = h * P * p.kv_bytes_per_token * p.seconds_per_byte(tier)
    if load and not p.kv_bytes_per_token:
        raise EstimateError("tier hits need the KV size of a token: give --model-config or --kv-bytes-per-token")
    load_total = sum(load.values())
    lookup = math.ceil(P / p.block_tokens) * p.lookup_s_per_block
    decode = p.output_tokens / p.decode_tok_s if p.decode_tok_s else 0.0
    prefill = max(compute, load_total) if p.overlap else compute + load_total
    return Prediction(ttft_base_s=p.overhead_s + compute_base,
                      ttft_s=p.overhead_s + lookup + prefill,
                      compute_s=compute, load_s=load, lookup_s=lookup, decode_s=decode,
                      work_base_s=compute_base + decode,
                      work_s=lookup + compute + (0.0 if p.overlap else load_total) + decode)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


# -- gathering inputs ----------------------------------------------------------------------------

def _bandwidths(args: argparse.Namespace, block_bytes: float | None) -> dict[str, Input]:
    """GB/s per tier: a flag, else ``bench store`` / ``bench remote`` output, else absent."""
    out: dict[str, Input] = {}
    store = load_json(args.store_json) if args.store_json else None
    column, note = "", ""
    if store is not None and isinstance(store.get("by_block_size"), dict) and store["by_block_size"]:
        from .config import parse_size

        sizes = {}
        for label in store["by_block_size"]:
            try:
                sizes[label] = parse_size(label)
            except ValueError:
                raise EstimateError(f"{args.store_json}: key 'by_block_size.{label}': not a size") from None
        target = block_bytes or store.get("block_bytes") or 1
        label = min(sizes, key=lambda k: abs(math.log(sizes[k] / target)))
        column = f"by_block_size.{label}."
        note = f" (the measured block size nearest to {_size(target)})" if block_bytes else ""
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
            if (v := _num(obj, key)) is not None and v > 0:
                return v, where + key
    for where, obj in dicts:
        total, n = _num(obj, "prompt_tokens"), _num(obj, "requests")
        if name == "prompt_tokens" and total and n:
            return total / n, f"{where}prompt_tokens / {where}requests = {total:g} / {n:g}"
    results = [r for r in measured.get("results", []) if isinstance(r, dict)]
    for res in sorted(results, key=lambda r: r.get("config") != "baseline"):
        tok, req = _num(res, "throughput_tok_s"), _num(res, "throughput_req_s")
        if name == "output_tokens" and tok and req:
            return tok / req, f"{res.get('config')} throughput_tok_s / throughput_req_s = {tok:g} / {req:g}"
    return None


def _hits_of_result(res: dict[str, Any]) -> tuple[Hits, str] | None:
    """A measured configuration's hit mix from ``tokens_per_tier`` (and ``hit_rate``), if present.

    ``tokens_per_tier`` holds cached tokens per source (vLLM's ``device``/``host``/``disk``/``p2p``/
    ``external_unspecified`` or kvstrata's tier names); the denominator is its ``prompt``/``total``
    entry, else cached plus ``computed``, else cached / ``hit_rate``.
    """
    tokens, rate = res.get("tokens_per_tier"), _num(res, "hit_rate")
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
        computed = _num(tokens, "computed")
        total = (sum(cached.values()) + computed if computed is not None else _num(res, "prompt_tokens")
                 or (sum(cached.values()) / rate if rate else None))
    if not total:
        return fallback
    notes = [(as_l1, "counted as L1"), (ignored, "ignored"), (["disk"] if remote and "disk" in tokens else [],
                                                              "counted as L3: staged from the shared tier")]
    note = "".join(f" ({', '.join(keys)} {what})" for keys, what in notes if keys)
    return Hits(**{k: v / total for k, v in cached.items()}), "tokens_per_tier" + note


def _size(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


@dataclass
class Estimate:
    inputs: dict[str, Input]
    params: Params
    hits: Hits
    hits_source: str
    prediction: Prediction
    comparison: list[dict[str, Any]]
    notes: list[str]


def build(args: argparse.Namespace) -> Estimate:
    """Gather every input with its source, run the model, compare with ``--measured``."""
    g = _Gather(args)
    g.workload()
    model = g.model()
    g.prefill(model)
    g.tiers()
    hits, hit_flags = g.hits()
    params = g.params()
    prediction = predict(params, hits)
    hits_source = ", ".join(sorted({g.inputs[f"hit_{t}"].source for t in TIERS}))
    comparison = _compare(g.measured, params, hits, hits_source, hit_flags) if g.measured else []
    return Estimate(g.inputs, params, hits, hits_source, prediction, comparison, g.notes)


class _Gather:
    """Collects ``inputs`` (value and source) in order: flags first, then files, then defaults."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.inputs: dict[str, Input] = {}
        self.notes: list[str] = []
        self.measured = load_json(args.measured) if args.measured else None
        if self.measured is not None and not isinstance(self.measured.get("results"), list):
            raise EstimateError(f"{args.measured}: key 'results' is missing or not a list "
                                "(not `kvstrata bench serve --json` output?)")
        self.ttft = load_json(args.ttft_json) if args.ttft_json else None
        results = self.measured["results"] if self.measured else []
        self.baseline = next((r for r in results if isinstance(r, dict) and r.get("config") == "baseline"), None)

    def flag(self, name: str, *, lo: float = 0.0, hi: float = math.inf, positive: bool = True) -> Input | None:
        value = getattr(self.args, name)
        if value is None:
            return None
        option = "--" + name.replace("_", "-")
        if not lo <= value <= hi or (positive and value <= 0):
            raise EstimateError(f"{option}: expected {_wanted(lo, hi, positive)}, found {value:g}")
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
        if device is None and self.baseline is not None and (found := _hits_of_result(self.baseline)):
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
        thr = _num(self.baseline, "throughput_req_s") if self.baseline else None
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


def _num(res: dict[str, Any], key: str) -> float | None:
    v = res.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _compare(measured: dict[str, Any], params: Params, input_hits: Hits, input_source: str,
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
        found = _hits_of_result(res)
        if is_base:
            hits, source = Hits(device=found[0].total if found else input_hits.device), \
                (found[1] if found else "inputs")
        elif found:
            hits, source = replace(found[0], **hit_flags), found[1] + (" and --hit-* flags" if hit_flags else "")
        else:
            hits, source = input_hits, f"inputs ({input_source})"
        row: dict[str, Any] = {"config": res.get("config", "n/a"), "concurrency": res.get("concurrency"),
                               "hits_source": source, "hits": {k: _r(v, 6) for k, v in
                                                               {"device": hits.device, **hits.tiers}.items()},
                               "measured_hit_rate": _num(res, "hit_rate"),
                               "input_hit_rate": _r(input_hits.device if is_base else input_hits.total, 6)}
        try:
            pred: Prediction | None = predict(params, hits)
        except EstimateError as e:
            pred, row["error"] = None, str(e)
        pred_ttft = pred_thr = None
        if pred is not None:
            pred_ttft = (pred.ttft_base_s if is_base else pred.ttft_s) * 1e3
            pred_thr = 1 / (pred.work_base_s if is_base else pred.work_s)
        meas_ttft, meas_thr = _num(res, "ttft_p50_ms"), _num(res, "throughput_req_s")
        row["ttft_p50_ms"] = _triple(meas_ttft, pred_ttft)
        row["throughput_req_s"] = _triple(meas_thr, pred_thr)
        base = next((b for b in results if b.get("config") == "baseline"
                     and b.get("concurrency") == res.get("concurrency")), None)
        if not is_base:
            row["ttft_gain"] = row["throughput_gain"] = _triple(None, None)
        if base is not None and not is_base:
            base_found = _hits_of_result(base)
            base_pred = predict(params, Hits(device=base_found[0].total if base_found else input_hits.device))
            mb_ttft, mb_thr = _num(base, "ttft_p50_ms"), _num(base, "throughput_req_s")
            if meas_thr is None or mb_thr is None:  # tokens/s gives the same ratio
                meas_thr, mb_thr = _num(res, "throughput_tok_s"), _num(base, "throughput_tok_s")
            row["ttft_gain"] = _triple(mb_ttft / meas_ttft if mb_ttft and meas_ttft else None,
                                       None if pred is None else base_pred.ttft_base_s / pred.ttft_s)
            row["throughput_gain"] = _triple(meas_thr / mb_thr if meas_thr and mb_thr else None,
                                             None if pred is None else base_pred.work_base_s / pred.work_s)
        rows.append(row)
    return rows


def _triple(measured: float | None, predicted: float | None) -> dict[str, float | None]:
    """Measured, predicted and the relative error (predicted - measured) / measured."""
    err = None if measured is None or predicted is None or not measured else (predicted - measured) / measured
    return {"measured": _r(measured), "predicted": _r(predicted), "error": _r(err, 3)}


# -- output --------------------------------------------------------------------------------------

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
    return {"inputs": {k: {"value": _r(v.value, 6) if isinstance(v.value, float) else v.value, "source": v.source}
                       for k, v in e.inputs.items()},
            "assumptions": {"staging": e.params.staging, "overlap": e.params.overlap},
            "formulas": _formulas(e.params),
            "hits_used": {k: _r(v, 6) for k, v in {"device": e.hits.device, **e.hits.tiers}.items()},
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
        print(f"  T_load_{tier}   {s * 1e3:.4g} ms ({_size(nbytes)} at {nbytes / s / GB:.4g} GB/s effective)")
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


# -- command line --------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model-config", help="model folder or its config.json (KV bytes per token, FLOPs)")
    g.add_argument("--kv-dtype", help="KV cache dtype if not the model's (e.g. fp8)")
    g.add_argument("--kv-bytes-per-token", type=float, help="instead of --model-config")
    g = parser.add_argument_group("compute")
    g.add_argument("--prefill-tok-s", type=float, help="prefill tokens/s of one request")
    g.add_argument("--ttft-json", help="`kvstrata bench ttft --json` output: prefill rate and overhead")
    g.add_argument("--overhead-ms", type=float, help="fixed per-request cost (default: bench ttft's fastest "
                                                     "full hit, else 0)")
    g.add_argument("--peak-tflops", type=float, help="without a measured rate: peak dense TFLOP/s")
    g.add_argument("--mfu", type=float, help=f"fraction of --peak-tflops prefill reaches (default {DEFAULT_MFU})")
    g.add_argument("--decode-tok-s", type=float, help="decode tokens/s of the whole server (default: "
                                                      "calibrated on the --measured baseline, else not modeled)")
    g = parser.add_argument_group("tiers")
    g.add_argument("--store-json", help="`kvstrata bench store --json` output: L1 and L2 GB/s, lookup time")
    g.add_argument("--remote-json", help="`kvstrata bench remote --json` output: L3 GB/s")
    for t in TIERS:
        g.add_argument(f"--{t}-gbps", type=float, help=f"{t.upper()} load bandwidth, GB/s")
    g.add_argument("--no-staging", dest="staging", action="store_false",
                   help="L2/L3 loads go straight to the engine (default: staged through L1, as in vLLM)")
    g.add_argument("--overlap", action="store_true", help="loads overlap compute (default: serial)")
    g = parser.add_argument_group("hits and workload")
    g.add_argument("--simulate-json", help="`kvstrata simulate --json` output: hit rate per tier")
    for t in TIERS:
        g.add_argument(f"--hit-{t}", type=float, help=f"fraction of prompt tokens loaded from {t.upper()}")
    g.add_argument("--hit-device", type=float, help="fraction served by the engine's own prefix cache, in both "
                                                    "runs (default: the --measured baseline's, else 0)")
    g.add_argument("--prompt-tokens", type=float, help="P (default: --measured workload, else --ttft-json)")
    g.add_argument("--output-tokens", type=float, help="O (default: --measured workload, else 0)")
    g.add_argument("--block-tokens", type=float, help="tokens per KV block (default: --measured, "
                                                      "--ttft-json, else 128)")
    parser.add_argument("--measured", help="`kvstrata bench serve --json` output to compare with")
    parser.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        est = build(args)
    except EstimateError as e:
        print(f"kvstrata estimate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_dict(est)))
    else:
        print_text(est)
    return 0
