"""StrataConnector with tensor parallelism: two ranks, each copying its own shard of every block.

- The scheduler's accounting of the ranks' reports, on vLLM's real Scheduler and its real
  KVOutputAggregator (the object that merges the ranks' worker metadata of a step), in-process,
  with no model run: a save is visible only after every rank has copied its shard, a failure on
  one rank aborts it, and a load keeps its pin until every rank has copied the blocks out.
- The real engine at ``tensor_parallel_size=2`` on CPU (``StepEngine(tp=2)``; one worker
  process per rank, one core each): greedy outputs equal vLLM alone, cold, after vLLM's own
  prefix cache is reset (L1 hit) and in a fresh engine on the same disk (L2 hit). vLLM alone is the
  session's ``baseline`` (TP=1, no engine start where another test computed it): on the tiny
  model TP=2 without kvstrata gives the same greedy tokens for these prompts (checked when this
  changed; a TP=2 engine without kvstrata cost a start).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engines.launchers import BS, FORK_A, FORK_B, LONG, SHARED, StepEngine, disk_config

pytest.importorskip("vllm")

TP = 2
PROMPTS = [LONG, FORK_A, FORK_B]  # one batch: the forks share 9 full blocks


# ------------------------------------------------------------------ scheduler-side accounting
class RankHarness:
    """vLLM's Scheduler with kvstrata as its connector, configured for TP=2, driven step by step:
    ``schedule()`` plans the copies, ``report(out, per_rank_meta)`` feeds back what each rank's
    worker reported, merged by vLLM's own KVOutputAggregator as the multiprocess executor does."""

    def __init__(self, model_dir: str, tmp: Path, spec=None, replicas: int = 1, pp: int = 1) -> None:  # noqa: ANN001
        """``spec``: the KV cache spec of the model's one group (default: 1 KV head of 64, bf16);
        ``replicas``: vLLM's ``kv_tp_replicas`` (TP ranks holding identical KV: ``TP`` for MLA);
        ``pp``: pipeline stages (the 2 ranks are then TP=1 x PP=2; the scheduler sees the first
        stage's layers, as vLLM gives it)."""
        import torch
        from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                 SchedulerConfig, VllmConfig)
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        cfg = tmp / "kvstrata.yaml"
        cfg.write_text("l1:\n  size: 8MiB\nl2:\n  enabled: false\n")
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, max_model_len=1024, enforce_eager=True, seed=0),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
            parallel_config=ParallelConfig(tensor_parallel_size=TP // pp, pipeline_parallel_size=pp),
            scheduler_config=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=1024,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(
                kv_connector="StrataConnector", kv_role="kv_both", kv_connector_module_path="kvstrata.adapters.vllm",
                kv_connector_extra_config={"config_file": str(cfg)}))
        vllm_config.cache_config.num_gpu_blocks = 64
        spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(4 // pp)]
        kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        kv_cache_config.kv_tp_replicas = replicas
        self.scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(vllm_config), block_size=BS)
        self.side = self.scheduler.connector._sched
        self.store = self.side.store
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, TP)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BS, sha256)
        self._n = 0

    def request(self, prompt: list[int], max_tokens: int = 1):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._n += 1
        req = Request(f"r{self._n}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0), None,
                      block_hasher=self._hasher)
        self.scheduler.add_request(req)
        return req

    def schedule(self):
        return self.scheduler.schedule()

    def report(self, out, metas: list) -> None:
        """Finish the step ``out``: every scheduled request samples token 7; rank r's worker
        metadata is ``metas[r]``."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        ids = list(out.num_scheduled_tokens)
        per_rank = [ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                      sampled_token_ids=[[7] for _ in ids],
                                      kv_connector_output=KVConnectorOutput(kv_connector_worker_meta=m))
                    for m in metas]
        self.scheduler.update_from_output(out, self.aggregator.aggregate(per_rank))

    def visible_tokens(self, prompt: list[int]) -> int:
        return self.store.lookup(self.side.ns, prompt).num_tokens

    def save_waits_for_rank_1(self, prompt: list[int], max_tokens: int = 1, missing: str = "") -> tuple[Any, Any]:
        """Request ``prompt``: its save, reported by rank 0 alone, is not served (``missing`` says
        what rank 1 holds); once rank 1 (the other TP rank or pipeline stage) reports it too, the
        whole prompt is. The step's scheduler output and the save op."""
        from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

        self.request(prompt, max_tokens=max_tokens)
        out = self.schedule()
        (save,) = out.kv_connector_metadata.saves
        self.report(out, [Meta(saved={0: {save.op_id}}), None])
        assert self.visible_tokens(prompt) == 0, f"committed with {missing} still missing"
        self.report(self.schedule(), [None, Meta(saved={1: {save.op_id}})])
        assert self.visible_tokens(prompt) == len(prompt)
        return out, save

    def load_stays_pinned_until_rank_1_read(self, prompt: list[int]) -> Any:
        """Request ``prompt`` again after vLLM forgot it (``reset_prefix_cache``): its load from L1
        keeps the blocks pinned once rank 0 reports it read, and unpins them only once rank 1 (the
        other TP rank or pipeline stage, which may still be reading the slots) has too. The load op."""
        from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

        assert self.scheduler.reset_prefix_cache()  # the engine forgets; kvstrata has it in L1
        self.request(prompt)  # finishes in its first step (max_tokens=1)
        out = self.schedule()
        (load,) = out.kv_connector_metadata.loads
        assert list(out.num_scheduled_tokens.values()) == [1]  # all but the last token come from L1
        assert all(self.pinned(prompt))
        # The request finishes in this very step, before the connector sees the reports; rank 1 has
        # not reported the load yet, so its slots must stay pinned (not reusable by another block).
        self.report(out, [Meta(loaded={0: {load.op_id}}), None])
        assert all(self.pinned(prompt))
        self.report(self.schedule(), [None, Meta(loaded={1: {load.op_id}})])
        assert not any(self.pinned(prompt))
        return load

    def pinned(self, prompt: list[int]) -> list[bool]:
        """Per stored block of ``prompt``: is its index row pinned?"""
        keys = self.store.lookup(self.side.ns, prompt).chain.keys
        idx = self.store.index
        with idx._lock:  # the index's own view: dropped leases released first, as its calls do
            idx._reap()
            return [bool(idx._pins[int(row)]) for row in idx.rows_of(keys)]


@pytest.fixture
def harness(model, tmp_path):
    h = RankHarness(model, tmp_path)
    yield h
    h.scheduler.shutdown()


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def test_save_commits_only_when_every_rank_acked(harness):
    from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

    prompt = _ids(11, 100)  # 3 full blocks and a 4-token tail, saved in the prompt's step
    _, save = harness.save_waits_for_rank_1(prompt, max_tokens=3, missing="rank 1's shard")
    assert len(save.slots) == 4

    # One rank failed, the other copied its shard: the block is never served, its slots go back.
    other = _ids(12, 70)
    harness.request(other)
    out = harness.schedule()
    (save,) = [op for op in out.kv_connector_metadata.saves if op.req_id != "r1"]
    harness.report(out, [Meta(failed={0: {save.op_id}}), Meta(saved={1: {save.op_id}})])
    assert harness.visible_tokens(other) == 0
    # Not committed, so the same prompt is saved again (as a whole) and commits on both acks.
    harness.request(other)
    out = harness.schedule()
    (again,) = [op for op in out.kv_connector_metadata.saves if op.req_id == "r3"]
    assert len(again.slots) == len(save.slots)
    harness.report(out, [Meta(saved={0: {again.op_id}}), Meta(saved={1: {again.op_id}})])
    assert harness.visible_tokens(other) == len(other)


def test_load_keeps_its_pin_until_every_rank_copied_the_blocks_out(harness):
    from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

    prompt = _ids(21, 100)
    harness.request(prompt)
    out = harness.schedule()
    (save,) = out.kv_connector_metadata.saves
    harness.report(out, [Meta(saved={r: {save.op_id}}) for r in range(TP)])
    load = harness.load_stays_pinned_until_rank_1_read(prompt)
    assert len(load.slots) == 4  # all four blocks, the tail included


def test_a_lookup_that_is_not_scheduled_gives_its_pin_back(harness):
    """Scenario: a request is looked up twice (vLLM asks again each step while it cannot be
    scheduled), then aborted: neither lookup may leave its pin behind."""
    from kvstrata.adapters.vllm import StrataWorkerMetadata as Meta

    prompt = _ids(31, 100)
    harness.request(prompt)
    out = harness.schedule()
    (save,) = out.kv_connector_metadata.saves
    harness.report(out, [Meta(saved={r: {save.op_id}}) for r in range(TP)])
    req = harness.request(prompt)
    connector = harness.scheduler.connector
    assert connector.get_num_new_matched_tokens(req, 0) == (len(prompt) - 1, False)
    assert connector.get_num_new_matched_tokens(req, 0) == (len(prompt) - 1, False)
    assert all(harness.pinned(prompt))
    connector.request_finished(req, [])
    assert not any(harness.pinned(prompt))


# ------------------------------------------------------------------ the real engine, TP=2
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": 8}


@pytest.fixture(scope="module")
def tp_runs(model, baseline, tmp_path_factory) -> dict[str, list[dict]]:
    """Two TP=2 engines, each given the same batch of prompts: kvstrata cold, then again after
    vLLM's own prefix cache reset (L1); a fresh kvstrata engine on the first one's disk folder
    (L2). Beside them vLLM alone (``baseline``)."""
    tmp = tmp_path_factory.mktemp("tp2")
    cfg = disk_config(tmp)
    arenas = {"op": "arenas", "children": False}  # the arena file is this process's (the scheduler's)

    def engine(name: str, config: Path | None) -> StepEngine:
        return StepEngine(model, tmp, config, name=name, tp=TP, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})

    with engine("tp-first", cfg) as first:
        runs = {"baseline": [{"tokens": baseline.many(PROMPTS)}],  # while the engine starts
                "first": first.run([arenas, GEN, arenas, {"op": "counters"}, {"op": "reset"}, GEN,
                                    {"op": "counters"}])}
    with engine("tp-second", cfg) as second:
        runs["second"] = second.run([GEN, {"op": "counters"}])
    return runs


@pytest.mark.timeout(1500)  # the first one starts two TP=2 engines (module fixture)
def test_tp2_cold_run_stores_every_block_and_matches_no_connector(tp_runs):
    before, cold, after, counters = tp_runs["first"][:4]
    assert cold["tokens"] == tp_runs["baseline"][0]["tokens"]
    # FORK_B reuses FORK_A's blocks of the same step through vLLM's own prefix cache; kvstrata
    # has committed nothing yet when the batch is looked up.
    assert cold["cached"] == [0, 0, (len(SHARED) // BS) * BS]
    assert counters.get("served_tokens", 0) == 0 and counters["saved_blocks"] > 0
    # Both ranks mapped the arena (each reports its rank), so the file is gone from /dev/shm.
    assert len(before["names"]) == 1 and after["names"] == []


@pytest.mark.timeout(1500)  # the first one starts two TP=2 engines (module fixture)
def test_tp2_l1_hit_after_prefix_cache_reset_matches_no_connector(tp_runs):
    _, _, _, cold_counters, reset, hit, counters = tp_runs["first"]
    assert reset["ok"] is True
    assert hit["tokens"] == tp_runs["baseline"][0]["tokens"]
    assert hit["cached"] == [len(p) - 1 for p in PROMPTS]
    # LONG and FORK_A come from kvstrata whole; FORK_B may take its shared blocks from FORK_A's
    # blocks of the same step (vLLM's own cache) and the rest from kvstrata.
    loaded = counters["served_tokens"] - cold_counters.get("served_tokens", 0)
    assert len(LONG) - 1 + len(FORK_A) - 1 < loaded <= sum(len(p) - 1 for p in PROMPTS)


@pytest.mark.timeout(1500)  # the first one starts two TP=2 engines (module fixture)
def test_tp2_l2_hit_in_a_fresh_engine_matches_no_connector(tp_runs):
    hit, counters = tp_runs["second"]
    assert hit["tokens"] == tp_runs["baseline"][0]["tokens"]
    assert hit["cached"] == [len(p) - 1 for p in PROMPTS]
    assert counters["served_tokens"] > len(LONG) - 1 + len(FORK_A) - 1
    # Every distinct block and prompt tail was committed by the first engine (both ranks' shards,
    # or the outputs would differ) and is read from disk once here.
    distinct = {tuple(p[: (i + 1) * BS]) for p in PROMPTS for i in range(len(p) // BS)}
    assert counters["hit_blocks_l2"] == len(distinct) + len(PROMPTS)
