"""What a vLLM engine's blocks are keyed on, and where its L1 arena lives.

Owns the namespace derivation (model and weights version, KV dtype, device layout, block size,
parallel group, a speculative draft whose layers keep KV in the blocks: ``draft_identity``),
whether a block is stored once for every tensor-parallel rank (``latent_shared``: MLA), and the arena's name in
``/dev/shm`` (``KVSTRATA_SHM_DIR``) with the clean-up of arenas whose engine died.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING

import torch

from kvstrata.config import StrataConfig
from kvstrata.identity import resolve_model_version
from kvstrata.keys import Namespace
from kvstrata.store import remove_dead_arenas

from .groups import group_layouts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)
SHM_DIR = os.environ.get("KVSTRATA_SHM_DIR", "/dev/shm")


def _kv_dtype(vllm_config: "VllmConfig") -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    return str(vllm_config.model_config.dtype if cache_dtype in (None, "auto") else cache_dtype)


def _device_layout(vllm_config: "VllmConfig") -> str:
    """Where K/V packing can differ: device kind and, on CPU, the attention kernel's ISA."""
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    if kind == "cpu":
        amx = torch.cpu._is_amx_tile_supported()
        avx512 = torch.cpu._is_avx512_supported()
        return f"cpu:{current_platform.get_cpu_architecture().name}:amx={int(amx)}:avx512={int(avx512)}"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"{kind}:{backend or 'auto'}"


def latent_shared(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> bool:
    """True for an MLA model whose latent KV every tensor-parallel rank holds whole and identical:
    one copy of a block serves every rank, so it is stored once (rank 0 writes it, every rank reads
    it) and keyed apart from the TP degree. vLLM's own offloading connector stores such a block once
    on the same test (``offloading/config.py``, ``replicated_layout``): an MLA spec, and
    ``kv_tp_replicas`` (the consecutive ranks vLLM computed to hold identical KV for every layer)
    equal to the TP degree; anything that shards the latent (decode context parallelism) keeps one
    region per rank. One KV cache group only: hybrid models keep their per-rank layout."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    tp = vllm_config.parallel_config.tensor_parallel_size
    return (len(groups) == 1 and isinstance(groups[0].kv_cache_spec, MLAAttentionSpec)
            and getattr(kv_cache_config, "kv_tp_replicas", 1) == tp)


# Speculative methods whose proposer keeps no KV (it drafts from the token ids): the blocks are the
# target model's alone, as without speculation. Any other method (EAGLE, EAGLE-3, MTP, a draft
# model, ...) runs draft layers whose KV vLLM keeps in the same blocks.
NO_DRAFT_KV = frozenset({"ngram", "ngram_gpu", "suffix"})


def draft_identity(vllm_config: "VllmConfig") -> dict[str, str]:
    """``{"draft": method, model and weights version}`` when speculative decoding runs draft layers
    whose KV shares the target's blocks (EAGLE's head is one more layer in the target's KV cache
    group), so that engines with different drafts never exchange blocks; else nothing. The
    draft's version is always read from its files (``namespace.model_version`` pins the target's)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method in NO_DRAFT_KV:
        return {}
    draft = spec.draft_model_config
    version = resolve_model_version(None, draft.model, draft.revision,
                                    hub_cache=vllm_config.load_config.download_dir)
    return {"draft": f"{spec.method}:{draft.model}:{version}"}


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: StrataConfig) -> Namespace:
    model = vllm_config.model_config
    version = resolve_model_version(cfg.namespace.model_version, model.model, model.revision,
                                    hub_cache=vllm_config.load_config.download_dir)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    layout = (f"{_device_layout(vllm_config)};{layers}x{type(spec).__name__}"
              f"(heads={getattr(spec, 'num_kv_heads', '?')},head={getattr(spec, 'head_size', '?')},"
              f"page={spec.page_size_bytes})")
    if len(kv_cache_config.kv_cache_groups) > 1:  # a hybrid model: every group's kind, window and layers
        layout += ";groups=" + ",".join(g.tag.hex()[:16] for g in group_layouts(kv_cache_config))
    par = vllm_config.parallel_config
    # MLA: one copy of the latent for every rank, so the same blocks at any TP degree. Otherwise a
    # slot holds every rank's shard, and the namespace covers the whole parallel group.
    shared = latent_shared(vllm_config, kv_cache_config)
    if shared:
        layout += ";mla"
    return Namespace(
        engine="vllm",
        model=model.model,
        model_version=version,
        kv_dtype=_kv_dtype(vllm_config),
        layout=layout,
        block_size=vllm_config.cache_config.block_size,
        rank=0,
        world_size=1 if shared else par.tensor_parallel_size,
        tenant=cfg.namespace.tenant,
        extra={"pp": str(par.pipeline_parallel_size), **draft_identity(vllm_config)},
    )


def new_arena_path() -> str:
    """A fresh arena name in ``SHM_DIR`` for this scheduler process (after clearing dead ones)."""
    _remove_dead_arenas()
    return os.path.join(SHM_DIR, f"kvstrata-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _remove_dead_arenas() -> None:
    """Delete arenas of schedulers that died without cleaning up (e.g. a force-killed EngineCore):
    a file in /dev/shm lives until deleted, and holds its memory until then. An arena counts as
    dead only once no process holds its creator's lock (``remove_dead_arenas``): a live engine in
    another PID namespace sharing /dev/shm keeps its arena, whatever its pid looks like here."""
    for name in remove_dead_arenas(SHM_DIR):
        log.info("kvstrata: removed the arena of a dead engine: %s", os.path.join(SHM_DIR, name))
