"""Two real vLLM engines sharing the remote tier (Redis standalone, Redis Cluster, shared folder).

Each pair of engines (own L1 and L2, one shared tier) is started together and serves every test
of its backend, each test under cache salts of its own.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import pytest

import redisutil
from engines.conftest import BS, LONG, StepEngine, gen, salt

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

BLOCK_BYTES = 4 * 2 * 2 * 64 * BS * 2  # the tiny model's KV per block: layers, K and V, heads, head dim, bf16


def remote_config(tmp: Path, name: str, remote: dict) -> Path:
    """Each engine gets its own L1 and L2; only the remote tier is shared."""
    lines = ["l1:", "  size: 128MiB", "l2:", f"  path: {tmp / name / 'l2'}", "remote:", "  enabled: true"]
    lines += [f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in remote.items()]
    path = tmp / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_published(engine: StepEngine, before: dict[str, int], blocks: int = len(LONG) // BS,
                   timeout: float = 60) -> None:
    """Until ``engine``'s save threads have written ``blocks`` full blocks to the remote tier since
    the counters ``before`` (remote writes are asynchronous) and nothing more is being written."""
    deadline, last = time.monotonic() + timeout, -1
    while True:
        written = engine.counters().get("remote_bytes_written", 0) - before.get("remote_bytes_written", 0)
        if written >= blocks * BLOCK_BYTES and written == last:
            return
        assert time.monotonic() < deadline, f"{written} bytes written to the remote tier"
        last = written
        time.sleep(0.3)


@pytest.fixture(scope="module")
def pairs(model, tmp_path_factory) -> Iterator:  # noqa: ANN001
    """``pairs(backend)``: two engines (``a``, ``b``) on a fresh shared tier of that backend,
    started on first use and kept for the module."""
    made: dict[str, tuple[StepEngine, StepEngine]] = {}
    with contextlib.ExitStack() as stack:
        def get(backend: str) -> tuple[StepEngine, StepEngine]:
            if backend not in made:
                tmp = tmp_path_factory.mktemp(f"remote-{backend}")
                shared = stack.enter_context(redisutil.shared_backend(backend, tmp))
                made[backend] = tuple(stack.enter_context(StepEngine(model, tmp, remote_config(tmp, n, shared),
                                                                     name=f"{backend}-{n}")) for n in "ab")
            return made[backend]

        yield get


@pytest.mark.parametrize("backend", ["redis", "cluster", "fs"])
def test_second_engine_hits_what_the_first_stored_through_the_remote_tier(pairs, backend):
    a, b = pairs(backend)
    s, before = salt(), a.counters()
    first = a.run([gen(LONG, salt=s)])
    wait_published(a, before)
    counted = b.counters()
    out = b.run([gen(LONG, salt=s), {"op": "counters"}])
    assert out[0]["cached"] >= 0.9 * len(LONG)
    assert out[0]["tokens"] == first[0]["tokens"]
    assert out[1]["hit_blocks_remote"] - counted.get("hit_blocks_remote", 0) == len(LONG) // BS + 1


def test_reset_on_one_engine_stops_hits_on_the_other(pairs):
    a, b = pairs("redis")
    s, before = salt(), a.counters()
    ra = a.run([gen(LONG, salt=s)])
    wait_published(a, before)
    hit = b.run([gen(LONG, salt=s), {"op": "reset"}])[0]
    assert a.run([{"op": "reset", "connector": True}])[0]["ok"] is True
    after = b.run([{"op": "sleep", "s": 0.1}, gen(LONG, salt=s)])[1]
    assert hit["cached"] >= 0.9 * len(LONG)  # before the reset: hits
    assert after["cached"] == 0  # 100 ms after A's reset: B's own L1/L2 copies are hidden too
    assert after["tokens"] == hit["tokens"] == ra[0]["tokens"]


def test_redis_killed_mid_run_fails_no_request_and_hits_resume_after_restart(model, baseline, tmp_path):
    """Engines of its own: Redis is killed and restarted under ``a`` (timeout 100 ms); ``b`` starts
    after the restart and loads from Redis what ``a`` stored then."""
    p1, p2, p3 = LONG, LONG[::-1], [t + 1 for t in LONG]
    with redisutil.standalone(tmp_path / "redis") as (url, port, procs):
        remote = {"backend": "redis", "url": url, "timeout_ms": 100}
        engines = [StepEngine(model, tmp_path, remote_config(tmp_path, "a", remote), name="a")]
        try:
            a = engines[0]
            ra = a.run([gen(p1)])
            redisutil.stop(procs.pop())
            ra += a.run([gen(p2), gen(p1)])
            procs.append(redisutil.start(port, tmp_path / "redis"))
            engines.append(b := StepEngine(model, tmp_path, remote_config(tmp_path, "b", remote), name="b"))
            _, before, last = a.run([{"op": "sleep", "s": 2.5}, {"op": "counters"}, gen(p3)])
            ra.append(last)
            wait_published(a, before)
            rb = b.run([gen(p3), {"op": "counters"}])
        finally:
            for engine in engines:
                engine.close(timeout=0)  # killed: nothing left to save (a clean stop waits on the lost Redis)
    assert [r["tokens"] for r in ra] == [baseline(p1), baseline(p2), baseline(p1), baseline(p3)]
    assert rb[0]["cached"] >= 0.9 * len(p3) and rb[0]["tokens"] == baseline(p3)
    assert rb[1]["hit_blocks_remote"] > 0
