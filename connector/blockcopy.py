"""blockcopy.py: ``BlockLayout``, moving whole KV blocks between an engine's per-layer KV tensors
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
which makes a hit many times slower and its time erratic. On CUDA the host side goes through a
pinned staging buffer on a side stream, with one event per layer so that a forward pass can wait
for exactly the layer it is about to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


def block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    """The dimension that indexes blocks: the first whose size is ``num_blocks``."""
    for dim, size in enumerate(shape):
        if size == num_blocks:
            return dim
    raise ValueError(f"no dimension of size num_blocks={num_blocks} in KV cache shape {tuple(shape)}")


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
        self.device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._stream = torch.cuda.Stream(device=self.device)
            self._events: dict[str, torch.cuda.Event] = {}
            self._staging: torch.Tensor | None = None

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
        n, rows, idx = self._indices(slots, block_ids)
        staged = self._staging_views(n)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written by compute
        with torch.cuda.stream(self._stream):
            for layer, host in zip(self.layers, staged):
                host.copy_(layer.blocks[idx].reshape(n, -1).view(torch.uint8), non_blocking=True)
        self._stream.synchronize()
        for layer, host in zip(self.layers, staged):
            arena[rows, layer.offset : layer.offset + layer.nbytes] = host

    # ----------------------------------------------------------- arena -> engine
    def load(self, slots: list[int], arena: torch.Tensor, block_ids: list[int]) -> None:
        """Copy arena rows ``slots`` into engine blocks ``block_ids`` (all layers).

        On CPU the copy is complete on return. On CUDA each layer's upload is queued on a side
        stream with an event; call ``wait_layer(name)`` before a forward pass reads that layer
        (or ``wait_all()``).
        """
        if not block_ids:
            return
        _check_pairs(slots, block_ids)
        if not self._cuda:
            for layer, ids, view in self._cpu_runs(slots, arena, block_ids):  # scatter straight into the blocks
                layer.blocks.index_copy_(0, ids, view)
            return
        n, rows, idx = self._indices(slots, block_ids)
        self._stream.synchronize()  # the previous load may still read the staging buffer
        for layer, host in zip(self.layers, self._staging_views(n)):
            torch.index_select(arena[:, layer.offset : layer.offset + layer.nbytes], 0, rows, out=host)
            with torch.cuda.stream(self._stream):
                dev = host.to(self.device, non_blocking=True)
                layer.blocks[idx] = dev.view(layer.blocks.dtype).view(n, *layer.blocks.shape[1:])
                event = torch.cuda.Event()
                event.record(self._stream)
            self._events[layer.name] = event

    def _cpu_runs(self, slots: list[int], arena: torch.Tensor,
                  block_ids: list[int]) -> Iterator[tuple[_Layer, torch.Tensor, torch.Tensor]]:
        """For each run of consecutive slots and each layer: ``(layer, the run's block ids, the
        run's slots as that layer's blocks)``, one batched copy each."""
        begin = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                ids = torch.tensor(block_ids[begin:i], dtype=torch.long)
                for layer in self.layers:
                    yield layer, ids, self._slot_view(arena, slots[begin], i - begin, layer)
                begin = i

    @staticmethod
    def _slot_view(arena: torch.Tensor, start: int, n: int, layer: _Layer) -> torch.Tensor:
        """Slots ``start .. start+n-1``, this layer's bytes only, as ``n`` engine blocks (a view)."""
        raw = arena[start : start + n, layer.offset : layer.offset + layer.nbytes]
        return raw.view(layer.blocks.dtype).view(n, *layer.blocks.shape[1:])

    def _indices(self, slots: list[int], block_ids: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
        return (len(block_ids), torch.tensor(slots, dtype=torch.long),
                torch.tensor(block_ids, dtype=torch.long, device=self.device))

    def _staging_views(self, n: int) -> list[torch.Tensor]:
        """One contiguous pinned ``[n, layer bytes]`` region per layer (reused across calls)."""
        total = n * self.nbytes
        if self._staging is None or self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        views, start = [], 0
        for layer in self.layers:
            views.append(self._staging[start : start + n * layer.nbytes].view(n, layer.nbytes))
            start += n * layer.nbytes
        return views

    def wait_layer(self, name: str) -> None:
        if self._cuda and (event := self._events.pop(name, None)) is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_all(self) -> None:
        if self._cuda:
            for name in list(self._events):
                self.wait_layer(name)
