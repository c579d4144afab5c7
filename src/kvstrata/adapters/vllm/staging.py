"""What of a pinned hit the vLLM scheduler side can promise the engine (``Staging.resident``):
every promised block must be a memory copy away, in an L1 slot, so blocks found only on a backing
tier are first read into L1. Inline when few (``l1.stage_inline_bytes``: a background thread
would fight the busy scheduler loop for the GIL), else on the store's background thread, and the
scheduler tells vLLM to ask again later meanwhile (``Staging.busy``).
"""

from __future__ import annotations

import threading

from kvstrata.keys import BlockChain
from kvstrata.store import Hit, StoreProtocol

from kvstrata.adapters.vllm.pending import Pending


class Staging:
    """Staging of the scheduler side's lookups into L1; see the module docstring."""

    def __init__(self, store: StoreProtocol, block_size: int, slot_bytes: int, inline_bytes: int,
                 local_copy: bool) -> None:
        self.store = store
        self.block_size = block_size
        self.slot_bytes = slot_bytes
        self.inline_bytes = inline_bytes
        self.local_copy = local_copy  # blocks read from the shared tier are also written to the disk tier
        self._lock = threading.Lock()  # staging jobs finish on the store's background thread

    def busy(self, st: Pending) -> bool:
        """Whether a background job is staging the request's blocks (ask again later)."""
        with self._lock:
            return st.staging

    def resident(self, st: Pending, hit: Hit, num_computed_tokens: int) -> tuple[int | None, list[int]]:
        """Tokens of the pinned ``hit`` beyond ``num_computed_tokens`` that are in L1 now (staging
        what is not; None while a background staging job runs), and the L1 slots of its blocks."""
        usable = min(hit.num_tokens, len(st.tokens) - 1)  # the last token is always computed
        if usable <= num_computed_tokens:
            return 0, []
        n_blocks = -(-usable // self.block_size)
        slots = self.store.arena.slots(hit)[:n_blocks]
        first = num_computed_tokens // self.block_size
        if not st.staged:  # where each block comes from, before staging copies it into L1
            st.origin = self.store.origins(hit)[:n_blocks]
        if any(s is None for s in slots[first:]) and not st.staged:
            wanted = hit._replace(chain=BlockChain(*(part[:n_blocks] for part in hit.chain)),
                                  tiers=hit.tiers[:n_blocks], lease=None)
            if not self._stage(st, wanted, first):
                return None, []
            slots = self.store.arena.slots(hit)[:n_blocks]  # staged rows are the pinned ones
        resident = first
        while resident < n_blocks and slots[resident] is not None:
            resident += 1
        usable = min(usable, resident * self.block_size, sum(hit.chain.lengths[:resident]))
        if usable <= num_computed_tokens:
            return 0, []
        return usable - num_computed_tokens, slots[:resident]  # type: ignore[return-value]

    def _stage(self, st: Pending, hit: Hit, first: int) -> bool:
        """Bring the hit's blocks into L1. Returns True when done inline (small hits): the caller
        can promise them now; False when a background job was started (ask again later)."""
        missing = sum(1 for s in self.store.arena.slots(hit)[first:] if s is None)
        if missing * self.slot_bytes <= self.inline_bytes:
            # Inline: a background thread would fight this busy scheduler loop for the GIL.
            self.store.stage(hit, local_copy=self.local_copy)
            st.staged = True
            return True

        def staged(n: int | None) -> None:  # None: the job raised; the request must not wait forever
            with self._lock:
                st.staging, st.staged = False, True

        with self._lock:
            st.staging = True
        if not self.store.stage_later(hit, staged, local_copy=self.local_copy):
            with self._lock:
                st.staging, st.staged = False, True  # queue full: serve what L1 has
        return False
