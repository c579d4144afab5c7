"""kvstrata seen from outside SGLang: its ``kvstrata_*`` series in the real server's ``/metrics``
(``--enable-metrics``; CPU, tiny local model, the test-only shims) and ``kvstrata stats`` naming
the model whose pages the server stored.

One server runs the scenario once (``served``): a scrape at start, a cold request (its pages are
backed up to kvstrata, through L1 and on to the disk tier), ``/flush_cache`` (SGLang's device and
host caches only), the same prompt again (a kvstrata L1 hit: SGLang prefetches it from storage).
The disk-tier test runs it first, on the direct-I/O server test_sglang.py's last test left running.
SGLang feeds its metrics from the scheduler loop, so every scrape waits until the figure it
checks has been exported. The names, types and buckets are the vLLM adapter's
(``kvstrata.metrics.METRICS``); the Grafana dashboard's kvstrata series are checked against this scrape too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from engines.launchers import PAGE, SGLangServers, ids, needs_sglang, sglang_config, sglang_python
from engines.test_sglang import block_files
from kvstrata.metrics import METRICS
from tests.harness.sglang_server import SGLangServer, SHIMS

# Server starts take minutes on 2 cores shared with the other test worker.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "examples" / "grafana" / "kvstrata.json"
IDS = ids(41, 600)  # 600 tokens: 37 full pages and an 8-token tail
FULL = len(IDS) // PAGE  # the prompt's full pages (SGLang also backs up the page its output completes)


def series(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def scrape(server: SGLangServer) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def scrape_until(server: SGLangServer, ready: Callable[[str], bool], timeout: float = 30) -> str:
    """The scheduler exports between its steps: scrape until ``ready(text)`` (or give the last scrape)."""
    deadline = time.monotonic() + timeout
    text = scrape(server)
    while not ready(text) and time.monotonic() < deadline:
        time.sleep(0.5)
        text = scrape(server)
    return text


def run_scenario(server: SGLangServer, cfg: Path, tmp: Path, model: str, tier: str) -> dict[str, Any]:
    """On a server with metrics on: scrape, cold request, flush, hit (from ``tier``), scrape."""
    out: dict[str, Any] = {"tmp": tmp, "cfg": cfg, "model": model}
    out["m0"] = scrape_until(server, lambda t: "kvstrata_saved_blocks_total" in t)
    files = len(block_files(cfg))
    out["cold"] = server.generate(IDS, 8)
    deadline = time.monotonic() + 60
    while len(block_files(cfg)) < files + FULL and time.monotonic() < deadline:  # backups are asynchronous
        time.sleep(0.2)
    saved, loads = (series(out["m0"], name, **labels) for name, labels in (
        ("kvstrata_saved_blocks_total", {}), ("kvstrata_load_seconds_count", {"tier": tier})))
    out["m1"] = scrape_until(server, lambda t: series(t, "kvstrata_saved_blocks_total") >= saved + FULL)
    server.flush()
    out["hit"] = server.generate(IDS, 8)
    out["m2"] = scrape_until(server, lambda t: series(t, "kvstrata_load_seconds_count", tier=tier) > loads)
    out["log"] = server.log_path.read_text(errors="replace")
    out["direct"] = "direct disk I/O" in out["log"]
    out["files"] = len(block_files(cfg))
    for name in ("m0", "m1", "m2"):  # kept for a look after a failure
        (tmp / f"{name}.metrics").write_text(out[name])
    return out


@pytest.fixture(scope="module")
def servers(sglang_servers: SGLangServers) -> Iterator[SGLangServers]:
    yield sglang_servers
    sglang_servers.stop()


@pytest.fixture(scope="module")
def served(model: str, servers: SGLangServers, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shipped set-up: kvstrata's L1 (256 MiB) is larger than SGLang's host pool, so pages go
    through L1 and the hit is served from it. A server of its own: its first scrape is taken
    before any request."""
    tmp = tmp_path_factory.mktemp("sglang-observability")
    cfg = sglang_config(tmp / "sglang.json", tmp / "l2")
    return run_scenario(servers.get(cfg, metrics=True, fresh=True), cfg, tmp, model, "l1")


@needs_sglang
def test_a_hit_from_the_disk_tier_grows_the_l2_series(model, servers, sglang_direct_config, tmp_path):
    """Scenario: kvstrata's L1 (4 MiB) is smaller than the host pool, so pages go straight between
    the pool and their files, and the hit is read from disk. First of the module: on the server
    test_sglang.py's last test left running (the same config, metrics on), else a new one."""
    server = servers.get(sglang_direct_config, metrics=True)
    out = run_scenario(server, sglang_direct_config, tmp_path, model, "l2")
    m1, m2, hit = out["m1"], out["m2"], out["hit"]
    assert out["direct"]
    loaded = hit.cached["storage"] // PAGE
    assert loaded >= FULL - 2 and hit.tokens == out["cold"].tokens

    def grew(name: str, **labels: str) -> float:
        return series(m2, name, **labels) - series(m1, name, **labels)

    assert grew("kvstrata_hit_blocks_total", tier="l2") == loaded
    assert grew("kvstrata_hit_tokens_total", tier="l2") == hit.cached["storage"]
    assert grew("kvstrata_hit_blocks_total", tier="l1") == 0 and grew("kvstrata_hit_tokens_total", tier="l1") == 0
    assert grew("kvstrata_bytes_read_total", tier="l2") >= loaded * series(m1, "kvstrata_resident_bytes", tier="l2") \
        / out["files"] * 0.99  # the pages' payloads (files add a header)
    assert series(m2, "kvstrata_load_seconds_count", tier="l2") >= 1
    assert series(m2, "kvstrata_load_seconds_count", tier="l1") == 0
    assert series(m1, "kvstrata_resident_blocks", tier="l2") == out["files"]
    assert series(m1, "kvstrata_resident_blocks", tier="l1") == 0


@needs_sglang
def test_kvstrata_start_up_line_is_in_sglangs_log(served):
    """SGLang configures the root logger, which kvstrata's logger reaches by propagation: its
    start-up line (namespace, page size, I/O path) is in the server's log, in SGLang's format."""
    lines = [line for line in served["log"].splitlines() if "kvstrata: namespace" in line]
    assert lines, served["log"][-3000:]
    # SGLang's "[%Y-%m-%d %H:%M:%S{ TPn}] message" format (the rank suffix only where it runs more than one)
    assert re.match(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d( [A-Z]+\d+)*\] kvstrata: ", lines[0]), lines[0]


@needs_sglang
def test_series_exist_from_the_first_scrape_with_sglangs_labels(served):
    m0 = served["m0"]
    for m in METRICS:
        name = f"kvstrata_{m.name}" + {"counter": "_total", "gauge": "", "histogram": "_count"}[m.kind]
        assert name + "{" in m0, f"{name} missing from the first scrape"
    assert re.search(r'^kvstrata_hit_blocks_total\{[^}]*model_name="[^"]+"[^}]*tier="l1"', m0, re.M), m0[:2000]
    line = next(line for line in m0.splitlines() if line.startswith("kvstrata_hit_blocks_total{"))
    assert 'tp_rank="0"' in line and 'pp_rank="0"' in line


@needs_sglang
def test_a_hit_grows_the_hit_series_of_its_tier_by_the_pages_loaded(served):
    cold, hit, m1, m2 = served["cold"], served["hit"], served["m1"], served["m2"]
    assert cold.cached.get("storage", 0) == 0
    loaded = hit.cached["storage"] // PAGE
    assert loaded >= FULL - 2 and hit.tokens == cold.tokens  # SGLang keeps the last page(s) to compute

    def grew(name: str, **labels: str) -> float:
        return series(m2, name, **labels) - series(m1, name, **labels)

    assert grew("kvstrata_hit_blocks_total", tier="l1") == loaded
    assert grew("kvstrata_hit_tokens_total", tier="l1") == hit.cached["storage"]
    assert grew("kvstrata_hit_blocks_total", tier="l2") == 0 and grew("kvstrata_hit_tokens_total", tier="l2") == 0
    assert grew("kvstrata_bytes_read_total", tier="l1") > 0
    # SGLang's own storage series, fed by the same get_stats call, still work.
    assert grew("sglang:prefetch_pgs_sum") >= loaded


@needs_sglang
def test_histograms_have_samples_and_gauges_show_what_is_resident(served):
    m1, m2 = served["m1"], served["m2"]
    assert series(m1, "kvstrata_lookup_seconds_count") >= 1  # batch_exists before the backup
    assert series(m2, "kvstrata_lookup_seconds_count") > series(m1, "kvstrata_lookup_seconds_count")
    assert series(m2, "kvstrata_load_seconds_count", tier="l1") >= 1
    assert series(m2, "kvstrata_load_seconds_bucket", tier="l1", le="+Inf") >= 1
    # SGLang's backups wait for the disk copies (batch_set_v1), so L2 is written on SGLang's own
    # backup thread and no kvstrata save queue is involved: the histogram is there, with no samples.
    assert "kvstrata_save_queue_wait_seconds_count{" in m2
    stored = served["files"]
    assert stored >= FULL and series(m1, "kvstrata_saved_blocks_total") == stored
    assert series(m1, "kvstrata_resident_blocks", tier="l1") == series(m1, "kvstrata_resident_blocks", tier="l2") \
        == stored
    assert series(m1, "kvstrata_bytes_written_total", tier="l1") == series(m1, "kvstrata_resident_bytes", tier="l1") > 0
    assert series(m1, "kvstrata_bytes_written_total", tier="l2") > 0
    assert series(m1, "kvstrata_tenant_blocks", tier="l2", tenant="default") == stored  # namespace.tenant empty


@needs_sglang
def test_every_kvstrata_metric_of_the_grafana_dashboard_is_in_the_sglang_scrape(served):
    names = set(re.findall(r"\b(kvstrata_[a-z_]+|sglang:[a-z_:]+)", GRAFANA.read_text()))
    scraped = {line.split("{")[0].split(" ")[0] for line in served["m2"].splitlines() if not line.startswith("#")}
    assert names and not names - scraped, sorted(names - scraped)
    # The dashboard's model variable reads model_name, which the SGLang series carry too.
    assert "label_values(kvstrata_saved_blocks_total, model_name)" in GRAFANA.read_text()


@needs_sglang
def test_stats_names_the_model_the_sglang_server_stored(served):
    cfg = served["tmp"] / "kvstrata.json"  # JSON is YAML: the server's disk tier, kvstrata's part only
    cfg.write_text(json.dumps({"l2": json.loads(served["cfg"].read_text())["l2"]}))
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "stats", "--config", str(cfg), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(res.stdout)
    (ns_id, described), = data["descriptors"].items()
    assert described["engine"] == "sglang" and described["block_size"] == PAGE
    assert served["model"] in described["model"]
    epoch_id = data["current_epochs"][ns_id]
    assert data["namespaces"][ns_id][epoch_id]["blocks"] == served["files"]


# Two backends with metrics on (TP ranks 0 and 1) and one with metrics off, in one process over
# SGLang's real host pool, with prometheus_client's default registry (no multiprocess directory).
_IN_PROCESS = """
import dataclasses, json, re, sys
sys.path.insert(0, sys.argv[1])
import sglang_cpu_hook
sglang_cpu_hook.install()
from prometheus_client import REGISTRY, generate_latest
from kvstrata.adapters.sglang import StrataStorage
from tests.harness.sglang_pool import host_pool, storage_config

def make(metrics, rank):
    cfg = storage_config({"l1": {"size": "16MiB"}, "l2": {"path": sys.argv[2]}, "interface_v1": 1,
                          "namespace": {"model_version": "v1"}}, model_name="tiny-test", tp_rank=rank, tp_size=2)
    s = StrataStorage(dataclasses.replace(cfg, enable_storage_metrics=metrics), {})
    s.register_mem_pool_host(host_pool(256, layers=3, heads=2, head_dim=8, page=16))
    return s

off = make(False, 0)
off.get_stats()
made_when_off = "kvstrata_" in generate_latest(REGISTRY).decode()
on = [make(True, 0), make(True, 1), make(True, 0)]
for s in on:
    s.get_stats()
text = generate_latest(REGISTRY).decode()
print(json.dumps({"made_when_off": made_when_off,
                  "ranks": sorted(set(re.findall(r'kvstrata_hit_blocks_total[{][^}]*tp_rank="([0-9])"', text))),
                  "stats": type(on[0].get_stats()).__name__}))
"""


@needs_sglang
def test_metrics_are_made_only_with_metrics_on_and_once_per_process(tmp_path):
    res = subprocess.run([sglang_python(), "-c", _IN_PROCESS, str(SHIMS), str(tmp_path / "l2")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"made_when_off": False, "ranks": ["0", "1"], "stats": "StrataStorageMetrics"}
