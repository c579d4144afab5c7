"""kvstrata's series in vLLM's own ``/metrics``: ``kvstrata_*`` with the engine's labels.

How the figures travel (vLLM's connector stats path): each step the scheduler calls the
connector's ``get_kv_connector_stats`` on both sides. The scheduler side (``StatsCollector``)
reports the store's counter deltas, its latency samples and, in a step where a counter moved, the
resident bytes and blocks per tier (``BlockStore.resident``); each worker reports its own samples and bytes (the L1-to-KV-cache copy).
vLLM merges them (``StrataStats.aggregate``) and sends them with the scheduler stats to the API
server process, where ``StrataPromMetrics.observe`` (built by vLLM through the connector's
``build_prom_metrics``, with vLLM's ``PromMetric`` classes and its ``model_name``/``engine``
labels) feeds the Prometheus series. Names and meanings are ``kvstrata.metrics.METRICS``, shared
with the SGLang adapter. Nothing is exported with ``--disable-log-stats`` (vLLM then collects no
stats at all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, PromMetric, PromMetricT

from kvstrata.metrics import METRICS, SOURCES, TIERS

from .metadata import StrataStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstrata.store import BlockStore


class StatsCollector:
    """The scheduler side's report: what changed in the store since the last call."""

    def __init__(self, store: "BlockStore") -> None:
        self.store = store
        self._last: dict[str, int] = {}

    def collect(self) -> StrataStats | None:
        counters = self.store.counters
        now = counters.snapshot()
        delta = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        samples = counters.take_samples()
        if not (delta or samples):
            return None
        gauges = self.store.resident() if delta else {}
        return StrataStats({"counters": delta, "gauges": gauges, "samples": samples})


class StrataPromMetrics(KVConnectorPromMetrics):
    """``kvstrata_*`` series (``METRICS``) for every engine of this API server; children are made
    up front, so every series shows in a scrape (at 0) before its first event."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        make = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        # (engine index, source name) -> the labelled child the source feeds
        self._children: dict[tuple[int, str], Any] = {}
        for m in METRICS:
            kwargs: dict[str, Any] = {"name": f"kvstrata_{m.name}", "documentation": m.doc,
                                      "labelnames": labelnames + (["tier"] if m.per_tier else [])}
            if m.kind == "histogram":
                kwargs["buckets"] = m.buckets
            if m.kind == "gauge":
                kwargs["multiprocess_mode"] = "mostrecent"
            metric = make[m.kind](**kwargs)
            for engine, values in per_engine_labelvalues.items():
                for tier in TIERS if m.per_tier else ("",):
                    child = metric.labels(*values, *([tier] if tier else []))
                    self._children[(engine, m.source.format(tier=tier))] = child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, delta in transfer_stats_data.get("counters", {}).items():
            child = self._child(name, "counter", engine_idx)
            if child is not None and delta > 0:
                child.inc(delta)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            child = self._child(name, "gauge", engine_idx)
            if child is not None:
                child.set(value)
        for name, values in transfer_stats_data.get("samples", {}).items():
            child = self._child(name, "histogram", engine_idx)
            if child is not None:
                for v in values:
                    child.observe(v)

    def _child(self, source: str, kind: str, engine_idx: int) -> Any:
        """The child ``source`` feeds, or None for a figure that is only logged (not a series)."""
        found = SOURCES.get(source)
        if found is None or found[0].kind != kind:
            return None
        return self._children.get((engine_idx, source))

