"""The vLLM adapter's namespace (adapters/vllm/namespace.py): at several tensor-parallel degrees, on
vLLM's own KV cache spec classes, and with the engine's runtime settings, on real ``VllmConfig``
objects vLLM builds from engine arguments: no engine starts.

An MLA model's latent is the same on every rank and stored once, so TP=1 and TP=2 instances of it
share one namespace; any other model's blocks hold every rank's shard, and its namespace names the
TP degree (pinned seeds: a namespace is the same in every process and on every machine; they were
pinned again when the model settings entered the namespace). The engines sharing an MLA
model's blocks across TP degrees: tests/engines/test_vllm_mla.py.

Runtime settings that change the KV (a RoPE override, a sliding window, the model dtype, a
quantization method, dummy weights) are in the namespace (``model_settings``); settings that cannot
change it (the config file's transformers version, the sampler's seed, memory sizing, the model
folder's path) are not. The engines: tests/engines/test_vllm_overrides.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash
from tests.builders import make_config

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        MLAAttentionSpec)

from kvstrata.adapters.vllm import namespace  # noqa: E402

# The model's KV cache spec as vLLM's CPU build makes it for the presets of
# examples/make_tiny_model.py: mla (latent 512 + rope 64, one "head") and a Llama-like dense model.
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
DENSE = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
# Seeds of DENSE's namespace at TP=1 and TP=2 (device layout fixed below), as ``fields_seed`` gives
# them: pinned since the model settings entered the namespace.
DENSE_SEEDS = {1: "b0a4cf629a75a7030b200b14559372aa", 2: "eab7e36bd4f7e1a5f6a2b0bba9e42109"}


def fields_seed(ns) -> str:  # noqa: ANN001
    """xxh3-128 of the canonical JSON of the namespace's fields (the key scheme left out): what the
    adapter decides, whichever scheme the store keys it by."""
    fields = asdict(ns)
    fields.pop("key_scheme", None)
    return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


@pytest.fixture(autouse=True)
def fixed_device(monkeypatch):
    """Seeds independent of this machine's CPU ISA (a part of the real layout)."""
    monkeypatch.setattr(namespace, "_device_layout", lambda vllm_config: "cpu:X86:amx=0:avx512=1")


def vllm_config(tp: int) -> SimpleNamespace:
    """What ``namespace_for`` reads of a ``VllmConfig``."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/models/m", revision=None, dtype=torch.float32),
        load_config=SimpleNamespace(download_dir=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def kv_cache_config(spec, replicas: int) -> KVCacheConfig:  # noqa: ANN001
    """Four layers of ``spec``; ``replicas``: vLLM's ``kv_tp_replicas`` (consecutive TP ranks that
    hold identical KV: the TP degree for MLA, 1 when the latent is sharded, e.g. by DCP)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    cfg.kv_tp_replicas = replicas
    return cfg


def ns_of(spec, tp: int, replicas: int, tmp_path):  # noqa: ANN001, ANN201
    cfg = make_config(tmp_path, namespace__model_version="v1")
    return namespace.namespace_for(vllm_config(tp), kv_cache_config(spec, replicas), cfg)


def test_mla_namespace_is_the_same_at_tp1_and_tp2(tmp_path):
    one, two = ns_of(MLA, 1, 1, tmp_path), ns_of(MLA, 2, 2, tmp_path)
    assert one == two and one.seed == two.seed
    assert two.world_size == 1 and two.layout.endswith(";mla")
    assert namespace.latent_shared(vllm_config(2), kv_cache_config(MLA, 2))


def test_other_models_namespace_names_the_tp_degree_as_before(tmp_path):
    one, two = ns_of(DENSE, 1, 1, tmp_path), ns_of(DENSE, 2, 1, tmp_path)
    assert one.seed != two.seed and (one.world_size, two.world_size) == (1, 2)
    assert (fields_seed(one), fields_seed(two)) == (DENSE_SEEDS[1], DENSE_SEEDS[2])
    # KV heads replicated across ranks (fewer KV heads than ranks) is not MLA: still one shard per rank.
    assert fields_seed(ns_of(DENSE, 2, 2, tmp_path)) == DENSE_SEEDS[2]
    assert not namespace.latent_shared(vllm_config(2), kv_cache_config(DENSE, 2))


def test_an_mla_latent_sharded_across_ranks_keeps_one_region_per_rank(tmp_path):
    """Scenario: decode context parallelism splits an MLA model's tokens across its TP ranks, so
    vLLM finds no replicas (``kv_tp_replicas`` 1): the ranks' blocks differ, each is stored."""
    sharded = ns_of(MLA, 2, 1, tmp_path)
    assert sharded.world_size == 2 and "mla" not in sharded.layout
    assert sharded.seed != ns_of(MLA, 1, 1, tmp_path).seed
    assert not namespace.latent_shared(vllm_config(2), kv_cache_config(MLA, 1))


def with_speculation(method: str, draft: str) -> SimpleNamespace:
    config = vllm_config(1)
    config.speculative_config = SimpleNamespace(method=method, draft_model_config=SimpleNamespace(model=draft,
                                                                                                  revision=None))
    return config


def test_a_draft_with_kv_is_part_of_the_namespace_and_ngram_is_not(tmp_path):
    """Scenario: EAGLE's head is one more attention layer in the target's KV cache group, so its KV
    is in every stored block: engines with different heads (same shapes) must not exchange blocks,
    while n-gram speculation keeps no KV and shares the blocks of an engine without speculation."""
    drafts = []
    for name in ("head-a", "head-b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(name.encode() * 1000)
        drafts.append(str(folder))
    cfg = make_config(tmp_path, namespace__model_version="v1")
    kv = kv_cache_config(DENSE, 1)
    seed = {key: fields_seed(namespace.namespace_for(config, kv, cfg)) for key, config in {
        "alone": vllm_config(1), "ngram": with_speculation("ngram", "/models/m"),
        "a": with_speculation("eagle", drafts[0]), "a again": with_speculation("eagle", drafts[0]),
        "b": with_speculation("eagle", drafts[1]), "a as eagle3": with_speculation("eagle3", drafts[0])}.items()}
    assert seed["alone"] == seed["ngram"] == DENSE_SEEDS[1]
    assert seed["a"] == seed["a again"]
    assert len({seed["alone"], seed["a"], seed["b"], seed["a as eagle3"]}) == 4


# ------------------------------------------------------------------ runtime settings, real configs
ROOT = Path(__file__).resolve().parents[2]
THETA_1000 = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """config.json-only folders (vLLM builds its configs from them; no weights are read): the tiny
    preset of examples/make_tiny_model.py (Llama), and a Mistral of its shape with a 64-token
    sliding window."""
    from transformers import MistralConfig

    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    assert spec is not None and spec.loader is not None
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    preset = make.PRESETS["tiny"]
    shape = {**make.SHAPE, **preset.shape, "vocab_size": preset.tokenizer_vocab}
    out = {"llama": tmp_path_factory.mktemp("llama"), "mistral": tmp_path_factory.mktemp("mistral")}
    preset.config_cls(**shape, architectures=["LlamaForCausalLM"]).save_pretrained(out["llama"])
    MistralConfig(**shape, sliding_window=64, architectures=["MistralForCausalLM"]).save_pretrained(out["mistral"])
    return out


def engine_namespace(folder: Path, tmp_path: Path, **engine_args):  # noqa: ANN003, ANN201
    """The namespace of an engine started with ``engine_args`` on ``folder`` (weights version pinned),
    from the ``VllmConfig`` vLLM builds for it."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(folder), block_size=32, skip_tokenizer_init=True, **engine_args).create_engine_config()
    cfg = make_config(tmp_path, namespace__model_version="v1")
    return namespace.namespace_for(config, kv_cache_config(DENSE, 1), cfg)


# name: (model, the base engine's arguments, the same engine with one setting changed)
CHANGES = {
    "rope_theta": ("llama", {}, {"hf_overrides": THETA_1000}),
    "rope_linear_x4": ("llama", {"max_model_len": 4096},
                       {"max_model_len": 4096, "hf_overrides": {"rope_parameters": {
                           "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}}),
    "sliding_window": ("mistral", {}, {"hf_overrides": {"sliding_window": 128}}),
    "sliding_window_off": ("mistral", {"max_model_len": 64}, {"max_model_len": 64, "disable_sliding_window": True}),
    # The KV cache dtype pinned: KV computed in bf16 or fp16, then stored as fp8, holds other values.
    "dtype": ("llama", {"kv_cache_dtype": "fp8", "dtype": "bfloat16"}, {"kv_cache_dtype": "fp8", "dtype": "float16"}),
    "quantization": ("llama", {}, {"quantization": "fp8_per_channel"}),
    "quantization_moe_int8": ("llama", {}, {"quantization": "int8_per_channel_weight_only"}),
    "dummy_weights": ("llama", {}, {"load_format": "dummy"}),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_runtime_setting_that_changes_the_kv_changes_the_namespace(change, model_dirs, tmp_path):
    """Scenario: a second engine on the same model folder with a RoPE override loaded
    999/999 of the first engine's tokens under the same namespace, and answered differently from
    its own reference. Every other part of the namespace is equal here: the settings tell them apart."""
    model, base_args, changed_args = CHANGES[change]
    base = engine_namespace(model_dirs[model], tmp_path, **base_args)
    changed = engine_namespace(model_dirs[model], tmp_path, **changed_args)
    assert base.seed != changed.seed
    assert base.extra["model_config"] != changed.extra["model_config"]
    assert (base.model, base.model_version, base.kv_dtype, base.layout) == \
        (changed.model, changed.model_version, changed.kv_dtype, changed.layout)


def test_settings_that_cannot_change_the_kv_leave_the_namespace_alone(model_dirs, tmp_path):
    """The config file's transformers version and special token ids, the sampler's seed, memory
    sizing, vLLM's own prefix cache and the execution mode are out of the namespace; so is the model
    folder's path from the settings (Namespace.model still names the model as the engine was given it)."""
    copy = Path(shutil.copytree(model_dirs["llama"], tmp_path / "elsewhere"))
    raw = json.loads((copy / "config.json").read_text())
    raw.update(transformers_version="4.0.0", eos_token_id=7, bos_token_id=8)
    (copy / "config.json").write_text(json.dumps(raw))
    base = engine_namespace(model_dirs["llama"], tmp_path)
    same = engine_namespace(model_dirs["llama"], tmp_path, seed=7, served_model_name="alias", max_logprobs=3,
                            gpu_memory_utilization=0.5, enable_prefix_caching=False, enforce_eager=True)
    assert same == base and same.seed == base.seed
    moved = engine_namespace(copy, tmp_path)
    assert moved.extra["model_config"] == base.extra["model_config"]


CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_vllm_namespace import DENSE, kv_cache_config, namespace
from tests.builders import make_config
from vllm.engine.arg_utils import EngineArgs
namespace._device_layout = lambda vllm_config: "cpu:X86:amx=0:avx512=1"
out = {}
for folder in sys.argv[3:]:
    config = EngineArgs(model=folder, block_size=32, skip_tokenizer_init=True,
                        hf_overrides={"rope_parameters": {"rope_theta": 1000, "rope_type": "default"}}).create_engine_config()
    ns = namespace.namespace_for(config, kv_cache_config(DENSE, 1), make_config(sys.argv[2], namespace__model_version="v1"))
    out[folder] = [ns.seed.hex(), ns.extra["model_config"]]
print("RESULT " + json.dumps(out))
"""


def test_the_same_settings_give_the_same_namespace_in_another_process(model_dirs, tmp_path):
    """Another process (another hash seed, the override's keys in another order, its float written
    as an int) on the same folder gives the same namespace, and on a copy of the folder elsewhere
    the same settings digest: nothing in it depends on a path, a dict order or a process."""
    copy = str(shutil.copytree(model_dirs["llama"], tmp_path / "copy"))
    here = engine_namespace(model_dirs["llama"], tmp_path, hf_overrides=THETA_1000)
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), str(tmp_path), str(model_dirs["llama"]),
                           copy],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONHASHSEED": "12345", "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    there = json.loads(lines[-1][len("RESULT "):])
    assert there[str(model_dirs["llama"])] == [here.seed.hex(), here.extra["model_config"]]
    assert there[copy][1] == here.extra["model_config"]
