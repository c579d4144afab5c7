"""adapters/model_settings.py: an engine's resolved settings as canonical JSON and one digest
(``Namespace.extra["model_config"]``), and docs/consistency.md's list of what is left out.

Equal settings must give one digest in any process and on any machine (no dict order, float
spelling, memory address or path in it); different settings must give different ones. The
adapters' use of it on the engines' own config objects: tests/adapters/test_vllm_namespace.py (vLLM) and
tests/engines/test_sglang_overrides.py (SGLang)."""

from __future__ import annotations

import ast
import enum
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvstrata.adapters.model_settings import HF_EXCLUDED, canonical, fields_of, hf_config_dict, settings_digest

ROOT = Path(__file__).resolve().parents[2]


class Impl(str, enum.Enum):
    AUTO = "auto"


@dataclass
class Quant:
    method: str
    scale: float


class Opaque:
    pass


def rope(theta):  # noqa: ANN001, ANN201
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


def test_equal_settings_written_differently_give_one_digest():
    a = {"hf": rope(1000.0), "impl": Impl.AUTO, "dtype": torch.bfloat16, "layers": (1, 2), "skip": {"b", "a"}}
    b = {"skip": {"a", "b"}, "layers": [1, 2], "dtype": "torch.bfloat16", "impl": "auto",
         "hf": {"rope_parameters": {"rope_theta": 1000, "rope_type": "default"}}}
    assert canonical(a) == canonical(b) and settings_digest(a) == settings_digest(b)


def test_different_settings_give_different_digests():
    digests = {settings_digest(s) for s in (rope(1000.0), rope(10000.0), rope(1000.5), {**rope(1000.0), "x": None},
                                            {"q": Quant("fp8", 1.0)}, {"q": Quant("fp8", 0.5)}, {"q": None})}
    assert len(digests) == 7


def test_an_object_is_never_keyed_on_its_address():
    """A repr like ``<Opaque object at 0x7f...>`` differs in every process: only the type is kept,
    and functions and classes are named by their qualified name."""
    assert canonical({"o": Opaque(), "f": rope, "t": Opaque}) == {
        "o": "<test_model_settings.Opaque>", "f": "test_model_settings.rope", "t": "test_model_settings.Opaque"}
    assert settings_digest({"o": Opaque()}) == settings_digest({"o": Opaque()})


def test_hf_keys_that_cannot_change_the_kv_are_left_out_at_any_depth():
    from transformers import LlamaConfig

    one = LlamaConfig(hidden_size=64, num_attention_heads=2, eos_token_id=2)
    one._name_or_path = "/models/here"
    two = LlamaConfig(hidden_size=64, num_attention_heads=2, eos_token_id=9)
    two._name_or_path = "/elsewhere/model"
    assert hf_config_dict(one) == hf_config_dict(two)
    nested = hf_config_dict({"text_config": {"_name_or_path": "/a", "hidden_size": 64}, "transformers_version": "5"})
    assert nested == {"text_config": {"hidden_size": 64}}
    three = LlamaConfig(hidden_size=64, num_attention_heads=2, eos_token_id=2, rope_theta=1000.0)
    assert hf_config_dict(three) != hf_config_dict(one)


def test_fields_of_leaves_out_the_excluded_fields():
    assert fields_of(Quant("fp8", 1.0), {"scale": "why"}) == {"method": "fp8"}
    assert fields_of(None, {}) == {}


def _dict_keys(path: Path, name: str) -> set[str]:
    """The literal keys of the module-level dict ``name`` in ``path`` (read without importing it:
    the SGLang adapter imports only in SGLang's environment)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{name} not found in {path}")


def test_docs_name_every_field_the_namespace_leaves_out():
    pytest.importorskip("vllm")
    from kvstrata.adapters.vllm import namespace

    section = (ROOT / "docs" / "consistency.md").read_text().split("## Runtime settings", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w.]+)`", section))
    sglang = ROOT / "src" / "kvstrata" / "adapters" / "sglang" / "namespace.py"
    excluded = (set(HF_EXCLUDED) | set(namespace.MODEL_EXCLUDED) | set(namespace.CACHE_EXCLUDED)
                | set(namespace.LOAD_EXCLUDED) | set(namespace.MULTIMODAL_EXCLUDED)
                | _dict_keys(sglang, "SERVER_EXCLUDED") | _dict_keys(sglang, "RESOLVED_EXCLUDED"))
    assert len(excluded) > 80
    assert excluded - named == set()
