"""The store protocol: ``StoreProtocol``, the contract engine glue programs against, and the
types it passes around: the handles ``Hit``, ``Reservation``, ``ByteRuns``, ``Arena``; a hybrid
model's ``GroupRule`` and ``GroupHit`` (``lookup_groups``); ``StoreFigures`` (``figures``); a
verified hit's ``Segment`` and ``Comparison`` (``complete_verify``, from ``verify.compare``).

``BlockStore`` (``store/block_store.py``) implements it; modeled on vLLM's ``kv_offload/abstract.py``,
every primitive is thread-safe. The adapters (``kvstrata.adapters``) use nothing else of the
store: ``tests/test_protocol.py`` checks their imports and every ``store.<name>`` they touch.

A hit's blocks come from L1, else from the first backing tier that holds them; bytes that come
from outside the process are checksummed, and a bad copy is deleted, counted, and it and every
block after it are reported as not loaded, so the engine recomputes them. Writes are
copy-on-write: a block is copied into a fresh slot or file and only then committed to the index,
so a reader never sees a partial block. Lookups and loads are timed and counted inside the store
(``lookup_seconds``, ``load_seconds_<tier>``, ``hit_blocks_<tier>``); the engine says what it
took (``count_served``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from kvstrata.index import EntryMeta, Lease
from kvstrata.keys import BlockChain, Extra, KeyScheme, Namespace
from kvstrata.verify.compare import (TOLERANCES, Comparison, Segment,  # verified hits: a block's layers, a verdict
                                     TokenMap)

if TYPE_CHECKING:
    import torch

    from kvstrata.tiers import MemoryTier


class Hit(NamedTuple):
    """A validated stored prefix. ``chain`` lists the blocks to load, in order."""

    ns: Namespace
    epoch: int  # the epoch of the blocks; 0 (no epoch) for a miss the epoch store could not vouch for
    chain: BlockChain
    tiers: list[int]  # tier bit set per block, at lookup time
    lease: Lease | None  # the pin of a pinned lookup (its owner token), given back by ``complete_load``

    @property
    def num_blocks(self) -> int:
        return len(self.chain.keys)

    @property
    def num_tokens(self) -> int:
        return sum(self.chain.lengths)


GroupKind = Literal["full", "window", "state"]
KINDS: tuple[GroupKind, ...] = ("full", "window", "state")


@dataclass(frozen=True, slots=True)
class GroupRule:
    """What one KV-cache group needs from the cache to resume a prompt at a block boundary."""

    kind: GroupKind  # "full": every block; "window": a sliding window; "state": an SSM state at N
    tag: bytes  # the group's own key chain (``keys.group_root``); distinct per group of a model
    window_tokens: int = 0  # "window" only: the tokens the window reaches (the engine's effective window)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"group kind {self.kind!r} is not one of {KINDS}")
        if not self.tag:
            raise ValueError("a group needs a non-empty tag: it separates the group's keys")
        if (self.kind == "window") != (self.window_tokens > 0):
            raise ValueError(f"window_tokens={self.window_tokens} for a {self.kind!r} group: "
                             "a window group needs a positive window, the others none")

    def first_block(self, stop: int, lo_block: int, block_size: int) -> int:
        """The first block this group loads to resume at token ``stop * block_size`` (it loads
        blocks ``[first, stop)``) when the engine already holds the blocks below ``lo_block``.
        A window reaching token ``N - window + 1`` needs that token's block on (``first == stop``
        for a window of one token: it needs nothing cached); a state only its block at N."""
        if self.kind == "full":
            return lo_block
        if self.kind == "state":
            return stop - 1
        return max(lo_block, (stop * block_size - self.window_tokens + 1) // block_size)


class GroupHit(NamedTuple):
    """A prefix every group can serve: resume at ``boundary`` tokens (0: a miss).

    ``hits[g]`` holds exactly the blocks group g loads, in block order, each with its own pin
    (``complete_load(hits[g])`` gives it back); ``positions[g]`` the block index of each in the
    prompt. On a miss every group's hit is empty, so ``hits`` and ``positions`` stay aligned with
    the rules either way."""

    boundary: int
    hits: list[Hit]
    positions: list[np.ndarray]

    @property
    def num_blocks(self) -> int:
        return sum(h.num_blocks for h in self.hits)


class StoreFigures(NamedTuple):
    """What ``figures`` reads: every counter, the latency samples, the gauges (names as in
    ``kvstrata.metrics.METRICS``'s sources)."""

    counters: dict[str, int]  # every counter's total now (as ``snapshot``)
    gauges: dict[str, int]  # bytes and blocks resident per tier, ``namespaces_not_joined`` ({}: not read)
    samples: dict[str, list[float]]  # latency samples observed since the previous ``figures`` call


class Reservation(NamedTuple):
    """L1 slots handed out by ``prepare_store`` for blocks being written; invisible until
    ``complete_store``. ``metas[i]`` is the block that goes into ``slots[i]``."""

    metas: list[EntryMeta]
    slots: list[int]


class ByteRuns(NamedTuple):
    """The caller's own memory as source or destination of direct disk I/O (SGLang's host pool):
    block i is the byte runs ``runs(i)`` (at most the store's ``max_runs`` of them).

    ``size`` is the bytes per block a ``save`` writes; a ``load`` reads each block's stored size.
    ``from_l1(i, slot)`` (loads only) copies block i from its L1 slot, for blocks resident there.
    """

    size: int
    runs: Callable[[int], Sequence[memoryview]]
    from_l1: Callable[[int, int], None] | None = None


class Arena:
    """Read-only view of the L1 arena, for engine glue that moves KV in and out of its slots
    itself: vLLM's workers map its shared file (``open_store(l1_shared_path=...)``); SGLang
    scatters and gathers its host pool from ``data``. Which slots a hit occupies is
    ``slots(hit)``; a reservation's are ``res.slots``."""

    __slots__ = ("_l1",)

    def __init__(self, l1: MemoryTier) -> None:
        self._l1 = l1

    @property
    def num_slots(self) -> int:
        return self._l1.num_slots

    @property
    def capacity_bytes(self) -> int:
        return self._l1.capacity_bytes

    @property
    def data(self) -> torch.Tensor | None:
        """The ``[num_slots, slot_bytes]`` uint8 tensor (None until the slot size is known)."""
        return self._l1.data

    def slots(self, hit: Hit) -> list[int | None]:
        """The L1 slot of each of the hit's blocks (None: not resident). Stable while pinned."""
        return self._l1.slots_of(hit.chain.keys)

    def unlink(self) -> None:
        """Remove the shared file's name; mappings stay valid until their processes drop them."""
        self._l1.close()


class StoreProtocol(Protocol):
    """What engine glue may ask of a store. Grouped as they are used:

    - keys: ``keys`` (the store's key scheme: ``keys.hash``, keyed by the deployment secret),
      ``chain`` (a prompt's chained block keys under the current epoch),
      ``tail_block``, ``page_chain`` (pages keyed by the engine's own chained digests),
      ``group_chain`` (one KV-cache group's keys of a hybrid model),
      ``current_epoch``;
    - lookups: ``lookup`` / ``lookup_chain`` (the longest valid stored prefix as a ``Hit``; with
      ``pin`` also vLLM's ``prepare_load``: nothing of it is evicted or reused until
      ``complete_load``), ``lookup_groups`` (one boundary for all the KV-cache groups of a
      hybrid model, and per group the blocks it loads there), ``stored_mask``, ``origins`` (the
      tier each block is served from);
    - loads, one name per destination: ``load_into`` (tensors), ``load_runs`` (the caller's
      memory, disk reads straight into it), ``stage`` / ``stage_later`` (into L1, now or on a
      background thread);
    - stores: ``prepare_store`` then ``complete_store`` (the caller fills fresh L1 slots),
      ``save`` (queued) / ``save_now`` / ``save_runs`` (straight to disk from the caller's memory);
    - verified hits: ``prepare_verify`` then ``complete_verify`` (the caller fills scratch L1 slots
      with the blocks the engine computed for stored keys; the comparison runs on a thread of the
      store's, and a stored block that differs is deleted);
    - figures: ``count_served``, ``snapshot``, ``figures`` (what an engine's metrics export),
      ``listen`` (tier changes), ``tier_bits``;
    - control: ``describe``, ``invalidate`` (a flush every instance adopts), ``reset`` (the
      engine's reset after a weight update: other instances serve and save nothing of the
      namespace until they reset too), ``joined``, ``flush``, ``close``; and the L1 ``arena`` view with
      the capabilities ``direct_reads``, ``direct_writes``, ``max_runs``.
    """

    @property
    def arena(self) -> Arena: ...
    @property
    def keys(self) -> KeyScheme: ...
    @property
    def direct_reads(self) -> bool: ...
    @property
    def direct_writes(self) -> bool: ...
    @property
    def max_runs(self) -> int: ...
    @property
    def tier_bits(self) -> dict[str, int]: ...

    def chain(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = ...,
              *, partial: bool = True) -> tuple[int, BlockChain]: ...
    def tail_block(self, ns: Namespace, epoch: int, parent: bytes | None, tokens: Sequence[int] | np.ndarray,
                   extra: Extra = ..., *, start: int = 0) -> BlockChain: ...
    def page_chain(self, ns: Namespace, epoch: int, digests: Sequence[bytes]) -> BlockChain: ...
    def current_epoch(self, ns: Namespace) -> int: ...
    def group_chain(self, ns: Namespace, epoch: int, tag: bytes, tokens: Sequence[int] | np.ndarray,
                    extra: Extra = ...) -> BlockChain: ...

    def lookup(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra = ...,
               *, pin: bool = False) -> Hit: ...
    def lookup_chain(self, ns: Namespace, epoch: int, chain: BlockChain, *, pin: bool = False) -> Hit: ...
    def lookup_groups(self, ns: Namespace, tokens: Sequence[int] | np.ndarray, extra: Extra,
                      rules: Sequence[GroupRule], *, lo: int, hi: int, pin: bool) -> GroupHit: ...
    def complete_load(self, hit: Hit) -> None: ...
    def stored_mask(self, ns: Namespace, epoch: int, chain: BlockChain) -> np.ndarray: ...
    def origins(self, hit: Hit) -> list[str]: ...

    def load_into(self, hit: Hit, out: Sequence[torch.Tensor] | torch.Tensor) -> int: ...
    def load_runs(self, hit: Hit, runs: ByteRuns) -> int: ...
    def stage(self, hit: Hit, *, local_copy: bool = True) -> int: ...
    def stage_later(self, hit: Hit, on_done: Callable[[int | None], None], *, local_copy: bool = True) -> bool: ...

    def prepare_store(self, ns: Namespace, epoch: int, chain: BlockChain, size: int) -> Reservation: ...
    def complete_store(self, res: Reservation, success: bool = True, *, wait: bool = False) -> int: ...
    def save(self, ns: Namespace, epoch: int, chain: BlockChain, src: Any,
             on_done: Callable[[int], None] | None = None) -> bool: ...
    def save_now(self, ns: Namespace, epoch: int, chain: BlockChain, src: Any) -> int: ...
    def save_runs(self, ns: Namespace, epoch: int, chain: BlockChain, runs: ByteRuns) -> int: ...

    def prepare_verify(self, ns: Namespace, epoch: int, chain: BlockChain, size: int, *,
                       tails: bool = False) -> Reservation: ...
    def complete_verify(self, res: Reservation, segments: Sequence[Segment], success: bool = True, *,
                        wait: bool = False) -> list[Comparison]: ...

    def count_served(self, origins: Sequence[str], tokens: Sequence[int], *, copied_from_l1: bool = True,
                     l1_bytes: int = 0) -> None: ...
    def snapshot(self) -> dict[str, int]: ...
    def figures(self, last: Mapping[str, int] | None = None) -> StoreFigures: ...
    def listen(self, listener: Callable[[str, Sequence[Any], bool], None]) -> None: ...

    def describe(self, ns: Namespace) -> None: ...
    def invalidate(self, ns_seed: bytes) -> int | None: ...
    def reset(self, ns_seed: bytes) -> int | None: ...
    def joined(self, ns_seed: bytes) -> bool: ...
    def flush(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...
