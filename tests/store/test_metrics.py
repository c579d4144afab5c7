"""Counters and their Prometheus export."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.metrics import Counters


def test_counters_are_exact_under_concurrent_increments():
    c = Counters()
    threads = [threading.Thread(target=lambda: [c.inc("hits") for _ in range(5000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("hits") == 20000
    assert c.snapshot() == {"hits": 20000}


def test_prometheus_export_shows_the_same_numbers():
    c = Counters()
    c.inc("checksum_failures", 3)
    registry = CollectorRegistry()
    c.register_prometheus(registry)
    text = generate_latest(registry).decode()
    assert "kvstrata_checksum_failures_total 3.0" in text
    c.inc("checksum_failures")
    assert "kvstrata_checksum_failures_total 4.0" in generate_latest(registry).decode()
