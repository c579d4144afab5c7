"""``kvstrata estimate``: the formulas on hand-computed examples, real input files, bad files, --measured."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvstrata.cli.main import main
from kvstrata.tools.estimate import EstimateError, Hits, Params, load_json, load_model_shape, predict

ROOT = Path(__file__).resolve().parents[2]

# Trimmed copies of real outputs on this kind of machine (field names as the commands print them).
STORE = {"quick": True, "memcpy_gbps": 7.261, "l1_put_gbps": 8.88, "l1_get_gbps": 7.451, "pwrite_gbps": 1.206,
         "pread_gbps": 7.172, "disk_put_gbps": 0.818, "disk_get_gbps": 5.579, "block_bytes": 262144,
         "by_block_size": {
             "256KiB": {"memcpy_gbps": 7.261, "l1_get_gbps": 7.451, "disk_get_gbps": 5.579},
             "1MiB": {"memcpy_gbps": 7.755, "l1_get_gbps": 6.539, "disk_get_gbps": 8.247},
             "4MiB": {"memcpy_gbps": 8.387, "l1_get_gbps": 8.265, "disk_get_gbps": 7.119}},
         "lookup_us_per_1k_blocks": 686.0, "engine_hash_us_per_1k_blocks": 2419.8}
REMOTE = {"url": "redis://127.0.0.1:41719/0", "block_bytes": 262144, "raw_redis_get_gbps": 0.341,
          "strata_redis_set_gbps": 0.714, "strata_redis_get_gbps": 0.352, "lookup_round_trips": 2}
SIMULATE = {"requests": 12031, "block_references": 288500, "hit_rate": 0.3664,
            "tiers": {"l1": {"capacity_blocks": 10922, "hit_rate": 0.2205, "bytes_served": 400205807616},
                      "l2": {"capacity_blocks": 174762, "hit_rate": 0.1459, "bytes_served": 264864006144}},
            "block_bytes": 6291456, "unbounded_hit_rate": 0.3664}
TTFT = {"cold_ms": 3755.0, "native_hit_ms": 286.0, "l1_hit_ms": 69.0, "l2_hit_ms": None,
        "details": {"prompt_tokens": 1500, "block_size": 128, "rounds": 5}}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "dtype": "bfloat16", "head_dim": 64, "hidden_size": 896,
             "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
             "num_key_value_heads": 2, "tie_word_embeddings": True, "vocab_size": 151936}


def write(tmp_path: Path, name: str, obj: object, prefix: str = "") -> str:
    path = tmp_path / name
    path.write_text(prefix + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    return str(path)


def estimate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    """Run the CLI with --json; returns the exit code, the parsed JSON (or {}) and stderr."""
    rc = main(["estimate", *argv, "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else {}, err


# -- formulas ------------------------------------------------------------------------------------

def test_no_hits_gives_gains_of_exactly_one():
    p = Params(prompt_tokens=4000, output_tokens=200, prefill_tok_s=800, overhead_s=0.05, decode_tok_s=30,
               kv_bytes_per_token=12288, bandwidth={"l1": 5e9})
    pred = predict(p, Hits())
    assert pred.ttft_gain == 1.0 and pred.throughput_gain == 1.0
    assert pred.ttft_s == pytest.approx(0.05 + 5.0)


def test_device_hits_alone_help_both_sides_equally():
    p = Params(prompt_tokens=1000, output_tokens=0, prefill_tok_s=100)
    pred = predict(p, Hits(device=0.6))
    assert pred.ttft_base_s == pytest.approx(4.0) and pred.ttft_gain == 1.0


def test_known_config_gives_hand_computed_numbers():
    # P 1000, R 500/s: compute (1 - .5 - .25) * 2 s = 0.5 s; L1 load .5*1000*1000 B / 1e9 = 0.5 ms;
    # L2 load .25*1e6 B * (1/0.5e9 + 1/1e9, staged) = 0.75 ms; lookup 10 blocks * 1 us; decode 100/50 = 2 s.
    p = Params(prompt_tokens=1000, output_tokens=100, prefill_tok_s=500, overhead_s=0.1, decode_tok_s=50,
               kv_bytes_per_token=1000, bandwidth={"l1": 1e9, "l2": 0.5e9}, lookup_s_per_block=1e-6,
               block_tokens=100)
    pred = predict(p, Hits(l1=0.5, l2=0.25))
    assert pred.compute_s == pytest.approx(0.5)
    assert pred.load_s == pytest.approx({"l1": 0.0005, "l2": 0.00075})
    assert pred.lookup_s == pytest.approx(1e-5)
    assert pred.ttft_base_s == pytest.approx(2.1)
    assert pred.ttft_s == pytest.approx(0.1 + 1e-5 + 0.5 + 0.00125)
    assert pred.work_base_s == pytest.approx(4.0)
    assert pred.work_s == pytest.approx(1e-5 + 0.5 + 0.00125 + 2.0)
    assert pred.ttft_gain == pytest.approx(2.1 / 0.60126)
    assert pred.throughput_gain == pytest.approx(4.0 / 2.50126)


def test_overlap_hides_loads_and_no_staging_skips_l1():
    p = Params(prompt_tokens=1000, output_tokens=0, prefill_tok_s=1000, kv_bytes_per_token=1e6,
               bandwidth={"l1": 1e9, "l2": 1e9})
    serial = predict(p, Hits(l2=0.5))
    assert serial.load_s["l2"] == pytest.approx(0.5 * 1e9 * 2e-9)  # disk read, then the copy out of L1
    assert serial.ttft_s == pytest.approx(0.5 + 1.0)
    direct = predict(replace(p, staging=False), Hits(l2=0.5))
    assert direct.ttft_s == pytest.approx(0.5 + 0.5)
    overlap = predict(replace(p, overlap=True), Hits(l2=0.5))
    assert overlap.ttft_s == pytest.approx(max(0.5, 1.0))
    assert overlap.work_s == pytest.approx(0.5)  # loads cost the server no compute time


def test_hits_above_one_and_missing_bandwidth_are_errors():
    p = Params(prompt_tokens=100, output_tokens=0, prefill_tok_s=100, kv_bytes_per_token=10, bandwidth={"l1": 1e9})
    with pytest.raises(EstimateError, match="add up to"):
        predict(p, Hits(device=0.5, l1=0.6))
    with pytest.raises(EstimateError, match="no l3 bandwidth.*--l3-gbps"):
        predict(p, Hits(l3=0.1))


# -- model shape ---------------------------------------------------------------------------------

def test_qwen2_shape_gives_kv_bytes_params_and_flops(tmp_path):
    shape = load_model_shape(write(tmp_path, "config.json", QWEN2_05B))
    assert shape.kv_bytes_per_token == 2 * 24 * 2 * 64 * 2 == 12288
    attn = 896 * 14 * 64 * 2 + 896 * 2 * 64 * 2
    assert shape.params_nonembed == 24 * (attn + 3 * 896 * 4864)
    assert shape.params_nonembed + shape.params_embed == 493_961_216  # Qwen2-0.5B without biases
    assert shape.flops_per_token(1000) == 2 * shape.params_nonembed + 24 * 14 * 128 * 1000


def test_model_folder_mla_and_kv_dtype(tmp_path):
    (tmp_path / "m").mkdir()
    write(tmp_path / "m", "config.json", QWEN2_05B)
    assert load_model_shape(str(tmp_path / "m"), kv_dtype="fp8").kv_bytes_per_token == 6144
    mla = {"hidden_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 8, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 1000,
           "torch_dtype": "bfloat16"}
    assert load_model_shape(write(tmp_path, "mla.json", mla)).kv_bytes_per_token == 3 * (512 + 64) * 2


@pytest.fixture(scope="session")
def small_model_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The config.json of examples/make_tiny_model.py's ``small`` preset (Qwen2-0.5B's shape), saved
    by the preset's own transformers config class; the estimate reads no weights, so none are built."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    preset = make.PRESETS["small"]
    out = tmp_path_factory.mktemp("small")
    preset.config_cls(**{**make.SHAPE, **preset.shape}).save_pretrained(out)
    return out / "config.json"


def test_small_preset_model_config(small_model_config):
    assert load_model_shape(str(small_model_config)).kv_bytes_per_token == 12288


# -- real input files ----------------------------------------------------------------------------

def test_real_outputs_give_every_input_with_its_source(tmp_path, capsys):
    files = {"model": write(tmp_path, "config.json", QWEN2_05B), "ttft": write(tmp_path, "ttft.json", TTFT),
             "store": write(tmp_path, "store.json", STORE, prefix="  block size 256KiB ...\n"),
             "remote": write(tmp_path, "remote.json", REMOTE), "sim": write(tmp_path, "sim.json", SIMULATE)}
    rc, out, _ = estimate(capsys, "--model-config", files["model"], "--ttft-json", files["ttft"],
                          "--store-json", files["store"], "--remote-json", files["remote"],
                          "--simulate-json", files["sim"])
    assert rc == 0
    inputs = {k: v["value"] for k, v in out["inputs"].items()}
    assert inputs["prompt_tokens"] == 1500 and inputs["block_tokens"] == 128
    assert inputs["overhead_ms"] == 69.0  # the fastest full hit
    assert inputs["prefill_tok_s"] == pytest.approx(1500 / 3.686, rel=1e-5)
    # a 128-token block of 12288 B/token is 1.5 MiB: the 1MiB column is the nearest
    assert inputs["l1_gbps"] == 6.539 and inputs["l2_gbps"] == 8.247 and inputs["l3_gbps"] == 0.352
    assert "by_block_size.1MiB.disk_get_gbps" in out["inputs"]["l2_gbps"]["source"]
    assert inputs["hit_l1"] == 0.2205 and out["inputs"]["hit_l1"]["source"].endswith("tiers.l1.hit_rate")
    compute_ms = (1 - 0.2205 - 0.1459) * 3686
    load_ms = 1500 * 12288 * (0.2205 / 6.539e6 + 0.1459 * (1 / 8.247e6 + 1 / 6.539e6))
    ttft_ms = 69 + 12 * 0.686e-3 + compute_ms + load_ms
    assert out["prediction"]["ttft_ms"] == pytest.approx(ttft_ms, rel=1e-3)
    assert out["prediction"]["ttft_gain"] == pytest.approx(3755 / ttft_ms, rel=1e-3)
    assert any("decode not modeled" in n for n in out["notes"])


def test_peak_tflops_gives_a_prefill_rate(tmp_path, capsys):
    model = write(tmp_path, "config.json", QWEN2_05B)
    rc, out, _ = estimate(capsys, "--model-config", model, "--peak-tflops", "100", "--prompt-tokens", "1000",
                          "--hit-l1", "0.5", "--l1-gbps", "10")
    assert rc == 0
    flops = 2 * 357_826_560 + 24 * 14 * 128 * 1000
    assert out["inputs"]["prefill_tok_s"]["value"] == pytest.approx(100e12 * 0.4 / flops, rel=1e-5)
    assert "default --mfu 0.4" in out["inputs"]["prefill_tok_s"]["source"]


def test_text_output_shows_formulas_and_sources(tmp_path, capsys):
    assert main(["estimate", "--prefill-tok-s", "500", "--prompt-tokens", "1000", "--kv-bytes-per-token", "1000",
                 "--hit-l1", "0.5", "--l1-gbps", "2"]) == 0
    out = capsys.readouterr().out
    assert "T_compute = (1 - h_dev - h_l1 - h_l2 - h_l3) * P / R" in out
    assert "--prefill-tok-s" in out and "gain 2x" in out  # 2 s / (1 s + 0.25 ms)


# -- bad input files -----------------------------------------------------------------------------

@pytest.mark.parametrize("flag,name,content,message", [
    ("--simulate-json", "sim.json", {"tiers": {"l1": {"hit_rate": "lots"}}},
     "sim.json: key 'tiers.l1.hit_rate': expected a number in [0, 1], found 'lots'"),
    ("--simulate-json", "sim.json", {"tiers": {"l1": {"hit_rate": 1.5}}}, "found 1.5"),
    ("--simulate-json", "sim.json", {"hit_rate": 0.3}, "sim.json: key 'tiers' is missing"),
    ("--store-json", "store.json", {"by_block_size": {"1MiB": {"l1_get_gbps": 5, "disk_get_gbps": 0}}},
     "store.json: key 'by_block_size.1MiB.disk_get_gbps': expected a number above 0, found 0"),
    ("--store-json", "store.json", {"by_block_size": {"1MiB": {"l1_get_gbps": 5}}},
     "store.json: key 'by_block_size.1MiB.disk_get_gbps' is missing"),
    ("--remote-json", "remote.json", "not json at all", "remote.json: no line is a JSON object"),
    ("--measured", "serve.json", {"rows": []}, "serve.json: key 'results' is missing or not a list"),
    ("--model-config", "config.json", {"hidden_size": 64, "num_attention_heads": 2},
     "config.json: key 'num_hidden_layers' is missing"),
    ("--model-config", "config.json", {**QWEN2_05B, "dtype": "int3"}, "unknown dtype 'int3'"),
])
def test_bad_files_name_the_file_key_and_value(tmp_path, capsys, flag, name, content, message):
    path = write(tmp_path, name, content)
    rc, _, err = estimate(capsys, "--prefill-tok-s", "100", "--prompt-tokens", "100", "--hit-l1", "0.1",
                          "--l1-gbps", "1", "--kv-bytes-per-token", "10", flag, path)
    assert rc == 2
    assert message in err and path.rsplit("/", 1)[0] in err


def test_missing_file_and_missing_inputs_exit_2(tmp_path, capsys):
    rc, _, err = estimate(capsys, "--ttft-json", str(tmp_path / "nope.json"))
    assert rc == 2 and "nope.json: cannot read" in err
    rc, _, err = estimate(capsys, "--prompt-tokens", "100")
    assert rc == 2 and "prefill rate is unknown" in err
    rc, _, err = estimate(capsys, "--prefill-tok-s", "100", "--prompt-tokens", "100", "--hit-l1", "1.2")
    assert rc == 2 and "--hit-l1: expected a fraction in [0, 1], found 1.2" in err
    rc, _, err = estimate(capsys, "--prefill-tok-s", "100", "--prompt-tokens", "100", "--hit-l2", "0.2")
    assert rc == 2 and "no l2 bandwidth" in err


# -- --measured ----------------------------------------------------------------------------------

def serve_output(results: list[dict]) -> str:
    last = {"workload": {"mean_prompt_tokens": 1000, "mean_output_tokens": 0, "block_tokens": 100}, "results": results}
    return "progress: 64 requests ...\n" + json.dumps({"results": []}) + "\n" + json.dumps(last)


def test_measured_comparison_gives_relative_errors(tmp_path, capsys):
    measured = write(tmp_path, "serve.json", serve_output([
        {"config": "baseline", "concurrency": 8, "ttft_p50_ms": 1100.0, "throughput_req_s": 1.0, "hit_rate": 0.0,
         "tokens_per_tier": {}, "errors": 0},
        {"config": "strata", "concurrency": 8, "ttft_p50_ms": 600.0, "throughput_req_s": 1.8, "hit_rate": 0.5,
         "tokens_per_tier": {"device": 100, "host": 300, "disk": 100, "computed": 500}, "errors": 0},
        {"config": "strata-broken", "concurrency": 8, "errors": 3},
    ]))
    rc, out, _ = estimate(capsys, "--prefill-tok-s", "1000", "--overhead-ms", "100", "--kv-bytes-per-token", "1000",
                          "--l1-gbps", "1", "--l2-gbps", "1", "--measured", measured)
    assert rc == 0
    assert out["inputs"]["prompt_tokens"]["source"].endswith("serve.json workload.mean_prompt_tokens")
    base, strata, broken = out["comparison"]
    assert base["ttft_p50_ms"] == {"measured": 1100.0, "predicted": 1100.0, "error": 0.0}
    assert strata["hits"] == {"device": 0.1, "l1": 0.3, "l2": 0.1, "l3": 0.0}
    # compute 0.5 s; loads 0.3 MB / 1 GB/s + 0.1 MB * 2 / 1 GB/s (staged) = 0.5 ms
    ttft = 100 + 500 + 0.5
    assert strata["ttft_p50_ms"]["predicted"] == pytest.approx(ttft, rel=1e-4)
    assert strata["ttft_p50_ms"]["error"] == pytest.approx((ttft - 600) / 600, abs=1e-3)
    assert strata["ttft_gain"]["measured"] == pytest.approx(1100 / 600, rel=1e-3)
    assert strata["ttft_gain"]["predicted"] == pytest.approx(1100 / ttft, rel=1e-3)
    assert strata["throughput_gain"]["predicted"] == pytest.approx(1.0 / 0.5005, rel=1e-3)
    assert strata["throughput_gain"]["error"] == pytest.approx((1 / 0.5005 - 1.8) / 1.8, abs=1e-3)
    assert broken["ttft_p50_ms"]["measured"] is None and broken["ttft_p50_ms"]["error"] is None
    assert broken["hits_source"].startswith("inputs")


def test_measured_baseline_calibrates_decode_and_device_hits(tmp_path, capsys):
    measured = write(tmp_path, "serve.json", serve_output([
        {"config": "baseline", "concurrency": 4, "throughput_req_s": 0.25, "hit_rate": 0.2},
    ]).replace('"mean_output_tokens": 0', '"mean_output_tokens": 100'))
    rc, out, _ = estimate(capsys, "--prefill-tok-s", "1000", "--measured", measured)
    assert rc == 0
    assert out["inputs"]["hit_device"]["value"] == 0.2
    # 1/0.25 = 4 s per request, of which 0.8 s is prefill: decode 100 tokens in 3.2 s
    assert out["inputs"]["decode_tok_s"]["value"] == pytest.approx(100 / 3.2)
    assert out["comparison"][0]["throughput_req_s"]["error"] == pytest.approx(0, abs=1e-3)
    text_rc = main(["estimate", "--prefill-tok-s", "1000", "--measured", measured])
    text = capsys.readouterr().out
    assert text_rc == 0 and "calibrated" in text and "n/a" in text


def test_last_json_line_wins(tmp_path):
    path = write(tmp_path, "x.json", '{"a": 1}\n{"a": 2}\nnoise')
    assert load_json(path) == {"a": 2}


def test_bench_serve_summary_format(tmp_path, capsys):
    """Scenario: the summary line ``bench serve --json`` prints (totals, vLLM's sources, strata-remote)."""
    def result(config: str, ttft: float, req_s: float, tiers: dict) -> dict:
        return {"config": config, "concurrency": 4, "ttft_p50_ms": ttft, "ttft_p90_ms": ttft * 2, "ttft_p99_ms": None,
                "e2e_p50_ms": ttft * 3, "throughput_req_s": req_s, "throughput_tok_s": req_s * 20,
                "hit_rate": sum(tiers.values()) / 40_000, "tokens_per_tier": tiers, "errors": 0, "requests": 40,
                "prompt_tokens": 40_000, "cached_tokens": sum(tiers.values()), "wall_s": 40 / req_s}
    summary = {"results": [result("baseline", 2000, 0.5, {"device": 4000}),
                           result("strata-l1l2", 1000, 0.9, {"device": 4000, "host": 12000, "disk": 4000}),
                           result("strata-remote", 1100, 0.8, {"device": 4000, "disk": 16000})],
               "targets": [], "simulate_unbounded_hit_rate": 0.5,
               "settings": {"engine": "vllm", "requests": 40, "block_tokens": 64, "prompt_tokens": 40_000,
                            "max_output_tokens": 32}}
    measured = write(tmp_path, "serve.json", json.dumps(summary), prefix="| config | ... |\n")
    rc, out, _ = estimate(capsys, "--prefill-tok-s", "1000", "--kv-bytes-per-token", "1000", "--l1-gbps", "1",
                          "--l2-gbps", "1", "--l3-gbps", "0.5", "--measured", measured)
    assert rc == 0
    inputs = out["inputs"]
    assert inputs["prompt_tokens"]["value"] == 1000  # a total over requests, not a mean
    assert "settings.prompt_tokens / settings.requests" in inputs["prompt_tokens"]["source"]
    assert inputs["output_tokens"]["value"] == 20 and inputs["block_tokens"]["value"] == 64
    assert inputs["hit_device"]["value"] == 0.1
    base, l1l2, remote = out["comparison"]
    assert l1l2["hits"] == {"device": 0.1, "l1": 0.3, "l2": 0.1, "l3": 0.0}
    assert remote["hits"] == {"device": 0.1, "l1": 0.0, "l2": 0.0, "l3": 0.4}
    assert "counted as L3" in remote["hits_source"]
    assert remote["throughput_gain"]["measured"] == pytest.approx(1.6)
