"""Real vLLM engines on the remote tier (Redis standalone, Redis Cluster, shared folder).

On standalone Redis a pair of engines (own L1 and L2, one shared tier) is started together and
serves every test, each under cache salts of its own (the last one, Redis killed under the pair,
under prompts no other test sends). On Redis Cluster and the shared folder one engine with no disk
tier and a CPU tier of 20 blocks loads back from the shared tier a prompt its CPU tier evicted:
the engine's path to the shared tier is the same whatever the backend; what is the backend's own
(cross-process reads and writes, damaged values) is tested without an engine (tests/tiers/test_remote*.py).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.harness import redisutil
from engines.launchers import BS, LONG, StepEngine, delta, gen, salt

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

BLOCK_BYTES = 4 * 2 * 2 * 64 * BS * 2  # the tiny model's KV per block: layers, K and V, heads, head dim, bf16


EVICTING_L1 = 20 * BLOCK_BYTES  # more than one prompt, less than two: the next prompt evicts the last


def remote_config(tmp: Path, name: str, remote: dict, l1: int | None = None) -> Path:
    """Each engine gets its own L1 and L2 (with ``l1``: that many bytes of L1, no L2); only the
    remote tier is shared."""
    local = ["l1:", f"  size: {l1}", "l2:", "  enabled: false"] if l1 else [
        "l1:", "  size: 128MiB", "l2:", f"  path: {tmp / name / 'l2'}"]
    lines = [*local, "remote:", "  enabled: true"]
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


def wait_reachable(engine: StepEngine, timeout: float = 60) -> dict[str, int]:
    """Until ``engine``'s circuit breaker on the remote tier is closed (it closed as many times as
    it opened: its epoch subscriber makes the trial calls, the first as soon as it is connected
    again); its counters then."""
    deadline = time.monotonic() + timeout
    while True:
        counters = engine.counters()
        if counters.get("remote_circuit_closed", 0) >= counters.get("remote_circuit_opened", 0):
            return counters
        assert time.monotonic() < deadline, f"the circuit stayed open: {counters}"
        time.sleep(0.2)


class Pairs:
    """``pairs(backend)``: two engines (``a``, ``b``) on a fresh shared tier of that backend,
    started on first use and kept for the module; ``pairs.redis``: the standalone Redis of the
    "redis" pair as (port, [process], folder), so a test can kill and restart it.
    ``pairs.evicting(backend)``: one engine whose L1 holds less than two prompts, no L2."""

    def __init__(self, model: str, tmp_path_factory: pytest.TempPathFactory, stack: contextlib.ExitStack) -> None:
        self.model, self.tmp_path_factory, self.stack = model, tmp_path_factory, stack
        self.made: dict[str, tuple[StepEngine, StepEngine]] = {}
        self.redis: tuple[int, list, Path] | None = None

    def __call__(self, backend: str) -> tuple[StepEngine, StepEngine]:
        if backend not in self.made:
            tmp = self.tmp_path_factory.mktemp(f"remote-{backend}")
            if backend == "redis":
                url, port, procs = self.stack.enter_context(redisutil.standalone(tmp / "redis"))
                # timeout_ms: calls that must succeed on a loaded host (a killed Redis refuses at once)
                self.redis, shared = (port, procs, tmp / "redis"), {"backend": "redis", "url": url, "timeout_ms": 2000}
            else:
                shared = self.stack.enter_context(redisutil.shared_backend(backend, tmp))
            self.made[backend] = tuple(self.stack.enter_context(  # type: ignore[assignment]
                StepEngine(self.model, tmp, remote_config(tmp, n, shared), name=f"{backend}-{n}")) for n in "ab")
        return self.made[backend]

    def evicting(self, backend: str) -> StepEngine:
        tmp = self.tmp_path_factory.mktemp(f"evicting-{backend}")
        shared = self.stack.enter_context(redisutil.shared_backend(backend, tmp))
        return StepEngine(self.model, tmp, remote_config(tmp, "a", shared, EVICTING_L1), name=f"{backend}-evicting")


@pytest.fixture(scope="module")
def pairs(model, tmp_path_factory) -> Iterator[Pairs]:  # noqa: ANN001
    with contextlib.ExitStack() as stack:
        yield Pairs(model, tmp_path_factory, stack)


def test_second_engine_hits_what_the_first_stored_through_the_remote_tier(pairs):
    a, b = pairs("redis")
    s, before = salt(), a.counters()
    first = a.run([gen(LONG, salt=s)])
    wait_published(a, before)
    counted = b.counters()
    out = b.run([gen(LONG, salt=s), {"op": "counters"}])
    assert out[0]["cached"] >= 0.9 * len(LONG)
    assert out[0]["tokens"] == first[0]["tokens"]
    assert out[1]["hit_blocks_remote"] - counted.get("hit_blocks_remote", 0) == len(LONG) // BS + 1


@pytest.mark.parametrize("backend", ["cluster", "fs"])
def test_prompt_evicted_from_the_cpu_tier_is_loaded_back_from_the_remote_tier(pairs, baseline, backend):
    """One engine: LONG is stored and published, then a prompt twice as long evicts every block
    of it from L1 (it has no L2); LONG asked again is loaded from the shared tier, whole."""
    s = salt()
    with pairs.evicting(backend) as engine:
        before = engine.counters()
        first = engine.run([gen(LONG, salt=s)])[0]
        wait_published(engine, before)
        before = engine.counters()
        engine.run([gen(LONG + LONG[::-1], salt=salt())])  # 31 full blocks through an L1 of 20
        wait_published(engine, before, EVICTING_L1 // BLOCK_BYTES)  # at least what L1 holds
        counted = engine.counters()
        out = engine.run([{"op": "reset"}, gen(LONG, salt=s), {"op": "counters"}])
    assert out[1]["cached"] == len(LONG) - 1
    assert out[1]["tokens"] == first["tokens"] == baseline(LONG)
    grown = delta(out[2], counted)
    assert grown.get("hit_blocks_remote") == len(LONG) // BS + 1 and not grown.get("hit_blocks_l1"), grown


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
    # A reset after a weight update: B serves and saves nothing of the namespace until it resets
    # itself, which joins A's epoch (kvstrata.epochs.joins); the next tests share it again.
    assert b.run([{"op": "reset", "connector": True}])[0]["ok"] is True


def test_redis_killed_mid_run_fails_no_request_and_hits_resume_after_restart(pairs, baseline):
    """The "redis" pair, last in the module: Redis is killed and restarted (empty) under both
    engines; ``a`` serves every request right, before, during and after; after the restart ``b``,
    idle through it all, loads from Redis what ``a`` stored then."""
    a, b = pairs("redis")
    port, procs, folder = pairs.redis
    p1, p2, p3 = LONG, LONG[::-1], [t + 1 for t in LONG]
    ra = a.run([gen(p1)])
    redisutil.stop(procs.pop())
    ra += a.run([gen(p2), gen(p1)])
    procs.append(redisutil.start(port, folder))
    before = wait_reachable(a)
    assert before.get("remote_circuit_opened", 0) >= 1  # the kill was seen: the breaker opened
    ra += a.run([gen(p3)])
    wait_published(a, before)
    counted = b.counters()
    rb = b.run([gen(p3), {"op": "counters"}])
    assert [r["tokens"] for r in ra] == [baseline(p1), baseline(p2), baseline(p1), baseline(p3)]
    assert rb[0]["cached"] >= 0.9 * len(p3) and rb[0]["tokens"] == baseline(p3)
    assert rb[1]["hit_blocks_remote"] - counted.get("hit_blocks_remote", 0) > 0
