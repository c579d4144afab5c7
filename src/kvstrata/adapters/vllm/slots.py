"""How one vLLM block lies in a kvstrata slot, and which workers write it.

A slot holds one block (of one KV cache group, for a hybrid model) for every worker of the engine.
Workers are ranked ``pipeline stage * TP degree + TP rank``:

- tensor parallelism: one region per TP rank (rank r's shard at ``r * rank_bytes``);
- MLA (``namespace.latent_shared``): every rank holds the same latent, so a slot is one region,
  which TP rank 0 of each stage writes and every rank reads. A save is settled by its writers'
  reports (their report means the slot is whole); a load still waits for every rank;
- pipeline parallelism: a rank's region holds every stage's layers, stage s at
  ``sum(stage_bytes[:s])``, so a slot is laid out as with one stage: a save is committed when every
  stage has written its part, and a block is one unit in every tier (a hit covers every stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvstrata.config import ConfigError
from kvstrata.store import TOLERANCES, Segment

from kvstrata.adapters.vllm.groups import GroupLayout
from kvstrata.adapters.vllm.namespace import draft_identity, latent_shared

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class SlotPlan:
    rank_bytes: int  # one TP rank's region: every pipeline stage's layers of one block
    slot_bytes: int
    stage_bytes: tuple[int, ...]  # a rank region's bytes on each stage (empty: one stage)
    shared: bool  # MLA: one region that every rank reads
    ranks: int  # workers that report every op
    writers: frozenset[int]  # workers that write a save's slots
    # per KV cache group, a block's typed runs (each layer, each SSM state) in every rank region,
    # as verified hits compare them (``verify.compare``); () for a group that is not compared
    segments: tuple[tuple[Segment, ...], ...] = ()


def slot_plan(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
              layouts: list[GroupLayout] | None) -> SlotPlan:
    """The slot of this engine's blocks: ``layouts`` for a hybrid model (a slot fits its largest
    group's block), else the one group's pages of every layer."""
    if layouts:
        first = max(g.rank_bytes for g in layouts)
    else:
        group = kv_cache_config.kv_cache_groups[0]
        first = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
    par = vllm_config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    shared = latent_shared(vllm_config, kv_cache_config)
    if layouts and pp > 1:
        raise ConfigError("kvstrata: pipeline parallelism is supported for models whose one KV cache group is full "
                          f"attention, not for {len(layouts)} group(s) of kinds "
                          f"{', '.join(g.kind for g in layouts)}")
    stage_bytes = pipeline_stage_bytes(vllm_config, kv_cache_config, first) if pp > 1 else ()
    rank_bytes = sum(stage_bytes) or first
    ranks = tp * pp
    regions = [r * rank_bytes for r in range(1 if shared else tp)]
    if layouts:
        segments = tuple(_segments(regions, [g.parts] * len(g.layer_names)) for g in layouts)
    else:
        page = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        segments = (_segments(regions, [((page, kv_dtype(vllm_config, kv_cache_config)),)] * (rank_bytes // page)),)
    return SlotPlan(rank_bytes, rank_bytes if shared else rank_bytes * tp, stage_bytes, shared, ranks,
                    frozenset(range(0, ranks, tp) if shared else range(ranks)), segments)


def _segments(regions: list[int], layers: list[tuple[tuple[int, torch.dtype], ...]]) -> tuple[Segment, ...]:
    """The typed runs of every layer (``layers[i]``: its runs in order) in each rank region; ()
    if a layer has none or a dtype has no tolerance."""
    if not layers or any(not runs or any(d not in TOLERANCES for _, d in runs) for runs in layers):
        return ()
    runs, at = [], 0  # (name, offset in a rank region, bytes, dtype) of every layer's runs
    for i, layer in enumerate(layers):
        for j, (n, dtype) in enumerate(layer):
            runs.append((f"layer {i}" + (f" part {j}" if len(layer) > 1 else ""), at, n, dtype))
            at += n
    return tuple(Segment(f"rank {r} {name}", base + off, n, dtype)
                 for r, base in enumerate(regions) for name, off, n, dtype in runs)


def kv_dtype(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> torch.dtype:
    """The dtype of the values in a block: the KV cache spec's, except fp8 caches, which vLLM keeps
    as bytes (uint8), named by ``cache_dtype``."""
    cache = str(vllm_config.cache_config.cache_dtype)
    if cache.startswith("fp8"):
        return torch.float8_e5m2 if cache == "fp8_e5m2" else torch.float8_e4m3fn
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec.dtype


def pipeline_stage_bytes(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", first: int) -> tuple[int, ...]:
    """Bytes of one block's layers on each pipeline stage (one TP rank's share), in stage order.

    vLLM hands the scheduler the first stage's KV cache config (``first``: its bytes); the other
    stages' layers follow from vLLM's own partition of the decoder layers (``get_pp_indices``,
    which honours ``VLLM_PP_LAYER_PARTITION``), one attention layer per decoder layer. Refused
    where that does not hold or a block is more than one group of one page per layer: hybrid
    models, draft layers of speculative decoding (EAGLE's sit on the last stage alone)."""
    from vllm.distributed.utils import get_pp_indices

    pp = vllm_config.parallel_config.pipeline_parallel_size
    if len(kv_cache_config.kv_cache_groups) > 1 or draft_identity(vllm_config):
        raise ConfigError("kvstrata: pipeline parallelism is supported for models with one KV cache group and no "
                          "speculative draft layers")
    group = kv_cache_config.kv_cache_groups[0]
    page = group.kv_cache_spec.page_size_bytes
    total = vllm_config.model_config.get_total_num_hidden_layers()
    layers = [end - start for start, end in (get_pp_indices(total, stage, pp) for stage in range(pp))]
    if layers[0] * page != first:
        raise ConfigError(f"kvstrata: the first pipeline stage holds {first // page} KV layers, vLLM's partition of "
                          f"{total} layers into {pp} stages gives it {layers[0]}: cannot place the other stages")
    return tuple(n * page for n in layers)
