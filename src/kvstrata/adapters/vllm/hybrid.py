"""The scheduler side's paths for hybrid models: several KV cache groups under vLLM's HMA.

A prefix hit resumes every group at one block boundary (``store.lookup_groups``: full attention
loads every block from the engine's own prefix on, a sliding window the blocks its window reaches,
an SSM its state at the boundary). Loads are asynchronous (vLLM waits for them with the request in
``WAITING_FOR_REMOTE_KVS``): with several groups vLLM cannot recompute single blocks that failed to
load, only a whole request reported in ``failed_recving``, which the workers do for an op the
scheduler marks ``fail`` (vLLM allocated other positions than the hit needs) or that fails to copy.

Saves, in the step that computes the blocks: full and window groups copy the blocks the step
completes that vLLM keeps (never its null block), SSM groups the states vLLM hands over in
``boundary_state_offloads`` (the exact blocks: their positions in the table move). No partial
tails: an SSM state exists only at block boundaries. With an EAGLE-style drafter every group's
blocks are keyed on the tokens after them (``drafts.py``): a block waits for those and is left out
where its draft KV may be of another token, as on a dense model, and a state handed over before
those tokens are known (at the last known token) is not stored.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import GroupHit, GroupRule, StoreProtocol

from kvstrata.adapters.vllm.drafts import DraftInputs
from kvstrata.adapters.vllm.groups import GroupLayout, destinations, real_positions
from kvstrata.adapters.vllm.pending import Ops, Pending
from kvstrata.adapters.vllm.roles import Role
from kvstrata.adapters.vllm.verify import Verifies

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)


class HybridPlans:
    """Lookups, load ops and save ops of a hybrid model for the scheduler side (``scheduler.py``),
    over its store and namespace, its step's ops (``ops``) and its P/D role; ``slot_bytes``: the
    size of an L1 slot (one block of one group)."""

    def __init__(self, store: StoreProtocol, ns: Namespace, ops: Ops, role: Role, slot_bytes: int,
                 layouts: list[GroupLayout], verifies: Verifies) -> None:
        self.store = store
        self.verifies = verifies
        self.ns = ns
        self.ops = ops
        self.role = role
        self.slot_bytes = slot_bytes
        self.layouts = layouts
        self.rules = [GroupRule(g.kind, g.tag, g.window_tokens) for g in layouts]
        self.bs = layouts[0].block_size
        self.counted = next((i for i, g in enumerate(layouts) if g.kind == "full"), 0)  # the served tokens' group

    # -- lookup
    def match(self, st: Pending, num_computed_tokens: int) -> tuple[int, bool]:
        if st.loaded:  # its load is done: vLLM goes on from what it now holds
            return 0, False
        self.release(st)
        self.verifies.drop(st)  # asked again: this lookup decides
        st.local = num_computed_tokens
        hi = (len(st.tokens) - 1) // self.bs * self.bs  # the last token is always computed
        store = self.store
        hit = store.lookup_groups(self.ns, st.tokens, st.extra, self.rules, lo=num_computed_tokens, hi=hi,
                                  pin=True)
        if hit.boundary <= num_computed_tokens:
            self._give_back(hit)
            return 0, False
        if st.verify:  # computed instead, and compared as it is saved (``verify.py``)
            return self.verifies.instead_groups(st, hit, num_computed_tokens)
        counted = hit.hits[self.counted]  # the tier of each block, by its position in the prompt
        st.origin = ["l1"] * int(hit.positions[self.counted][0] if counted.num_blocks else 0) + store.origins(counted)
        slots = []
        for h in hit.hits:  # every block a memory copy away: stage what only a backing tier holds
            found = store.arena.slots(h)
            if any(s is None for s in found):
                store.stage(h._replace(lease=None), local_copy=self.role.local_copy)  # under the group's own pin
                found = store.arena.slots(h)
            if any(s is None for s in found):  # damaged or gone meanwhile: no partial promises
                self._give_back(hit)
                return 0, False
            slots.append(found)
        st.group_hit, st.group_slots = hit, slots
        return hit.boundary - num_computed_tokens, True

    def release(self, st: Pending) -> None:
        if st.group_hit is not None:
            self._give_back(st.group_hit)
            st.group_hit, st.group_slots = None, []

    def _give_back(self, hit: GroupHit) -> None:
        for h in hit.hits:
            self.store.complete_load(h)

    def alloc(self, st: Pending, blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        hit = st.group_hit
        if hit is None:
            return
        if num_external_tokens == 0:
            self.release(st)
            return
        table = blocks.get_block_ids()
        dests = [destinations(table[g], pos) for g, pos in enumerate(hit.positions)]
        req_id = st.request.request_id
        st.group_hit, st.group_slots, slots = None, [], st.group_slots
        st.loaded = True
        if any(d is None for d in dests):  # vLLM allocated other positions than the hit needs
            log.warning("kvstrata: %s: the load plan does not match vLLM's block tables; recomputing it", req_id)
            self._give_back(hit)
            self.ops.load(req_id, [], [], load_async=True, fail=True)
            return
        sent = False
        for g, (h, dest) in enumerate(zip(hit.hits, dests)):
            if not dest:
                self.store.complete_load(h)
                continue
            self.ops.load(req_id, list(slots[g]), dest, hit=h, group=g, load_async=True)
            sent = True
        if not sent:  # nothing to copy: still report the request done
            self.ops.load(req_id, [], [], load_async=True)
        self.store.count_served(*st.taken(num_external_tokens, self.bs))  # the workers copy out of L1

    # -- saves
    def plan_saves(self, req_id: str, st: Pending, scheduled: int, scheduler_output: "SchedulerOutput",
                   kv_cache_manager: Any) -> None:
        """The saves of the blocks this step completes; ``kv_cache_manager``: vLLM's (its block
        tables), bound to the scheduler side after it was made."""
        req = st.request
        after = min(req.num_computed_tokens + scheduled, req.num_tokens)
        full = after // self.bs
        drafts = st.extra if isinstance(st.extra, DraftInputs) else None
        if drafts is not None:  # keyed on the tokens after them: not before those are known
            drafts.note_step(after)
            full = min(full, drafts.known_blocks())
        states = [(g, b, n) for g, b, n in self._states(scheduler_output, req_id)
                  if n % self.bs == 0 and 0 < n <= full * self.bs]
        if full <= st.saved_full and not states:
            return
        tokens = np.asarray(req.all_token_ids[: full * self.bs], dtype=np.uint32)
        epoch = self.store.current_epoch(self.ns)
        if kv_cache_manager is None:
            raise RuntimeError("kvstrata: bind_kv_cache_manager() was not called before scheduling")
        table = kv_cache_manager.get_block_ids(req_id)
        for g, layout in enumerate(self.layouts):
            chain = self.store.group_chain(self.ns, epoch, layout.tag, tokens, st.extra)
            if layout.kind == "state":
                idx, ids = [], []
                for group, block_id, boundary in states:
                    if group == g:
                        idx.append(boundary // self.bs - 1)
                        ids.append(block_id)
            else:
                idx = real_positions(table[g], st.saved_full, full).tolist()
                if drafts is not None:
                    idx = [i for i in idx if drafts.stores(i, st.local)]
                ids = [table[g][i] for i in idx]
            if idx:
                self._save(req_id, epoch, chain.pick(idx), ids, g)
                self.verifies.plan_group(st, req_id, g, epoch, chain.pick(idx), idx, ids)
        st.saved_full = max(st.saved_full, full)

    def _save(self, req_id: str, epoch: int, todo: BlockChain, ids: list[int], group: int) -> None:
        res = self.store.prepare_store(self.ns, epoch, todo, self.slot_bytes)
        if not res.slots:
            return
        position = {key: i for i, key in enumerate(todo.keys)}
        self.ops.save(req_id, res, [ids[position[m.key]] for m in res.metas], group=group)

    @staticmethod
    def _states(scheduler_output: "SchedulerOutput", req_id: str) -> list[tuple[int, int, int]]:
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offloads = getattr(state, "boundary_state_offloads", None) or {}
        return [tuple(x) for x in offloads.get(req_id, ())]  # type: ignore[misc]
