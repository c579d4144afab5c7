"""``python -m benchmarks serve`` run as a user would: the command on vLLM with the tiny model (three
servers, a few seconds of requests); its JSON, its plot, that kvstrata hits, and that at
``verify.sample_rate`` 1.0 (``strata-verify-1``) its hits are verified with no mismatch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engines.launchers import run_command

# A benchmark starts engines one after the other (up to eight): slow on 2 shared cores.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "src" / "kvstrata" / "tools" / "data" / "conversation_sample.jsonl"


def test_bench_serve_on_vllm_reports_every_config_kvstrata_hits_and_verified_hits(model, tmp_path):
    pytest.importorskip("vllm")
    png = tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "benchmarks", "serve", "--engine", "vllm", "--model", model,
           "--trace", str(SAMPLE), "--sessions", "2", "--concurrency", "2", "--configs", "baseline,strata-l1l2,strata-verify-1",
           "--json", "--plot", str(png), "--work", str(tmp_path / "work"),
           # a device cache that holds one prompt, so the second conversation evicts the first
           "--max-prompt-tokens", "1024", "--device-tokens", "1536"]
    res = run_command(cmd, timeout=850, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("# python -m benchmarks serve") and "| config |" in res.stdout
    out = json.loads(lines[-1])
    rows = {r["config"]: r for r in out["results"]}
    assert set(rows) == {"baseline", "strata-l1l2", "strata-verify-1"}
    keys = {"config", "concurrency", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "throughput_req_s",
            "throughput_tok_s", "hit_rate", "tokens_per_tier", "errors"}
    for r in rows.values():
        assert keys <= set(r) and r["errors"] == 0 and r["concurrency"] == 2
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"] and r["throughput_req_s"] > 0
    strata = rows["strata-l1l2"]
    assert strata["hit_rate"] > 0 and strata["tokens_per_tier"].get("host", 0) > 0
    assert strata["hit_rate"] > rows["baseline"]["hit_rate"]
    assert 0 < out["simulate_unbounded_hit_rate"] < 1
    assert {t["target"] for t in out["targets"]} >= {"throughput vs baseline", "served fraction vs 0.9 x simulate"}
    # verified hits: none at rate 0; at 1.0 every hit kvstrata would serve is recomputed and compared
    assert strata["verify_sample_rate"] == 0 and strata["verify_checks"] == 0
    verified = rows["strata-verify-1"]
    assert verified["verify_sample_rate"] == 1.0 and verified["verify_checks"] > 0
    assert verified["verify_mismatches"] == 0 and verified["tokens_per_tier"].get("host", 0) == 0
    cost = {t["target"]: t for t in out["targets"] if t["config"] == "strata-verify-1"}
    assert cost["blocks verified"]["met"] and cost["verify mismatches"]["met"]
    assert cost["throughput vs strata-l1l2 (verify 0)"]["bound"] is None  # the cost, not a target
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "%|" in res.stderr  # the progress bar
