"""Verified hits in the vLLM scheduler: a request sampled at admission (``verify.sample_rate``,
``pending.Admission``) that would hit is told no external tokens, so the engine computes its
prefix; the blocks of the hit it computes are copied, in the step that computes them and exactly
like a save, into scratch slots (``store.prepare_verify``, ``Ops.verify``), and the store compares
them with the stored blocks of the same keys once every writer has reported (``complete_verify``):
a block that differs is deleted from every tier, counted and logged. The request's answer is the
engine's own computation: a verified request costs its hit, never a wrong answer.

Compared: the full blocks of the hit from the first block the engine computes (before it, vLLM's
own prefix cache served the request; those blocks are not recomputed). Not compared: a partial
tail (the engine's block holds other bytes past its tokens), nor KV of a dtype without a
tolerance. Hybrid models take the same steps per KV cache group (``hybrid.py``).
"""

from __future__ import annotations

from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import GroupHit, Hit, Reservation, StoreProtocol

from kvstrata.adapters.vllm.pending import Ops, Pending


class Verifies:
    def __init__(self, store: StoreProtocol, ns: Namespace, ops: Ops, block_size: int, slot_bytes: int) -> None:
        self.store = store
        self.ops = ops
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
        if st.verify_groups is not None:
            for hit in st.verify_groups.hits:
                self.store.complete_load(hit)
            st.verify_groups = None

    def plan(self, st: Pending, epoch: int, todo: BlockChain, where: list[int]) -> Reservation:
        """Scratch slots for the blocks of ``todo`` (the step's saves: ``where[i]`` is block i's
        index in the request) that the verified hit holds and the engine computed; the stored ones
        only (``prepare_verify``). The hit's pin goes once its last full block is planned."""
        hit = st.verify_hit
        if hit is None:
            return Reservation([], [])
        keys = set(hit.chain.keys)
        pick = [i for i, (key, at) in enumerate(zip(todo.keys, where)) if at >= st.verify_from and key in keys]
        res = Reservation([], [])
        if pick and epoch == hit.epoch and self.ops.verifies(0):
            res = self.store.prepare_verify(self.ns, epoch, todo.pick(pick), self.slot_bytes)
        if st.saved_full >= sum(1 for n in hit.chain.lengths if n == self.block_size):
            self.drop(st)  # after the slots were reserved: their eviction could not take the hit's blocks
        return res

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
