"""kvstrata's series in SGLang's own ``/metrics`` (``--enable-metrics``): ``kvstrata_*``, the same
names, types, buckets and ``tier`` labels as under vLLM (``kvstrata.metrics.METRICS``).

How the figures travel. With ``--enable-metrics`` SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before
it spawns the scheduler processes and serves ``/metrics`` from prometheus_client's multiprocess
collector, so a metric made in a scheduler process (where this backend lives) is in the scrape.
Every scheduler step, the radix cache calls the backend's ``get_stats()`` (only with metrics on)
and logs the returned ``StorageMetrics`` as ``sglang:prefetch_pgs`` and friends; the same call
feeds the store's counter deltas, latency samples and resident bytes/blocks to the ``kvstrata_*``
series here (``StorageSeries.update``). The series are made on the first such call, so nothing is
made with metrics off.

Labels: ``model_name`` (the served name, as on SGLang's own series), ``tp_rank``, ``pp_rank``,
``dp_rank`` and SGLang's ``--extra-metric-labels``. The metric families are made once per process
(prometheus_client refuses a name registered twice); each backend binds its own label values.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from kvstrata.metrics import bind_series, feed_series, make_series

from kvstrata.adapters.figures import FigureCollector

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvstrata.store import StoreProtocol

log = logging.getLogger(__name__)

_lock = threading.Lock()
_families: dict[tuple[str, ...], dict[str, Any]] = {}  # label names -> this process's metric families


def series_labels(config: "HiCacheStorageConfig") -> dict[str, str]:
    """The label values of this backend's series (see the module docstring)."""
    model, extra = config.model_name or "", {}
    try:  # the served name and extra labels, as SGLang's scheduler series carry them
        from sglang.srt.runtime_context import get_observability, get_serving

        model = get_serving().served_model_name or model
        extra = dict(get_observability().extra_metric_labels or {})
    except Exception:  # noqa: BLE001  not inside a server, or another SGLang version
        pass
    labels = {"model_name": str(model), "tp_rank": str(config.tp_rank), "pp_rank": str(config.pp_rank),
              "dp_rank": str(getattr(config, "dp_rank", 0))}
    labels.update({str(k): str(v) for k, v in extra.items() if k not in labels})
    return labels


def _metric_classes() -> dict[str, Any]:
    """prometheus_client's classes, or those of a stat logger SGLang was configured with (Ray)."""
    from prometheus_client import Counter, Gauge, Histogram

    try:
        from sglang.srt.observability.metrics_collector import (
            STAT_LOGGER_ROLE_STORAGE,
            StorageMetricsCollector,
            resolve_collector_class,
        )

        collector = resolve_collector_class(STAT_LOGGER_ROLE_STORAGE, StorageMetricsCollector)
    except Exception:  # noqa: BLE001  not inside a server, or another SGLang version
        collector = None
    return {"counter": getattr(collector, "_counter_cls", None) or Counter,
            "gauge": getattr(collector, "_gauge_cls", None) or Gauge,
            "histogram": getattr(collector, "_histogram_cls", None) or Histogram}


def _families_for(labelnames: tuple[str, ...]) -> dict[str, Any] | None:
    """This process's ``kvstrata_*`` families with ``labelnames`` (made on first use). None when
    they exist already with other label names: prometheus_client cannot register them twice."""
    with _lock:
        if labelnames in _families:
            return _families[labelnames]
        if _families:
            log.warning("kvstrata: metrics already made with labels %s; %s not exported",
                        sorted(next(iter(_families))), sorted(labelnames))
            return None
        # mostrecent: each process (rank) sets its own gauges; the rank labels tell them apart.
        made = _families[labelnames] = make_series(_metric_classes(), labelnames, multiprocess_mode="mostrecent")
        return made


class StorageSeries:
    """One backend's ``kvstrata_*`` children, fed from its store at every ``get_stats`` call."""

    def __init__(self, store: "StoreProtocol", labels: dict[str, str]) -> None:
        self.collector = FigureCollector(store)
        families = _families_for(tuple(labels))
        self.children = bind_series(families, list(labels.values())) if families is not None else {}
        log.info("kvstrata: exporting kvstrata_* metrics with labels %s", labels)

    def update(self, snapshot: dict[str, int]) -> None:
        """One pass: the counter deltas since the last call, the samples, the resident figures."""
        figures = self.collector.collect(snapshot)
        if figures is not None and self.children:
            feed_series(self.children, figures)
