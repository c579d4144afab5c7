"""worker/copy.py: ``BlockLayout``, moving whole KV blocks between an engine's per-layer KV tensors
and L1 arena slots (``save``: engine to slots, ``load``: slots to engine).

An engine keeps one KV tensor per layer, with the block index on some dimension (dim 0 for vLLM's
CPU and FlashInfer layouts ``[num_blocks, ...]``, dim 1 for FlashAttention's ``[2, num_blocks,
...]``, dim 0 for MLA's ``[num_blocks, block_size, dim]``). A stored block is the bytes of that
block in every layer, concatenated in layer order: an arena slot is ``[layer 0 | layer 1 | ...]``.
The bytes are never reinterpreted (K may be packed in an ISA-specific way).

Copies are one batched index operation per layer and direction for each run of consecutive arena
slots (a hit or a save is usually one run): on CPU ``index_copy_`` scatters a run of slots straight
into the engine's blocks, and ``index_select(..., out=)`` gathers blocks straight into a run of
slots. Neither makes a temporary: a gather into a fresh tensor costs a page fault per 4 KiB of it,
which makes a hit many times slower and its time erratic. On CUDA, on a side stream, the GPU
gathers (or scatters) the blocks into GPU staging rows laid out as arena slots, and the rows move
to or from the arena in one DMA per run of slots (one per slot where a rank's region is part of a
row), so the host copies nothing (``kvstrata bench copy`` measured the host-staged version at 1/8
to 1/14 of the DMA's speed on an H200). A load records one event per layer, so that a forward pass
waits for exactly the layer it is about to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

# GPU memory one layout may hold for its copies: a save or load larger than this goes in chunks.
STAGING_BYTES = 64 << 20


def block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """The dimension that indexes blocks: the first whose size is ``num_blocks``."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV cache shape {tuple(shape)}")


def _runs(slots: list[int], limit: int | None = None) -> Iterator[tuple[int, int]]:
    """``(begin, end)``: index ranges of ``slots`` whose slots are consecutive, ``limit`` long at most."""
    begin = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1 or i - begin == limit:
            yield begin, i
            begin = i


def _check_pairs(slots: list[int], block_ids: list[int]) -> None:
    if len(slots) != len(block_ids):
        raise ValueError(f"{len(slots)} arena slots for {len(block_ids)} engine blocks: one slot per block")


@dataclass
class _Layer:
    name: str
    blocks: torch.Tensor  # the layer's KV with the block dim moved to the front (a view)
    offset: int  # byte offset of this layer inside an arena slot
    nbytes: int  # bytes of one block of this layer


class BlockLayout:
    """Where each layer's block lives inside an arena slot, and the copies in both directions."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, base_offset: int = 0) -> None:
        self.layers: list[_Layer] = []
        offset = base_offset
        for name, kv in kv_caches.items():
            blocks = kv.movedim(block_dim(tuple(kv.shape), num_blocks), 0)
            nbytes = blocks[0].numel() * blocks.element_size()
            self.layers.append(_Layer(name, blocks, offset, nbytes))
            offset += nbytes
        self.nbytes = offset - base_offset
        self.base_offset = base_offset
        self.device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._events: dict[str, torch.cuda.Event] = {}
            self._staging: torch.Tensor | None = None  # GPU rows a copy passes through (STAGING_BYTES)

    def signature(self) -> str:
        """Layout identity for the store namespace: per-layer block shape and dtype."""
        shapes = {(tuple(layer.blocks.shape[1:]), str(layer.blocks.dtype)) for layer in self.layers}
        return f"{len(self.layers)}x" + "|".join(f"{list(s)}:{d}" for s, d in sorted(shapes))

    # ----------------------------------------------------------- engine -> arena
    def save(self, block_ids: list[int], arena: torch.Tensor, slots: list[int]) -> None:
        """Copy engine blocks ``block_ids`` into arena rows ``slots`` (all layers); done on return."""
        if not block_ids:
            return
        _check_pairs(slots, block_ids)
        if not self._cuda:
            for layer, ids, view in self._cpu_runs(slots, arena, block_ids):  # gather straight into the slots
                torch.index_select(layer.blocks, 0, ids, out=view)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written by compute
        with torch.cuda.stream(self._stream):
            for start, ids, stage in self._cuda_chunks(slots, block_ids):
                for layer in self.layers:  # gather on the GPU into the staged slots, layer after layer
                    self._stage_view(stage, layer).copy_(layer.blocks.index_select(0, ids))
                self._dma(arena, start, stage, to_host=True)
        self._stream.synchronize()

    # ----------------------------------------------------------- arena -> engine
    def load(self, slots: list[int], arena: torch.Tensor, block_ids: list[int]) -> None:
        """Copy arena rows ``slots`` into engine blocks ``block_ids`` (all layers).

        The arena rows are read when this returns. On CPU the copy is complete; on CUDA each layer's
        scatter is queued on a side stream with an event: call ``wait_layer(name)`` before a forward
        pass reads that layer (or ``wait_all()``).
        """
        if not block_ids:
            return
        _check_pairs(slots, block_ids)
        if not self._cuda:
            for layer, ids, view in self._cpu_runs(slots, arena, block_ids):  # scatter straight into the blocks
                layer.blocks.index_copy_(0, ids, view)
            return
        # Blocks a finished request freed may still be read by kernels queued on the compute stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        read = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            for start, ids, stage in self._cuda_chunks(slots, block_ids):
                self._dma(arena, start, stage, to_host=False)
                read.record(self._stream)
                for layer in self.layers:  # scatter on the GPU; the last chunk's scatter ends the layer
                    layer.blocks.index_copy_(0, ids, self._stage_view(stage, layer))
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._events[layer.name] = event
        read.synchronize()  # the caller may reuse the arena rows once this returns

    # ----------------------------------------------------------- CUDA staging
    def _cuda_chunks(self, slots: list[int],
                     block_ids: list[int]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(first slot, block ids on the GPU, GPU staging rows)`` per run of consecutive slots, cut to
        the staging buffer's size. Called on the side stream, which orders the buffer's reuse."""
        for begin, end in _runs(slots, limit=max(1, STAGING_BYTES // max(1, self.nbytes))):
            need = (end - begin) * self.nbytes
            if self._staging is None or self._staging.numel() < need:
                self._staging = torch.empty(need, dtype=torch.uint8, device=self.device)
            ids = torch.tensor(block_ids[begin:end], dtype=torch.long, device=self.device)
            yield slots[begin], ids, self._staging[:need].view(end - begin, self.nbytes)

    def _stage_view(self, stage: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """One layer's bytes of the staged rows, as that layer's blocks (a view)."""
        offset = layer.offset - self.base_offset
        raw = stage[:, offset : offset + layer.nbytes]
        return raw.view(layer.blocks.dtype).view(stage.shape[0], *layer.blocks.shape[1:])

    def _dma(self, arena: torch.Tensor, start: int, stage: torch.Tensor, to_host: bool) -> None:
        """Staged rows to or from arena rows ``start ..``: one copy when this layout fills the rows,
        else one per row (this rank's region of each). Asynchronous where the arena is page-locked."""
        n = stage.shape[0]
        if self.base_offset == 0 and self.nbytes == arena.shape[1]:
            pairs = [(arena[start : start + n], stage)]
        else:
            pairs = [(arena[start + i, self.base_offset : self.base_offset + self.nbytes], stage[i])
                     for i in range(n)]
        for host, dev in pairs:
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

    def _cpu_runs(self, slots: list[int], arena: torch.Tensor,
                  block_ids: list[int]) -> Iterator[tuple[_Layer, torch.Tensor, torch.Tensor]]:
        """For each run of consecutive slots and each layer: ``(layer, the run's block ids, the
        run's slots as that layer's blocks)``, one batched copy each."""
        for begin, end in _runs(slots):
            ids = torch.tensor(block_ids[begin:end], dtype=torch.long)
            for layer in self.layers:
                yield layer, ids, self._slot_view(arena, slots[begin], end - begin, layer)

    @staticmethod
    def _slot_view(arena: torch.Tensor, start: int, n: int, layer: _Layer) -> torch.Tensor:
        """Slots ``start .. start+n-1``, this layer's bytes only, as ``n`` engine blocks (a view)."""
        raw = arena[start : start + n, layer.offset : layer.offset + layer.nbytes]
        return raw.view(layer.blocks.dtype).view(n, *layer.blocks.shape[1:])

    def wait_layer(self, name: str) -> None:
        if self._cuda and (event := self._events.pop(name, None)) is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all(self) -> None:
        if self._cuda:
            for name in list(self._events):
                self.wait_layer(name)
