"""``python -m benchmarks ttft --engine vllm`` run as a user would, on the tiny model: the benchmark
starts its own engine processes (cold, kvstrata L1, kvstrata L2 and the shared Redis tier in fresh
processes, a private redis-server for the latter), and its JSON must show a real hit from each with
the cold run's greedy outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engines.launchers import run_command

pytest.importorskip("vllm")

# A benchmark starts engines one after the other (up to eight): slow on 2 shared cores.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ttft_vllm_loads_all_but_the_last_token_with_the_cold_output(model):
    res = run_command([sys.executable, "-m", "benchmarks", "ttft", "--engine", "vllm",
                      "--model", model, "--configs", "cold,l1,l2,l3", "--rounds", "1",
                      "--prompt-tokens", "500", "--json"],
                      cwd=ROOT, timeout=850)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert not out["details"]["errors"], out["details"]["errors"]
    for field in ("cold_ms", "l1_hit_ms", "l2_hit_ms", "l3_hit_ms", "cold_over_l1", "l2_over_l1", "l3_over_l1",
                  "l1_first_over_median", "l2_p90_over_p50", "l3_first_over_median"):
        assert out[field] and out[field] > 0, field
    assert out["details"]["first_ms"]["l1"] == out["details"]["samples_ms"]["l1"][0]
    assert out["hit_fraction"] == pytest.approx(499 / 500)  # the partial tail too; the last token is computed
    assert out["details"]["cached_tokens"]["l2"] == [499]  # from disk, in a fresh engine process
    assert out["details"]["cached_tokens"]["l3"] == [499]  # from Redis, L1 and L2 empty
    assert out["outputs_identical"] is True, out["details"]["outputs"]
    # Bytes stored per prompt token: the model's K and V (fp32) per layer, plus 128-byte headers
    # and the slack of a partial tail: never twice the KV (as a copy per rank or a stray group would be).
    cfg = json.loads((Path(model) / "config.json").read_text())
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    assert 0.95 * kv <= out["stored_bytes_per_token"] < 1.3 * kv, (out["stored_bytes_per_token"], kv)
