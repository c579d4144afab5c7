"""``kvstrata bench verify --quick`` run as an operator would, on the tiny model in float32: its two
engines (the prompts alone, then batched with others in chunks of two blocks) store and read back
real blocks, and the float32 tolerance of verified hits (``kvstrata.verify.compare.TOLERANCES``)
passes every honest recomputation and fails every block of another prompt, of other weights and
of another layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from engines.launchers import run_command
from kvstrata.verify.compare import TOLERANCES

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_verify_float32_tolerance_separates_honest_recomputations_from_everything_else(model):
    res = run_command([sys.executable, "-m", "kvstrata.cli.main", "bench", "verify", "--model", model,
                       "--quick", "--dtype", "float32", "--json"], cwd=ROOT, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    fig = out["dtypes"]["float32"]
    assert fig["kv_dtype"] == "float32" and fig["layers"] == 4
    tol = TOLERANCES[torch.float32]
    assert fig["tolerance"] == tol
    rows = fig["classes"]
    assert set(rows) == {"honest", "other prompt", "other weights", "other layer"}
    for name, row in rows.items():
        assert row["blocks"]["count"] == out["prompts"] * out["blocks_per_prompt"] > 0, name
        assert row["segments"]["count"] > 0, name
    assert rows["honest"]["blocks"]["max"] <= tol, rows["honest"]
    for name in ("other prompt", "other weights", "other layer"):
        assert rows[name]["blocks"]["min"] > tol, (name, rows[name])
        assert rows[name]["segments"]["min"] > tol, (name, rows[name])  # every layer of it, not just the worst
    assert fig["separates"] and fig["separates_segments"]
    assert fig["margin"] is None or fig["margin"] > 10  # None: no honest error at all
