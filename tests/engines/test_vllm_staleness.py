"""A real vLLM server whose shared tier (a real redis-server) is reached through a faulty proxy
(``tools/torture/faults.py``): a reset made elsewhere while Redis hangs is never served past the bound, a
reset asked of this server while Redis refuses fails, and hits come back when Redis answers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.harness import redisutil
from engines.launchers import LONG
from kvstrata.tools.torture.faults import FaultyProxy

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

BOUND_S = 0.25  # remote.invalidation_ms + remote.confirm_margin_ms, the defaults


def config(path: Path, l2: Path, url: str) -> Path:
    path.write_text(f"l1:\n  size: 128MiB\nl2:\n  path: {l2}\nremote:\n  enabled: true\n  url: {url}\n"
                    "  breaker:\n    reset_ms: 200\n    max_backoff_ms: 1000\n")
    return path


def epoch_key(client: redis.Redis) -> bytes:
    """The one namespace's epoch key (the server has one model, one namespace)."""
    keys = list(client.scan_iter(match="kvstrata:epoch:*"))
    assert len(keys) == 1, keys
    return keys[0]


def test_vllm_behind_a_faulty_redis_serves_no_retired_epoch_and_recovers(vllm_server, baseline, tmp_path):
    """Scenario, one server A reaching Redis through the proxy:

    1. A serves the prompt, then again from kvstrata (vLLM's own cache reset): equal outputs.
    2. The proxy hangs; an operator's ``kvstrata invalidate --model`` (another instance of the
       store, straight to Redis) makes a new epoch. Past the bound A loads nothing of the
       prompt from its own L1 and disk, which still hold it, and its outputs stay equal.
    3. The proxy forwards again: A learns the new epoch (the old blocks stay misses), stores
       the prompt under it and serves it from kvstrata again.
    4. The proxy refuses; A's own reset (``/reset_prefix_cache?reset_external=true``) answers
       ``success: false``, and A serves nothing of the namespace. When Redis answers again the new
       epoch is written to Redis (without any request), and hits resume.
    """
    want = baseline(LONG)
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs), FaultyProxy(url) as proxy:
        client = redis.Redis.from_url(url)
        a = vllm_server(config(tmp_path / "a.yaml", tmp_path / "a-l2", proxy.url))

        def serve() -> int:
            a.reset_prefix_cache()  # vLLM's own cache: what is cached now came from kvstrata
            done = a.complete(LONG)
            assert done.tokens == want
            return done.cached_tokens or 0

        def hits_again(timeout: float = 60) -> int:
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if (cached := serve()) >= 0.9 * len(LONG):
                    return cached
                time.sleep(0.3)
            raise AssertionError("kvstrata served nothing after Redis answered again")

        assert serve() == 0
        assert hits_again() >= 0.9 * len(LONG)  # 1: from kvstrata
        old = client.get(epoch_key(client))

        proxy.set_mode("hang")  # 2
        direct = config(tmp_path / "operator.yaml", tmp_path / "operator-l2", url)
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "invalidate", "--model", a.model,
                              "--config", str(direct)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "new epoch" in res.stdout, res.stdout + res.stderr
        new = client.get(epoch_key(client))
        assert new != old
        time.sleep(BOUND_S)
        for _ in range(3):
            assert serve() == 0, "an epoch retired elsewhere was served while Redis hung"

        proxy.set_mode("pass")  # 3
        assert hits_again() >= 0.9 * len(LONG)
        assert client.get(epoch_key(client)) == new

        proxy.set_mode("refuse")  # 4
        answer = json.loads(a.post("/reset_prefix_cache?reset_external=true"))
        assert answer == {"success": False}, answer
        assert serve() == 0
        assert client.get(epoch_key(client)) == new  # nothing written: the reset failed
        proxy.set_mode("pass")
        end = time.monotonic() + 30
        while client.get(epoch_key(client)) == new:  # written by A's subscriber thread, no request
            assert time.monotonic() < end, "the pending reset was never written"
            time.sleep(0.2)
        assert hits_again() >= 0.9 * len(LONG)
        assert "could not be invalidated" in a.tail(200_000)  # the engine's log says why the reset failed
