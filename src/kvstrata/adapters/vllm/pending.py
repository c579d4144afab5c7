"""What the vLLM scheduler side keeps between calls: a request as it tracks it (``Pending``),
which requests are served from kvstrata and stored in it (``Admission``), and the copy ops of its
steps (``Ops``).

A request is served only if its keys can be made (``request_keys``: its LoRA adapter's files are
the ones the engine loaded; with an EAGLE-style drafter its full blocks are keyed on the tokens
after them too: ``drafts.py``), and its blocks are stored only while they cannot be of other weights
than this instance's: not if it was running at this instance's last reset, or if its local prefix
hit came from vLLM's own cache from before that reset (``resets.LocalCacheGuard``), and not once
its LoRA adapter's files changed after it was keyed. Nothing is served or stored while the engine's
weights changed in memory without a reset before it (``weights.WeightUpdates``).

A request sampled for a verified hit (``verify.sample_rate``, ``Admission``) is told no external
tokens: the engine computes its prefix, and the blocks it computes are copied like a save into
scratch slots (``Ops.verify``) and compared with the stored blocks of the same keys.

Every copy is an op with an id, sent to the workers in the metadata of the step it is planned in
(``Ops.load``, ``Ops.save``, ``Ops.verify``, ``Ops.take``). An op is settled when every rank that
copies it has reported it (``Ops.report``): a load gives its pin back; a save is committed to the
store if no rank failed, else aborted; a verification is compared, then its slots go back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from kvstrata.adapter_versions import AdapterVersions
from kvstrata.keys import NO_EXTRA, Extra
from kvstrata.store import GroupHit, Hit, Reservation, Segment, StoreProtocol

from kvstrata.adapters.vllm.drafts import draft_inputs
from kvstrata.adapters.vllm.metadata import CopyOp
from kvstrata.adapters.vllm.request_keys import adapter_unchanged, request_keys
from kvstrata.adapters.vllm.resets import LocalCacheGuard
from kvstrata.adapters.vllm.roles import Role
from kvstrata.adapters.vllm.weights import WeightUpdates

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class Pending:
    """A live request, from its first lookup to ``request_finished``."""

    request: "Request"
    tokens: np.ndarray
    extra: Extra
    adapter: tuple[int, str, str] | None = None  # the LoRA adapter (id, path, version) the keys cover
    served: bool = True  # False: no lookups (its keys cannot be made: request_keys)
    saves: bool = True  # False: nothing of it is stored (keyless, or its KV may predate a reset)
    checked: bool = False  # its local prefix hit was checked against the last reset (LocalCacheGuard)
    saved_full: int = 0  # full blocks already planned for saving
    tail_saved: bool = False
    local: int = 0  # block-aligned tokens the engine already had
    hit: Hit | None = None  # pinned (hit.lease) from the lookup until its load op takes it over
    slots: list[int] = field(default_factory=list)  # L1 slots of the hit's blocks, read under the pin
    staging: bool = False
    staged: bool = False
    origin: list[str] = field(default_factory=list)  # per block of the hit: the tier it is served from
    learned: bool = False  # the hit's keys were paired with vLLM's block hashes (KV events)
    scheduled: bool = False  # planned in a step already (roles.Consumer)
    group_hit: GroupHit | None = None  # a hybrid model's pinned GroupHit, until its load ops take it over
    group_slots: list[list[int]] = field(default_factory=list)
    loaded: bool = False  # a hybrid model's asynchronous load was handed to the workers
    verify: bool = False  # sampled for a verified hit (verify.sample_rate): its hit is computed, not loaded
    verify_hit: Hit | None = None  # the hit it computes instead, pinned until its blocks are planned
    verify_from: int = 0  # the first block of that hit the engine computes (before it: vLLM's own cache)
    verify_groups: GroupHit | None = None  # a hybrid model's verified hit, pinned until its blocks are planned

    def taken(self, num_external_tokens: int, block_size: int) -> tuple[list[str], list[int]]:
        """Per block of the load the request is about to get (``num_external_tokens`` beyond
        ``local``): the tier it comes from, its tokens."""
        bs = block_size
        first = self.local // bs
        last = -(-(self.local + num_external_tokens) // bs)
        end = self.local + num_external_tokens
        return self.origin[first:last], [min(bs, end - i * bs) for i in range(first, last)]


class Admission:
    """Which requests are served and stored (see the module docstring)."""

    def __init__(self, sample_rate: float = 0.0, draft_lookahead: int = 0, block_size: int = 0) -> None:
        self.sample_rate = sample_rate  # verify.sample_rate
        self.draft_lookahead = draft_lookahead  # tokens after a position its draft KV depends on (``drafts.py``)
        self.block_size = block_size
        self._sampler = random.Random()
        self.adapters = AdapterVersions()  # LoRA adapters by content, as this engine loaded them
        self.guard = LocalCacheGuard()  # vLLM's own cached blocks from before this instance's last reset
        self.weights = WeightUpdates()  # off the store while the weights changed without a reset before it
        self._unchanged: dict[tuple[int, str, str], bool] = {}  # adapters checked this step

    def new_step(self, scheduled_tokens: int) -> None:
        """A step computing ``scheduled_tokens`` tokens was planned: adapters are checked again in
        the next (their files stat'ed once per step, not once per request)."""
        self._unchanged.clear()
        self.weights.stepped(scheduled_tokens)

    def admit(self, request: "Request") -> Pending:
        """A new request's state: its keys (``request_keys``), or none when they cannot be made
        (its LoRA adapter changed under the engine): then it is neither served nor stored."""
        keys = request_keys(request, self.adapters)
        if keys is None:
            return Pending(request, np.zeros(0, np.uint32), NO_EXTRA, served=False, saves=False)
        verify = self.sample_rate > 0 and self._sampler.random() < self.sample_rate
        extra = draft_inputs(request, keys.extra, self.block_size, self.draft_lookahead)  # EAGLE: the next token too
        return Pending(request, keys.tokens, extra, keys.adapter, verify=verify)

    def may_save(self, st: Pending, req_id: str, kv_cache_manager: Any, block_size: int) -> bool:
        """Whether the blocks of ``st`` may be stored now (see the module docstring)."""
        if not st.saves or self.weights.off:
            return False
        if not st.checked and kv_cache_manager is not None:
            st.checked = True
            if not self.guard.fresh(kv_cache_manager, req_id, st.local, block_size):
                st.saves = False
                return False
        if st.adapter is not None:
            unchanged = self._unchanged.get(st.adapter)
            if unchanged is None:
                unchanged = self._unchanged[st.adapter] = adapter_unchanged(st.request, self.adapters, st.adapter)
            st.saves = unchanged
        return st.saves

    def reset(self, live: Iterable[Pending], kv_cache_manager: Any) -> None:
        """This instance resets (new weights): what it computed before may be of the old weights,
        so nothing more of the requests running now is stored, nor of vLLM's cached blocks that
        outlive the reset."""
        for st in live:
            st.saves = False
        self.guard.reset(kv_cache_manager)
        self.weights.reset()


@dataclass(slots=True)
class _InFlight:
    """A copy op the workers are running. Settled when every rank has reported it: a save is
    committed if no rank failed (else aborted), a load gives its pin back."""

    waiting: set[int]  # ranks that have not reported the op yet
    req_id: str
    ok: bool = True
    reservation: Reservation | None = None  # a save: the slots the ranks are filling
    hit: Hit | None = None  # a load: the pinned blocks the ranks are reading
    verify: bool = False  # a save into scratch slots, compared with the stored blocks (verified hits)
    group: int = 0  # the KV cache group of its blocks


class Ops:
    """The load and save ops of the step being planned, and those in flight until every rank that
    copies them has reported them: a load, every rank (each reads the slots); a save, every rank
    that writes a part of the slots (``writers``: rank 0 alone for a shared latent)."""

    def __init__(self, store: StoreProtocol, role: Role, ranks: int, writers: frozenset[int],
                 segments: tuple[tuple[Segment, ...], ...] = ()) -> None:
        self.store = store
        self.segments = segments  # per KV cache group, a block's typed runs, as verified hits compare them
        self.role = role
        self.ranks = ranks
        self.writers = writers
        self._loads: list[CopyOp] = []
        self._saves: list[CopyOp] = []
        self._inflight: dict[int, _InFlight] = {}  # op id -> what settles when every rank reports it
        self._next_op = 1

    def load(self, req_id: str, slots: list[int], block_ids: list[int], *, hit: Hit | None = None,
             group: int = 0, load_async: bool = False, fail: bool = False) -> None:
        """A load op of this step: the ranks copy L1 ``slots`` into the engine's ``block_ids``. The
        op owns the pin of ``hit`` from now on: it goes when every rank has copied the blocks out.
        ``fail``: the workers copy nothing and report the request failed."""
        op = CopyOp(self._new_op_id(), req_id, slots, block_ids, group=group, load_async=load_async, fail=fail)
        self._loads.append(op)
        if hit is not None:
            self._track(op, hit=hit)

    def save(self, req_id: str, res: Reservation, block_ids: list[int], *, group: int = 0) -> None:
        """A save op of this step: the ranks copy the engine's ``block_ids`` into the slots of
        ``res`` (``block_ids[i]`` into ``res.slots[i]``), published when every writer reported."""
        op = CopyOp(self._new_op_id(), req_id, res.slots, block_ids, group=group)
        self._saves.append(op)
        self._track(op, reservation=res)

    def verifies(self, group: int) -> bool:
        """Whether blocks of KV cache group ``group`` can be compared (its typed runs are known)."""
        return group < len(self.segments) and bool(self.segments[group])

    def verify(self, req_id: str, res: Reservation, block_ids: list[int], *, group: int = 0) -> None:
        """A verification op of this step (``store.prepare_verify``): the ranks copy the engine's
        ``block_ids`` into the scratch slots of ``res`` exactly as for a save; when every writer
        has reported, the store compares them with the stored blocks of the same keys."""
        op = CopyOp(self._new_op_id(), req_id, res.slots, block_ids, group=group)
        self._saves.append(op)
        self._inflight[op.op_id] = _InFlight(set(self.writers), req_id, reservation=res, verify=True, group=group)

    def take(self) -> tuple[list[CopyOp], list[CopyOp]]:
        """The step's load and save ops, for its metadata; the next step starts with none."""
        loads, saves = self._loads, self._saves
        self._loads, self._saves = [], []
        return loads, saves

    def _new_op_id(self) -> int:
        self._next_op += 1
        return self._next_op - 1

    def _track(self, op: CopyOp, *, hit: Hit | None = None, reservation: Reservation | None = None) -> None:
        """Op ``op`` is sent to every rank: settle it (unpin ``hit``, publish ``reservation``) when
        every rank that copies it has reported it."""
        ranks = self.writers if reservation is not None else range(self.ranks)
        self._inflight[op.op_id] = _InFlight(set(ranks), op.req_id, reservation=reservation, hit=hit)
        if reservation is not None:
            self.role.saving(op.req_id, op.op_id)

    def report(self, op_id: int, rank: int, ok: bool) -> None:
        """Rank ``rank`` finished its part of op ``op_id``; settle the op once every rank has."""
        op = self._inflight.get(op_id)
        if op is None:
            return
        op.waiting.discard(rank)
        op.ok = op.ok and ok
        if op.waiting:
            return
        del self._inflight[op_id]
        if op.hit is not None:
            self.store.complete_load(op.hit)  # every rank has copied the blocks out of their slots
        if op.verify:
            assert op.reservation is not None
            self.store.complete_verify(op.reservation, self.segments[op.group], op.ok)
        elif op.reservation is not None:
            # Published (visible to lookups from now on) only if every rank copied its shard.
            self.store.complete_store(op.reservation, op.ok)
            self.role.settled(op.req_id, op_id)
