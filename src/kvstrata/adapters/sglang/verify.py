"""Verified hits in SGLang's storage backend (``PageChecks``): a sampled ``batch_exists`` answers
"not stored" for the stored pages it is asked about, so SGLang computes them; when SGLang writes
them back (``batch_set_v1``, ``batch_set``), they are compared with their stored copies instead
of being skipped as stored (``store.prepare_verify`` / ``complete_verify``). A page that differs is
deleted from every tier, counted and logged by the store, and not stored again by this write-back
(the next request that computes it stores it). A verified request costs its hit, never a wrong answer.
The write-back only copies the pages into scratch slots: the comparison (reading the stored copy
from a tier, deleting a mismatch from every tier) runs on the store's comparison thread, so no
call of SGLang's waits on a tier for it.

Sampling. A query with a hit is sampled with probability ``verify.sample_rate``; the keys of its
stored pages are remembered (``Sampled``: at most ``CAPACITY`` keys, each for ``TTL_S`` seconds)
until their write-back. While a key is remembered, every query answers "not stored" from it on,
so the several queries of one request (SGLang's admission probe, its prefetch, a retry) agree.
A key whose write-back never comes (the request aborted, or its pages reached the radix tree
through another request first) expires uncompared.

Segments. A page is compared layer by layer, in the host pool's dtype, with the bytes SGLang stores
for it (``PageRows``: the pool buffer cut to one page). In ``layer_first`` each run of the page
(one per layer and K/V; one per layer for MLA's latent) is a segment. In ``page_first`` a layer's
part of a page is not contiguous, so each token's part of a layer is one: smaller segments than
the calibration's (a whole block of a layer), so an honest recomputation's worst segment is
noisier there.

Never sampled: a rank that does not write (MLA ranks other than the writer: nothing would be
compared), and a pool whose dtype has no tolerance (the store's ``TOLERANCES``; an fp8 KV cache
kept as uint8 bytes), logged once.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import TOLERANCES, Segment, StoreProtocol

if TYPE_CHECKING:
    from kvstrata.adapters.sglang.pages import PageRows

log = logging.getLogger(__name__)

TTL_S = 300.0  # a sampled page's write-back comes after its prefill: seconds, even under load
CAPACITY = 16384  # remembered page keys (a sampled query remembers at most SGLang's batch, 128)

# fill(slots, pages): copy page ``pages[i]`` of the write-back into arena slot ``slots[i]``
Fill = Callable[[Sequence[int], Sequence[int]], None]


class Sampled:
    """Page keys hidden from queries until their write-back is compared. Thread-safe: SGLang
    queries from its prefetch thread and writes back from its backup thread."""

    def __init__(self, rate: float, *, ttl_s: float = TTL_S, capacity: int = CAPACITY,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.ttl_s, self.capacity = rate, ttl_s, capacity
        self._rng = rng or random.Random()
        self._clock = clock
        self._keys: OrderedDict[str, float] = OrderedDict()  # key -> deadline, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def answer(self, keys: Sequence[str], stored: int) -> int:
        """What a query of ``keys`` whose first ``stored`` pages are stored reports: up to the first
        remembered key; or, sampled, 0 (those pages remembered)."""
        if stored <= 0 or (self.rate <= 0 and not self._keys):
            return stored
        now = self._clock()
        with self._lock:
            self._expire(now)
            held = self._keys
            first = next((i for i, key in enumerate(keys[:stored]) if key in held), stored)
            if first < stored or self._rng.random() >= self.rate:
                return first
            held.update(dict.fromkeys(keys[:stored], now + self.ttl_s))
            while len(held) > self.capacity:
                held.popitem(last=False)
        return 0

    def take(self, keys: Sequence[str]) -> list[int]:
        """The positions in ``keys`` of remembered keys, forgotten now (their write-back is here)."""
        if not self._keys:
            return []
        with self._lock:
            self._expire(self._clock())
            return [i for i, key in enumerate(keys) if self._keys.pop(key, None) is not None]

    def _expire(self, now: float) -> None:
        held = self._keys
        while held and next(iter(held.values())) <= now:
            held.popitem(last=False)


def page_segments(rows: "PageRows", layout: str, layers: int) -> list[Segment] | None:
    """One segment per contiguous part of a stored page that belongs to one layer (see the module
    docstring), or None when the pool's dtype has no tolerance or its pages have no layer
    dimension where the layout puts it."""
    dtype = rows.buf.dtype
    shape, dim = rows.page_shape, rows.dim
    # layer_first: [..., layer, page, ...]: a run is one layer; page_first: [..., page, layer, ...]
    cut = dim if layout == "layer_first" else dim + 2
    if dtype not in TOLERANCES or (layout != "layer_first" and shape[dim + 1 : dim + 2] != (layers,)):
        return None
    size = math.prod(shape[cut:]) * rows.buf.element_size()
    return [Segment(f"{layout} part {i}", i * size, size, dtype) for i in range(rows.page_bytes // size)]


class PageChecks:
    """One ``StrataStorage``'s verified hits: the sampled keys and the comparison of their
    write-back (see the module docstring)."""

    def __init__(self, store: StoreProtocol, rows: "PageRows", segments: Sequence[Segment], rate: float) -> None:
        self.store, self.rows, self.segments = store, rows, list(segments)
        self.sampled = Sampled(rate)

    @classmethod
    def for_pool(cls, store: StoreProtocol, rows: "PageRows", layout: str, layers: int,
                 rate: float) -> "PageChecks | None":
        """The checks of a host pool, or None when nothing is to be verified (rate 0, or a dtype
        without tolerance: logged)."""
        if rate <= 0:
            return None
        segments = page_segments(rows, layout, layers)
        if segments is None:
            log.warning("kvstrata: verify.sample_rate is %g, but no hit is verified: the host pool keeps KV as "
                        "%s (a tolerance exists for %s) in pages %s", rate, rows.buf.dtype,
                        ", ".join(str(d).removeprefix("torch.") for d in TOLERANCES), rows.signature)
            return None
        log.info("kvstrata: verified hits: a fraction %g of the queries with a hit (%d segments per page)", rate,
                 len(segments))
        return cls(store, rows, segments, rate)

    def answer(self, keys: Sequence[str], stored: int) -> int:
        """``batch_exists``'s answer for ``keys`` whose first ``stored`` pages are stored."""
        return self.sampled.answer(keys, stored)

    def write_back(self, ns: Namespace, epoch: int, keys: Sequence[str], chain: BlockChain,
                   fill: Fill) -> list[int]:
        """Compare the pages of a write-back (``keys``, their ``chain``) that were hidden from a query
        with their stored copies: ``fill`` copies them into scratch slots as a save does, and the
        store compares them on its comparison thread. Returns their positions in ``keys``, stored
        now (a mismatching page is deleted once compared)."""
        pick = self.sampled.take(keys)
        if not pick:
            return []
        sub = BlockChain(*([part[i] for i in pick] for part in chain))
        res = self.store.prepare_verify(ns, epoch, sub, self.rows.page_bytes)
        if res.slots:
            where = {key: at for key, at in zip(sub.keys, pick)}
            try:
                fill(res.slots, [where[meta.key] for meta in res.metas])
            except BaseException:
                self.store.complete_verify(res, self.segments, success=False)
                raise
            self.store.complete_verify(res, self.segments)
            log.debug("kvstrata: %d of %d written-back pages queued for comparison", len(res.slots), len(keys))
        return pick
