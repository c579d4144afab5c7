"""TEST SCAFFOLDING ONLY: HiCache on SGLang's CPU "device" (see ``sitecustomize.py`` here).

Upstream HiCache assumes CUDA/HIP/XPU: host pools ask for pinned, ``cudaHostRegister``-ed memory,
and the host<->device copy functions are imported only for those devices. Here the "device" KV
pool is itself CPU memory, so plain memory and plain torch indexing are enough:

- ``patch_common``: host registration becomes a no-op;
- ``patch_mha`` / ``patch_mla``: host pools are built with ``pin_memory=False``, and the module
  gets torch-indexing copy functions for the layouts the tests use (``layer_first`` with
  ``--hicache-io-backend direct``; ``page_first`` with ``--hicache-io-backend kernel``).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Sequence

import torch


def patch_common(module: ModuleType) -> None:
    module._cuda_host_register = lambda buffer, *args, **kwargs: buffer
    module._cuda_host_unregister = lambda buffer: None


def _unpinned(cls: type) -> None:
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """Copy token rows ``src_indices`` of every source layer to rows ``dst_indices``."""
    src_idx = src_indices.to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_idx] = src[src_idx].to(dst.device)


def transfer_kv_per_layer_pf_lf(src_k: torch.Tensor, dst_k: torch.Tensor, src_v: torch.Tensor,
                                dst_v: torch.Tensor, src_indices: torch.Tensor,
                                dst_indices: torch.Tensor, layer_id: int, item_size: int,
                                src_layout_dim: int) -> None:
    """Host page_first ``[size, layers, ...]`` -> device layer ``[size, ...]`` for one layer."""
    src_idx = src_indices.to(torch.long)
    dst_idx = dst_indices.to(torch.long)
    dst_k[dst_idx] = src_k[src_idx, layer_id]
    dst_v[dst_idx] = src_v[src_idx, layer_id]


def _backup_page_first(cls: type) -> None:
    """Device layers -> host ``page_first`` (upstream passes pointer tables to a CUDA kernel)."""
    backup = cls.backup_from_device_all_layer

    @functools.wraps(backup)
    def backup_from_device_all_layer(self: Any, device_pool: Any, host_indices: torch.Tensor,
                                     device_indices: torch.Tensor, io_backend: str) -> None:
        if self.layout != "page_first" or io_backend != "kernel":
            return backup(self, device_pool, host_indices, device_indices, io_backend)
        src_idx = device_indices.to(torch.long)
        dst_idx = host_indices.to(torch.long)
        for layer, (k, v) in enumerate(zip(self.device_k_buffers, self.device_v_buffers)):
            self.k_buffer[dst_idx, layer] = k[src_idx]
            self.v_buffer[dst_idx, layer] = v[src_idx]

    cls.backup_from_device_all_layer = backup_from_device_all_layer


def patch_mha(module: ModuleType) -> None:
    _unpinned(module.MHATokenToKVPoolHost)
    module.transfer_kv_direct = transfer_kv_direct
    module.transfer_kv_per_layer_pf_lf = transfer_kv_per_layer_pf_lf
    _backup_page_first(module.MHATokenToKVPoolHost)


def patch_mla(module: ModuleType) -> None:
    _unpinned(module.MLATokenToKVPoolHost)
    module.transfer_kv_direct = transfer_kv_direct
