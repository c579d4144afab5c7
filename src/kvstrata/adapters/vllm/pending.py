"""A vLLM request as the scheduler side tracks it (``Pending``), and which requests are served from
kvstrata and stored in it (``Admission``).

A request is served only if its keys can be made (``request_keys``: its LoRA adapter's files are
the ones the engine loaded), and its blocks are stored only while they cannot be of other weights
than this instance's: not if it was running at this instance's last reset, or if its local prefix
hit came from vLLM's own cache from before that reset (``resets.LocalCacheGuard``), and not once
its LoRA adapter's files changed after it was keyed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from kvstrata.adapter_versions import AdapterVersions
from kvstrata.keys import NO_EXTRA, Extra
from kvstrata.store import Hit

from kvstrata.adapters.vllm.request_keys import adapter_unchanged, request_keys
from kvstrata.adapters.vllm.resets import LocalCacheGuard

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
    group_hit: Any = None  # a hybrid model's pinned GroupHit, until its load ops take it over
    group_slots: list[list[int]] = field(default_factory=list)
    loaded: bool = False  # a hybrid model's asynchronous load was handed to the workers


class Admission:
    """Which requests are served and stored (see the module docstring)."""

    def __init__(self) -> None:
        self.adapters = AdapterVersions()  # LoRA adapters by content, as this engine loaded them
        self.guard = LocalCacheGuard()  # vLLM's own cached blocks from before this instance's last reset
        self._unchanged: dict[tuple[int, str, str], bool] = {}  # adapters checked this step

    def new_step(self) -> None:
        """A new engine step: adapters are checked again (their files stat'ed once per step, not
        once per request)."""
        self._unchanged.clear()

    def admit(self, request: "Request") -> Pending:
        """A new request's state: its keys (``request_keys``), or none when they cannot be made
        (its LoRA adapter changed under the engine): then it is neither served nor stored."""
        keys = request_keys(request, self.adapters)
        if keys is None:
            return Pending(request, np.zeros(0, np.uint32), NO_EXTRA, served=False, saves=False)
        return Pending(request, keys.tokens, keys.extra, keys.adapter)

    def may_save(self, st: Pending, req_id: str, kv_cache_manager: Any, block_size: int) -> bool:
        """Whether the blocks of ``st`` may be stored now (see the module docstring)."""
        if not st.saves:
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
