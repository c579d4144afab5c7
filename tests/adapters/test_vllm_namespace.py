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

from kvstrata.adapters import versions  # noqa: E402
from kvstrata.adapters.vllm import namespace  # noqa: E402

# The model's KV cache spec as vLLM's CPU build makes it for the presets of
# examples/make_tiny_model.py: mla (latent 512 + rope 64, one "head") and a Llama-like dense model.
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
DENSE = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
# Seeds of DENSE's namespace at TP=1 and TP=2 (device layout and software fixed below), as
# ``fields_seed`` gives them: pinned again when the software releases, the context-parallel sizes
# and the attention backends entered the namespace.
DENSE_SEEDS = {1: "2ef35661a2c888da3830c867678c1ee2", 2: "d3f6ddec20ec2b2dba89a9f9cd6a9b7f"}


def fields_seed(ns) -> str:  # noqa: ANN001
    """xxh3-128 of the canonical JSON of the namespace's fields (the key scheme left out): what the
    adapter decides, whichever scheme the store keys it by."""
    fields = asdict(ns)
    fields.pop("key_scheme", None)
    return xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


SOFTWARE = {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu", "transformers": "5.19.0"}  # pinned for the seeds


def pin_software(set_) -> None:  # noqa: ANN001
    """The engine's, torch's and transformers' versions as ``SOFTWARE`` says (``set_``: setattr or
    monkeypatch.setattr): seeds that do not move with the installed releases."""
    set_(versions, "_version", lambda dist: SOFTWARE[dist])
    set_(namespace.vllm, "__version__", SOFTWARE["vllm"])


@pytest.fixture(autouse=True)
def fixed_device(monkeypatch):
    """Seeds independent of this machine's CPU ISA (a part of the real layout) and of the software
    releases installed."""
    monkeypatch.setattr(namespace, "_device_layout", lambda vllm_config: "cpu:X86:amx=0:avx512=1")
    pin_software(monkeypatch.setattr)


def vllm_config(tp: int) -> SimpleNamespace:
    """What ``namespace_for`` reads of a ``VllmConfig``."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model="/models/m", revision=None, dtype=torch.float32),
        load_config=SimpleNamespace(download_dir=None),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1, prefill_context_parallel_size=1))


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
from test_vllm_namespace import DENSE, kv_cache_config, namespace, pin_software
from tests.builders import make_config
from vllm.engine.arg_utils import EngineArgs
namespace._device_layout = lambda vllm_config: "cpu:X86:amx=0:avx512=1"
pin_software(setattr)
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


# ------------------------------------------------------------------ software, parallel layouts, backends
@pytest.mark.parametrize("part,other", [("vllm", "0.32.1"), ("vllm", "0.32.0+cu129"), ("torch", "2.14.1+cpu"),
                                        ("transformers", "5.19.1")])
def test_another_release_of_the_engine_torch_or_transformers_is_another_namespace(part, other, tmp_path,
                                                                                   monkeypatch):
    """Scenario: a rolling upgrade puts a new vLLM, torch or transformers release beside the old one
    on the same shared tier. Model code, a rotary fix or a kernel's packing can change the KV a
    prompt gives, and neither the weights nor the settings show it: the release itself is in the
    namespace (an upgrade starts cold), unless the operator names a ``version_group`` for both."""
    before = ns_of(DENSE, 1, 1, tmp_path)
    assert before.extra["software"] == "vllm=0.32.0+cpu;torch=2.13.0+cpu;transformers=5.19.0"
    monkeypatch.setitem(SOFTWARE, part, other)
    pin_software(monkeypatch.setattr)
    after = ns_of(DENSE, 1, 1, tmp_path)
    assert after.seed != before.seed and other in after.extra["software"]

    grouped = make_config(tmp_path, namespace__model_version="v1", namespace__version_group="llama-kv-1")
    joined = namespace.namespace_for(vllm_config(1), kv_cache_config(DENSE, 1), grouped)
    monkeypatch.setitem(SOFTWARE, part, {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu", "transformers": "5.19.0"}[part])
    pin_software(monkeypatch.setattr)
    assert namespace.namespace_for(vllm_config(1), kv_cache_config(DENSE, 1), grouped).seed == joined.seed
    assert joined.extra["software"] == "group:llama-kv-1" and joined.seed != before.seed
    other_group = make_config(tmp_path, namespace__model_version="v1", namespace__version_group="llama-kv-2")
    assert namespace.namespace_for(vllm_config(1), kv_cache_config(DENSE, 1), other_group).seed != joined.seed


@pytest.mark.parametrize("setting", ["decode_context_parallel_size", "prefill_context_parallel_size"])
def test_context_parallelism_is_refused_at_start_up_on_vllms_own_config(setting, tmp_path):
    """Scenario: with DCP a vLLM scheduler block holds block_size x DCP tokens spread over the ranks
    (PCP spreads a request's positions), while kvstrata's block i is tokens [i*bs, (i+1)*bs) on every
    rank: it would save and load other tokens' KV. vLLM's real ``ParallelConfig`` with either size 2
    is refused with the setting, its value and the reason; at 1 (the default) both sizes are in the
    namespace beside TP and PP."""
    from vllm.config import ParallelConfig

    config = vllm_config(2)
    config.parallel_config = ParallelConfig(tensor_parallel_size=2, **{setting: 2})
    with pytest.raises(ValueError, match=rf"{setting}=2 is not supported: .*context parallelism"):
        namespace.namespace_for(config, kv_cache_config(DENSE, 1), make_config(tmp_path, namespace__model_version="v1"))
    config.parallel_config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert namespace.parallel_layout(config) == {"pp": "2", "cp": "dcp=1,pcp=1"}


def test_the_attention_backends_the_workers_report_enter_the_namespace(tmp_path):
    """Scenario: two engines of one release, model and settings on different hardware pick different
    attention backends (vLLM chooses per layer when the model is built, in the worker), which lay K
    and V out differently. Each worker reports its layers' backends in its handshake metadata; the
    scheduler's namespace names their union, so the two never exchange blocks. Until the workers
    report, the namespace is marked unreported; a vLLM that never hands the reports over gets a
    namespace of its own, never shared."""
    from kvstrata.adapters.vllm.backends import BackendReport, reported

    base = ns_of(DENSE, 1, 1, tmp_path)
    assert base.extra["attention"] == namespace.UNREPORTED
    cpu = namespace.with_backends(base, reported({(0, 0): BackendReport(("CPU_ATTN",))}))
    flash = namespace.with_backends(base, reported({(0, 0): BackendReport(("FLASH_ATTN",)),
                                                    (0, 1): BackendReport(("FLASH_ATTN",))}))
    assert cpu.extra["attention"] == "CPU_ATTN" and flash.extra["attention"] == "FLASH_ATTN"
    assert len({base.seed, cpu.seed, flash.seed}) == 3
    assert reported({(0, 0): BackendReport(("A",)), (1, 0): BackendReport(("B", "A"))}) == ("A", "B")
    assert reported({(0, 0): None}) is None
    lone = [namespace.with_backends(base, None) for _ in range(2)]
    assert lone[0].seed != lone[1].seed and lone[0].extra["attention"].startswith("unreported:")
