"""TEST SCAFFOLDING ONLY: a pure-torch stand-in for SGLang's CPU ``sgl_kernel`` build.

That build is not on PyPI. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports two ops from it on the
default path; they are written here with torch indexing. Any other name imports (SGLang probes
for optional kernels at import time) but raises ``NotImplementedError`` when called, so SGLang's
native torch layers run instead. Put on the server's ``PYTHONPATH`` by the tests' SGLang launcher (``tests/engines/launchers.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[r, start[r]:end[r]] = out_cache_loc[<r's slice>]`` for every request r,
    the slices of ``out_cache_loc`` following each other in request order."""
    lens = (end_offset - start_offset).to(torch.long)
    total = int(lens.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.long), lens)
    firsts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    cols = torch.repeat_interleave(start_offset.to(torch.long), lens) + torch.arange(total) - firsts
    req_to_token[rows, cols] = out_cache_loc[:total].to(req_to_token.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In every layer buffer (given by address and row stride in bytes), copy row ``src_loc[i]``
    to row ``tgt_loc[i]``."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.long)
    src = src_loc.to(torch.long)
    rows = int(max(int(tgt.max()), int(src.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, int(stride))
        buf[tgt] = buf[src]


def _missing(name: str) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU test stand-in")

    op.__name__ = name
    return op


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
