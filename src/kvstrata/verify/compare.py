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

A partial block (a prompt's tail, ``tokens`` fewer than the block size) is compared over the
values of its tokens only: past them the engine's block holds whatever its memory held before.
Which value belongs to which token depends on how the engine packs a block, so a segment says it
(``TokenMap``, made by the engine glue); a tail whose segments have no map cannot be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
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


@dataclass(frozen=True, eq=False)
class TokenMap:
    """The token of a block each value of a segment belongs to (``token_of``: int, -1 for a value of
    no token), for comparing partial blocks; one map serves every segment of its size and dtype.
    ``trailing``: the last tokens of a partial block that are never compared (their KV depends on
    tokens after the block: an EAGLE-style draft head's, ``adapters/vllm/drafts.py``)."""

    token_of: torch.Tensor
    trailing: int = 0

    def values(self, tokens: int) -> torch.Tensor:
        """The indices of the values of the first ``tokens`` tokens, less the trailing ones."""
        return _values(self, tokens - self.trailing)


@lru_cache(maxsize=256)  # a handful of maps, a tail length each: computed once, not per comparison
def _values(tokens_map: TokenMap, tokens: int) -> torch.Tensor:
    of = tokens_map.token_of
    return torch.nonzero((of >= 0) & (of < tokens)).reshape(-1)


@dataclass(frozen=True)
class Segment:
    """One layer's bytes in a block: ``nbytes`` at ``offset``, holding values of ``dtype``;
    ``tokens`` says which token each value is of (partial blocks are compared only with one)."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    tokens: TokenMap | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        if self.offset < 0 or self.nbytes <= 0 or self.nbytes % size:
            raise ValueError(f"segment {self.name!r}: {self.nbytes} bytes at {self.offset} is not a whole "
                             f"number of {self.dtype} values")
        if self.tokens is not None and self.tokens.token_of.numel() != self.nbytes // size:
            raise ValueError(f"segment {self.name!r}: a token map of {self.tokens.token_of.numel()} values for "
                             f"{self.nbytes // size}")


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


def comparable(segments: Sequence[Segment], tokens: int | None = None) -> bool:
    """Whether blocks cut into ``segments`` can be compared: any full block; a partial one of
    ``tokens`` tokens only when every segment says which token each value is of, and has values
    of those tokens to compare."""
    if not segments:
        return False
    return tokens is None or all(s.tokens is not None and s.tokens.values(tokens).numel() for s in segments)


def relative_errors(stored: torch.Tensor, computed: torch.Tensor, segments: Sequence[Segment],
                    tokens: int | None = None) -> torch.Tensor:
    """The relative L2 error of each segment of two blocks (flat uint8 tensors of equal size);
    with ``tokens``, of the values of a partial block's first ``tokens`` tokens only."""
    if stored.dtype != torch.uint8 or computed.dtype != torch.uint8:
        raise TypeError("blocks are compared as uint8 bytes")
    if stored.numel() != computed.numel():
        raise ValueError(f"blocks of {stored.numel()} and {computed.numel()} bytes")
    end = max((s.offset + s.nbytes for s in segments), default=0)
    if end > stored.numel():
        raise ValueError(f"segments reach byte {end} of a {stored.numel()}-byte block")
    if tokens is not None and not comparable(segments, tokens):
        raise ValueError(f"a partial block of {tokens} tokens is compared only over segments whose token map "
                         "holds values of those tokens")
    out = torch.empty(len(segments), dtype=torch.float64)
    by_shape: dict[tuple[torch.dtype, int, int], list[int]] = {}
    for i, s in enumerate(segments):
        by_shape.setdefault((s.dtype, s.nbytes, id(s.tokens) if tokens is not None else 0), []).append(i)
    for (dtype, nbytes, _map), index in by_shape.items():  # one batched pass per (dtype, size, token map)
        a = _rows(stored, [segments[i] for i in index], nbytes).view(dtype)
        b = _rows(computed, [segments[i] for i in index], nbytes).view(dtype)
        if tokens is not None:
            values = segments[index[0]].tokens.values(tokens)  # type: ignore[union-attr]
            a, b = a[:, values], b[:, values]
        a, b = a.double(), b.double()
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
            tolerances: dict[torch.dtype, float] | None = None, tokens: int | None = None) -> Comparison:
    """The worst segment of ``stored`` against ``computed`` and whether it is within its dtype's
    tolerance (``TOLERANCES`` unless given); ``tokens``: a partial block of that many tokens,
    compared over their values only (every segment needs a ``TokenMap``)."""
    if not segments:
        raise ValueError("no segments to compare")
    errors = relative_errors(stored, computed, segments, tokens)
    worst = int(torch.argmax(torch.nan_to_num(errors, nan=float("inf"))))
    table = TOLERANCES if tolerances is None else tolerances
    return Comparison(errors, worst, table[segments[worst].dtype])
