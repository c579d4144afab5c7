"""``kvstrata.verify.compare``: a stored block beside a recomputed one, per layer segment."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.verify.compare import TOLERANCES, Segment, compare, relative_errors, segments_of


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def block(layers: int = 4, n: int = 512, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, n, generator=g) * torch.logspace(-2, 2, layers)[:, None]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_equal_blocks_pass_and_another_prompts_block_fails(dtype):
    a, b = block(dtype=dtype, seed=1), block(dtype=dtype, seed=2)
    segs = segments_of(a.numel() * a.element_size(), 4, dtype)
    same = compare(as_bytes(a), as_bytes(a.clone()), segs)
    assert same.ok and same.error == 0.0
    other = compare(as_bytes(a), as_bytes(b), segs)
    assert not other.ok and other.error > 1.0  # unrelated values of one scale: about sqrt(2)


def test_the_error_is_per_layer_whatever_the_layers_scale():
    # layers differ in scale by 10^4: a wrong small layer is caught beside a right large one
    a = block(seed=3)
    b = a.clone()
    b[0] = block(seed=4)[0]  # the smallest layer replaced
    c = compare(as_bytes(a), as_bytes(b), segments_of(a.numel() * 4, 4, torch.float32))
    assert not c.ok and c.worst == 0
    assert torch.all(c.errors[1:] == 0)


def test_rounding_noise_of_the_dtype_passes():
    a = block(dtype=torch.float32, seed=5)
    noisy = a * (1 + 1e-6 * torch.randn(a.shape, generator=torch.Generator().manual_seed(6)))
    assert compare(as_bytes(a), as_bytes(noisy), segments_of(a.numel() * 4, 4, torch.float32)).ok
    bf = a.to(torch.bfloat16)
    bf_noisy = (a * (1 + 4e-3 * torch.randn(a.shape, generator=torch.Generator().manual_seed(7)))).to(torch.bfloat16)
    assert compare(as_bytes(bf), as_bytes(bf_noisy), segments_of(bf.numel() * 2, 4, torch.bfloat16)).ok


def test_a_nan_or_inf_segment_never_matches():
    a = block(seed=8)
    b = a.clone()
    b[2, 7] = float("nan")
    c = compare(as_bytes(a), as_bytes(b), segments_of(a.numel() * 4, 4, torch.float32))
    assert c.worst == 2 and c.error == float("inf") and not c.ok
    c = compare(as_bytes(b), as_bytes(b), segments_of(a.numel() * 4, 4, torch.float32))
    assert not c.ok  # not even against itself


def test_zero_segments_are_equal():
    z = torch.zeros(2, 64)
    assert compare(as_bytes(z), as_bytes(z), segments_of(z.numel() * 4, 2, torch.float32)).ok


def test_uneven_and_mixed_dtype_segments():
    k = torch.randn(64)  # float32 layer
    v = torch.randn(96).to(torch.bfloat16)  # bf16 layer of another size
    stored = torch.cat([as_bytes(k), as_bytes(v)])
    computed = torch.cat([as_bytes(k), as_bytes(-v)])
    segs = [Segment("k", 0, 256, torch.float32), Segment("v", 256, 192, torch.bfloat16)]
    c = compare(stored, computed, segs)
    assert c.errors[0] == 0 and c.errors[1] > 1.9 and c.worst == 1 and c.tolerance == TOLERANCES[torch.bfloat16]


@pytest.mark.parametrize("bad", [
    lambda: Segment("x", 0, 6, torch.float32),  # not whole values
    lambda: Segment("x", -4, 8, torch.float32),
    lambda: segments_of(100, 3, torch.float32),
])
def test_bad_segments_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_blocks_of_other_sizes_or_types_are_refused():
    segs = segments_of(16, 1, torch.float32)
    with pytest.raises(ValueError):
        relative_errors(torch.zeros(16, dtype=torch.uint8), torch.zeros(20, dtype=torch.uint8), segs)
    with pytest.raises(TypeError):
        relative_errors(torch.zeros(4), torch.zeros(4), segs)
    with pytest.raises(ValueError):
        relative_errors(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), segs)


@settings(max_examples=50, deadline=None)
@given(layers=st.integers(1, 6), n=st.integers(1, 64), seed=st.integers(0, 2**16), gap=st.integers(0, 3))
def test_batched_errors_equal_one_segment_at_a_time(layers, n, seed, gap):
    g = torch.Generator().manual_seed(seed)
    step = (n + gap) * 4
    a, b = torch.randn(layers * (n + gap), generator=g), torch.randn(layers * (n + gap), generator=g)
    segs = [Segment(f"l{i}", i * step, n * 4, torch.float32) for i in range(layers)]
    batched = relative_errors(as_bytes(a), as_bytes(b), segs)
    for i, s in enumerate(segs):
        one = relative_errors(as_bytes(a), as_bytes(b), [s])[0]
        x, y = a[i * (n + gap): i * (n + gap) + n].double(), b[i * (n + gap): i * (n + gap) + n].double()
        want = float((x - y).norm() / max(x.norm(), y.norm()))
        assert float(batched[i]) == pytest.approx(float(one)) == pytest.approx(want)


def test_a_block_that_is_a_row_of_a_larger_tensor():
    """An L1 arena row is a view at an offset into the arena's storage: the segments are read from
    the row, not from the start of the storage."""
    arena = torch.randn(4, 64).view(torch.uint8)
    row = arena[2]
    segments = segments_of(256, 4, torch.float32)
    assert compare(row.clone(), row, segments).error == 0
    assert compare(arena[1].clone(), row, segments).error > 0.5
