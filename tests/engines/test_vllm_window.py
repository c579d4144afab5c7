"""A model whose only KV cache group is a sliding window (the ``swa`` preset: a tiny Mistral with
``sliding_window=64`` and no full-attention layer), on real offline vLLM engines.

Scenario (found as a user would): after an invalidation, a prompt that vLLM's own cache still
serves was saved by kvstrata under the new epoch, and with one group kvstrata copied every position
of vLLM's block table, including vLLM's null block, which vLLM puts before the window on a prefix
hit: 5 of 9 saved blocks were all zeros, and a fresh engine loaded them and answered wrongly. Such
a model now goes through the per-group paths a hybrid does (no null block reaches a save; a load
brings the blocks the window reaches).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines.launchers import BS, StepEngine, disk_config, gen, ids, tiny_model
from kvstrata.format.block import HEADER_SIZE, unpack_header

pytestmark = pytest.mark.timeout(900)

PROMPT = ids(31, 400)  # 12 full blocks and a tail; the window is 2 blocks


def payloads(l2: Path) -> dict[bytes, bytes]:
    """Every block file under ``l2``: its payload, by key."""
    out = {}
    for path in (l2 / "blocks").glob("*/*.kvb"):
        raw = path.read_bytes()
        out[unpack_header(raw[:HEADER_SIZE]).key] = raw[HEADER_SIZE:]
    return out


def test_a_window_only_model_never_stores_vllms_null_block_and_a_fresh_engine_answers_as_vllm(tmp_path, baseline):
    model = tiny_model("swa")
    cfg = disk_config(tmp_path)
    l2 = tmp_path / "l2"
    with StepEngine(model, tmp_path, cfg, name="window") as first:
        assert first.run([{"op": "kv_groups"}])[0]["groups"] == [["SlidingWindowSpec", BS]]
        cold, = first.run([gen(PROMPT)])
        stored = set(payloads(l2))
        # An operator's invalidation (no weights changed): vLLM's own cache still holds the prompt.
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "invalidate", "--config", str(cfg), "--model", model],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        again, = first.run([gen(PROMPT)])
        assert again["cached"] >= len(PROMPT) // BS * BS - BS and again["tokens"] == cold["tokens"]
    after = payloads(l2)
    fresh = {k: v for k, v in after.items() if k not in stored}
    assert fresh, "the prompt served from vLLM's own cache stored nothing under the new epoch"
    assert not [k.hex() for k, v in fresh.items() if not any(v)], "vLLM's null block was stored as a block"

    with StepEngine(model, tmp_path, cfg, name="window-fresh") as second:
        loaded, = second.run([gen(PROMPT)])
    assert loaded["tokens"] == baseline(PROMPT, model=model)
    assert loaded["cached"] > 0  # the window's blocks before the boundary came from the disk tier
