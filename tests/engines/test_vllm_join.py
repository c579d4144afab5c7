"""A weight update and reset on one vLLM engine is joined by the others, never caught, on two
real offline engines sharing one redis-server (each with its own L1 and L2).

Before: engine A changed its weights in memory and called ``reset_prefix_cache(reset_connector=True)``;
engine B, still on the old weights, adopted A's new epoch at once and saved into it what it computed
(its own prefix cache serving it the old prompt again); A then loaded B's KV of the weights it had
left, and answered wrong. Now B serves and saves nothing of the namespace until it resets itself,
and its reset joins A's epoch (``kvstrata.epochs.joins``).

On the same engines (issue 50, parts 2 and 3): a reset reaches an idle peer before the epoch key
can be lost; and weight updates with requests in flight, in the old order (update, steps, reset:
nothing of the new weights is saved under the old epoch, ``kvstrata.adapters.vllm.weights``) and in
vLLM's (``pause_generation(clear_cache=True)``, update, resume), each checked on the peer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

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

        # Issue 50, part 2, on the same engines: a reset reaches an idle peer before the epoch key can
        # be lost. A takes other weights and resets while B sits idle; Redis then loses the epoch key
        # (allkeys-lru evicting it, an operator). B serves P and a new prompt R, then A serves P and R,
        # then B a prompt S that A computed. Before the fix B joined the generation-0 epoch made after the
        # loss, saved its old weights' KV into it, and A loaded 519 of 519 tokens of it.
        R, S = ids(9, 400), ids(10, 400)
        assert a.run([{**RELOAD, "seed": 12}, RESET])[1]["ok"] is True
        time.sleep(1.0)  # B makes no call: only its epoch subscriber may read
        client = redis.Redis.from_url(url)
        assert client.delete(*client.keys("kvstrata:epoch:*")) == 1
        counted = b.counters()
        idle = b.run([gen(P), gen(R), gen(R, salt=salt()), {"op": "counters"}])
        grown = delta(idle[3], counted)
        assert not grown.get("saved_blocks") and grown.get("not_joined_saves", 0) > 0, grown
        assert idle[0]["tokens"] == joined[2]["tokens"] and idle[1]["tokens"] == idle[2]["tokens"]  # B's weights
        counted = a.counters()
        later = a.run([gen(P), gen(R), gen(S), gen(P, salt=salt()), gen(R, salt=salt()), {"op": "counters"}])
        assert later[0]["cached"] == 0 and later[1]["cached"] == 0, later  # nothing B computed
        assert later[0]["tokens"] == later[3]["tokens"] and later[1]["tokens"] == later[4]["tokens"]
        assert later[1]["tokens"] != idle[1]["tokens"]  # the weights differ: a wrong load would show
        wait_published(a, counted, (len(P) + len(R) + len(S)) // BS)
        counted = b.counters()
        behind = b.run([gen(S), {"op": "counters"}])
        assert behind[0]["cached"] == 0 and not delta(behind[1], counted).get("served_tokens")  # nothing of A's

        # Issue 50, part 3, on the same engines: weight updates with requests in flight, in the old order
        # and in vLLM's (pause_generation(clear_cache=True), update, resume).
        b.run([{**RELOAD, "seed": 12}, RESET])  # B joins A's epoch, on A's weights
        unsafe_order_saves_nothing_of_the_new_weights(a, b)
        pause_order_leaves_each_epoch_its_own_weights(a, b)


def pause(mode: str = "abort") -> dict:
    """What ``pause_generation(mode=mode, clear_cache=True)`` asks of the engine core (the reset)."""
    return {"op": "pause", "mode": mode, "clear_cache": True}


def in_flight(name: str, prompt: list[int]) -> list[dict]:
    """A request left in flight: its prompt computed and one token decoded; 90 tokens in all, so
    that the blocks its decoding completes come after what happens next."""
    return [{"op": "submit", "id": name, "prompt": prompt, "max_tokens": 90}, {"op": "steps", "n": 2}]


def unsafe_order_saves_nothing_of_the_new_weights(a: StepEngine, b: StepEngine) -> None:
    """Scenario: A and B share an epoch and weights. A reloads its weights with a request X in
    flight and no reset before (the old order: the reset comes after, and on a server engine steps
    run between the two). X finishes on the new weights and A serves a new prompt Y; then B, on the
    old weights and the same epoch, serves X's whole sequence and Y. Before the fix A saved X's
    decoded blocks and Y under the old epoch, and B loaded them. Now the update takes A off the
    store until its reset: A saves nothing of the new weights, B loads no more than X's prompt
    (computed before the update) and answers as it does alone. After its reset A stores again, in a
    new weights generation."""
    X, Y = ids(11, 400), ids(12, 400)
    counted = a.counters()
    first = a.run([*in_flight("x", X), {"op": "counters"}])
    off = a.run([{**RELOAD, "seed": 13}, {"op": "steps", "n": None}, gen(Y), {"op": "counters"}])
    before, after = delta(first[2], counted), delta(off[3], first[2])
    print(f"old order: before the update {before}; after it, before the reset {after}")
    x_out, y_new = off[1]["finished"]["x"], off[2]
    assert not first[1]["finished"] and before.get("saved_blocks", 0) >= len(X) // BS, before  # X's prompt
    time.sleep(1.5)  # what A had saved would be in Redis by now
    x_all = X + x_out["tokens"]
    peer = b.run([gen(x_all), gen(x_all, salt=salt()), gen(Y), gen(Y, salt=salt())])
    print(f"old order: B loads {peer[0]['cached']} of X's {len(x_all)} tokens and {peer[2]['cached']} of Y's")
    assert peer[0]["cached"] <= len(X) and peer[2]["cached"] == 0, peer  # X's prompt at most (its tail included)
    assert peer[0]["tokens"] == peer[1]["tokens"] and peer[2]["tokens"] == peer[3]["tokens"]
    assert not after.get("saved_blocks") and y_new["cached"] == 0, after

    counted = a.counters()
    reset = a.run([RESET, gen(Y), {"op": "counters"}])
    grown = delta(reset[2], counted)
    assert reset[0]["ok"] is True and grown.get("invalidations") == 1, grown  # a new weights generation
    assert reset[1]["cached"] == 0 and reset[1]["tokens"] == y_new["tokens"]  # the new weights, as while off
    assert grown.get("saved_blocks", 0) >= len(Y) // BS, grown  # on the store again
    wait_published(a, counted, len(Y) // BS)


def pause_order_leaves_each_epoch_its_own_weights(a: StepEngine, b: StepEngine) -> None:
    """Scenario: vLLM's order, on both engines. B (behind A's reset, on the old weights) pauses with
    its cache clear, takes A's weights and resumes: its pause's reset joins A's epoch and the update
    right after it keeps B on the store, so B loads what A stored and answers as it does alone. Then A, with a
    request Z in flight, pauses ("keep": Z frozen), takes other weights and resumes: Z finishes and A
    serves a new prompt W, storing it in its new generation. B, on A's old weights, loads nothing;
    once B has done the same, it loads W (the new weights' blocks) and answers as A, and nothing of
    Z's old-weights blocks reaches it: its answer to Z's whole sequence is its own."""
    Y, Z, W = ids(12, 400), ids(13, 400), ids(14, 400)
    counted = b.counters()
    joined = b.run([pause(), {**RELOAD, "seed": 13}, {"op": "resume"}, gen(Y), gen(Y, salt=salt()),
                    {"op": "counters"}])
    grown = delta(joined[5], counted)
    assert grown.get("epoch_joins") == 1 and not grown.get("invalidations"), grown
    assert joined[3]["cached"] >= 0.9 * len(Y), joined[3]  # A's blocks: the update did not take B off the store
    assert joined[3]["tokens"] == joined[4]["tokens"]

    counted = a.counters()
    first = a.run(in_flight("z", Z))
    paused = a.run([pause("keep"), {**RELOAD, "seed": 14}, {"op": "resume"}, {"op": "steps", "n": None}, gen(W),
                    gen(W, salt=salt()), {"op": "counters"}])
    grown = delta(paused[6], counted)
    print(f"pause order: A {grown}")
    z_all = Z + paused[3]["finished"]["z"]["tokens"]
    assert not first[1]["finished"] and grown.get("invalidations") == 1, grown  # the pause's reset
    assert paused[4]["tokens"] == paused[5]["tokens"]
    # Z's prompt (before the pause) and W (after it) stored: the update after the pause kept A on the store
    wait_published(a, counted, len(Z) // BS + 1 + len(W) // BS)

    counted = b.counters()
    behind = b.run([gen(W), {"op": "counters"}])
    assert behind[0]["cached"] == 0 and not delta(behind[1], counted).get("served_tokens")
    counted = b.counters()
    caught_up = b.run([pause(), {**RELOAD, "seed": 14}, {"op": "resume"}, gen(W), gen(z_all), gen(z_all, salt=salt()),
                       {"op": "counters"}])
    grown = delta(caught_up[6], counted)
    print(f"pause order: B after its own update {grown}; Z's sequence: {caught_up[4]['cached']} tokens loaded")
    assert grown.get("epoch_joins") == 1 and not grown.get("invalidations"), grown
    assert caught_up[3]["cached"] >= 0.9 * len(W) and caught_up[3]["tokens"] == paused[4]["tokens"]
    assert caught_up[4]["tokens"] == caught_up[5]["tokens"]
