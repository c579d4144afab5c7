"""A stored block beside the block the engine computed for the same key, layer by layer.

Two honest computations of one prefix need not be bit-identical: another batch, another chunking
of the prefill or another kernel path rounds differently. So a block is not compared byte for byte
but per segment (one layer's part of the block, in the layer's dtype) by the relative L2 error
``||stored - computed|| / max(||stored||, ||computed||)``: 0 for equal segments, about 1.4 for
unrelated ones of the same scale, whatever the scale of the layer. A block passes when its worst
segment is within the tolerance of its dtype (``TOLERANCES``, calibrated by ``kvstrata bench
verify``: docs/consistency.md "Verified hits").

The comparison reads the segments as the engine laid them out (``worker.copy.BlockLayout``: a
block is ``[layer 0 | layer 1 | ...]``) and never reorders them: packed or permuted layouts compare
the same, since the error is over the whole segment. One vectorized pass per dtype; no per-token
or per-element Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

# The largest worst-segment relative L2 error of an honest recomputation, per KV dtype. Measured by
# `kvstrata bench verify --model M --dtype float32,bfloat16,float16,fp8,fp8_e5m2 --sweep 1e-3` on
# the tiny (4 layers) and small (24 layers, Qwen2-0.5B shape) presets of examples/make_tiny_model.py,
# vLLM 0.32 CPU build, 2-core Xeon with AMX (docs/consistency.md "Verified hits: calibration"): the
# largest honest error (another batch and prefill chunking) and the smallest dishonest one (another
# prompt, another layer, every weight times 1 + 0.01 N(0, 1)) over both models, in the comments.
TOLERANCES: dict[torch.dtype, float] = {
    # honest <= 4.1e-7, dishonest >= 3.1e-2. The geometric mean is 1e-4; a decade above it, as the
    # honest side is the one other kernels (GPU GEMMs, split-K) move: 31x below the nearest dishonest.
    torch.float32: 1e-3,
    # honest 0 (the CPU fp16 path was bit-identical), dishonest >= 3.1e-2. By argument: bf16's
    # honest 1.8e-2 at 8x finer rounding is ~2e-3; 1e-2 is 4x above that and 3x below the dishonest.
    torch.float16: 1e-2,
    # honest <= 1.8e-2 (24 layers; 4.6e-3 at 4), dishonest >= 3.2e-2 (4 layers; 7.1e-2 at 24): the
    # geometric mean, 2.4e-2, rounded up (honest drift grows with depth): 1.7x / 1.07x margins.
    torch.bfloat16: 3e-2,
    # honest <= 3.9e-2, dishonest >= 5.6e-2: geometric mean 4.7e-2, rounded up: 1.3x / 1.1x.
    torch.float8_e4m3fn: 5e-2,
    # honest <= 5.6e-2, dishonest >= 7.8e-2: geometric mean 6.6e-2, rounded up: 1.25x / 1.1x.
    torch.float8_e5m2: 7e-2,
}
_EPS = 1e-30


@dataclass(frozen=True)
class Segment:
    """One layer's bytes in a block: ``nbytes`` at ``offset``, holding values of ``dtype``."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        if self.offset < 0 or self.nbytes <= 0 or self.nbytes % size:
            raise ValueError(f"segment {self.name!r}: {self.nbytes} bytes at {self.offset} is not a whole "
                             f"number of {self.dtype} values")


class Comparison(NamedTuple):
    errors: torch.Tensor  # float64, one relative L2 error per segment
    worst: int  # the index of the segment with the largest error
    tolerance: float  # of the worst segment's dtype

    @property
    def error(self) -> float:
        return float(self.errors[self.worst])

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def segments_of(nbytes: int, layers: int, dtype: torch.dtype) -> list[Segment]:
    """``layers`` equal segments of one dtype over ``nbytes`` (a block of identical layers)."""
    if layers <= 0 or nbytes % layers:
        raise ValueError(f"{nbytes} bytes do not split into {layers} equal layers")
    size = nbytes // layers
    return [Segment(f"layer {i}", i * size, size, dtype) for i in range(layers)]


def relative_errors(stored: torch.Tensor, computed: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """The relative L2 error of each segment of two blocks (flat uint8 tensors of equal size)."""
    if stored.dtype != torch.uint8 or computed.dtype != torch.uint8:
        raise TypeError("blocks are compared as uint8 bytes")
    if stored.numel() != computed.numel():
        raise ValueError(f"blocks of {stored.numel()} and {computed.numel()} bytes")
    end = max((s.offset + s.nbytes for s in segments), default=0)
    if end > stored.numel():
        raise ValueError(f"segments reach byte {end} of a {stored.numel()}-byte block")
    out = torch.empty(len(segments), dtype=torch.float64)
    by_shape: dict[tuple[torch.dtype, int], list[int]] = {}
    for i, s in enumerate(segments):
        by_shape.setdefault((s.dtype, s.nbytes), []).append(i)
    for (dtype, nbytes), index in by_shape.items():  # one batched pass per (dtype, size)
        a = _rows(stored, [segments[i] for i in index], nbytes).view(dtype).double()
        b = _rows(computed, [segments[i] for i in index], nbytes).view(dtype).double()
        diff = torch.linalg.vector_norm(a - b, dim=1)
        scale = torch.maximum(torch.linalg.vector_norm(a, dim=1), torch.linalg.vector_norm(b, dim=1))
        err = torch.where(scale > _EPS, diff / scale.clamp_min(_EPS), torch.zeros_like(diff))
        # a segment with NaN or inf is never a match (a NaN block is not an honest recomputation)
        bad = ~(torch.isfinite(a).all(dim=1) & torch.isfinite(b).all(dim=1))
        out[torch.tensor(index)] = torch.where(bad, torch.full_like(err, float("inf")), err)
    return out


def _rows(block: torch.Tensor, segments: Sequence[Segment], nbytes: int) -> torch.Tensor:
    block = block.reshape(-1)  # one flat run of bytes (a view when it already is one)
    offsets = [s.offset for s in segments]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else nbytes
    if step >= nbytes and all(b - a == step for a, b in zip(offsets, offsets[1:])):  # evenly spaced: a view
        # as_strided's offset counts from the storage's start, not the view's (an arena row)
        return block.as_strided((len(offsets), nbytes), (step, 1), block.storage_offset() + offsets[0])
    return torch.stack([block[o:o + nbytes] for o in offsets])


def compare(stored: torch.Tensor, computed: torch.Tensor, segments: Sequence[Segment],
            tolerances: dict[torch.dtype, float] | None = None) -> Comparison:
    """The worst segment of ``stored`` against ``computed`` and whether it is within its dtype's
    tolerance (``TOLERANCES`` unless given)."""
    if not segments:
        raise ValueError("no segments to compare")
    errors = relative_errors(stored, computed, segments)
    worst = int(torch.argmax(torch.nan_to_num(errors, nan=float("inf"))))
    table = TOLERANCES if tolerances is None else tolerances
    return Comparison(errors, worst, table[segments[worst].dtype])
