"""kvstrata's series in vLLM's own ``/metrics``: ``kvstrata_*`` with the engine's labels.

How the figures travel (vLLM's connector stats path): each step the scheduler calls the
connector's ``get_kv_connector_stats`` on both sides. The scheduler side (``StatsCollector``)
reports the store's counter deltas, its latency samples and, in a step where a counter moved, the
resident bytes and blocks per tier (the store's ``figures``); each worker reports its own samples
and bytes (the L1-to-KV-cache copy).
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

from kvstrata.metrics import Figures, bind_series, feed_series, make_series

from kvstrata.adapters.figures import FigureCollector
from kvstrata.adapters.vllm.mm_items import unhashed_items
from kvstrata.adapters.vllm.metadata import StrataStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstrata.store import StoreProtocol


class StatsCollector:
    """The scheduler side's report: what changed in the store since the last call
    (``kvstrata.adapters.figures.FigureCollector``, shared with the SGLang adapter), and the
    multimodal items this process could not key by content (``mm_items.unhashed_items``)."""

    def __init__(self, store: "StoreProtocol") -> None:
        self._figures = FigureCollector(store)
        self._unkeyed = 0

    def collect(self) -> StrataStats | None:
        figures = self._figures.collect()
        unkeyed = unhashed_items() - self._unkeyed
        if unkeyed:
            self._unkeyed += unkeyed
            figures = figures or Figures({}, {}, {})
            figures = figures._replace(counters={**figures.counters, "mm_items_unkeyed": unkeyed})
        return None if figures is None else StrataStats(figures._asdict())


class StrataPromMetrics(KVConnectorPromMetrics):
    """``kvstrata_*`` series (``METRICS``) for every engine of this API server; children are made
    up front, so every series shows in a scrape (at 0) before its first event."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        make = {"counter": self._counter_cls, "gauge": self._gauge_cls, "histogram": self._histogram_cls}
        families = make_series(make, labelnames, multiprocess_mode="mostrecent")
        # engine index -> (source name -> the labelled child the source feeds)
        self._children: dict[int, dict[str, Any]] = {
            engine: bind_series(families, values) for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        children = self._children.get(engine_idx)
        if children:
            data = transfer_stats_data
            feed_series(children, Figures(data.get("counters", {}), data.get("gauges", {}), data.get("samples", {})))
