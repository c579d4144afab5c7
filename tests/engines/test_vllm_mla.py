"""An MLA model (examples/make_tiny_model.py's ``mla`` preset: DeepSeek-V2, 2 layers, 4 experts,
fp32) on the real vLLM engine with kvstrata, at TP=1 and TP=2.

Its latent KV (512 + 64 values per token and layer) is the same on every tensor-parallel rank, so
kvstrata stores it once: rank 0 writes a block's one copy, every rank reads it, and the namespace
does not name the TP degree. So a TP=2 instance serves what a TP=1 instance stored and the
reverse, and a block takes the same bytes on disk at either degree (a copy per rank before).
vLLM's CPU build runs MLA with block size 16 and with its own prefix caching off ("forcing
chunked prefill and prefix caching to be disabled"), so every hit here is kvstrata's.

Engines on one disk tier: a TP=1 engine (cold, then again after a reset: L1), kept up while a TP=2
one runs (the first prompt from disk; a new prompt cold, then again: L1) and stops, then asked the
TP=2 engine's prompt, which it never saw (from disk, as TP=2 wrote it); beside them vLLM alone at
TP=1 (``baseline``; TP=2 alone gives the same greedy tokens for these prompts, checked when this
was written). The commit rule with one writer (rank 0's report settles a save; a load waits for
every rank) on vLLM's real scheduler, with no model run, is the first test.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engines.launchers import StepEngine, delta, disk_config, gen, ids, tiny_model
from engines.test_vllm_tp import RankHarness
from kvstrata.format.block import HEADER_SIZE

pytest.importorskip("vllm")

BS = 16  # vLLM's CPU MLA backend requires it
DTYPE = "float32"
LATENT = 2 * (512 + 64) * 4  # bytes per token: 2 layers of kv_lora_rank + qk_rope_head_dim, fp32
FIRST, SECOND = ids(61, 1600), ids(62, 1600)
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


# ------------------------------------------------------------------ scheduler-side accounting
def test_one_writer_commits_a_save_and_every_rank_releases_a_load(model, tmp_path):
    """Scenario: at TP=2 an MLA block has one copy, written by rank 0 alone. A save is committed
    on rank 0's report (no other rank writes a byte of it) and dropped if rank 0 failed; a load's
    pin holds until both ranks, which both read that copy, have reported it."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32)
    h = RankHarness(model, tmp_path, spec, replicas=2)
    try:
        prompt = ids(63, 100)
        h.request(prompt)
        out = h.schedule()
        arena, (save,) = out.kv_connector_metadata.arena, out.kv_connector_metadata.saves
        assert arena.shared and arena.slot_bytes == arena.rank_bytes == spec.page_size_bytes * 4
        h.report(out, [Meta(saved={0: {save.op_id}}), None])
        assert h.visible_tokens(prompt) == len(prompt)  # rank 1 never reports a save

        other = ids(64, 70)
        h.request(other)
        out = h.schedule()
        (failed,) = [op for op in out.kv_connector_metadata.saves if op.req_id == "r2"]
        h.report(out, [Meta(failed={0: {failed.op_id}}), None])
        assert h.visible_tokens(other) == 0

        h.load_stays_pinned_until_rank_1_read(prompt)
    finally:
        h.scheduler.shutdown()


# ------------------------------------------------------------------ the real engines
def stored_bytes(l2: Path) -> int:
    return sum(f.stat().st_size for f in l2.rglob("*.kvb"))


def settled_bytes(l2: Path, blocks: int, timeout: float = 60) -> int:
    """``stored_bytes`` once ``l2`` holds ``blocks`` block files and their total has not changed
    for a second (a live engine writes L2 in the background; a block file appears whole, by
    rename); past ``timeout`` whatever is there, for the test to fail on."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while True:
        files = list(l2.rglob("*.kvb"))
        total = sum(f.stat().st_size for f in files)
        if total != last:
            last, since = total, time.monotonic()
        if (len(files) >= blocks and time.monotonic() - since >= 1) or time.monotonic() > deadline:
            return total
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mla_runs(baseline, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("mla")
    model = tiny_model("mla")
    cfg = disk_config(tmp)
    l2 = tmp / "l2"

    def engine(name: str, tp: int) -> StepEngine:
        return StepEngine(model, tmp, cfg, name=name, tp=tp, dtype=DTYPE, block_size=BS,
                          env=TP2_ENV if tp == 2 else None)

    counters = {"op": "counters"}
    runs: dict = {}
    with engine("mla-tp1", 1) as first:  # vLLM alone computes while this engine starts
        runs["alone"] = baseline.many([FIRST, SECOND], model=model, dtype=DTYPE, block_size=BS)
        runs["tp1"] = first.run([gen(FIRST), {"op": "reset"}, gen(FIRST), counters])
        runs["bytes_tp1"] = settled_bytes(l2, len(FIRST) // BS)  # every save written through
        with engine("mla-tp2", 2) as second:  # the TP=1 engine stays up, idle
            runs["tp2"] = second.run([gen(FIRST), gen(SECOND), {"op": "reset"}, gen(SECOND), counters])
        runs["bytes_tp2"] = stored_bytes(l2) - runs["bytes_tp1"]  # after TP=2's clean stop
        # SECOND was never asked of the TP=1 engine: its L1 holds only FIRST, so its hits are
        # what TP=2 wrote to disk. Its counters: what grew while it served SECOND.
        before = first.counters()
        served, after = first.run([gen(SECOND), counters])
        runs["tp1_again"] = [served, delta(after, before)]
    cached = [r["cached"] for phase in ("tp1", "tp2", "tp1_again") for r in runs[phase] if "cached" in r]
    print(f"mla: stored bytes per token {runs['bytes_tp1'] / len(FIRST):.1f} at TP=1, "
          f"{runs['bytes_tp2'] / len(SECOND):.1f} at TP=2; cached tokens, phase by phase: {cached}")
    return runs


def hit(run: dict, prompt: list[int]) -> None:
    assert run["cached"] >= 0.9 * len(prompt) and run["cached"] == len(prompt) - 1, run["cached"]


@pytest.mark.timeout(900)  # the first one starts the module's three engines
def test_tp1_mla_cold_and_l1_hit_match_vllm_alone(mla_runs):
    cold, reset, again, counters = mla_runs["tp1"]
    alone = mla_runs["alone"][0]
    assert cold["cached"] == 0 and cold["tokens"] == alone
    assert reset["ok"] is True
    hit(again, FIRST)
    assert again["tokens"] == alone
    assert counters["hit_tokens_l1"] == len(FIRST) - 1


@pytest.mark.timeout(900)
def test_tp2_mla_serves_what_tp1_stored_and_stores_its_own(mla_runs):
    from_tp1, cold, _, again, counters = mla_runs["tp2"]
    hit(from_tp1, FIRST)  # TP=1's blocks, from disk: one namespace at both degrees
    assert from_tp1["tokens"] == mla_runs["alone"][0]
    assert counters["hit_blocks_l2"] == len(FIRST) // BS
    assert cold["cached"] == 0 and cold["tokens"] == mla_runs["alone"][1]
    hit(again, SECOND)  # L1 at TP=2: both ranks read rank 0's copy
    assert again["tokens"] == mla_runs["alone"][1]


@pytest.mark.timeout(900)
def test_tp1_mla_serves_what_tp2_stored(mla_runs):
    from_tp2, counters = mla_runs["tp1_again"]
    hit(from_tp2, SECOND)
    assert from_tp2["tokens"] == mla_runs["alone"][1]
    assert counters["hit_blocks_l2"] == len(SECOND) // BS


@pytest.mark.timeout(900)
def test_mla_block_bytes_per_token_are_the_same_at_tp1_and_tp2(mla_runs):
    """One copy of the latent per block at either degree (before: one per rank at TP=2)."""
    per_token = (mla_runs["bytes_tp1"] / len(FIRST), mla_runs["bytes_tp2"] / len(SECOND))
    assert per_token[0] == per_token[1] == LATENT + HEADER_SIZE / BS, per_token
