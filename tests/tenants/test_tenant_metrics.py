"""The tenant series, fed as the engines feed theirs: per tier and tenant (children made as tenants
appear), evictions by cause, and ``kvstrata stats``'s view of the same figures."""

from __future__ import annotations

import prometheus_client as prom

from kvstrata.format.block import HEADER_SIZE
from kvstrata.metrics import Figures, bind_series, feed_series, make_series
from kvstrata.store import BlockStore
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens, store_prompt

FILE = HEADER_SIZE + BLOCK_BYTES


def test_tenant_gauges_and_eviction_causes_reach_prometheus(tmp_path):
    cfg = {"l1.size": 8 * BLOCK_BYTES, "l2.size": 16 * FILE, "tenants.shares": {"l2": {"a": 0.25, "b": "50%"}}}
    registry = prom.CollectorRegistry()
    make = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
    series = make_series({k: (lambda c: lambda **kw: c(registry=registry, **{k2: v for k2, v in kw.items()
                                                                              if k2 != "multiprocess_mode"}))(c)
                          for k, c in make.items()}, ["engine"])
    children = bind_series(series, ["0"])
    with BlockStore(make_config(tmp_path, cfg)) as store:
        a, b = make_namespace(tenant="a"), make_namespace(tenant="b")
        for i in range(6):
            store_prompt(store, b, random_tokens(f"b{i}", BLOCK_SIZE))
        for i in range(30):
            store_prompt(store, a, random_tokens(f"a{i}", BLOCK_SIZE))
        figures = store.figures()
        feed_series(children, Figures(figures.counters, figures.gauges, figures.samples))
        tenants = store.stats()["tenants"]
    value = registry.get_sample_value
    assert value("kvstrata_tenant_blocks", {"engine": "0", "tier": "l2", "tenant": "b"}) == 6
    assert value("kvstrata_tenant_bytes", {"engine": "0", "tier": "l2", "tenant": "a"}) == tenants["l2"]["a"]["bytes"] > 0
    assert value("kvstrata_tenant_share_bytes", {"engine": "0", "tier": "l2", "tenant": "b"}) == 8 * FILE
    assert value("kvstrata_tenant_share_bytes", {"engine": "0", "tier": "l2", "tenant": "a"}) == 4 * FILE
    own = value("kvstrata_evictions_by_cause_total", {"engine": "0", "tier": "l2", "cause": "own_share"})
    assert own == figures.counters["l2_evicted_own_share"] > 0
    assert value("kvstrata_evictions_by_cause_total", {"engine": "0", "tier": "l1", "cause": "lru"}) > 0  # no L1 shares
    assert value("kvstrata_evictions_by_cause_total", {"engine": "0", "tier": "l2", "cause": "over_share"}) == 0
    assert tenants["l2"]["b"]["blocks"] == 6 and tenants["l1"]["a"]["share_bytes"] == 0
