"""A prompt's partial tail is verified like a full block, over the values of its tokens only
(``verify.compare.TokenMap``, ``store.prepare_verify(..., tails=True)``, ``adapters/vllm/tails.py``).

Before, a tail was never compared: a planted tail (another prompt's KV under the victim's tail key,
valid checksum) survived every verification and was loaded by the next engine that hit it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvstrata.keys import BlockChain
from kvstrata.store import BlockStore, Hit, Reservation
from kvstrata.verify.compare import Segment, TokenMap, comparable, compare
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens

HEADS, HEAD = 1, 2  # a block of one float32 layer: [heads, block_size, 2 * head] = BLOCK_BYTES


def vec_layout(heads: int, block_size: int, head: int) -> torch.Tensor:
    """The token of each value of a page laid out as vLLM's CPU ``vec`` kernel writes it: per head,
    K as ``[head, block_size]`` (a token's K in a column), then V as ``[block_size, head]``."""
    k = torch.arange(head * block_size) % block_size
    v = torch.arange(block_size * head) // head
    return torch.cat([k, v] * heads).to(torch.int32)


TOKENS = TokenMap(vec_layout(HEADS, BLOCK_SIZE, HEAD))
SEGMENTS = [Segment("layer 0", 0, BLOCK_BYTES, torch.float32, TOKENS)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def tail_block(seed: int, ntok: int, garbage: int) -> torch.Tensor:
    """A block whose first ``ntok`` tokens hold KV drawn from ``seed`` and the rest whatever the
    engine's memory held (drawn from ``garbage``)."""
    kv = torch.randn(BLOCK_BYTES // 4, generator=torch.Generator().manual_seed(seed))
    out = torch.randn(BLOCK_BYTES // 4, generator=torch.Generator().manual_seed(garbage))
    mine = (TOKENS.token_of >= 0) & (TOKENS.token_of < ntok)
    out[mine] = kv[mine]
    return out


def test_a_tail_is_compared_over_its_tokens_values_only():
    stored, computed = tail_block(1, 5, garbage=10), tail_block(1, 5, garbage=11)
    assert not compare(as_bytes(stored), as_bytes(computed), SEGMENTS).ok  # whole blocks: the garbage differs
    honest = compare(as_bytes(stored), as_bytes(computed), SEGMENTS, tokens=5)
    assert honest.ok and honest.error == 0.0
    planted = compare(as_bytes(tail_block(2, 5, garbage=10)), as_bytes(computed), SEGMENTS, tokens=5)
    assert not planted.ok and planted.error > 1.0  # another prompt's tail


def test_one_wrong_token_of_a_tail_is_caught_and_the_trailing_ones_are_not_compared():
    stored = tail_block(1, 5, garbage=10)
    wrong = stored.clone()
    wrong[TOKENS.token_of == 4] += 3.0  # the tail's last token's K and V
    assert not compare(as_bytes(wrong), as_bytes(stored), SEGMENTS, tokens=5).ok
    drafted = [dataclasses.replace(SEGMENTS[0], tokens=TokenMap(TOKENS.token_of, trailing=1))]
    assert compare(as_bytes(wrong), as_bytes(stored), drafted, tokens=5).ok  # EAGLE: its KV depends on the next token


def test_a_tail_without_a_token_map_is_not_comparable():
    plain = [Segment("layer 0", 0, BLOCK_BYTES, torch.float32)]
    assert comparable(plain) and not comparable(plain, 5) and comparable(SEGMENTS, 5)
    assert not comparable([dataclasses.replace(SEGMENTS[0], tokens=TokenMap(TOKENS.token_of, trailing=1))], 1)
    with pytest.raises(ValueError, match="token map"):
        compare(as_bytes(tail_block(1, 5, 1)), as_bytes(tail_block(1, 5, 1)), plain, tokens=5)
    with pytest.raises(ValueError, match="token map of"):
        Segment("layer 0", 0, BLOCK_BYTES, torch.float32, TokenMap(torch.zeros(3, dtype=torch.int32)))


# ------------------------------------------------------------------ the store
NTOK = 11  # the prompt's tail: 11 of 16 tokens


def stored_prompt(tmp_path, kv_tail: torch.Tensor):
    """Two full blocks and a tail (its KV ``kv_tail``) stored in L1 and L2."""
    store = BlockStore(make_config(tmp_path, {"l2.write": "through"}))
    ns = make_namespace(kv_dtype="float32")
    tokens = random_tokens("tails", 2 * BLOCK_SIZE + NTOK)
    epoch, chain = store.chain(ns, tokens)
    assert chain.lengths == [BLOCK_SIZE, BLOCK_SIZE, NTOK]
    full = [tail_block(i, BLOCK_SIZE, garbage=0) for i in (1, 2)]
    assert store.save_now(ns, epoch, chain, torch.stack([as_bytes(b) for b in [*full, kv_tail]])) == 3
    store.flush()
    return store, ns, tokens, epoch, chain, full


def verify(store, ns, epoch, chain, rows, *, tails: bool = True):
    res = store.prepare_verify(ns, epoch, chain, BLOCK_BYTES, tails=tails)
    for slot, m in zip(res.slots, res.metas):
        store.arena.data[slot, :BLOCK_BYTES] = as_bytes(rows[chain.keys.index(m.key)])
    return res, store.complete_verify(res, SEGMENTS, wait=True)


def total(snap: dict, name: str) -> int:
    return sum(v for k, v in snap.items() if k.startswith(f"{name}_"))


def test_an_honest_tail_verifies_clean_whatever_its_block_holds_past_its_tokens(tmp_path):
    store, ns, tokens, epoch, chain, full = stored_prompt(tmp_path, tail_block(3, NTOK, garbage=20))
    res, results = verify(store, ns, epoch, chain, [*full, tail_block(3, NTOK, garbage=21)])
    assert [m.ntok for m in res.metas] == [BLOCK_SIZE, BLOCK_SIZE, NTOK] and res.metas[2].tail
    assert [r.ok for r in results] == [True, True, True]
    assert store.lookup(ns, tokens).num_tokens == len(tokens)  # kept
    store.close()


def test_a_planted_tail_is_caught_and_deleted_from_every_tier(tmp_path):
    """Scenario: the victim's tail key holds another prompt's tail KV (a valid checksum: written
    through the store API). A verification of the victim computes the right tail: the planted one
    is counted, deleted from L1 and L2, and no lookup finds a tail there any more, also after a
    restart (its disk marker is gone with it)."""
    store, ns, tokens, epoch, chain, full = stored_prompt(tmp_path, tail_block(4, NTOK, garbage=20))
    _res, untouched = verify(store, ns, epoch, chain, [*full, tail_block(3, NTOK, garbage=21)], tails=False)
    assert len(untouched) == 2  # as before: the full blocks only, the planted tail stays
    assert store.lookup(ns, tokens).num_tokens == len(tokens)
    _res, results = verify(store, ns, epoch, chain, [*full, tail_block(3, NTOK, garbage=21)])
    assert [r.ok for r in results] == [True, True, False]
    snap = store.snapshot()
    assert total(snap, "verify_mismatches") == 1 and snap["verify_deleted_blocks"] == 1
    assert store.lookup(ns, tokens).num_tokens == 2 * BLOCK_SIZE  # the full blocks, no tail
    store.close()
    again = BlockStore(make_config(tmp_path, {"l2.write": "through"}))
    assert again.wait_recovered(30)
    assert again.lookup(ns, tokens).num_tokens == 2 * BLOCK_SIZE
    again.close()


# ------------------------------------------------------------------ the vLLM scheduler's plan
class _Store:
    """Records what ``Verifies.plan`` asks to verify; every block asked for is stored."""

    def __init__(self) -> None:
        self.asked: list[tuple[BlockChain, bool]] = []

    def prepare_verify(self, ns, epoch, chain, size, *, tails=False):
        self.asked.append((chain, tails))
        return Reservation([_Meta(k) for k in chain.keys], list(range(len(chain.keys))))

    def complete_load(self, hit) -> None:
        pass


class _Meta:
    def __init__(self, key: bytes) -> None:
        self.key = key


class _Ops:
    segments = ((Segment("layer 0", 0, BLOCK_BYTES, torch.float32),),)

    def verifies(self, group: int) -> bool:
        return True


def test_the_plan_takes_a_hits_tail_from_the_engine_block_at_its_place():
    """Scenario: the stored hit is 2 full blocks and an 11-token tail; the verified request's
    prompt goes on past the tail (its block 2 is full). The step that saves block 2 also verifies
    the hit's tail from engine block 2; before, it was never verified (the request saves block 2
    under another key than the tail's)."""
    pytest.importorskip("vllm")
    from kvstrata.adapters.vllm.pending import Pending
    from kvstrata.adapters.vllm.verify import Verifies

    ns = make_namespace(kv_dtype="float32")
    hit_chain = BlockChain([b"k0", b"k1", b"tail"], [b"r", b"k0", b"k1"], [0, 0, 0], [BLOCK_SIZE, BLOCK_SIZE, NTOK])
    request = BlockChain([b"k0", b"k1", b"k2full"], [b"r", b"k0", b"k1"], [0, 0, 0], [BLOCK_SIZE] * 3)
    for tails, want in ((True, ([b"k0", b"k1", b"tail"], [0, 1, 2])), (False, ([b"k0", b"k1"], [0, 1]))):
        store = _Store()
        verifies = Verifies(store, ns, _Ops(), BLOCK_SIZE, BLOCK_BYTES)  # type: ignore[arg-type]
        verifies.tails = tails
        st = Pending(None, np.zeros(0, np.uint32), None)  # type: ignore[arg-type]
        st.verify_hit, st.saved_full = Hit(ns, 7, hit_chain, [1, 1, 1], None), 3
        res, at = verifies.plan(st, 7, request, [0, 1, 2])
        assert ([m.key for m in res.metas], at) == want and store.asked[0][1] == tails
        assert st.verify_hit is None  # its last block planned: the pin went


def test_a_tail_planned_in_a_later_step_keeps_the_pin_until_then():
    pytest.importorskip("vllm")
    from kvstrata.adapters.vllm.pending import Pending
    from kvstrata.adapters.vllm.verify import Verifies

    ns = make_namespace(kv_dtype="float32")
    hit_chain = BlockChain([b"k0", b"tail"], [b"r", b"k0"], [0, 0], [BLOCK_SIZE, NTOK])
    store = _Store()
    verifies = Verifies(store, ns, _Ops(), BLOCK_SIZE, BLOCK_BYTES)  # type: ignore[arg-type]
    verifies.tails = True
    st = Pending(None, np.zeros(0, np.uint32), None)  # type: ignore[arg-type]
    st.verify_hit, st.saved_full = Hit(ns, 7, hit_chain, [1, 1], None), 1
    res, at = verifies.plan(st, 7, BlockChain([b"k0"], [b"r"], [0], [BLOCK_SIZE]), [0])  # a chunk: block 0 only
    assert at == [0] and st.verify_hit is not None  # the tail is still to come
    st.tail_saved = True
    res, at = verifies.plan(st, 7, BlockChain([b"tail"], [b"k0"], [0], [NTOK]), [1])  # the prompt's end
    assert [m.key for m in res.metas] == [b"tail"] and at == [1] and st.verify_hit is None


# ------------------------------------------------------------------ vLLM's CPU layout
def test_the_cpu_backends_token_layout_is_read_off_its_kernel():
    """``tails.py`` reads the layout off vLLM's own cache-write kernel; on this machine's kernel
    (``vec``: no AMX) it is K column-major and V row-major, as vLLM's source says."""
    pytest.importorskip("vllm")
    from kvstrata.adapters.vllm.tails import PageSpec, tail_tokens

    page = PageSpec(32, 2, 64, torch.float32, 2 * 32 * 2 * 64, "auto", torch.float32)
    tokens = tail_tokens(page, ("CPU_ATTN",), trailing=1)
    assert tokens is not None and tokens.trailing == 1
    if not torch.cpu._is_amx_tile_supported():
        assert torch.equal(tokens.token_of, vec_layout(2, 32, 64))
    owned = torch.bincount(tokens.token_of.long(), minlength=32)
    assert (owned == 2 * 2 * 64).all()
    assert tail_tokens(page, ("FLASH_ATTN",), 0) is None  # no layout known: tails not compared
    assert tail_tokens(page, ("CPU_ATTN", "CPU_MLA"), 0) is None
    assert tail_tokens(dataclasses.replace(page, values=page.values + 8), ("CPU_ATTN",), 0) is None  # padded page
