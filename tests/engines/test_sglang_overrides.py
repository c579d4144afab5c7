"""SGLang's runtime settings that change the KV are in the storage backend's namespace.

The backend reads the running server's resolved settings (``model_settings`` in
adapters/sglang/namespace.py: SGLang's "model" config namespace and the ModelConfig it resolves
from it, HF config with ``--json-model-override-args`` applied). Here SGLang's own argument parser
publishes the server args of each variant in SGLang's environment, as a server's scheduler does, and
the namespace is derived from them: no server starts (``sglang_probe``, a few seconds).

Servers on one store that differ only where the KV does not (the served name, a copy of the model
folder elsewhere, another process) share it: test_sglang.py's second server hits what the first
stored. The vLLM side: tests/adapters/test_vllm_namespace.py and test_vllm_overrides.py.
"""

from __future__ import annotations

import json
import shutil

from engines.launchers import needs_sglang, sglang_probe

pytestmark = needs_sglang

THETA_1000 = json.dumps({"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})
# The same override with its keys in another order and its float written as an int.
THETA_1000_AGAIN = json.dumps({"rope_parameters": {"rope_theta": 1000, "rope_type": "default"}})

PROBE = """
from types import SimpleNamespace
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.runtime_context import publish
from kvstrata.adapters.sglang.namespace import load_strata_config, namespace_for

spec = json.loads(argv[0])
cfg = load_strata_config({"namespace.model_version": "v1", "l2.path": spec["l2"]})
rows = SimpleNamespace(buf=torch.empty(0, dtype=torch.bfloat16), signature="MHATokenToKVPoolHost:layer_first:[16]", page_size=16)
storage = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="tiny")
out = {}
for name, args in spec["variants"].items():
    publish(prepare_server_args(["--device", "cpu", *args]), role="scheduler")
    ns = namespace_for(storage, cfg, rows, True)
    out[name] = [ns.seed.hex(), ns.extra.get("model_config")]
print("RESULT " + json.dumps(out))
"""


def test_a_runtime_setting_that_changes_the_kv_changes_the_sglang_namespace(model, tmp_path):
    copy = str(shutil.copytree(model, tmp_path / "elsewhere"))
    base = ["--model-path", model]
    variants = {
        "base": base,
        "rope_theta": [*base, "--json-model-override-args", THETA_1000],
        "rope_linear_x4": [*base, "--json-model-override-args",
                           json.dumps({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}})],
        "dtype": [*base, "--dtype", "float32"],
        "kv_cache_dtype": [*base, "--kv-cache-dtype", "fp8_e4m3"],
        "quantization": [*base, "--quantization", "w8a8_int8"],
        "dummy_weights": [*base, "--load-format", "dummy"],
        "context_length": [*base, "--context-length", "2048"],
        # same KV: the override written otherwise, a served name, the folder copied elsewhere
        "rope_theta_again": [*base, "--json-model-override-args", THETA_1000_AGAIN],
        "served_name": [*base, "--served-model-name", "alias"],
        "elsewhere": ["--model-path", copy],
    }
    spec = [json.dumps({"l2": str(tmp_path / "l2"), "variants": variants})]
    first, second = sglang_probe(PROBE, spec), sglang_probe(PROBE, spec)
    assert first == second  # another process: the same namespaces
    seeds = {name: seed for name, (seed, _) in first.items()}
    changed = ["rope_theta", "rope_linear_x4", "dtype", "kv_cache_dtype", "quantization", "dummy_weights",
               "context_length"]
    assert len({seeds["base"], *(seeds[name] for name in changed)}) == 1 + len(changed), first
    assert seeds["rope_theta_again"] == seeds["rope_theta"]
    assert seeds["served_name"] == seeds["base"]
    # Namespace.model is the served name here ("tiny"), so the copy elsewhere shares it whole.
    assert seeds["elsewhere"] == seeds["base"] and first["base"][1] is not None


def test_a_lora_adapter_rewritten_at_its_path_changes_the_sglang_namespace(model, tmp_path):
    """SGLang keys a ``--lora-paths`` adapter's pages on ``uuid5(name, path)``, the same whatever the
    files hold: the namespace covers the adapters' contents, so a server whose adapter was
    rewritten in place shares nothing with one that served the old files."""
    from engines.test_vllm_identity import write_lora

    path = tmp_path / "adapter"
    args = ["--model-path", model, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "k_proj",
            "v_proj", "--lora-paths", f"a={path}"]
    spec = [json.dumps({"l2": str(tmp_path / "l2"), "variants": {"base": ["--model-path", model], "lora": args}})]
    write_lora(path, 1)
    first, again = sglang_probe(PROBE, spec), sglang_probe(PROBE, spec)
    write_lora(path, 2)  # the same names and sizes, other weights
    rewritten = sglang_probe(PROBE, spec)
    assert first == again and first["lora"][0] != first["base"][0]
    assert rewritten["base"] == first["base"] and rewritten["lora"][0] != first["lora"][0]


VERSIONS = """
from kvstrata.adapters import versions
real = versions._version
group = load_strata_config({"namespace.model_version": "v1", "l2.path": spec["l2"], "namespace.version_group": "g1"})
publish(prepare_server_args(["--device", "cpu", *spec["variants"]["base"]]), role="scheduler")
for torch_version in ("2.13.0+cpu", "2.14.1+cpu"):
    versions._version = lambda dist: torch_version if dist == "torch" else real(dist)
    for name, config in (("own", cfg), ("group", group)):
        ns = namespace_for(storage, config, rows, True)
        out[f"{name} torch {torch_version}"] = [ns.seed.hex(), ns.extra["software"]]
"""


def test_the_sglang_namespace_names_its_releases_and_resolved_attention_backends(model, tmp_path):
    """Scenario: a rolling upgrade of SGLang, torch or transformers beside the old release, or a
    server whose attention backends resolve otherwise, on one shared tier: neither the weights nor
    the model settings show what changes the KV. The namespace names SGLang's, torch's and
    transformers' releases (another torch: another namespace; one ``namespace.version_group``
    joins them) and the (prefill, decode) attention backends the server resolved."""
    base = ["--model-path", model]
    variants = {"base": base,
                "split": [*base, "--prefill-attention-backend", "torch_native", "--decode-attention-backend", "intel_amx"]}
    got = sglang_probe(PROBE.replace('print("RESULT', VERSIONS + '\nprint("RESULT'),
                       [json.dumps({"l2": str(tmp_path / "l2"), "variants": variants})])
    import re

    assert re.fullmatch(r"sglang=0\.5\.23;torch=\S+;transformers=\S+", got["own torch 2.13.0+cpu"][1]), got
    assert got["own torch 2.13.0+cpu"][0] != got["own torch 2.14.1+cpu"][0]
    assert got["group torch 2.13.0+cpu"] == got["group torch 2.14.1+cpu"] == [got["group torch 2.13.0+cpu"][0],
                                                                              "group:g1"]
    assert got["group torch 2.13.0+cpu"][0] not in (got["own torch 2.13.0+cpu"][0], got["own torch 2.14.1+cpu"][0])
    assert got["split"][0] != got["base"][0]


def test_a_backend_outside_a_server_keys_on_what_it_is_given(tmp_path):
    """No published server args (an in-process backend): no model settings to cover, the namespace
    is what the storage config gives, as before."""
    code = PROBE.split("out = {}")[0] + """
ns = namespace_for(storage, cfg, rows, True)
print("RESULT " + json.dumps({"extra": ns.extra}))
"""
    got = sglang_probe(code, [json.dumps({"l2": str(tmp_path / "l2")})])
    assert "model_config" not in got["extra"]
