"""The model of ``kvstrata estimate``: a transparent account of kvstrata's TTFT and throughput gains.

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

The model's two objects: ``ModelShape`` (what a token costs: KV bytes, prefill FLOPs) and
``predict`` (the formulas above, baseline and kvstrata, for one request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

TIERS = ("l1", "l2", "l3")
GB = 1e9


class EstimateError(ValueError):
    """An input the user has to fix; the message names the file or flag, the key and the value."""


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
        return {"ttft_base_ms": rounded(self.ttft_base_s * 1e3), "ttft_ms": rounded(self.ttft_s * 1e3),
                "compute_ms": rounded(self.compute_s * 1e3),
                "load_ms": {k: rounded(v * 1e3) for k, v in self.load_s.items()},
                "lookup_ms": rounded(self.lookup_s * 1e3), "decode_ms": rounded(self.decode_s * 1e3),
                "work_base_s": rounded(self.work_base_s), "work_s": rounded(self.work_s),
                "throughput_base_req_s": rounded(1 / self.work_base_s), "throughput_req_s": rounded(1 / self.work_s),
                "ttft_gain": rounded(self.ttft_gain), "throughput_gain": rounded(self.throughput_gain)}


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


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")
