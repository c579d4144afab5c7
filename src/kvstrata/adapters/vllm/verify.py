"""Verified hits in the vLLM scheduler: a request sampled at admission (``verify.sample_rate``,
``pending.Admission``) that would hit is told no external tokens, so the engine computes its
prefix; the blocks of the hit it computes are copied, in the step that computes them and exactly
like a save, into scratch slots (``store.prepare_verify``, ``Ops.verify``), and the store compares
them with the stored blocks of the same keys once every writer has reported (``complete_verify``):
a block that differs is deleted from every tier, counted and logged. The request's answer is the
engine's own computation: a verified request costs its hit, never a wrong answer.

Compared: the blocks of the hit from the first block the engine computes (before it, vLLM's own
prefix cache served the request; those blocks are not recomputed). The hit's partial tail too,
over its tokens' values only (``tails.py`` reads which values those are off the attention
backend; the engine's block past them holds other bytes): from the engine block at its place,
whether the request ends there or goes on past it. Not compared: tails where no token layout is
known (backends other than vLLM's CPU one, MLA; hybrid models store no tails), nor KV of a dtype
without a tolerance. Hybrid models take the same steps per KV cache group (``hybrid.py``).

The comparison itself (reading the stored copy, deleting a mismatch from every tier, the
verification record) runs on the store's comparison thread: ``complete_verify``, which the ops
call when every writer has reported, returns at once, so no tier is waited on in a step.
"""

from __future__ import annotations

import dataclasses

from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import GroupHit, Hit, Reservation, StoreProtocol

from kvstrata.adapters.vllm.pending import Ops, Pending
from kvstrata.adapters.vllm.tails import PageSpec, tail_tokens


class Verifies:
    def __init__(self, store: StoreProtocol, ns: Namespace, ops: Ops, block_size: int, slot_bytes: int,
                 page: PageSpec | None = None, trailing: int = 0) -> None:
        """``page``: one layer's block of a dense model (``tails.page_spec``), whose tails are
        compared once the workers name its attention backend (``bind``); ``trailing``: the last
        tokens of a tail never compared (``tails.tail_tokens``)."""
        self.store = store
        self.ops = ops
        self.ns = ns
        self.block_size = block_size
        self.slot_bytes = slot_bytes
        self.page, self.trailing = page, trailing
        self.tails = False  # whether partial tails are compared (their segments carry a token map)

    def bind(self, ns: Namespace, backends: tuple[str, ...] | None) -> None:
        """The namespace with the workers' attention backends, before the engine serves: tails are
        compared from now on where the backend's token layout is known."""
        self.ns = ns
        if self.page is None or not self.ops.verifies(0):
            return
        tokens = tail_tokens(self.page, backends, self.trailing)
        if tokens is not None:
            self.ops.segments = (tuple(dataclasses.replace(s, tokens=tokens) for s in self.ops.segments[0]),
                                 *self.ops.segments[1:])
            self.tails = True

    def instead(self, st: Pending, hit: Hit, num_computed_tokens: int) -> tuple[int, bool]:
        """No external tokens for the sampled request ``st``: its pinned ``hit`` is kept until
        ``plan`` has planned the comparison of the blocks the engine computes, from
        ``num_computed_tokens`` on."""
        st.verify_hit, st.verify_from = hit, num_computed_tokens // self.block_size
        return 0, False

    def drop(self, st: Pending) -> None:
        """Give back the pin of the request's verified hit (a new lookup, or the request ends)."""
        if st.verify_hit is not None:
            self.store.complete_load(st.verify_hit)
            st.verify_hit = None
        if st.verify_groups is not None:
            for hit in st.verify_groups.hits:
                self.store.complete_load(hit)
            st.verify_groups = None

    def plan(self, st: Pending, epoch: int, todo: BlockChain, where: list[int]) -> tuple[Reservation, list[int]]:
        """Scratch slots for the blocks the verified hit holds that the engine computed this step
        (``todo``, the step's saves: ``where[i]`` is block i's index in the request); the stored
        ones only (``prepare_verify``). With them, the request's block index of each reserved
        block. The hit's partial tail is taken from the engine block at its index, whichever block
        of the request the step saves there (its tail, or a full block that goes on past it). The
        hit's pin goes once its last block is planned."""
        hit = st.verify_hit
        if hit is None:
            return Reservation([], []), []
        bs = self.block_size
        keys = set(hit.chain.keys)
        pick = [i for i, (key, at, n) in enumerate(zip(todo.keys, where, todo.lengths))
                if at >= st.verify_from and key in keys and n == bs]
        check = todo.pick(pick)
        at = [where[i] for i in pick]
        last = len(hit.chain.keys) - 1
        tail = last >= 0 and hit.chain.lengths[last] < bs
        if tail and self.tails and last >= st.verify_from and last in where:
            check = BlockChain(*(a + [b[last]] for a, b in zip(check, hit.chain)))
            at.append(last)
        res = Reservation([], [])
        if check.keys and epoch == hit.epoch and self.ops.verifies(0):
            res = self.store.prepare_verify(self.ns, epoch, check, self.slot_bytes, tails=self.tails)
        full = last + 1 - tail
        if st.saved_full >= full and (not tail or not self.tails or st.tail_saved or st.saved_full > last):
            self.drop(st)  # after the slots were reserved: their eviction could not take the hit's blocks
        index = dict(zip(check.keys, at))
        return res, [index[m.key] for m in res.metas]

    # -- hybrid models: per KV cache group (``hybrid.py``)
    def instead_groups(self, st: Pending, hit: GroupHit, num_computed_tokens: int) -> tuple[int, bool]:
        """``instead`` for a hybrid model's pinned ``hit`` (``lookup_groups``), kept until the request
        ends: an SSM state at a boundary is handed over steps after the blocks before it."""
        st.verify_groups, st.verify_from = hit, num_computed_tokens // self.block_size
        return 0, False

    def plan_group(self, st: Pending, req_id: str, group: int, epoch: int, todo: BlockChain, where: list[int],
                   block_ids: list[int]) -> None:
        """The verification op of group ``group``'s blocks this step saves (``todo``, at positions
        ``where``, in engine blocks ``block_ids``) that the verified hit holds: the stored ones."""
        hit = st.verify_groups
        if hit is None or epoch != hit.hits[group].epoch or not self.ops.verifies(group):
            return
        keys = set(hit.hits[group].chain.keys)
        pick = [i for i, (key, at) in enumerate(zip(todo.keys, where)) if at >= st.verify_from and key in keys]
        if not pick:
            return
        res = self.store.prepare_verify(self.ns, epoch, todo.pick(pick), self.slot_bytes)
        position = {todo.keys[i]: i for i in pick}
        if res.slots:
            self.ops.verify(req_id, res, [block_ids[position[m.key]] for m in res.metas], group=group)
