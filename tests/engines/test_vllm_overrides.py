"""Runtime settings that change the KV, end to end on real vLLM engines.

Scenario: vLLM 0.32 started with ``--hf-overrides '{"rope_parameters": ...}'`` on the same model
folder as an engine without it loaded 999/999 of that engine's tokens from kvstrata (the namespace
did not cover the override) and answered differently from its own reference. Here a plain engine
stores a long prompt on a disk tier; then an engine with a RoPE override and one with online fp8
weight quantization (``fp8_per_channel``: the CPU build quantizes every linear layer; plain
``fp8`` is refused) serve the same prompt on the same tier. Each must load nothing and answer as its
own settings do: its reference is the same prompt under a fresh cache salt (keys nothing was
stored under). Each answers differently from the plain engine, so KV from the wrong settings would
show.

Random weights at the tiny preset's scale make attention nearly uniform, so position (RoPE) barely
shows in outputs: the engines run a private copy of the tiny model with ``q_proj`` and ``k_proj``
scaled by 8. Unit tests on vLLM's config objects (every setting, the exclusions, another process):
tests/adapters/test_vllm_namespace.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.launchers import BS, LONG, StepEngine, disk_config, gen, salt

pytest.importorskip("vllm")
# Three engines one after the other: about 25 s each on an idle machine, two minutes each when the
# 2 cores are shared, which the suite's 300 s per test would not cover.
pytestmark = pytest.mark.timeout(900)

THETA_1000 = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}
QK_SCALE = 8.0


@pytest.fixture
def sharp_model(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private copy of the tiny model whose attention depends on position: every layer's q_proj
    and k_proj scaled by ``QK_SCALE`` (logits x64). A private identity cache for its new weights."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "identity-cache"))
    folder = Path(shutil.copytree(model, tmp_path / "model"))
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    scaled = [name for name in tensors if name.endswith(("q_proj.weight", "k_proj.weight"))]
    assert len(scaled) == 8, sorted(tensors)
    for name in scaled:
        tensors[name] = (tensors[name].float() * QK_SCALE).to(torch.bfloat16)
    save_file(tensors, str(path), metadata=metadata)
    return str(folder)


def test_an_engine_with_a_rope_override_or_quantization_loads_nothing_another_engine_stored(sharp_model, tmp_path):
    cfg = disk_config(tmp_path)
    with StepEngine(sharp_model, tmp_path, cfg, name="plain") as plain:
        old = plain.run([gen(LONG)])[0]
    assert len(list((tmp_path / "l2" / "blocks").glob("*/*.kvb"))) == len(LONG) // BS + 1

    for name, options in {"rope": {"hf_overrides": THETA_1000}, "fp8": {"quantization": "fp8_per_channel"}}.items():
        with StepEngine(sharp_model, tmp_path, cfg, name=name, **options) as engine:
            served, reference = engine.run([gen(LONG), gen(LONG, salt=salt())])
        seen = (name, served, reference, old["tokens"])
        assert served["cached"] == 0 and reference["cached"] == 0, seen
        assert served["tokens"] == reference["tokens"], seen
        assert served["tokens"] != old["tokens"], seen  # its settings answer differently: stale KV would show
