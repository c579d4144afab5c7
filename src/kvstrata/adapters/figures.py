"""``FigureCollector``: what a store reports to an engine's metrics at each of its reporting calls,
shared by both adapters (vLLM's ``StatsCollector``, SGLang's ``StorageSeries``).

It asks the store only for its ``figures()`` (a protocol member) and turns them into one
interval's ``kvstrata.metrics.Figures``: the counters that moved since its previous call (as
deltas), the latency samples observed since then and, in an interval where a counter moved, the
bytes and blocks resident per tier (gauges the store reads only then: they cost a pass over its
index).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.metrics import Figures

if TYPE_CHECKING:
    from kvstrata.store import StoreProtocol


class FigureCollector:
    """A store's ``Figures`` since the last call. One collector per reporting loop (it remembers
    the counters it last reported)."""

    def __init__(self, store: "StoreProtocol") -> None:
        self.store = store
        self._last: dict[str, int] = {}

    def collect(self, snapshot: dict[str, int] | None = None) -> Figures | None:
        """``snapshot``: the store's ``snapshot()`` if the caller took one already (then the deltas
        are taken from it). None when nothing moved and no sample was observed."""
        figures = self.store.figures(self._last)
        now = figures.counters if snapshot is None else snapshot
        last = self._last
        delta = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
        self._last = now
        if not (delta or figures.samples):
            return None
        return Figures(delta, figures.gauges if delta else {}, figures.samples)
