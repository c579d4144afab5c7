"""What an SGLang storage backend's pages are keyed on.

Owns kvstrata's part of SGLang's extra config (``load_strata_config``: the keys that belong to
SGLang are left out), SGLang page keys as bytes (``digests_of``) and the namespace (model and weights version, dtype,
pool layout, page size, ranks, interface, the server's resolved model settings: ``model_settings``,
the software releases: ``versions.software_identity``, and the attention backends the server
resolved: ``attention_backends``).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import TYPE_CHECKING, Any, Sequence

import xxhash

from kvstrata.config import StrataConfig, load_engine_config
from kvstrata.identity import model_identity, resolve_model_version
from kvstrata.keys import Namespace

from kvstrata.adapters.model_settings import canonical, fields_of, hf_config_dict, settings_digest
from kvstrata.adapters.versions import software_identity

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvstrata.adapters.sglang.pages import PageRows

# Keys of the extra config that belong to SGLang (or to its other backends), not to kvstrata.
# SGLang itself pops prefetch_*, hicache_storage_pass_prefix_keys and tp_lcm_size before we see
# the dict; they are listed for callers that hand over the file as written.
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "hicache_storage_pass_prefix_keys",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "tp_lcm_size",
    "file_storage_path", "enable_metadata_cache", "metadata_ttl",
})


def load_strata_config(extra_config: dict[str, Any] | None) -> StrataConfig:
    """kvstrata's part of SGLang's extra config (``config_file`` plus dotted or nested keys)."""
    return load_engine_config(extra_config, SGLANG_KEYS)


def digests_of(keys: Sequence[str]) -> list[bytes]:
    """SGLang page keys as bytes: 32 bytes for the usual hex SHA-256, the UTF-8 text otherwise."""
    try:
        return [bytes.fromhex(k) for k in keys]
    except ValueError:
        return [k.encode() for k in keys]


def _loaded_model(model_name: str) -> tuple[str, str | None]:
    """The model path (folder or hub id) and revision the server loaded. ``model_name`` is the served
    name, which may be an alias (``--served-model-name``) or carry a storage format tag."""
    try:
        from sglang.srt.runtime_context import get_model

        loaded = get_model()
        return loaded.model_path, loaded.revision
    except (ImportError, ValueError, AttributeError):  # not published (in-process use) or older SGLang
        return model_name, None


log = logging.getLogger(__name__)

# The server's model settings are in the namespace (``model_settings``): every leaf of SGLang's
# resolved "model" config namespace (--json-model-override-args, --quantization, --dtype,
# --kv-cache-dtype, --load-format, --context-length, ...), every attribute of the ModelConfig
# SGLang resolves from them, and its HF config (overrides applied), except the names listed here
# with the reason they cannot change the KV. docs/consistency.md ("Runtime settings") has the lists.
_READING = "how and where the weights are read, not which weights"
_PEER = "how weights are fetched from a peer instance or service, not which"
SERVER_EXCLUDED: dict[str, str] = {
    "model_path": "the model's path or hub id: Namespace.model; its files are in the weights version",
    "revision": "the hub revision: resolved into the weights version",
    "download_dir": "where hub files are cached (a path); the weights version covers the files",
    "decrypted_config_file": "where a decrypted config is read from: its resolved content is in",
    "decrypted_draft_config_file": "a draft model's config file",
    "model_checksum": "a check of the weight files: the weights version covers them",
    "engine_info_bootstrap_port": "a port",
    "checkpoint_engine_wait_weights_before_ready": "start-up ordering",
    "delete_ckpt_after_loading": "what happens to the files after loading",
    "modelopt_checkpoint_save_path": "where a quantized checkpoint is written",
    "modelopt_export_path": "where a quantized checkpoint is exported",
    "remote_instance_weight_loader_seed_instance_ip": _PEER,
    "remote_instance_weight_loader_seed_instance_service_port": _PEER,
    "remote_instance_weight_loader_send_weights_group_ports": _PEER,
    "remote_instance_weight_loader_backend": _PEER,
    "remote_instance_weight_loader_start_seed_via_transfer_engine": _PEER,
    "modelexpress_config": _PEER,
    "startup_weight_load_mode": _READING, "is_startup_weight_load_overlap": _READING,
    "weight_loader_disable_mmap": _READING, "weight_loader_prefetch_checkpoints": _READING,
    "weight_loader_prefetch_num_threads": _READING, "weight_loader_drop_cache_after_load": _READING,
    "weight_cache_mode": "a cache of loaded weights shared between processes",
    "weight_cache_socket": "a cache of loaded weights shared between processes",
    "weight_cache_timeout": "a cache of loaded weights shared between processes",
}
_OUTPUT = "after the last hidden state: sampling defaults, stop tokens, reasoning-output parsing"
RESOLVED_EXCLUDED: dict[str, str] = {
    "model_path": SERVER_EXCLUDED["model_path"], "revision": SERVER_EXCLUDED["revision"],
    "hf_generation_config": _OUTPUT, "sampling_defaults": _OUTPUT, "hf_eos_token_id": _OUTPUT,
    "think_end_ids": _OUTPUT, "self_opened_think_start_ids": _OUTPUT,
    "request_selectable_think_end_id_sequences": _OUTPUT,
}
# Leaves whose value is JSON text: compared as data (key order and spacing are not settings).
_JSON_TEXT = frozenset({"json_model_override_args", "model_loader_extra_config"})
# Leaves that name a file whose content is the setting (KV cache scales): its bytes, not its path.
_FILE_CONTENT = frozenset({"quantization_param_path"})


def model_settings() -> dict | None:
    """What of the running server's resolved model configuration can change the KV, or None outside
    a server (no published server args: an in-process backend, or an SGLang without them). A server
    whose model config cannot be resolved again here gets a random value: its pages are kept for
    this process only, never shared under a guessed identity."""
    try:
        from sglang.srt.runtime_context import get_model, get_server_args

        bag, server_args = get_model(), get_server_args()
    except (ImportError, ValueError, AttributeError):
        return None
    settings: dict[str, Any] = {"server": _server_leaves(bag)}
    try:
        from sglang.srt.configs.model_config import ModelConfig

        resolved = ModelConfig.from_server_args(server_args)
    except Exception as e:  # an I/O edge: the model's config is read and resolved again
        log.warning("kvstrata: cannot resolve the server's model config (%s: %s); its pages are kept for this "
                    "process only", type(e).__name__, e)
        return {"unresolved": uuid.uuid4().hex}
    adapters = static_adapters(getattr(server_args, "lora_paths", None))
    if adapters:
        settings["lora_adapters"] = adapters
    hf, text = resolved.hf_config, getattr(resolved, "hf_text_config", None)
    settings["resolved"] = fields_of(resolved, RESOLVED_EXCLUDED.keys() | {"hf_config", "hf_text_config"})
    settings["hf_config"] = hf_config_dict(hf)
    if text is not None and text is not hf:
        settings["hf_text_config"] = hf_config_dict(text)
    return settings


def static_adapters(lora_paths: Any) -> dict[str, str]:
    """The content version of every adapter of ``--lora-paths``, by the id SGLang keys its pages on.

    SGLang adds a request's LoRA id to its ``extra_key``, and a ``--lora-paths`` adapter's id is
    ``uuid5(name, path)`` (``LoRARef.deterministic_id``): the same after a restart whatever the
    adapter's files hold. Its pages are therefore shared only by servers whose adapters have the
    same files (an adapter rewritten at the same path starts another namespace). Adapters loaded at
    run time get a random id (``uuid4``): their pages are never shared across restarts anyway."""
    if not lora_paths:
        return {}
    items = lora_paths.items() if isinstance(lora_paths, dict) else lora_paths
    out: dict[str, str] = {}
    for item in items:
        if isinstance(item, tuple):  # a dict's (name, path)
            ref, name, path = None, *item
        elif isinstance(item, dict):
            ref, name, path = None, item.get("lora_name"), item.get("lora_path")
        elif isinstance(item, str):
            ref, (name, _, path) = None, (item.partition("=") if "=" in item else (item, "", item))
        else:  # SGLang's resolved LoRARef
            ref, name, path = getattr(item, "lora_id", None), getattr(item, "lora_name", None), \
                getattr(item, "lora_path", None)
        if path:
            out[str(ref or name)] = model_identity(str(path)).version
    return out


def _server_leaves(bag: Any) -> dict[str, Any]:
    """A resolved config namespace's leaves (nested namespaces as dicts), exclusions left out."""
    out: dict[str, Any] = {}
    for name, value in vars(bag).items():
        if name.startswith("_") or name in SERVER_EXCLUDED:
            continue
        if type(value) is type(bag):
            out[name] = _server_leaves(value)
        elif name in _JSON_TEXT and isinstance(value, str):
            out[name] = _json_or_text(value)
        elif name in _FILE_CONTENT and value:
            out[name] = _file_content(value)
        else:
            out[name] = canonical(value)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return canonical(json.loads(text)) if text.strip() else None
    except ValueError:
        return text


def _file_content(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return "xxh3:" + xxhash.xxh3_128_hexdigest(f.read())
    except OSError:
        return f"unreadable:{path}"


def attention_backends() -> str:
    """The (prefill, decode) attention backends the server resolved (``runtime_context``: its
    ``exec.kernel`` leaves, where SGLang resolves ``--attention-backend`` and the split pair), or
    ``unpublished`` outside a server (an in-process backend)."""
    try:
        from sglang.srt.runtime_context import attention_backends as resolved

        prefill, decode = resolved()
    except (ImportError, ValueError, AttributeError, RuntimeError, TypeError):
        return "unpublished"
    return f"prefill={prefill},decode={decode}"


def namespace_for(config: "HiCacheStorageConfig", cfg: StrataConfig, rows: "PageRows", v1: bool) -> Namespace:
    """``v1``: the zero-copy interface (its pages are keyed apart from the flat-page interface's)."""
    model = config.model_name or ""
    version = resolve_model_version(cfg.namespace.model_version, *_loaded_model(model))
    shared = config.is_mla_model  # MLA KV is identical on every TP rank: one copy for all
    settings = model_settings()
    extra = {} if settings is None else {"model_config": settings_digest(settings)}
    if extra:
        log.info("kvstrata: model settings digest %s", extra["model_config"])
    return Namespace(
        engine="sglang",
        model=model,
        model_version=version,
        kv_dtype=str(rows.buf.dtype),
        layout=rows.signature,
        block_size=rows.page_size,
        rank=0 if shared else config.tp_rank,
        world_size=1 if shared else config.tp_size,
        tenant=cfg.namespace.tenant,
        key_scheme=cfg.keys.hash,
        extra={"pp": f"{config.pp_rank}/{config.pp_size}",
               "cp": f"{config.attn_cp_rank}/{config.attn_cp_size}",
               "interface": "v1" if v1 else "flat", **extra,
               "software": software_identity("sglang", _sglang_version(), cfg.namespace.version_group),
               "attention": attention_backends()},
    )


def _sglang_version() -> str | None:
    try:
        import sglang

        return getattr(sglang, "__version__", None)
    except ImportError:
        return None
