"""What an SGLang storage backend's pages are keyed on.

Owns kvstrata's part of SGLang's extra config (``load_strata_config``: the keys that belong to
SGLang are left out), SGLang page keys as bytes (``digests_of``) and the namespace (model and weights version, dtype,
pool layout, page size, ranks, interface).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvstrata.config import StrataConfig, load_engine_config
from kvstrata.identity import resolve_model_version
from kvstrata.keys import Namespace

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from .pages import PageRows

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


def namespace_for(config: "HiCacheStorageConfig", cfg: StrataConfig, rows: "PageRows", v1: bool) -> Namespace:
    """``v1``: the zero-copy interface (its pages are keyed apart from the flat-page interface's)."""
    model = config.model_name or ""
    version = resolve_model_version(cfg.namespace.model_version, *_loaded_model(model))
    shared = config.is_mla_model  # MLA KV is identical on every TP rank: one copy for all
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
        extra={"pp": f"{config.pp_rank}/{config.pp_size}",
               "cp": f"{config.attn_cp_rank}/{config.attn_cp_size}",
               "interface": "v1" if v1 else "flat"},
    )
