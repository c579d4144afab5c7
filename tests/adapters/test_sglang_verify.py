"""Verified hits in the SGLang adapter (``kvstrata.adapters.sglang.verify``), without SGLang: the
sampled keys a query hides (``Sampled``), the per-layer segments of a host page (``page_segments``)
and the comparison of a write-back (``PageChecks``) over a real store and ``PageRows`` of a pool
with SGLang's own buffer shapes. ``StrataStorage`` itself, over SGLang's real host pool and on a
real server: tests/engines/test_sglang_verify.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvstrata.adapters.sglang.namespace import digests_of
from kvstrata.adapters.sglang.pages import PageRows
from kvstrata.adapters.sglang.verify import PageChecks, Sampled, page_segments
from kvstrata.store import BlockStore
from tests.builders import make_config, make_namespace, sglang_keys

PAGE, LAYERS, HEADS, DIM, TOKENS = 16, 3, 2, 8, 256


def host_pool(layout: str = "layer_first", *, mla: bool = False, dtype: torch.dtype = torch.bfloat16):
    """What ``PageRows`` reads of SGLang's host pools, with their buffer shapes (``pool_host/mha.py``,
    ``mla.py``): MHA ``[2, layers, tokens, heads, dim]`` (layer_first) or ``[2, tokens, layers, heads,
    dim]`` (page_first); MLA ``[layers, tokens, 1, latent]`` or ``[tokens, layers, 1, latent]``."""
    if mla:
        dims = (LAYERS, TOKENS, 1, 4 * DIM) if layout == "layer_first" else (TOKENS, LAYERS, 1, 4 * DIM)
    else:
        dims = (2, LAYERS, TOKENS, HEADS, DIM) if layout == "layer_first" else (2, TOKENS, LAYERS, HEADS, DIM)
    buf = torch.randn(dims, generator=torch.Generator().manual_seed(0)).to(dtype) if dtype.is_floating_point \
        else torch.zeros(dims, dtype=dtype)
    return SimpleNamespace(layout=layout, kv_buffer=buf, size=TOKENS, page_size=PAGE, layer_num=LAYERS, dcp_size=1)


def total(snap: dict, name: str) -> int:
    """A per-tier counter summed over the tiers (the copy compared is read from a tier chosen at
    random among those holding it)."""
    return sum(v for k, v in snap.items() if k.startswith(f"{name}_"))


def pages(first: int, n: int) -> torch.Tensor:
    """Host indices of ``n`` consecutive pages from page ``first``."""
    return torch.arange(first * PAGE, (first + n) * PAGE)


# ---------------------------------------------------------------------------------- sampling
def test_a_sampled_query_hides_its_stored_pages_until_their_write_back():
    keys = sglang_keys(1, 6)
    sampled = Sampled(1.0)
    assert sampled.answer(keys, 0) == 0 and not len(sampled)  # nothing stored: nothing to verify
    assert sampled.answer(keys, 4) == 0  # sampled: the 4 stored pages are hidden
    assert len(sampled) == 4
    sampled.rate = 0.0
    assert sampled.answer(keys, 4) == 0  # another query of the same request agrees
    assert sampled.answer(keys[2:], 2) == 0
    assert sampled.answer(sglang_keys(2, 3), 3) == 3  # other pages are answered as they are
    assert sampled.take(keys[3:] + keys[:1]) == [0, 3]  # the write-back: keys 3 and 0
    assert sampled.answer(keys, 4) == 1  # hidden from key 1 on
    assert sampled.take(keys) == [1, 2] and not len(sampled)
    assert sampled.answer(keys, 4) == 4 and sampled.take(keys) == []


def test_sample_rate_zero_never_hides_a_page():
    sampled = Sampled(0.0)
    keys = sglang_keys(3, 8)
    assert all(sampled.answer(keys, n) == n for n in range(9))
    assert not len(sampled) and sampled.take(keys) == []


def test_the_sample_rate_is_the_fraction_of_queries_with_a_hit_that_are_hidden():
    sampled = Sampled(0.25, rng=random.Random(7))
    hidden = sum(sampled.answer(sglang_keys(i, 2), 2) == 0 for i in range(2000))
    assert 400 < hidden < 600


def test_remembered_keys_expire_and_are_bounded():
    now = [0.0]
    sampled = Sampled(1.0, ttl_s=10, capacity=5, clock=lambda: now[0])
    a, b = sglang_keys(4, 3), sglang_keys(5, 3)
    assert sampled.answer(a, 3) == 0
    now[0] = 5
    assert sampled.answer(b, 3) == 0
    assert len(sampled) == 5  # the oldest of a went for room
    assert sampled.take(a) == [1, 2]
    now[0] = 16  # b's deadline passed: its write-back never came, its pages are served again
    sampled.rate = 0.0
    assert sampled.answer(b, 3) == 3 and not len(sampled)


# ---------------------------------------------------------------------------------- segments
@pytest.mark.parametrize("layout,mla,count", [("layer_first", False, 2 * LAYERS), ("page_first", False, 2 * PAGE * LAYERS),
                                              ("layer_first", True, LAYERS), ("page_first", True, PAGE * LAYERS)])
def test_each_segment_is_one_layer_of_a_page(layout, mla, count):
    pool = host_pool(layout, mla=mla)
    rows = PageRows(pool, 1024)
    layer_dim = list(pool.kv_buffer.shape).index(LAYERS)  # no other dimension is that long
    shape = [1] * pool.kv_buffer.dim()
    shape[layer_dim] = LAYERS
    pool.kv_buffer.copy_(torch.arange(LAYERS).view(shape).expand_as(pool.kv_buffer))  # every value: its layer
    segments = page_segments(rows, layout, LAYERS)
    assert segments is not None and len(segments) == count
    assert [s.offset for s in segments] == [i * segments[0].nbytes for i in range(count)]
    assert sum(s.nbytes for s in segments) == rows.page_bytes
    page = rows.gather(pages(3, 1), 1)[0]
    layers = [set(page[s.offset: s.offset + s.nbytes].view(torch.bfloat16).tolist()) for s in segments]
    assert all(len(values) == 1 for values in layers)  # no segment mixes layers
    assert {v for values in layers for v in values} == set(map(float, range(LAYERS)))


def test_a_pool_without_a_tolerance_or_a_layer_dimension_is_never_sampled(tmp_path):
    rows = PageRows(host_pool(dtype=torch.uint8), 1024)  # an fp8 KV cache kept as bytes
    assert page_segments(rows, "layer_first", LAYERS) is None
    assert page_segments(PageRows(host_pool("page_first"), 1024), "page_first", LAYERS + 1) is None  # no layer dim
    store = BlockStore(make_config(tmp_path))
    assert PageChecks.for_pool(store, rows, "layer_first", LAYERS, 1.0) is None
    assert PageChecks.for_pool(store, PageRows(host_pool(), 1024), "layer_first", LAYERS, 0.0) is None
    store.close()


# ------------------------------------------------------------------------ write-back compared
class Backend:
    """What ``StrataStorage`` does around ``PageChecks``: queries and write-backs of pool pages."""

    def __init__(self, tmp_path, layout: str, rate: float = 1.0) -> None:
        self.pool = host_pool(layout)
        self.rows = PageRows(self.pool, 1024)
        self.store = BlockStore(make_config(tmp_path, {"l2.write": "through"}))
        self.ns = make_namespace(kv_dtype="bfloat16", block_size=PAGE)
        self.checks = PageChecks.for_pool(self.store, self.rows, layout, LAYERS, rate)
        assert self.checks is not None

    def chain(self, keys: list[str]):
        epoch = self.store.current_epoch(self.ns)
        return epoch, self.store.page_chain(self.ns, epoch, digests_of(keys))

    def stored(self, keys: list[str]) -> int:
        epoch, chain = self.chain(keys)
        return self.store.lookup_chain(self.ns, epoch, chain).num_blocks

    def save(self, keys: list[str], indices: torch.Tensor) -> None:
        epoch, chain = self.chain(keys)
        self.store.save_now(self.ns, epoch, chain, self.rows.gather(indices, len(keys)).clone())

    def query(self, keys: list[str]) -> int:
        return self.checks.answer(keys, self.stored(keys))

    def write_back(self, keys: list[str], indices: torch.Tensor) -> list[int]:
        epoch, chain = self.chain(keys)
        self.store.save_now(self.ns, epoch, chain, self.rows.gather(indices, len(keys)).clone())
        data = self.store.arena.data
        checked = self.checks.write_back(self.ns, epoch, keys, chain, lambda slots, at: self.rows.gather_into(
            data, slots, at, indices, len(keys)))
        assert self.store.wait_verified(30)  # compared on the store's comparison thread
        return checked

    def recompute(self) -> None:
        """The engine computes the same KV again, rounded differently (relative noise 1e-3)."""
        buf = self.pool.kv_buffer
        noise = 1 + 1e-3 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(1))
        buf.copy_((buf.float() * noise).to(buf.dtype))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_an_honest_write_back_is_checked_and_kept(tmp_path, layout):
    b = Backend(tmp_path, layout)
    keys = sglang_keys(6, 5)
    b.save(keys, pages(0, 5))
    assert b.query(keys) == 0  # sampled: SGLang computes the 5 pages
    b.recompute()
    assert b.write_back(keys, pages(0, 5)) == [0, 1, 2, 3, 4]
    snap = b.store.snapshot()
    assert total(snap, "verify_checks") == 5 and not total(snap, "verify_mismatches")
    assert b.stored(keys) == 5  # kept
    b.store.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_planted_page_is_caught_counted_and_deleted(tmp_path, layout):
    """Scenario: page 2 of a prompt is stored under its key with a valid checksum but the KV of
    another page (written through the store API); the prompt's next query is sampled, SGLang
    computes the pages and writes them back: page 2 is compared, counted and deleted, the others
    kept, and page 2 is not stored again by that write-back."""
    b = Backend(tmp_path, layout)
    keys = sglang_keys(7, 5)
    b.save(keys[:2], pages(0, 2))
    b.save(keys[2:3], pages(9, 1))  # the plant: page 9's bytes under page 2's key
    b.save(keys[3:], pages(3, 2))
    assert b.stored(keys) == 5
    assert b.query(keys) == 0
    b.recompute()
    assert b.write_back(keys, pages(0, 5)) == [0, 1, 2, 3, 4]
    snap = b.store.snapshot()
    assert total(snap, "verify_checks") == 5 and total(snap, "verify_mismatches") == 1
    assert b.stored(keys) == 2  # the next query stops at the deleted page
    assert b.stored(keys[3:]) == 2  # the pages after it are kept
    epoch, chain = b.chain(keys)
    assert b.store.stored_mask(b.ns, epoch, chain).tolist() == [True, True, False, True, True]
    b.store.close()


def test_pages_not_hidden_are_written_back_as_before(tmp_path):
    b = Backend(tmp_path, "layer_first")
    keys = sglang_keys(8, 4)
    b.save(keys[:2], pages(0, 2))
    b.checks.sampled.rate = 0.0
    assert b.query(keys) == 2
    assert b.write_back(keys, pages(0, 4)) == []  # nothing hidden: nothing compared
    assert not total(b.store.snapshot(), "verify_checks") and b.stored(keys) == 4
    b.store.close()


def test_a_failed_copy_compares_nothing_and_the_next_write_back_is_compared(tmp_path):
    b = Backend(tmp_path, "layer_first")
    keys = sglang_keys(9, 3)
    b.save(keys, pages(0, 3))
    assert b.query(keys) == 0
    epoch, chain = b.chain(keys)

    def fail(slots, at):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        b.checks.write_back(b.ns, epoch, keys, chain, fail)
    assert not total(b.store.snapshot(), "verify_checks") and b.stored(keys) == 3
    assert b.query(keys) == 0  # sampled again (rate 1)
    assert b.write_back(keys, pages(0, 3)) == [0, 1, 2]
    assert total(b.store.snapshot(), "verify_checks") == 3
    b.store.close()
