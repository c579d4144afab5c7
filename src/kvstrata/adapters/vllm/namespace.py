"""What a vLLM engine's blocks are keyed on, and where its L1 arena lives.

Owns the namespace derivation (model and weights version, KV dtype, device layout, block size,
parallel group and layout: ``parallel_layout``, a speculative draft whose layers keep KV in the
blocks: ``draft_identity``, the resolved model settings: ``model_settings``, the software
releases: ``versions.software_identity``, and the attention backends the workers report:
``with_backends``),
whether a block is stored once for every tensor-parallel rank (``latent_shared``: MLA), and the arena's name in
``/dev/shm`` (``KVSTRATA_SHM_DIR``) with the clean-up of arenas whose engine died.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import torch
import vllm

from kvstrata.config import StrataConfig
from kvstrata.identity import resolve_model_version
from kvstrata.keys import Namespace
from kvstrata.worker.arena import remove_dead_arenas

from kvstrata.adapters.model_settings import fields_of, hf_config_dict, settings_digest
from kvstrata.adapters.versions import software_identity
from kvstrata.adapters.vllm.groups import group_layouts

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


# The settings below are in the namespace (``model_settings``): every field of vLLM's ModelConfig,
# LoadConfig and CacheConfig, the resolved HF config (overrides applied) and the multimodal config,
# except the fields named here with the reason they cannot change the KV. A field a new vLLM adds
# is in until it is listed. docs/consistency.md ("Runtime settings") has the same lists.
_AFTER_HIDDEN_STATES = "after the last hidden state: sampling, logprobs, what is returned"
_TOKENIZATION = "text to token ids: the keys are on token ids"
_MEMORY = "GPU memory management, not the computation"
MODEL_EXCLUDED: dict[str, str] = {
    "model": "the model's path or hub id: Namespace.model; its files are in the weights version",
    "model_weights": "where the weights were fetched from (an object-storage URI); the weights version "
                    "fingerprints the local files",
    "revision": "the hub revision: resolved into the weights version",
    "hf_config_path": "where the HF config is read from: its resolved content is in",
    "config_format": "how the HF config is read: its resolved content is in",
    "tokenizer": _TOKENIZATION, "tokenizer_mode": _TOKENIZATION, "tokenizer_revision": _TOKENIZATION,
    "skip_tokenizer_init": _TOKENIZATION,
    "seed": "the sampler's seed (dummy weights use a fixed seed of their own)",
    "hf_token": "a credential for the hub",
    "served_model_name": "the name the API answers to",
    "allowed_local_media_path": "which media a request may read", "allowed_media_domains": "which media a request may fetch",
    "spec_target_max_model_len": "a draft model's length limit",
    "allow_deprecated_quantization": "permission to use a deprecated method; the method itself is in",
    "enforce_eager": "execution strategy (CUDA graphs, torch.compile): the same computation, rounded no "
                     "differently than another batch shape is",
    "disable_cascade_attn": "has no effect (deprecated in vLLM 0.32)",
    "enable_prompt_embeds": "admits embedding inputs; a block's embedding rows are in its keys",
    "return_sampling_mask": _AFTER_HIDDEN_STATES, "max_logprobs": _AFTER_HIDDEN_STATES,
    "logprobs_mode": _AFTER_HIDDEN_STATES, "use_fp64_gumbel": _AFTER_HIDDEN_STATES,
    "enable_trace_replay": _AFTER_HIDDEN_STATES, "logits_processors": _AFTER_HIDDEN_STATES,
    "generation_config": _AFTER_HIDDEN_STATES, "override_generation_config": _AFTER_HIDDEN_STATES,
    "pooler_config": "pooling, after the last hidden state",
    "enable_sleep_mode": _MEMORY, "sleep_preserve_parameter_names": _MEMORY, "sleep_mode_backend": _MEMORY,
    "sleep_mode_offload_cudagraph": _MEMORY, "enable_nccl_comm_suspend": _MEMORY, "enable_cumem_allocator": _MEMORY,
    "io_processor_plugin": "request and response processing around the model",
    "renderer_num_workers": "threads that render prompts",
}
_SIZING = "how many blocks fit on this machine, not what a block holds"
_PREFIX_CACHE = "vLLM's own prefix cache: which blocks it keeps and how it finds them"
CACHE_EXCLUDED: dict[str, str] = {
    "gpu_memory_utilization": _SIZING, "kv_cache_memory_bytes": _SIZING, "num_gpu_blocks_override": _SIZING,
    "num_gpu_blocks": _SIZING, "num_cpu_blocks": _SIZING, "kv_cache_size_tokens": _SIZING,
    "kv_cache_max_concurrency": _SIZING,
    "enable_prefix_caching": _PREFIX_CACHE, "prefix_caching_hash_algo": _PREFIX_CACHE,
    "prefix_cache_retention_interval": _PREFIX_CACHE, "prefix_match_unit": _PREFIX_CACHE,
    "hash_block_size": _PREFIX_CACHE, "cache_hit_alignment_tokens": _PREFIX_CACHE,
    "enable_mamba_shared_prefix_checkpoint": _PREFIX_CACHE,
    "kv_offloading_size": "vLLM's own CPU offloading", "kv_offloading_backend": "vLLM's own CPU offloading",
    "user_specified_block_size": "whether the block size was given: its value is in",
    "_block_size_resolved": "whether the block size was resolved: its value is in",
}
_READING = "how and where the weights are read, not which weights"
LOAD_EXCLUDED: dict[str, str] = {
    "download_dir": "where hub files are cached (a path); the weights version covers the files",
    "safetensors_load_strategy": _READING, "safetensors_prefetch_num_threads": _READING,
    "safetensors_prefetch_block_size": _READING, "device": _READING, "use_tqdm_on_load": _READING,
    "pt_load_map_location": _READING,
}
_MM_TRANSPORT = "how multimodal items are cached, hashed, moved or profiled, not what they compute"
MULTIMODAL_EXCLUDED: dict[str, str] = {
    "limit_per_prompt": "how many items a prompt may carry",
    "mm_processor_cache_gb": _MM_TRANSPORT, "mm_processor_cache_type": _MM_TRANSPORT,
    "mm_hasher_algorithm": _MM_TRANSPORT, "mm_shm_cache_max_object_size_mb": _MM_TRANSPORT,
    "mm_tensor_ipc": _MM_TRANSPORT, "mm_ipc_gpu_memory_gb": _MM_TRANSPORT, "skip_mm_profiling": _MM_TRANSPORT,
    "mm_encoder_tp_mode": "how the encoder is sharded: the same computation",
    "mm_encoder_fp8_scale_save_path": "where calibrated scales are written", "mm_encoder_fp8_scale_save_margin":
        "how calibrated scales are written",
    "interleave_mm_strings": "prompt rendering: the token ids are in the keys",
}
# Fields that are in, each in its own part of the settings.
_OWN_PART = frozenset({"hf_config", "hf_text_config", "multimodal_config"})


def model_settings(vllm_config: "VllmConfig") -> dict:
    """What of the engine's resolved configuration can change the KV (see ``MODEL_EXCLUDED``)."""
    model = vllm_config.model_config
    hf, text = getattr(model, "hf_config", None), getattr(model, "hf_text_config", None)
    settings = {
        "model": fields_of(model, MODEL_EXCLUDED.keys() | _OWN_PART),
        "hf_config": hf_config_dict(hf),
        "multimodal": fields_of(getattr(model, "multimodal_config", None), MULTIMODAL_EXCLUDED),
        "load": fields_of(getattr(vllm_config, "load_config", None), LOAD_EXCLUDED),
        "cache": fields_of(getattr(vllm_config, "cache_config", None), CACHE_EXCLUDED),
    }
    if text is not None and text is not hf:  # a multimodal model's text stack, when vLLM keeps it apart
        settings["hf_text_config"] = hf_config_dict(text)
    return settings


# Parallel layouts that change which tokens a block holds, refused with the reason: kvstrata block i
# is tokens [i * block_size, (i + 1) * block_size) of a request on every rank.
UNSUPPORTED_PARALLEL: dict[str, str] = {
    "decode_context_parallel_size": "decode context parallelism (DCP) spreads a block's tokens over the ranks "
                                    "(a scheduler block holds block_size x DCP tokens, each rank a strided share)",
    "prefill_context_parallel_size": "prefill context parallelism (PCP) spreads a request's tokens over the ranks "
                                     "(each rank holds other positions of a block)",
}


def parallel_layout(vllm_config: "VllmConfig") -> dict[str, str]:
    """Every parallel size that changes what a block of this engine holds, for the namespace:
    tensor parallelism (a slot holds every rank's shard: ``Namespace.world_size``), pipeline
    parallelism (every stage's layers), and the context-parallel sizes, which must be 1. Data and
    expert parallelism do not change what a block holds: a data-parallel rank is an engine of its
    own, and experts are weights, not KV.

    Raises ``ValueError`` naming the setting, its value and the reason for a layout kvstrata does
    not support (``UNSUPPORTED_PARALLEL``): the engine does not start with it."""
    par = vllm_config.parallel_config
    for name, why in UNSUPPORTED_PARALLEL.items():
        size = getattr(par, name, 1) or 1
        if size > 1:
            raise ValueError(f"kvstrata: {name}={size} is not supported: {why}, while kvstrata stores block i as "
                             f"tokens [i*block_size, (i+1)*block_size) of the request on every rank. Run without "
                             f"it, or without kvstrata's connector")
    return {"pp": str(par.pipeline_parallel_size),
            "cp": f"dcp={getattr(par, 'decode_context_parallel_size', 1)},pcp={getattr(par, 'prefill_context_parallel_size', 1)}"}


UNREPORTED = "unreported"  # the attention backends before the workers report them (``with_backends``)


def with_backends(ns: Namespace, backends: Sequence[str] | None) -> Namespace:
    """``ns`` naming the attention backends the workers reported (``backends.reported``). None (no
    worker reported: a vLLM that does not hand the workers' reports to the scheduler) gives a
    random name: the blocks are kept for this process only, never shared under a guessed backend."""
    named = ",".join(backends) if backends is not None else f"{UNREPORTED}:{uuid.uuid4().hex}"
    return replace(ns, extra={**ns.extra, "attention": named})


def namespace_for(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", cfg: StrataConfig) -> Namespace:
    """The engine's namespace, its attention backends ``UNREPORTED`` until the workers report them
    (``with_backends``). Raises ``ValueError`` for a parallel layout kvstrata refuses."""
    parallel = parallel_layout(vllm_config)
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
    settings = settings_digest(model_settings(vllm_config))
    log.info("kvstrata: model settings digest %s", settings)
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
        key_scheme=cfg.keys.hash,
        extra={**parallel, "model_config": settings, **draft_identity(vllm_config),
               "software": software_identity("vllm", getattr(vllm, "__version__", None), cfg.namespace.version_group),
               "attention": UNREPORTED},
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
