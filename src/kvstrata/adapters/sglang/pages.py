"""Pages of SGLang's host KV pool as byte rows and byte runs (``PageRows``).

Owns every copy between the host pool and kvstrata: whole pages as ``[n, page_bytes]`` rows
(staging buffers, L1 slots) and, for direct disk I/O, a page as writable runs of the pool buffer.
It also checks the pool's layout (``layer_first`` or ``page_first``, no decode context parallelism).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Sequence

import torch

from kvstrata.config import ConfigError

if TYPE_CHECKING:
    from sglang.srt.mem_cache.pool_host import HostKVCache

LAYOUTS = ("layer_first", "page_first")


class PageRows:
    """Pages of SGLang's host KV pool as ``[n, page_bytes]`` rows, and back.

    A stored page has the bytes of ``host_pool.get_data_page(i, flat=True)``: the pool buffer with
    the token dimension cut to one page, in the buffer's own dimension order. So the legacy path
    (flat page tensors) and the zero-copy path store identical bytes for the same layout.

    SGLang hands out host memory in whole pages, so a page is one slice of the token dimension:
    each page moves with one numpy slice copy (a few contiguous runs per page, e.g. one per layer
    and K/V in ``layer_first``), rather than one torch ``index_copy_`` over all token indices,
    which copies row by row and uses torch's intra-op thread pool (which collapses when the
    engine keeps every core busy). Pages that are not contiguous in the pool fall back to that
    indexed copy. Rows live in a per-thread staging buffer that is reused, because
    touching fresh memory costs as much as the copy itself.
    """

    def __init__(self, pool: "HostKVCache", max_runs: int) -> None:
        """``max_runs``: the most byte runs a page may have for direct disk I/O (the store's ``max_runs``)."""
        if pool.layout not in LAYOUTS:
            raise ConfigError(f"kvstrata: SGLang host layout {pool.layout!r} is not supported; "
                              f"use --hicache-mem-layout {' or '.join(LAYOUTS)}")
        if getattr(pool, "dcp_size", 1) > 1:
            raise ConfigError("kvstrata: decode context parallelism (dcp_size > 1) is not supported")
        buf = pool.kv_buffer
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
            raise ConfigError(f"kvstrata: the SGLang host pool has no CPU kv_buffer ({type(buf).__name__})")
        dims = list(buf.shape)
        if dims.count(pool.size) != 1:
            raise ConfigError(f"kvstrata: cannot find the token dimension of host KV buffer {dims}")
        self.buf = buf
        self.dim = dims.index(pool.size)
        self.page_size = pool.page_size
        dims[self.dim] = self.page_size
        self.page_shape = tuple(dims)
        self.page_bytes = math.prod(self.page_shape) * buf.element_size()
        self.signature = f"{type(pool).__name__}:{pool.layout}:{list(self.page_shape)}:{buf.dtype}"
        self._raw = buf.view(torch.uint8).numpy()  # bytes view: numpy copies are single-threaded
        self._raw_page = self._raw.shape[: self.dim] + (self.page_size,) + self._raw.shape[self.dim + 1 :]
        self._lead = (slice(None),) * self.dim
        self._ramp = torch.arange(self.page_size)
        self._local = threading.local()
        # A page as byte runs of the pool buffer (direct disk I/O): one run per index of the
        # dimensions before the token one (layer_first: K/V x layers; page_first: K/V).
        token_bytes = math.prod(dims[self.dim + 1 :]) * buf.element_size()
        self._token_bytes = token_bytes
        self._run_bytes = self.page_size * token_bytes
        self._run_offsets = tuple(j * pool.size * token_bytes for j in range(math.prod(dims[: self.dim])))
        self.pool_bytes = buf.numel() * buf.element_size()
        # Runs must be addressable in the flat buffer, and few enough for one preadv/pwritev.
        self.direct = buf.is_contiguous() and len(self._run_offsets) <= max_runs
        self._mem = memoryview(self._raw.reshape(-1)) if self.direct else None

    def staging(self, n: int) -> torch.Tensor:
        """``[n, page_bytes]`` uint8 rows of this thread's reused buffer (valid until its next call)."""
        held = getattr(self._local, "rows", None)
        if held is None or held.shape[0] < n:
            held = self._local.rows = torch.empty((n, self.page_bytes), dtype=torch.uint8)
        return held[:n]

    def runs(self, start: int) -> list[memoryview]:
        """The page starting at token ``start`` as writable byte runs of the pool buffer, in the
        order of its stored bytes (``get_data_page(start, flat=True)``); needs ``direct``."""
        if self._mem is None:
            raise RuntimeError("kvstrata: direct page runs need a contiguous host pool buffer")
        mem, size, base = self._mem, self._run_bytes, start * self._token_bytes
        return [mem[base + off : base + off + size] for off in self._run_offsets]

    def copy_slot(self, arena: torch.Tensor, slot: int, start: int) -> None:
        """Write ``arena[slot]`` to the page starting at token ``start``."""
        self._raw[self._lead + (slice(start, start + self.page_size),)] = \
            arena.numpy()[slot, : self.page_bytes].reshape(self._raw_page)

    def page_starts(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        """First token of each page, or None when some page is not one contiguous run."""
        tokens = host_indices[: n * self.page_size].to(torch.long).view(n, self.page_size)
        if not torch.equal(tokens - tokens[:, :1], self._ramp.expand(n, -1)):
            return None
        return tokens[:, 0].tolist()

    def gather(self, host_indices: torch.Tensor, n: int) -> torch.Tensor:
        """Pages starting at ``host_indices[i * page_size]`` as staging rows."""
        rows = self.staging(n)
        starts = self.page_starts(host_indices, n)
        if starts is None:
            tokens = host_indices[: n * self.page_size].to(torch.long)
            pages = self.buf.index_select(self.dim, tokens).unflatten(self.dim, (n, self.page_size))
            rows.view(self.buf.dtype).view(n, *self.page_shape).copy_(pages.movedim(self.dim, 0))
            return rows
        out = rows.numpy().reshape(n, *self._raw_page)
        for i, start in enumerate(starts):  # per page, not per token: one slice copy each
            out[i] = self._raw[self._lead + (slice(start, start + self.page_size),)]
        return rows

    def gather_into(self, arena: torch.Tensor, slots: Sequence[int], pages: Sequence[int],
                    host_indices: torch.Tensor, n: int) -> None:
        """Copy page ``pages[i]`` of ``host_indices`` (``n`` pages) into ``arena[slots[i]]``:
        one copy, no staging rows."""
        starts = self.page_starts(host_indices, n)
        dst = arena.numpy()
        if starts is None:
            rows = self.gather(host_indices, n)
            for slot, page in zip(slots, pages):
                dst[slot, : self.page_bytes] = rows[page].numpy()
            return
        for slot, page in zip(slots, pages):
            start = starts[page]
            dst[slot, : self.page_bytes].reshape(self._raw_page)[...] = \
                self._raw[self._lead + (slice(start, start + self.page_size),)]

    def scatter_from(self, arena: torch.Tensor, slots: Sequence[int], host_indices: torch.Tensor) -> None:
        """Write ``arena[slots[i]]`` to page i of ``host_indices``: one copy, no staging rows."""
        n = len(slots)
        if not n:
            return
        starts = self.page_starts(host_indices, n)
        if starts is None:
            self.scatter(arena[torch.tensor(slots, dtype=torch.long), : self.page_bytes], host_indices)
            return
        for slot, start in zip(slots, starts):
            self.copy_slot(arena, slot, start)

    def scatter(self, rows: torch.Tensor, host_indices: torch.Tensor) -> None:
        """Write ``rows`` (``[n, page_bytes]`` uint8) to the pages at ``host_indices``."""
        n = rows.shape[0]
        if not n:
            return
        starts = self.page_starts(host_indices, n)
        if starts is None:
            tokens = host_indices[: n * self.page_size].to(torch.long)
            pages = rows.view(self.buf.dtype).view(n, *self.page_shape).movedim(0, self.dim)
            self.buf.index_copy_(self.dim, tokens, pages.flatten(self.dim, self.dim + 1))
            return
        src = rows.numpy().reshape(n, *self._raw_page)
        for i, start in enumerate(starts):
            self._raw[self._lead + (slice(start, start + self.page_size),)] = src[i]
