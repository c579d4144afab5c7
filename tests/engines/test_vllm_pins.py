"""A load's pin through the real vLLM engine: the blocks a worker copies out
of its L1 slots are the blocks the scheduler pinned, however long the copy takes.

The copy is made slow by the test-only trial ``load_delay_s`` (tests/harness/trials.py, planted
into the engine's process), far past a tiny ``lease_seconds``. On this engine (one process,
steps in order) the one writer of L1 slots that runs during a worker's copy is a background
staging job (a disk hit larger than ``l1.stage_inline_bytes``): it is what would refill the
slots of a pin that ran out. ``tests/index/test_pins.py`` has the same rule at the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.launchers import BS, delta, gen, ids

pytest.importorskip("vllm")

DELAY_S = 1.5  # each step with loads: the worker sleeps this long before copying
C = ids(701, 7 * BS + 16)  # 7 full blocks and a 16-token tail: 8 L1 slots
A = ids(702, 4 * BS + 16)  # 4 full blocks and a tail: 5 L1 slots


def slot_bytes(model: str) -> int:
    """Bytes of one vLLM block of ``model`` (every layer's K and V; bf16), one L1 slot."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16", "slot_bytes assumes 2-byte KV"
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * BS * 2 * head * 2


def test_a_load_slower_than_the_lease_copies_the_blocks_own_bytes(vllm_engine, model, baseline, tmp_path):
    """Scenario: L1 holds 8 slots, lease_seconds is 1 us (a lease runs out before the index's next
    call, whatever the timing), every disk hit is staged in the background, and each worker
    sleeps 1.5 s before a load's copy. C (8 slots) is generated,
    then A (5 slots), which pushes C's last 5 blocks out of L1 (they stay on L2). After a reset
    of vLLM's own cache, A and C come in one batch: A's hit is pinned in L1 and its load op
    sent; C's 5 disk blocks are staged on a save thread while the worker sleeps, and L1 has no
    free slot: only A's (pinned) and C's first 3 (pinned by the staging). A's pin must hold
    until the worker has copied, so the staging finds L1 full (``l1_full``) and both outputs
    equal vLLM alone. With a pin that ran out after the lease, the staging refilled A's slots
    with C's blocks and the worker copied those into A's KV cache."""
    cfg = tmp_path / "pins.yaml"
    cfg.write_text(f"l1:\n  size: {8 * slot_bytes(model)}\n  stage_inline_bytes: 0\n"
                   f"l2:\n  path: {tmp_path / 'l2'}\nlease_seconds: 0.000001\n")
    engine = vllm_engine(cfg, trials={"load_delay_s": DELAY_S})
    want_a, want_c = baseline.many([A, C])
    cold_c, cold_a, before, _, batch, after = engine.run(
        [gen(C), gen(A), {"op": "counters"}, {"op": "reset"}, {"op": "generate", "prompts": [A, C]},
         {"op": "counters"}])
    assert cold_c["tokens"] == want_c and cold_a["tokens"] == want_a
    assert batch["cached"][0] == len(A) - 1, "A's hit was not served from L1 whole"
    assert batch["tokens"] == [want_a, want_c], "a load copied other blocks' bytes into the KV cache"
    counted = delta(after, before)
    assert counted.get("l1_full", 0) > 0, f"the staging never needed A's slots: no reuse pressure ({counted})"
