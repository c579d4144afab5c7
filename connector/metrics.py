"""metrics.py: ``Counters``, the counters of one store: hits per tier, load failures, dropped
saves, evictions, bytes moved.

One object, one lock; every component increments through ``inc``. ``snapshot()`` feeds
``kvstrata stats``, the engines' own stats hooks and, when prometheus-client is installed,
``register_prometheus()`` exposes the same numbers as ``kvstrata_<name>_total``.
"""

from __future__ import annotations

import threading
from collections import Counter


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._values.items()))

    def register_prometheus(self, registry=None) -> None:  # type: ignore[no-untyped-def]
        """Expose the counters through prometheus-client (optional dependency)."""
        from prometheus_client.core import REGISTRY, CounterMetricFamily

        counters = self

        class _Collector:
            def collect(self):  # type: ignore[no-untyped-def]
                for name, value in counters.snapshot().items():
                    yield CounterMetricFamily(f"kvstrata_{name}", f"kvstrata {name}", value=value)

        (registry or REGISTRY).register(_Collector())
