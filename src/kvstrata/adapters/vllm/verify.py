"""Verified hits in the vLLM scheduler: a request sampled at admission (``verify.sample_rate``,
``pending.Admission``) that would hit is told no external tokens, so the engine computes its
prefix; the blocks of the hit it computes are copied, in the step that computes them and exactly
like a save, into scratch slots (``store.prepare_verify``, ``Ops.verify``), and the store compares
them with the stored blocks of the same keys once every writer has reported (``complete_verify``):
a block that differs is deleted from every tier, counted and logged. The request's answer is the
engine's own computation: a verified request costs its hit, never a wrong answer.

Compared: the full blocks of the hit from the first block the engine computes (before it, vLLM's
own prefix cache served the request; those blocks are not recomputed). Not compared: a partial
tail (the engine's block holds other bytes past its tokens), and hybrid models (several KV cache
groups: not sampled yet).
"""

from __future__ import annotations

from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import Hit, Reservation, StoreProtocol

from kvstrata.adapters.vllm.pending import Pending


class Verifies:
    def __init__(self, store: StoreProtocol, ns: Namespace, block_size: int, slot_bytes: int) -> None:
        self.store = store
        self.ns = ns
        self.block_size = block_size
        self.slot_bytes = slot_bytes

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

    def plan(self, st: Pending, epoch: int, todo: BlockChain, where: list[int]) -> Reservation:
        """Scratch slots for the blocks of ``todo`` (the step's saves: ``where[i]`` is block i's
        index in the request) that the verified hit holds and the engine computed; the stored ones
        only (``prepare_verify``). The hit's pin goes once its last full block is planned."""
        hit = st.verify_hit
        if hit is None:
            return Reservation([], [])
        keys = set(hit.chain.keys)
        pick = [i for i, (key, at) in enumerate(zip(todo.keys, where)) if at >= st.verify_from and key in keys]
        if st.saved_full >= sum(1 for n in hit.chain.lengths if n == self.block_size):
            self.drop(st)
        if not pick or epoch != hit.epoch:
            return Reservation([], [])
        chain = BlockChain(*([part[i] for i in pick] for part in todo))
        return self.store.prepare_verify(self.ns, epoch, chain, self.slot_bytes)
