"""TEST SCAFFOLDING ONLY: HiCache on SGLang's CPU "device" (see ``sitecustomize.py`` here).

Upstream HiCache assumes CUDA/HIP/XPU: host pools ask for pinned, ``cudaHostRegister``-ed memory,
and the host<->device copy functions are imported only for those devices. Here the "device" KV
pool is itself CPU memory, so plain memory and plain torch indexing are enough:

- ``patch_common``: host registration becomes a no-op;
- ``patch_mha`` / ``patch_mla``: host pools are built with ``pin_memory=False``, and the module
  gets torch-indexing copy functions for the layouts the tests use (``layer_first`` with
  ``--hicache-io-backend direct``; ``page_first`` with ``--hicache-io-backend kernel``);
- ``patch_mooncake_sender``: the prefill/decode split's Mooncake sender hands page indices over
  as a pinned host tensor behind a CUDA event; on CPU it takes its plain path instead.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Sequence

import torch


TEST_HOST_RESERVE_BYTES = 1 << 30


def patch_reserve(module: ModuleType) -> None:
    """The free host memory a HiCache pool must leave: 1 GiB instead of upstream's 10 GiB (read by
    ``host_memory_budget_bytes`` from the module at each call)."""
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = TEST_HOST_RESERVE_BYTES


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


def patch_torch_native(module: ModuleType) -> None:
    """Extend attention over a cached prefix computes only the new queries.

    Upstream ``TorchNativeAttnBackend._run_sdpa_forward_extend`` builds a query tensor as long as
    the whole sequence (the prefix rows left uninitialised) and runs causal attention over all of
    it, so a prefix hit costs as much attention as a cold prefill: about 3.5 s for 3,000 tokens of
    the Qwen2-0.5B-shaped model here, which hides every cache path behind one floor. GPU backends
    attend the new tokens only; this does the same with a bottom-right causal mask (none for one
    new token). Requests without a prefix, with a sliding window or with an encoder take the
    upstream path unchanged.
    """
    cls = module.TorchNativeAttnBackend
    upstream = cls._run_sdpa_forward_extend

    @functools.wraps(upstream)
    def _run_sdpa_forward_extend(self: Any, query: torch.Tensor, output: torch.Tensor,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                 extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                                 encoder_lens: Any = None, scaling: Any = None, enable_gqa: bool = False,
                                 causal: bool = False, is_cross_attn: bool = False,
                                 sliding_window_size: Any = None) -> torch.Tensor:
        if (encoder_lens is not None or not causal or is_cross_attn
                or (sliding_window_size is not None and sliding_window_size > -1)
                or not bool((extend_prefix_lens > 0).any())):
            return upstream(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                            seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling,
                            enable_gqa, causal, is_cross_attn, sliding_window_size)
        heads_first = query.movedim(0, query.dim() - 2)  # [heads, tokens, head_size]
        start_q = 0
        for i in range(seq_lens.shape[0]):
            q_len, kv_len = int(extend_seq_lens[i]), int(seq_lens[i])
            prefix = kv_len - q_len
            q = heads_first[:, start_q : start_q + q_len, :]
            tokens = req_to_token[req_pool_indices[i], :kv_len]
            k = k_cache[tokens].movedim(0, query.dim() - 2)
            v = v_cache[tokens].movedim(0, query.dim() - 2)
            if not (q.dtype == k.dtype == v.dtype):
                k, v = k.to(q.dtype), v.to(q.dtype)
            mask, is_causal = None, prefix == 0
            if prefix and q_len > 1:  # query j sits at position prefix + j
                mask = (torch.arange(kv_len, device=q.device)[None, :]
                        <= prefix + torch.arange(q_len, device=q.device)[:, None])
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=enable_gqa,
                scale=scaling, is_causal=is_causal)
            output[start_q : start_q + q_len] = out.squeeze(0).movedim(query.dim() - 2, 0)
            start_q += q_len
        return output

    cls._run_sdpa_forward_extend = _run_sdpa_forward_extend


def patch_mooncake_sender(module: ModuleType) -> None:
    """``MooncakeKVSender.supports_host_tensor_indices`` (True upstream) makes the prefill server
    stage page indices in pinned memory (``prefill.py``), which CPU torch cannot allocate: "pin_memory=True
    requires a CUDA or other accelerator backend". False: ``kv_to_page_indices`` on plain tensors."""
    module.MooncakeKVSender.supports_host_tensor_indices = False
