"""The store protocol: its primitives, and the handles they pass around.

``BlockStore`` (``store/__init__.py``) offers these primitives, modeled on vLLM's
``kv_offload/abstract.py``; every one is thread-safe:

- ``lookup(ns, tokens, extra, pin=)`` / ``lookup_chain(ns, epoch, chain, pin=)``: the longest
  valid stored prefix, as a ``Hit``. With ``pin=True`` this is also vLLM's ``prepare_load``: the
  hit's blocks are pinned by key in the same index call, so none is evicted or reused until
- ``complete_load(hit)``: gives the pin back.
- ``load(hit, out)``: copies the hit's blocks into ``out``, fastest tier first, and returns how
  many leading blocks are valid. ``out`` is tensors, or ``ByteRuns`` (direct disk I/O on the
  caller's memory), or nothing: the blocks are made resident in L1 (staging), at once or, with
  ``wait=False``, on the background threads.
- ``prepare_store(ns, epoch, chain, size)``: fresh L1 slots for the blocks not stored yet, as a
  ``Reservation`` nobody can see; the caller fills them (``arena.data[slot]``), then
- ``complete_store(res, success)``: publishes them (and writes them through) or gives them back.
- ``save(ns, epoch, chain, src)``: the one-call write of the same path: tensors staged through
  L1, or ``ByteRuns`` straight to disk; queued, or with ``wait=True`` synchronous.
- ``describe(ns)``: records what a namespace is (model, weights version, dtype, layout, tenant)
  beside its epoch, once at start, for ``kvstrata stats`` and ``invalidate --model``.
- ``stored_mask``, ``invalidate``, ``gc``, ``stats``, ``flush``, ``close``; ``arena`` is a
  read-only view of the L1 arena for engines that copy KV in and out of its slots themselves.

A hit's blocks come from L1, else from the first backing tier that holds them; bytes that come
from outside the process are checksummed, and a bad copy is deleted, counted, and it and every
block after it are reported as not loaded, so the engine recomputes them. Writes are
copy-on-write: a block is copied into a fresh slot or file and only then committed to the index,
so a reader never sees a partial block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from ..index import EntryMeta
from ..keys import BlockChain, Namespace

if TYPE_CHECKING:
    import torch

    from ..tiers import MemoryTier


class Hit(NamedTuple):
    """A validated stored prefix. ``chain`` lists the blocks to load, in order."""

    ns: Namespace
    epoch: int  # the generation of the blocks; 0 (no generation) for a miss the epoch store could not vouch for
    chain: BlockChain
    tiers: list[int]  # tier bit set per block, at lookup time
    lease: int | None  # the pin of a pinned lookup, given back by ``complete_load``

    @property
    def num_blocks(self) -> int:
        return len(self.chain.keys)

    @property
    def num_tokens(self) -> int:
        return sum(self.chain.lengths)


class Reservation(NamedTuple):
    """L1 slots handed out by ``prepare_store`` for blocks being written; invisible until
    ``complete_store``. ``metas[i]`` is the block that goes into ``slots[i]``."""

    metas: list[EntryMeta]
    slots: list[int]


class ByteRuns(NamedTuple):
    """The caller's own memory as source or destination of direct disk I/O (SGLang's host pool):
    block i is the byte runs ``runs(i)`` (at most ``BlockStore.max_runs`` of them).

    ``size`` is the bytes per block a ``save`` writes; a ``load`` reads each block's stored size.
    ``from_l1(i, slot)`` (loads only) copies block i from its L1 slot, for blocks resident there.
    """

    size: int
    runs: Callable[[int], Sequence[memoryview]]
    from_l1: Callable[[int, int], None] | None = None


class Arena:
    """Read-only view of the L1 arena, for engine glue that moves KV in and out of its slots
    itself: vLLM's workers map its shared file (``BlockStore(l1_shared_path=...)``); SGLang
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
