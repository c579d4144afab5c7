"""A weight update and reset on one vLLM engine is joined by the others, never caught, on two
real offline engines sharing one redis-server (each with its own L1 and L2).

Before: engine A changed its weights in memory and called ``reset_prefix_cache(reset_connector=True)``;
engine B, still on the old weights, adopted A's new epoch at once and saved into it what it computed
(its own prefix cache serving it the old prompt again); A then loaded B's KV of the weights it had
left, and answered wrong. Now B serves and saves nothing of the namespace until it resets itself,
and its reset joins A's epoch (``kvstrata.epochs.joins``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.harness import redisutil
from engines.launchers import BS, LONG, StepEngine, delta, gen, ids, salt

# Two engine starts, and vLLM's weight reloads, on 2 cores shared with another test worker.
pytestmark = [pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed"),
              pytest.mark.timeout(900)]

P, Q = LONG, ids(7, 400)
BLOCK_BYTES = 4 * 2 * 2 * 64 * BS * 2  # the tiny model's KV per block: layers, K and V, heads, head dim, bf16
RELOAD = {"op": "reload_weights", "seed": 11, "scale": 0.5}  # the new weights, the same for every engine
RESET = {"op": "reset", "connector": True}


def config(tmp: Path, name: str, url: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(f"l1:\n  size: 128MiB\nl2:\n  path: {tmp / name / 'l2'}\nremote:\n  enabled: true\n  url: {url}\n"
                    "  timeout_ms: 2000\n")  # calls that must succeed on a loaded host
    return path


def wait_published(engine: StepEngine, before: dict[str, int], blocks: int, timeout: float = 60) -> None:
    """Until ``engine`` has written ``blocks`` blocks to Redis since ``before`` (saves to the shared
    tier are asynchronous)."""
    deadline = time.monotonic() + timeout
    while (written := engine.counters().get("remote_bytes_written", 0) - before.get("remote_bytes_written", 0)) \
            < blocks * BLOCK_BYTES:
        assert time.monotonic() < deadline, f"{written} bytes written to Redis"
        time.sleep(0.3)


def test_a_weight_update_and_reset_on_one_engine_is_joined_not_caught(model, tmp_path):
    """Scenario: A and B serve P. A reloads its weights in memory and resets (connector too). B,
    still on the old weights, serves P again (vLLM's own prefix cache hit) and a new prompt Q: it
    saves nothing and loads nothing from kvstrata. A then serves P and Q: it loads nothing (cached
    tokens 0: its own cache was reset, and kvstrata has nothing of its new epoch but what A stores),
    and answers as A alone does under fresh cache salts (nothing stored under them). B then takes
    the same new weights and resets: its reset joins A's epoch (no new bump, A keeps its hits),
    it loads what A stored, and it answers as A does."""
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs), \
            StepEngine(model, tmp_path, config(tmp_path, "a", url), name="join-a") as a, \
            StepEngine(model, tmp_path, config(tmp_path, "b", url), name="join-b") as b:
        old = a.run([gen(P)])[0]
        assert b.run([gen(P)])[0]["tokens"] == old["tokens"]

        assert a.run([RELOAD, RESET])[1]["ok"] is True
        counted = b.counters()
        stale = b.run([{"op": "sleep", "s": 0.3}, gen(P), gen(Q), {"op": "counters"}])
        assert stale[1]["tokens"] == old["tokens"]  # B's old weights, from its own prefix cache
        grown = delta(stale[3], counted)
        assert grown.get("not_joined_saves", 0) > 0 and not grown.get("saved_blocks"), grown
        assert grown.get("not_joined_misses", 0) >= 1 and not grown.get("served_tokens"), grown

        counted = a.counters()
        new = a.run([gen(P), gen(Q), gen(P, salt=salt()), gen(Q, salt=salt()), {"op": "counters"}])
        assert new[0]["cached"] == 0 and new[1]["cached"] == 0  # nothing B computed with the old weights
        grown = delta(new[4], counted)
        assert not grown.get("served_tokens") and not grown.get("not_joined_misses"), grown
        assert new[0]["tokens"] == new[2]["tokens"] and new[1]["tokens"] == new[3]["tokens"]
        assert new[0]["tokens"] != old["tokens"]  # the weights change what P gives: a wrong load would show
        wait_published(a, counted, len(P) // BS + len(Q) // BS)

        counted = b.counters()
        joined = b.run([RELOAD, RESET, gen(P), gen(Q), {"op": "counters"}])
        assert joined[1]["ok"] is True
        grown = delta(joined[4], counted)
        assert grown.get("epoch_joins") == 1 and not grown.get("invalidations"), grown
        assert joined[2]["cached"] >= 0.9 * len(P) and joined[3]["cached"] >= 0.9 * len(Q)  # A's blocks
        assert joined[2]["tokens"] == new[0]["tokens"] and joined[3]["tokens"] == new[1]["tokens"]

        again = a.run([{"op": "reset"}, gen(P)])[1]  # vLLM's own cache only: what is cached comes from kvstrata
        assert again["cached"] == len(P) - 1 and again["tokens"] == new[0]["tokens"]
