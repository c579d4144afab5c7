"""The files ``kvstrata estimate`` reads, untrusted: JSON outputs of the benchmarks
(``load_json``, ``get``: a bad value is an ``EstimateError`` naming the file, key and value) and a
model's ``config.json`` (``load_model_shape``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvstrata.tools.estimate.model import EstimateError, ModelShape

DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2,
               "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1}


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
        raise EstimateError(f"{path}: key '{key}': expected {wanted(lo, hi, positive)}, found {value!r}")
    return float(value)


def wanted(lo: float, hi: float, positive: bool) -> str:
    if positive and hi == math.inf:
        return "a number above 0"
    return f"a number in [{lo:g}, {hi:g}]" + (" above 0" if positive else "")


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
