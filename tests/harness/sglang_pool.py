"""SGLang's own objects for driving a HiCache storage backend in-process: a real host KV pool
(``MHATokenToKVPoolHost``, bf16, on CPU), the ``HiCacheStorageConfig`` SGLang hands a backend, and
the per-call extra info that carries prefix keys.

Used by ``kvstrata bench store``'s SGLang comparison (``benchmarks/store_sglang.py``) and by
tests/engines/sglang_storage_cases.py. Importing this module needs no sglang; calling it does
(./.venv-sglang), and on a CPU machine only after the CPU shims of tests/engines/sglang_shims are
installed.
"""

from __future__ import annotations

from typing import Any


def host_pool(device_tokens: int, *, layers: int, heads: int, head_dim: int, page: int,
              layout: str = "layer_first") -> Any:
    """A zeroed host pool at SGLang's host ratio 2 over device buffers of ``device_tokens`` tokens,
    so ``2 * device_tokens`` host tokens; ``layout`` is ``layer_first`` or ``page_first``."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(device_tokens + page, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(device_tokens + page, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))

    def ptrs(ts: tuple) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers)
    pool._keepalive = (k, v)  # the device buffers live as long as the pool
    return pool


def storage_config(extra: dict[str, Any], *, model_name: str, tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False, page_first: bool = False) -> Any:
    """The ``HiCacheStorageConfig`` SGLang builds for a backend (no pipeline or context parallelism,
    no storage metrics); ``extra`` is the backend's ``--hicache-storage-backend-extra-config``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=page_first, model_name=model_name, extra_config=extra)


def extra_info(prefix: list[str]) -> Any:
    """The extra info of one ``batch_*`` call: the keys of the pages before the batch, if any."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=prefix or None)
