"""Pipeline parallelism on the real vLLM engine with kvstrata: two stages of the tiny
Llama (layers 0-1 and 2-3), one worker process each.

Each stage's worker is a rank of its own (stage * TP degree + TP rank) that copies its own layers
into a slot, at its stage's offset in the rank's region, so a slot is laid out as with one stage.
A save is committed once every stage has reported its part (one stage's report alone commits
nothing, so a stage that dies mid-save leaves nothing half-written to serve), and a load's pin goes
once every stage has read its part. A block is one unit in every tier, with every stage's layers:
a hit always covers every stage.

vLLM 0.32's CPU build runs ``pipeline_parallel_size=2`` only with its model warm-up on: with
``enforce_eager`` and an explicit KV cache size (``VLLM_CPU_KVCACHE_SPACE``) the CPU worker skips
the warm-up (``CPUWorker._should_warm_up_model``), the only place the later stage's buffer for the
previous stage's hidden states is allocated (``GPUModelRunner._dummy_run``), and the first request
fails on that stage (``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors``), which EngineCore reports as ``KeyError`` in
``Scheduler.update_from_output`` (docs/support.md quotes it; a test that kept it true cost an engine
start, the suite's budget did not have it).
The kvstrata engines run with ``compilation_config`` mode 1 (stock ``torch.compile``, eager
backend), which warms up: 2 engines, one after the other on one disk tier (cold, after vLLM's own
prefix cache is reset: L1; fresh: L2); outputs equal vLLM alone without pipeline parallelism.
Between them the later stage's part of one block of a third prompt is damaged on disk: the fresh
engine's hit stops before that block, which it recomputes (a stage's part is never served alone).
And the first engine ends with its last stage's worker killed during a save: frozen (SIGSTOP)
before a fourth prompt is sent, so the first stage runs the prompt and writes its layers while the
last stage cannot, then killed. The fresh engine serves nothing of that prompt.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from engines.launchers import BS, EngineFailed, StepEngine, delta, disk_config, gen, ids
from engines.test_vllm_tp import RankHarness

pytest.importorskip("vllm")

PP = 2
WARM = {"mode": 1, "backend": "eager"}  # torch.compile with the eager backend: vLLM warms the model up
PROMPT, OTHER, DAMAGED, KILLED = ids(91, 600), ids(92, 300), ids(95, 600), ids(96, 600)
LAYER_PAGE = BS * 2 * 2 * 64 * 2  # one layer's block: 2 KV heads, K and V of 64, bf16


def test_a_save_is_committed_when_every_stage_wrote_its_layers(model, tmp_path):
    """Scenario: vLLM's scheduler at TP=1 x PP=2, no model run. A save reported by one stage is not
    served (the other stage's layers may be missing); both stages' reports commit it; a failure
    on one stage drops it. A load keeps its pin until both stages have read their layers."""
    from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

    h = RankHarness(model, tmp_path, pp=PP)
    try:
        prompt = ids(93, 100)
        out, _ = h.save_waits_for_rank_1(prompt, missing="the second stage's layers")
        arena = out.kv_connector_metadata.arena
        assert arena.stage_bytes == (arena.rank_bytes // 2,) * 2 and arena.slot_bytes == arena.rank_bytes

        other = ids(94, 70)
        h.request(other)
        out = h.schedule()
        (failed,) = [op for op in out.kv_connector_metadata.saves if op.req_id == "r2"]
        h.report(out, [Meta(saved={0: {failed.op_id}}), Meta(failed={1: {failed.op_id}})])
        assert h.visible_tokens(other) == 0

        h.load_stays_pinned_until_rank_1_read(prompt)
    finally:
        h.scheduler.shutdown()


def stage_worker(engine: StepEngine, stage: int) -> int:
    """The pid of ``engine``'s worker process for pipeline stage ``stage`` (vLLM titles it
    ``VLLM::Worker_PP<stage>``), among the processes of the engine's session."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(entry)) == engine.proc.pid and \
                    f"Worker_PP{stage}".encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    assert len(found) == 1, (stage, found)
    return found[0]


def kill_last_stage_mid_save(engine: StepEngine, prompt: list[int]) -> str:
    """The last stage's worker is frozen, ``prompt`` is sent, the first stage runs it and writes
    its layers (3 s), then the frozen worker is killed. Returns how the request ended (it cannot
    succeed: its last stage never ran)."""
    worker = stage_worker(engine, PP - 1)
    os.kill(worker, signal.SIGSTOP)
    engine.send([gen(prompt)])
    time.sleep(3)
    os.kill(worker, signal.SIGKILL)
    try:
        return json.dumps(engine.receive(timeout=120))
    except EngineFailed as e:  # the step failed, or the engine exited
        return f"failed: {str(e)[:200]}"


@pytest.fixture(scope="module")
def pp_runs(model, baseline, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pp")
    cfg = disk_config(tmp)
    runs: dict = {"alone": baseline.many([PROMPT, OTHER]), "damaged_alone": baseline(DAMAGED),
                  "killed_alone": baseline(KILLED)}
    counters = {"op": "counters"}

    def files() -> set:
        return set((tmp / "l2" / "blocks").glob("*/*.kvb"))

    with StepEngine(model, tmp, cfg, name="pp", pp=PP, compilation=WARM) as first:
        runs["first"] = first.run([gen(PROMPT), gen(OTHER), counters, {"op": "reset"}, gen(PROMPT), counters])
        before = files()
        first.run([gen(DAMAGED)])
        deadline = time.monotonic() + 60  # the disk tier is written in the background
        while len(files() - before) < len(DAMAGED) // BS + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        runs["killed"] = kill_last_stage_mid_save(first, KILLED)
    # The later stage's layers of one full block of DAMAGED are damaged on disk (they end the
    # payload): the block fails its checksum, so a fresh engine's hit stops before it.
    victim = max(sorted(files() - before), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x5A
    victim.write_bytes(bytes(data))
    with StepEngine(model, tmp, cfg, name="pp-fresh", pp=PP, compilation=WARM) as second:
        runs["fresh"] = second.run([gen(PROMPT), gen(OTHER), counters, gen(DAMAGED), counters, gen(KILLED)])
    print("pp:", [r["cached"] for phase in ("first", "fresh") for r in runs[phase] if "cached" in r], runs["killed"][:120])
    return runs


@pytest.mark.timeout(600)
def test_pp2_stores_every_stages_layers_and_serves_them_from_cpu_memory(pp_runs):
    cold, cold_other, counted, _, again, served = pp_runs["first"]
    assert (cold["cached"], cold_other["cached"]) == (0, 0)
    assert [cold["tokens"], cold_other["tokens"]] == pp_runs["alone"]
    # A block holds all 4 layers: 2 written by each stage.
    assert counted["saved_blocks"] == len(PROMPT) // BS + 1 + len(OTHER) // BS + 1
    assert counted["l1_bytes_written"] == counted["saved_blocks"] * 4 * LAYER_PAGE
    assert again["cached"] == len(PROMPT) - 1 and again["tokens"] == pp_runs["alone"][0]
    assert delta(served, counted).get("hit_blocks_l1") == len(PROMPT) // BS + 1


@pytest.mark.timeout(600)
def test_fresh_pp2_engine_loads_both_stages_from_disk(pp_runs):
    prompt, other, counters, *_ = pp_runs["fresh"]
    assert prompt["cached"] == len(PROMPT) - 1 and other["cached"] == len(OTHER) - 1
    assert [prompt["tokens"], other["tokens"]] == pp_runs["alone"]
    assert counters["hit_blocks_l2"] == len(PROMPT) // BS + 1 + len(OTHER) // BS + 1


@pytest.mark.timeout(600)
def test_a_block_whose_later_stage_part_is_damaged_is_recomputed_and_the_hit_stops_before_it(pp_runs):
    _, _, counters, damaged, after, _ = pp_runs["fresh"]
    assert damaged["tokens"] == pp_runs["damaged_alone"]
    assert damaged["cached"] < len(DAMAGED) - 1 and damaged["cached"] % BS == 0, damaged["cached"]
    assert delta(after, counters).get("checksum_failures") == 1


@pytest.mark.timeout(600)
def test_a_stage_killed_during_a_save_leaves_nothing_half_committed_to_serve(pp_runs):
    assert pp_runs["killed"].startswith("failed"), pp_runs["killed"]  # killed mid-request, not after it
    after_restart = pp_runs["fresh"][-1]
    assert after_restart["cached"] == 0, after_restart["cached"]  # the first stage's part alone: not committed
    assert after_restart["tokens"] == pp_runs["killed_alone"]
