"""Two real vLLM engines sharing the remote tier (Redis standalone, Redis Cluster, shared folder)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import redisutil
from test_vllm import BS, LONG, STEPS, gen, model, run  # noqa: F401  (model is a fixture)

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")


def remote_config(tmp: Path, name: str, remote: dict) -> Path:
    """Each engine gets its own L1 and L2; only the remote tier is shared."""
    lines = ["l1:", "  size: 128MiB", "l2:", f"  path: {tmp / name / 'l2'}", "remote:", "  enabled: true"]
    lines += [f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in remote.items()]
    path = tmp / f"{name}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(params=["redis", "cluster", "fs"])
def shared(request, tmp_path):
    with redisutil.shared_backend(request.param, tmp_path) as settings:
        yield settings


def test_second_engine_hits_what_the_first_stored_through_the_remote_tier(model, tmp_path, shared):
    a = run(model, tmp_path, remote_config(tmp_path, "a", shared), [gen(LONG)])
    b = run(model, tmp_path, remote_config(tmp_path, "b", shared), [gen(LONG), {"op": "counters"}])
    assert b[0]["cached"] >= 0.9 * len(LONG)
    assert b[0]["tokens"] == a[0]["tokens"]
    assert b[1]["hit_blocks_remote"] == len(LONG) // BS + 1


def _start(model: str, tmp: Path, config: Path, steps: list[dict]) -> tuple[subprocess.Popen[str], Path]:
    spec = tmp / f"spec-{random.random()}.json"
    spec.write_text(json.dumps({"model": model, "config": str(config), "block_size": BS, "steps": steps}))
    log = spec.with_suffix(".log")
    proc = subprocess.Popen([sys.executable, str(STEPS), str(spec)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)
    return proc, log


def _finish(proc: subprocess.Popen[str], log: Path) -> list[dict]:
    assert proc.wait(timeout=600) == 0, log.read_text()[-6000:]
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def _wait(path: Path, procs: list[subprocess.Popen[str]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert all(p.poll() is None for p in procs), "an engine exited early"
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def test_reset_on_one_engine_stops_hits_on_the_other(model, tmp_path):
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        remote = {"backend": "redis", "url": url}
        f = {n: str(tmp_path / n) for n in ("stored", "b_hit", "reset")}
        a, a_log = _start(model, tmp_path, remote_config(tmp_path, "a", remote), [
            gen(LONG), {"op": "signal", "file": f["stored"]}, {"op": "wait", "file": f["b_hit"]},
            {"op": "reset", "connector": True}, {"op": "signal", "file": f["reset"]}])
        b, b_log = _start(model, tmp_path, remote_config(tmp_path, "b", remote), [
            {"op": "wait", "file": f["stored"]}, gen(LONG), {"op": "reset"}, {"op": "signal", "file": f["b_hit"]},
            {"op": "wait", "file": f["reset"]}, {"op": "sleep", "s": 0.1}, gen(LONG)])
        ra, rb = _finish(a, a_log), _finish(b, b_log)
        assert ra[3]["ok"] is True
        assert rb[1]["cached"] >= 0.9 * len(LONG)  # before the reset: hits
        assert rb[6]["cached"] == 0  # 100 ms after A's reset: B's own L1/L2 copies are hidden too
        assert rb[6]["tokens"] == rb[1]["tokens"] == ra[0]["tokens"]


def test_redis_killed_mid_run_fails_no_request_and_hits_resume_after_restart(model, tmp_path):
    p1, p2, p3 = LONG, LONG[::-1], [t + 1 for t in LONG]
    with redisutil.standalone(tmp_path / "redis") as (url, port, procs):
        remote = {"backend": "redis", "url": url, "timeout_ms": 100}
        f = {n: tmp_path / n for n in ("a1", "killed", "a2", "restarted")}
        a, a_log = _start(model, tmp_path, remote_config(tmp_path, "a", remote), [
            gen(p1), {"op": "signal", "file": str(f["a1"])}, {"op": "wait", "file": str(f["killed"])},
            gen(p2), gen(p1), {"op": "signal", "file": str(f["a2"])}, {"op": "wait", "file": str(f["restarted"])},
            {"op": "sleep", "s": 2.5}, gen(p3)])
        _wait(f["a1"], [a])
        redisutil.stop(procs.pop())
        f["killed"].touch()
        _wait(f["a2"], [a])
        procs.append(redisutil.start(port, tmp_path / "redis"))
        f["restarted"].touch()
        ra = _finish(a, a_log)
        baseline = run(model, tmp_path, None, [gen(p1), gen(p2), gen(p3)])
        assert [r["tokens"] for r in (ra[0], ra[3], ra[4], ra[8])] == [
            baseline[0]["tokens"], baseline[1]["tokens"], baseline[0]["tokens"], baseline[2]["tokens"]]
        b = run(model, tmp_path, remote_config(tmp_path, "b", remote), [gen(p3), {"op": "counters"}])
        assert b[0]["cached"] >= 0.9 * len(p3) and b[0]["tokens"] == baseline[2]["tokens"]
        assert b[1]["hit_blocks_remote"] > 0
