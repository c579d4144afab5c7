"""Which token of a vLLM block each value is of, so that verified hits compare a prompt's partial
tail (``verify.py``) over its tokens' values only: past them the engine's block holds whatever its
memory held before, in the stored copy and in the engine's alike.

The answer depends on how the attention backend packs a block, not on the block's shape: vLLM's
CPU backend (``CPU_ATTN``) keeps K of a head as ``[head_size, block_size]`` (each token's K in a
column) on its ``vec`` kernels and in other orders on AMX or NEON, V as ``[block_size, head_size]``,
all inside a tensor shaped ``[heads, block_size, 2 * head_size]``. So the map is not derived: it is
read off the backend's own cache-write kernel (``_probe_cpu_attn``: each token writes values that
spell its index, bit by bit, into an empty block), and checked (every token owns as many values).

Backends without a maker here (``MAKERS``: the GPU backends, MLA) leave tails uncompared, said once
at start. A map that were wrong would flag honest tails, so none is guessed from a shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from kvstrata.store import TokenMap

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageSpec:
    """One layer's block as a dense attention backend lays it out on this rank."""

    block_size: int
    heads: int
    head_size: int
    dtype: torch.dtype  # of the cache tensor (uint8 for an fp8 cache)
    values: int  # values in one layer's page, in the dtype verified hits compare it in
    cache_dtype: str  # vLLM's ``cache_dtype`` ("auto", "fp8_e4m3", ...)
    model_dtype: torch.dtype  # of the K and V the kernel writes


def _probe_cpu_attn(page: PageSpec) -> torch.Tensor | None:
    """The token of each value of a ``CPU_ATTN`` page, read off its cache-write kernel with the
    kernel choice (ISA) vLLM makes for this page on this machine."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs, heads, hd = page.block_size, page.heads, page.head_size
    isa = _get_attn_isa(page.model_dtype, bs, hd, page.cache_dtype)
    cache = torch.zeros(1, heads, bs, 2 * hd, dtype=page.dtype)
    key_cache, value_cache = cache.view(1, heads, 2 * bs, hd).chunk(2, dim=2)  # as CPUAttentionBackendImpl cuts it
    slots = torch.arange(bs, dtype=torch.int64)

    def written(marks: torch.Tensor) -> torch.Tensor:  # the values written nonzero when token t writes marks[t]
        cache.zero_()
        kv = marks.to(page.model_dtype)[:, None, None].expand(bs, heads, hd).contiguous()
        cpu_attn_reshape_and_cache(kv, kv, key_cache, value_cache, slots, isa, kv_cache_dtype=page.cache_dtype)
        return cache.reshape(-1).view(torch.uint8).view(cache.numel(), -1).ne(0).any(1)

    token_of = torch.zeros(cache.numel(), dtype=torch.int32)
    for bit in range(max(1, (bs - 1).bit_length())):
        token_of |= written(((slots >> bit) & 1).float()).int() << bit
    token_of[~written(torch.ones(bs))] = -1
    return token_of


# attention backend name (as the workers report it, ``backends.py``) -> the token of each value of a page
MAKERS: dict[str, Callable[[PageSpec], torch.Tensor | None]] = {"CPU_ATTN": _probe_cpu_attn}


def page_spec(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> PageSpec | None:
    """The page of a model whose one KV cache group is dense attention, or None (MLA, several
    groups, a spec without heads): its tails are not compared."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if not isinstance(spec, AttentionSpec) or isinstance(spec, MLAAttentionSpec):
        return None
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    size = 1 if cache_dtype.startswith("fp8") else torch.empty((), dtype=spec.dtype).element_size()
    return PageSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, spec.page_size_bytes // size,
                    cache_dtype, vllm_config.model_config.dtype)


def tail_tokens(page: PageSpec | None, backends: tuple[str, ...] | None, trailing: int) -> TokenMap | None:
    """The token map of this engine's pages (see the module docstring), or None, logged once, when
    its tails cannot be compared. ``trailing``: the last tokens of a tail never compared (an
    EAGLE-style draft head's KV there depends on the token after it, ``drafts.py``)."""
    name = backends[0] if backends and len(backends) == 1 else None
    maker = MAKERS.get(name) if name is not None and page is not None else None
    token_of = None
    if maker is not None and page is not None:
        try:
            token_of = maker(page)
        except Exception as e:  # a kernel this vLLM lacks, or refuses here: tails go uncompared
            log.warning("kvstrata: verified hits: cannot read how %s lays out a block's tokens (%s: %s)", name,
                        type(e).__name__, e)
        if token_of is not None and not _whole(token_of, page):
            log.warning("kvstrata: verified hits: %s's block layout read back inconsistent; tails not compared", name)
            token_of = None
    if token_of is None:
        log.info("kvstrata: verified hits compare full blocks only (no token layout known for attention backends "
                 "%s): a prompt's partial tail is not compared", ", ".join(backends or ("none reported",)))
        return None
    log.info("kvstrata: verified hits compare a prompt's partial tail over its tokens (%s)", name)
    return TokenMap(token_of, trailing)


def _whole(token_of: torch.Tensor, page: PageSpec) -> bool:
    """Whether ``token_of`` covers one page and every token of the block owns the same number of
    its values (K and V of every head), the rest none."""
    if token_of.numel() != page.values:
        return False
    owned = torch.bincount(token_of[token_of >= 0].long(), minlength=page.block_size)
    return owned.numel() == page.block_size and bool((owned == 2 * page.heads * page.head_size).all())
