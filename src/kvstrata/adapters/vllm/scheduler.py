"""The scheduler side of the vLLM connector: lookups, load and save plans, and settling ops.

Owns the store (``open_store``: index, L1 bookkeeping, disk tier, epochs). Its L1 arena is a file
in ``/dev/shm`` so that workers on this host can map it; once every worker reports its mapping, the
file is unlinked, so no arena outlives the engine. Lookups answer from the index only; blocks
found only on disk are first read into L1 (``staging.py``): inline when small
(``l1.stage_inline_bytes``), else in the background (the scheduler is told "ask again later"
meanwhile), so that every promised block is a memory copy away and pinned.

Every copy is an op with an id (``pending.Ops``), and every rank reports the ops it has finished,
keyed by its rank (vLLM hands the scheduler the reports of all ranks of a step merged by
``aggregate``). An op is settled only when every rank has reported it:

- Loads: the lookup pins the hit (validated and pinned under one index lock) and reads its L1
  slots under that pin; the load op keeps the pin until every rank has copied the blocks out, so
  a slot cannot be reused for another block in between.
- Saves happen in the step that computes the blocks: the scheduler reserves fresh slots for every
  block that step completes and is not stored yet (and for the prompt's partial tail in the step
  that finishes the prompt), each rank copies its shard right after the forward pass, and the
  blocks are committed to the index when every rank reports its copy done (aborted if any rank
  failed: a block missing one shard is never served). Nothing waits for a request to finish, so
  no block is ever held back from the engine.
- P/D (``kv_role``, ``roles.py``): a producer publishes before it answers, a consumer saves its own.
- The ranks are every worker (pipeline stage * TP degree + TP rank: every stage's layers are in a
  block, so a hit covers every stage); the writers of a save, every rank, or TP rank 0 of each
  stage for an MLA latent that every rank holds whole (``slots.SlotPlan``).

Hybrid models (several KV cache groups) take ``hybrid.py``'s paths; verified hits, ``verify.py``.
"""

from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.config import load_engine_config
from kvstrata.keys import BlockChain
from kvstrata.store import StoreProtocol, open_store

from kvstrata.adapters.vllm.drafts import DraftInputs, draft_lookahead
from kvstrata.adapters.vllm.events import KVEvents
from kvstrata.adapters.vllm.groups import grouped_layouts
from kvstrata.adapters.vllm.hybrid import HybridPlans
from kvstrata.adapters.vllm.metadata import ArenaSpec, StrataMetadata, StrataStats, StrataWorkerMetadata
from kvstrata.adapters.vllm.metrics import StatsCollector
from kvstrata.adapters.vllm.namespace import namespace_for, new_arena_path, with_backends
from kvstrata.adapters.vllm.pending import Admission, Ops, Pending
from kvstrata.adapters.vllm.roles import make_role
from kvstrata.adapters.vllm.slots import slot_plan
from kvstrata.adapters.vllm.staging import Staging
from kvstrata.adapters.vllm.tails import page_spec
from kvstrata.adapters.vllm.verify import Verifies
from kvstrata.adapters.vllm.weights import WeightUpdates, watch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM's per-source hit metric (``vllm:prompt_tokens_cached_by_source``) for each tier. vLLM has no
# source for a store shared between instances; its docs give ``external_unspecified`` to "remote
# store"s (``p2p`` is a transfer from another vLLM instance). kvstrata's own ``kvstrata_hit_*``
# series keep the exact split.
HIT_SOURCE = {"l1": CacheHitSource.HOST, "l2": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class SchedulerSide:
    """The scheduler role of ``StrataConnector``, in EngineCore: see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> None:
        cfg = load_engine_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.ns = namespace_for(vllm_config, kv_cache_config, cfg)
        # Any group other than one of full attention (a hybrid model, or a model whose only group is
        # a sliding window or an SSM): one slot holds one group's block, and every group goes
        # through its kind's checks (no null blocks saved, a window's reach on loads)
        layouts = grouped_layouts(kv_cache_config)
        self.block_size = layouts[0].block_size if layouts else vllm_config.cache_config.block_size
        plan = slot_plan(vllm_config, kv_cache_config, layouts)
        path = new_arena_path()
        self.store: StoreProtocol = open_store(cfg, l1_slot_bytes=plan.slot_bytes, l1_shared_path=path)
        self._bound = False  # the namespace names the workers' attention backends (``bind_backends``)
        atexit.register(self.store.arena.unlink)  # unlink the arena even if vLLM never calls shutdown
        self.arena = ArenaSpec(path, self.store.arena.num_slots, plan.slot_bytes, plan.rank_bytes,
                               [g.layer_names for g in layouts] if layouts else None, plan.shared, plan.stage_bytes)
        self._ranks = plan.ranks
        self._attached: set[int] = set()  # worker ranks that mapped the arena
        self._reqs: dict[str, Pending] = {}
        self.kv_cache_manager: Any = None  # bound by vLLM's scheduler
        self._admission = Admission(cfg.verify.sample_rate, draft_lookahead(vllm_config),  # served, stored, verified
                                    self.block_size)
        watch()  # weight updates made in memory reach ``self.weight_updates`` (weights.py)
        self.stats = StatsCollector(self.store)
        self.role = make_role(vllm_config, cfg, self.store)  # P/D: producer, consumer or both
        self._ops = Ops(self.store, self.role, plan.ranks, plan.writers, plan.segments)  # the step's copies and those in flight
        self._verifies = Verifies(self.store, self.ns, self._ops, self.block_size, plan.slot_bytes,
                                  page_spec(vllm_config, kv_cache_config) if cfg.verify.sample_rate and not layouts
                                  else None,
                                  self._admission.draft_lookahead)
        self._staging = Staging(self.store, self.block_size, plan.slot_bytes, cfg.l1.stage_inline_bytes,
                                self.role.local_copy)
        self._hybrid = HybridPlans(self.store, self.ns, self._ops, self.role, plan.slot_bytes, layouts,
                                   self._verifies) if layouts else None
        events_cfg = vllm_config.kv_events_config
        self.events: KVEvents | None = None
        if events_cfg is not None and events_cfg.enable_kv_cache_events:
            if self._hybrid is None:
                self.events = KVEvents(self.block_size, self.store.tier_bits)
                self.store.listen(self.events.on_tier_change)
            else:  # one event stream per group is not built yet: say so rather than publish a partial one
                log.warning("kvstrata: KV events are not published for hybrid models yet (%d KV cache groups); "
                            "vLLM's own events are unaffected", len(self._hybrid.layouts))
        log.info("kvstrata: namespace %s (%s), %s, L1 %d slots of %d bytes at %s%s", self.ns.id, self.ns.model,
                 vllm_config.kv_transfer_config.kv_role,
                 self.arena.num_slots, plan.slot_bytes, path, "; MLA: one copy for every rank" if plan.shared else "")

    @property
    def weight_updates(self) -> WeightUpdates:
        """This engine's weight updates made in memory (``weights.py``; its hook finds them here)."""
        return self._admission.weights

    # -- the namespace's last part
    def bind_backends(self, backends: tuple[str, ...] | None) -> None:
        """The attention backends the workers report (``backends.reported``; None: none reported)
        enter the namespace, before the engine serves: vLLM hands the reports over in its start-up."""
        self.ns = with_backends(self.ns, backends)
        self._verifies.bind(self.ns, backends)
        if self._hybrid is not None:
            self._hybrid.ns = self.ns
        self.store.describe(self.ns)  # kvstrata stats / invalidate --model name the model
        self._bound = True
        if backends is None:
            log.warning("kvstrata: the workers reported no attention backend; this engine's blocks are kept for "
                        "this process only (namespace %s)", self.ns.id)
        log.info("kvstrata: namespace %s, attention backends %s", self.ns.id, self.ns.extra["attention"])

    # -- lookup
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._bound:
            self.bind_backends(None)
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = self._admission.admit(request)
        if not st.served:
            return 0, False
        if self.weight_updates.off:  # the weights changed in memory without a reset before it (weights.py)
            self._release(st)
            self._verifies.drop(st)
            if self._hybrid is not None:
                self._hybrid.release(st)
            return 0, False
        if self._hybrid is not None:
            return self._hybrid.match(st, num_computed_tokens)
        if self._staging.busy(st):
            return None, False  # disk blocks are being staged into L1: ask again later
        self._release(st)
        st.local = num_computed_tokens
        # Validated and pinned under one index lock: a pinned row keeps its block and its L1 slot
        # until the pin goes, so the slots read below stay this block's until the load is copied.
        hit = self.store.lookup(self.ns, st.tokens, st.extra, pin=True)
        if self.events is not None and not st.learned and hit.num_blocks:
            st.learned = True
            n_full = sum(1 for n in hit.chain.lengths if n == self.block_size)
            self.events.learn(hit.chain.keys[:n_full], request.block_hashes, 0, st.tokens, hit.tiers)
        if st.verify:
            self._verifies.drop(st)  # a lookup asked again (the request was not scheduled): this one counts
            if hit.num_blocks > num_computed_tokens // self.block_size:
                return self._verifies.instead(st, hit, num_computed_tokens)
        matched, slots = self._staging.resident(st, hit, num_computed_tokens)
        if not matched:
            self.store.complete_load(hit)
            return matched, False
        st.hit, st.slots = hit, slots
        return matched, False

    def _may_save(self, st: Pending, req_id: str) -> bool:
        return self._admission.may_save(st, req_id, self.kv_cache_manager, self.block_size)

    def _release(self, st: Pending) -> None:
        """Give back the pin of the request's last lookup (not handed to a load op)."""
        if st.hit is not None:
            self.store.complete_load(st.hit)
            st.hit, st.slots = None, []

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        st = self._reqs.get(request.request_id)
        if not num_external_tokens or st is None:
            return {}
        out: dict[CacheHitSource, int] = {}
        for tier, tokens in zip(*st.taken(num_external_tokens, self.block_size)):
            out[HIT_SOURCE[tier]] = out.get(HIT_SOURCE[tier], 0) + tokens
        return out

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and self._hybrid is not None:
            self._hybrid.alloc(st, blocks, num_external_tokens)
            return
        if st is None or st.hit is None:
            return
        if num_external_tokens == 0:
            self._release(st)
            return
        block_ids = blocks.get_block_ids()[0]
        first = st.local // self.block_size
        last = -(-(st.local + num_external_tokens) // self.block_size)
        # The load op owns the pin now: it goes when every rank has copied the blocks out.
        self._ops.load(request.request_id, st.slots[first:last], list(block_ids[first:last]), hit=st.hit)
        st.hit, st.slots = None, []
        self.store.count_served(*st.taken(num_external_tokens, self.block_size))  # the workers copy out of L1

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StrataMetadata:
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            self.role.planning(st, self.block_size)
            if not self._may_save(st, req_id):
                continue
            if self._hybrid is not None:
                self._hybrid.plan_saves(req_id, st, n, scheduler_output, self.kv_cache_manager)
            else:
                self._plan_saves(req_id, st, n)
        meta = StrataMetadata(self.arena, *self._ops.take(), self.role.take_sent())
        self._admission.new_step(scheduler_output.total_num_scheduled_tokens)
        return meta

    # -- saves
    def _plan_saves(self, req_id: str, st: Pending, scheduled: int) -> None:
        """Save the blocks this step completes, copied right after its forward pass.

        Called before the scheduler advances ``num_computed_tokens``. Tokens whose ids are not
        known yet (speculative drafts) are never saved. The prompt's partial tail is saved in the
        step that finishes the prompt, so a repeated prompt recomputes only its last token.

        With an EAGLE-style drafter a full block is keyed on the token after it (``drafts.py``): one
        that ends at the last known token waits for a later step (its KV stays in vLLM's blocks; a
        request that finishes first leaves it unsaved), and some are never saved (``stores``).
        """
        req = st.request
        before = req.num_computed_tokens
        after = min(before + scheduled, req.num_tokens)
        bs = self.block_size
        full = after // bs
        prompt_len = req.num_prompt_tokens
        tail = bool(prompt_len % bs) and before < prompt_len <= after and not st.tail_saved
        drafts = st.extra if isinstance(st.extra, DraftInputs) else None
        if drafts is not None:
            drafts.note_step(after)
            full = min(full, drafts.known_blocks())
            tail = tail and drafts.keeps_tails and drafts.stores(prompt_len // bs, st.local)
        if full <= st.saved_full and not tail:
            return
        tokens = np.asarray(req.all_token_ids[: max(full * bs, prompt_len if tail else 0)], dtype=np.uint32)
        epoch, chain = self.store.chain(self.ns, tokens[: full * bs], st.extra, partial=False)
        if self.events is not None and full > st.saved_full:
            self.events.learn(chain.keys[st.saved_full : full], req.block_hashes, st.saved_full, tokens)
        where = list(range(st.saved_full, full))  # engine block index of each planned block
        if drafts is not None:
            where = [i for i in where if drafts.stores(i, st.local)]
        todo = chain.pick(where)
        if tail:
            n_prompt_full = prompt_len // bs
            last = self.store.tail_block(self.ns, epoch, chain.keys[n_prompt_full - 1] if n_prompt_full else None,
                                         tokens[n_prompt_full * bs : prompt_len], st.extra, start=n_prompt_full * bs)
            todo = BlockChain(*(a + b for a, b in zip(todo, last)))
            where.append(n_prompt_full)
        st.saved_full, st.tail_saved = max(st.saved_full, full), st.tail_saved or tail
        res = self.store.prepare_store(self.ns, epoch, todo, self.arena.slot_bytes)
        check, check_at = self._verifies.plan(st, epoch, todo, where)  # a verified request's stored blocks
        if self.kv_cache_manager is None and (res.slots or check.slots):
            raise RuntimeError("kvstrata: bind_kv_cache_manager() was not called before scheduling")
        position = {key: i for i, key in enumerate(todo.keys)}
        if res.slots:
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            self._ops.save(req_id, res, [block_ids[where[position[m.key]]] for m in res.metas])
        if check.slots:
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            self._ops.verify(req_id, check, [block_ids[i] for i in check_at])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Everything computed was saved in the step that computed it, except the partial block at
        the end of the output: nothing is left to copy (a producer publishes first: ``roles.py``).

        The pin of a lookup no load op took over (a request aborted or preempted before its
        blocks were allocated) goes now. Ops already sent to the workers keep theirs until every
        rank reports them: a worker may still be copying (vLLM can finish a request while the
        step that carries its load runs), and their reports always come."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._release(st)
            self._verifies.drop(st)
            if self._hybrid is not None:
                self._hybrid.release(st)
        return self.role.finished(request.request_id), None

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, StrataWorkerMetadata):
            self._take_reports(meta)
        self.role.publish()  # a producer: before this step's answers go out

    def _take_reports(self, meta: StrataWorkerMetadata) -> None:
        if meta.attached and len(self._attached) < self._ranks:
            self._attached |= meta.attached
            if len(self._attached) >= self._ranks:
                # Every worker holds a mapping now: drop the name, so the memory goes back to the
                # system when the processes end, however they end (no leaked /dev/shm file).
                self.store.arena.unlink()
                log.info("kvstrata: all %d workers mapped the L1 arena; unlinked %s", self._ranks, self.arena.path)
        for reports, ok in ((meta.failed, False), (meta.saved, True), (meta.loaded, True)):
            for rank, op_ids in reports.items():
                for op_id in op_ids:
                    self._ops.report(op_id, rank, ok)

    # -- control and stats
    def reset_cache(self) -> bool:
        """vLLM's reset after a weight update (``reset_prefix_cache(reset_connector=True)``): a new
        weights generation of the namespace's epoch, or, when another instance reset first, that
        instance's epoch joined. False when the new epoch could not be written to the shared tier
        (the store has logged and counted it; this instance serves nothing of the namespace until
        it is).

        What this instance computed before it may be of the old weights, so none of it is stored
        afterwards: not the rest of the requests running now, and not what vLLM's own prefix cache
        still serves from before (its reset fails while requests hold blocks:
        ``resets.LocalCacheGuard``). An engine that a weight update took off the store is back on
        it; an update made before its next step is covered by this reset (``weights.py``: vLLM's
        ``pause_generation(clear_cache=True)`` makes it, then the update, then the resume)."""
        if not self._bound:
            self.bind_backends(None)
        self._admission.reset(self._reqs.values(), self.kv_cache_manager)
        # An engine reset, not an operator's flush: the other instances sharing the store serve and
        # save nothing of the namespace until they reset too (epochs/joins.py); the store logs either way.
        return self.store.reset(self.ns.seed) is not None

    def get_kv_connector_stats(self) -> StrataStats | None:
        return self.stats.collect()

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def shutdown(self) -> None:
        self.store.close()
