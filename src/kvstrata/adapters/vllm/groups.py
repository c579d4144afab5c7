"""The KV cache groups of a vLLM model as kvstrata keys and copies them (hybrid models).

vLLM's hybrid KV cache manager (HMA) gives a hybrid model several KV cache groups, each with a
block table of its own: full attention, a sliding window, or an SSM state (``MambaSpec``). kvstrata
keys each group's blocks on a chain of its own under one namespace and one epoch
(``keys.group_root`` with the group's ``tag``), so one invalidation hides every group at once, and
what a prefix hit at a block boundary needs from each group is its ``kind``:

- ``full``: every block before the boundary;
- ``window``: the blocks of the sliding window before the boundary;
- ``state``: the state at exactly the boundary, stored under the key of the block ending there.

``group_layouts`` reads a ``KVCacheConfig`` into ``GroupLayout``s and refuses, with a
``ConfigError`` that says why, what kvstrata cannot serve right. ``grouped_layouts`` says whether
a model takes that path: any model with a group other than full attention, however many groups it
has (a model whose only group is a sliding window keeps vLLM's null block before its window, as a
hybrid does), so every group's kind is checked at start-up and no null block reaches a save. The
position helpers never hand out vLLM's null block (id 0): vLLM puts it where a group keeps
nothing (before a window, between SSM states), so saving it would store garbage under a real key,
and loading into it would write into a block every request shares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import numpy as np
import xxhash

from kvstrata.config import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

NULL_BLOCK = 0  # vLLM's null block (BlockPool.null_block): a placeholder shared by every request

Kind = Literal["full", "window", "state"]


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group: how a hit uses it, and the bytes of one of its blocks on this rank."""

    index: int
    kind: Kind
    window_tokens: int  # the sliding window ("window" groups), else 0
    block_size: int
    layer_names: tuple[str, ...]
    page_bytes: int  # one layer's block without vLLM's padding
    tag: bytes  # roots the group's key chain: same model and layout, same tag, in every process
    # one layer's block as typed runs, in order: (bytes, dtype); an SSM state has one per state
    # tensor. Empty: not comparable (verified hits skip the group)
    parts: tuple[tuple[int, "torch.dtype"], ...] = ()

    @property
    def rank_bytes(self) -> int:
        return self.page_bytes * len(self.layer_names)


def _full(spec: "KVCacheSpec") -> tuple[Kind, int]:
    return "full", 0


def _window(spec: "KVCacheSpec") -> tuple[Kind, int]:
    if getattr(spec, "extra_retained_tokens", 0):
        raise ConfigError("kvstrata: sliding-window groups that retain extra tokens (multi-module "
                          "speculative decoding) are not supported yet")
    return "window", spec.sliding_window  # type: ignore[attr-defined]


def _state(spec: "KVCacheSpec") -> tuple[Kind, int]:
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise ConfigError(f"kvstrata: an SSM model needs vLLM's prefix caching of its states (mamba_cache_mode "
                          f"'align', not {mode!r}): start vLLM with --enable-prefix-caching")
    return "state", 0


def _kinds() -> list[tuple[type, Callable[["KVCacheSpec"], tuple[Kind, int]] | None]]:
    """Spec class -> its kind (None: refused), most derived classes first: the first match wins."""
    from vllm.v1 import kv_cache_interface as kci

    return [
        (kci.SlidingWindowMLASpec, _window),
        (kci.SinkFullAttentionSpec, None),
        (kci.RSWASpec, None),
        (kci.HiddenStateCacheSpec, None),
        (kci.MLAAttentionSpec, _full),
        (kci.FullAttentionSpec, _full),
        (kci.SlidingWindowSpec, _window),
        (kci.MambaSpec, _state),
    ]


def kind_of(spec: "KVCacheSpec") -> tuple[Kind, int]:
    """``(kind, window_tokens)`` of a group's spec; a ``ConfigError`` for a spec kvstrata refuses."""
    for cls, kind in _kinds():
        if isinstance(spec, cls):
            if kind is None:
                break
            return kind(spec)
    raise ConfigError(f"kvstrata: KV cache groups of type {type(spec).__name__} are not supported yet")


def _page_bytes(spec: "KVCacheSpec") -> int:
    """A block's bytes without padding: vLLM pads SSM pages to the attention page size."""
    if getattr(spec, "page_size_padded", None) is not None:
        spec = dataclasses.replace(spec, page_size_padded=None)  # type: ignore[type-var]
    return spec.page_size_bytes


def _parts(spec: "KVCacheSpec", page: int) -> tuple[tuple[int, "torch.dtype"], ...]:
    """One layer's block as typed runs: an SSM's states in order (vLLM carves them from the page
    one after another), else one run of the spec's dtype; () where that does not add up to the page."""
    from math import prod

    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    if shapes is not None and dtypes is not None:
        parts = tuple((prod(shape) * dtype.itemsize, dtype) for shape, dtype in zip(shapes, dtypes))
    else:
        parts = ((page, spec.dtype),)
    return parts if sum(n for n, _ in parts) == page else ()


def group_layouts(kv_cache_config: "KVCacheConfig") -> list[GroupLayout]:
    """The groups kvstrata stores, in vLLM's order. Refused (``ConfigError``): EAGLE/MTP draft
    groups, groups of different block sizes or of a block size other than the one vLLM hashes
    by (hits finer than a block), and spec types ``kind_of`` does not know."""
    out = []
    hash_block = getattr(kv_cache_config, "hash_block_size", None)
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        if group.is_eagle_group:
            raise ConfigError("kvstrata: EAGLE/MTP draft KV cache groups are not supported yet")
        spec = group.kv_cache_spec
        kind, window = kind_of(spec)
        page = _page_bytes(spec)
        layers = tuple(group.layer_names)
        signature = f"g{i}:{kind}:{window}:{type(spec).__name__}:{spec.block_size}:{page}:{','.join(layers)}"
        out.append(GroupLayout(i, kind, window, spec.block_size, layers, page,
                               xxhash.xxh3_128_digest(signature.encode()), _parts(spec, page)))
    sizes = {g.block_size for g in out} | ({hash_block} if hash_block else set())
    if len(sizes) > 1:
        raise ConfigError(f"kvstrata: KV cache groups of different block sizes {sorted(sizes)} are not supported yet")
    return out


def grouped_layouts(kv_cache_config: "KVCacheConfig") -> list[GroupLayout] | None:
    """The groups of a model whose blocks go through the per-group paths (``hybrid.py``), or None
    for a model whose one group is full attention (dense or MLA: every position of its block
    table is a real block). Refused (``ConfigError``, at start-up): a kind ``kind_of`` does not
    know, whatever the number of groups."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) == 1 and kind_of(groups[0].kv_cache_spec)[0] == "full":
        return None
    return group_layouts(kv_cache_config)


def real_positions(block_ids: Sequence[int], first: int, last: int) -> np.ndarray:
    """Positions in ``[first, last)`` of a group's block table that hold a real block (not the
    null block): what a save of those positions may copy."""
    ids = np.asarray(block_ids[first:last], dtype=np.int64)
    return np.flatnonzero(ids != NULL_BLOCK) + first


def destinations(block_ids: Sequence[int], positions: Sequence[int]) -> list[int] | None:
    """The block ids a load writes to at ``positions``, or None when a position is past the
    table or holds the null block: vLLM allocated other blocks than the hit needs, so the load
    must fail closed (recompute) rather than fill part of what it promised."""
    pos = np.asarray(positions, dtype=np.int64)
    if len(pos) and (pos.min() < 0 or pos.max() >= len(block_ids)):
        return None
    ids = np.asarray(block_ids, dtype=np.int64)[pos]
    if (ids == NULL_BLOCK).any():
        return None
    return ids.tolist()
