"""SGLang 0.5.23 on CPU with HiCache and StrataStorage: pipeline parallelism, MLA and speculative
decoding.

- Pipeline parallelism (``--pp-size 2``, the tiny Llama) runs, with one CPU per stage
  (``SGLANG_CPU_OMP_THREADS_BIND=0|1``: without it SGLang refuses more ranks than NUMA nodes).
  Each stage's scheduler has a host pool and a StrataStorage of its own over its own 2 of the 4
  layers (the stage is part of the namespace), so every page is stored once per stage; SGLang
  takes the MIN of the stages' storage hits (``cache_controller._sync_prefetch_hit_query``), so a
  hit covers every stage. A prompt comes back from storage after ``/flush_cache`` with the cold
  run's output (SGLang's ``file`` backend does the same, 592 of 600 tokens); a prompt whose later
  stage's pages are deleted from kvstrata's disk tier is not served from storage at all.
- MLA (the ``mla`` preset, a DeepSeek-V2): SGLang's CPU rotary embedding takes DeepSeek's YaRN
  scaling only, so the preset (default RoPE) fails while the model is built (a bare
  ``assert rope_scaling is not None`` in ``get_rope_cpu``). With the keys DeepSeek-V2's own
  config.json carries (YaRN of factor 1, ``moe_layer_freq``, ``scoring_func``) the model loads
  and StrataStorage attaches to SGLang's MLA host pool (one 576-value latent per token and
  layer), then the first prefill fails: on a CPU without AMX SGLang attends with
  ``torch_native``, and DeepSeek's attention runs a fresh prefill as MHA (192-dim heads) while
  that backend always attends over the KV pool, which holds the latent. With or without HiCache.
- EAGLE (a tiny EAGLE-1 head in SGLang's ``LlamaForCausalLMEagle`` format): the head loads, then
  SGLang refuses to build its draft attention, which it has for intel_amx, triton, flashinfer
  and other GPU backends but not for ``torch_native``. Before any KV cache or HiCache exists.
- n-gram (``--speculative-algorithm NGRAM``): with a page size above 1 (HiCache's 16 here)
  SGLang's argument checks refuse its default tree breadth of 10; with
  ``--speculative-ngram-max-bfs-breadth 1`` they pass, and the worker's import of
  ``sgl_kernel.speculative`` fails: SGLang's CPU n-gram path calls kernels of sgl-kernel's CPU
  build, which is not on PyPI (the tests' stand-in, ``sglang_shims/sgl_kernel``, has two of its
  ops). Checked in-process, without a server.

Every test here fails once SGLang does more (serves a layout it refuses now, or stops serving
one it serves). Servers: one for PP, two refused starts side by side; the session's SGLang server
is stopped first (2 cores).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines.launchers import (PAGE, SGLangServers, sglang_probe, ids, needs_sglang, new_sglang_server, sglang_args,
                              sglang_config, sglang_generate, sglang_log, tiny_model)
from kvstrata.format.block import HEADER_SIZE, unpack_header
from tests.harness.sglang_server import SGLangServer, SGLangUnavailable

pytestmark = [needs_sglang, pytest.mark.timeout(900)]

PROMPT = ids(29, 600)
OTHER = ids(30, 600)

# Keys of DeepSeek-V2's own config.json that transformers' DeepseekV2Config (the mla preset's)
# leaves out; SGLang reads them. YaRN of factor 1 rotates as the preset's default RoPE.
DEEPSEEK_V2_KEYS = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 1.0,
                                        "original_max_position_embeddings": 4096, "beta_fast": 32,
                                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                    "moe_layer_freq": 1, "scoring_func": "softmax"}


def variant(model: str, config: Path | None, log: Path, extra: list[str],
            env: dict[str, str] | None = None) -> SGLangServer:
    """The tests' CPU server (``new_sglang_server``: page 16, HiCache) with ``extra`` flags; not started."""
    server = new_sglang_server(model, config, log)
    server.cmd += extra
    server.env.update(env or {})
    return server


def refused(server: SGLangServer) -> str:
    """Start a server that must not come up; its log."""
    try:
        with pytest.raises(SGLangUnavailable, match="exited with"):
            server.__enter__()
    finally:
        server.stop()
    return sglang_log(server)


def eagle_head(target: str, out: Path) -> str:
    """An EAGLE-1 head for the tiny Llama in SGLang's format (``LlamaForCausalLMEagle``: ``fc``
    with a bias, one decoder layer; embeddings and LM head come from the target)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1,
                                                 "architectures": ["LlamaForCausalLMEagle"]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((Path(target) / name).read_bytes())
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "self_attn.q_proj.weight": (q, h),
              "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h),
              "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
              "post_attention_layernorm.weight": (h,)}
    weights = {(k if k.startswith("fc.") else "layers.0." + k): (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)
               for k, s in shapes.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


# In the SGLang environment, with the shims' import hook: SGLang's own argument resolution of the
# test server's flags plus NGRAM, the import its scheduler does for an NGRAM worker, and the CPU
# rotary embedding DeepSeek's attention asks for with the mla preset's default RoPE.
IN_PROCESS = """  # after SGLANG_PROBE (tests/engines/launchers.py)
def ngram_worker():
    import sglang.srt.speculative.ngram_worker
def default_rope():
    from sglang.srt.layers.rotary_embedding.factory import get_rope_cpu
    get_rope_cpu(64, 64, 4096, 10000, False, None, torch.float32, device="cpu")
print("RESULT " + json.dumps({
    "ngram_args": outcome(lambda: prepare_server_args(argv).resolve_once()),
    "ngram_args_breadth_1": outcome(
        lambda: prepare_server_args(argv + ["--speculative-ngram-max-bfs-breadth", "1"]).resolve_once()),
    "ngram_worker": outcome(ngram_worker),
    "default_rope": outcome(default_rope),
}))
"""


def in_process_checks(config: Path) -> dict[str, str]:
    argv = sglang_args(tiny_model(), config) + ["--speculative-algorithm", "NGRAM"]
    return sglang_probe(IN_PROCESS, argv)


@pytest.fixture(scope="module")
def refusals(sglang_servers: SGLangServers, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The MLA and EAGLE servers (HiCache with StrataStorage) started side by side, each expected
    to fail, and the in-process checks meanwhile: their logs and outcomes."""
    sglang_servers.stop()  # the session's server: at most two SGLang servers on 2 cores
    tmp = tmp_path_factory.mktemp("sglang-refusals")
    config = sglang_config(tmp / "sglang.json", tmp / "l2")
    mla = variant(tiny_model("mla"), config, tmp / "mla.log",
                  ["--json-model-override-args", json.dumps(DEEPSEEK_V2_KEYS)])
    eagle = variant(tiny_model(), config, tmp / "eagle.log",
                    ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                     eagle_head(tiny_model(), tmp / "head"), "--speculative-num-steps", "3",
                     "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"])
    with ThreadPoolExecutor(3) as pool:
        logs = {name: pool.submit(refused, server) for name, server in (("mla", mla), ("eagle", eagle))}
        checks = pool.submit(in_process_checks, config)
        return {**{name: f.result() for name, f in logs.items()}, "in_process": checks.result()}


def block_files(l2: Path, want: int) -> list[Path]:
    """kvstrata's disk files once there are ``want`` of them (backups to storage are asynchronous)."""
    deadline = time.monotonic() + 60
    while len(files := list((l2 / "blocks").glob("*/*.kvb"))) < want:
        assert time.monotonic() < deadline, f"{len(files)} of {want} pages reached kvstrata's disk tier"
        time.sleep(0.2)
    return files


def test_sglang_serves_pipeline_parallelism_from_strata_storage_only_where_every_stage_hits(
        sglang_servers, model, tmp_path):
    """Scenario: PP=2, kvstrata's L1 smaller than the host pools (pages go straight to disk). A
    prompt comes back from storage on both stages after ``/flush_cache``; a second prompt whose
    later stage's files are all deleted is not served from storage at all (SGLang takes the MIN of
    the stages' hits), and is recomputed with its cold output."""
    sglang_servers.stop()  # a PP=2 server is two schedulers: nothing else beside it
    l2 = tmp_path / "l2"
    config = sglang_config(tmp_path / "sglang.json", l2, l1={"size": "4MiB"})
    server = variant(model, config, tmp_path / "sglang.log", ["--pp-size", "2", "--skip-server-warmup"],
                     {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    pages = len(PROMPT) // PAGE
    with server as s:
        cold = sglang_generate(s, PROMPT)
        first = set(block_files(l2, 2 * pages))  # every full page, once per stage
        s.flush()
        again = sglang_generate(s, PROMPT)
        other_cold = sglang_generate(s, OTHER)
        later = re.search(r"PP1\] kvstrata: namespace (\w+) ", sglang_log(s))
        assert later, sglang_log(s)[-4000:]
        others = set(block_files(l2, 4 * pages)) - first
        gone = [f for f in others if unpack_header(f.read_bytes()[:HEADER_SIZE]).ns_seed[:8].hex() == later[1]]
        assert len(gone) == pages, (len(gone), len(others))
        for f in gone:
            f.unlink()
        s.flush()
        other_again = sglang_generate(s, OTHER)
    log = sglang_log(s)
    for stage in ("PP0", "PP1"):  # each stage: a namespace of its own over its 2 layers, and the hit
        assert re.search(rf"{stage}\] kvstrata: namespace \w+ \(MHATokenToKVPoolHost:layer_first:\[2, 2, 16, 2, 64\]",
                         log), log[-4000:]
        assert re.search(rf"{stage}\] HiCache prefetch success req=\w+ completed={pages * PAGE} ", log), log[-4000:]
    assert cold["storage"] == 0 and again["device"] == 0 and again["storage"] >= len(PROMPT) - PAGE, again
    assert again["tokens"] == cold["tokens"]
    assert other_again["storage"] == 0 and other_again["device"] == 0, other_again  # stage 0 alone: no hit
    assert other_again["tokens"] == other_cold["tokens"]


def test_sglang_refuses_the_mla_model_at_its_first_prefill_on_cpu_with_strata_storage_attached(refusals):
    log = refusals["mla"]
    assert "kvstrata: namespace" in log and "MLATokenToKVPoolHost:layer_first:[2, 16, 1, 576]" in log, log[-4000:]
    assert ("RuntimeError: Expected size for first two dimensions of batch2 tensor to be: [4, 192] but got: "
            "[4, 576]." in log), log[-4000:]
    assert "torch_native_backend.py" in log and "forward_normal_core" in log  # the MHA path over the latent pool
    # The mla preset as built (default RoPE) does not get that far: SGLang's CPU RoPE wants DeepSeek's YaRN.
    assert refusals["in_process"]["default_rope"] == "AssertionError: "


def test_sglang_refuses_an_eagle_head_on_cpu_torch_native_attention(refusals):
    log = refusals["eagle"]
    assert "type=LlamaForCausalLMEagle" in log, log[-4000:]  # the head itself loads
    assert "ValueError: EAGLE is not supported in decode attention backend torch_native" in log, log[-4000:]
    assert "Creating dynamic storage backend" not in log  # refused before HiCache's storage exists


def test_sglang_ngram_speculation_needs_sgl_kernels_cpu_build_and_a_tree_breadth_of_1_with_pages(refusals):
    checks = refusals["in_process"]
    assert checks["ngram_args"] == (
        "ValueError: speculative_eagle_topk(10) > 1 with page_size(16) > 1 is unstable and produces incorrect "
        "results for paged attention backends. This combination is only supported for the 'flashinfer' backend.")
    assert checks["ngram_args_breadth_1"] == "ok"
    assert checks["ngram_worker"] == "ModuleNotFoundError: No module named 'sgl_kernel.speculative'"
