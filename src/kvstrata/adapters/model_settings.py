"""An engine's resolved model settings as one digest, for ``Namespace.extra["model_config"]``.

Runtime settings change the KV without touching the model's files, so the weights version cannot
see them: a RoPE override (vLLM's ``--hf-overrides``, SGLang's ``--json-model-override-args``), a
quantization method, the model dtype, a sliding window turned off, dummy weights. Each adapter
collects its engine's settings *after* the engine resolved them (the HF config with the overrides
applied, the config dataclasses' fields) and this module reduces them to one digest:

- ``canonical``: any config value as plain JSON, the same in every process and on every machine
  (sorted keys, integral floats as ints, enums by value, torch dtypes by name, dataclasses by
  their fields, functions and classes by qualified name, an unknown object by its type only: a
  repr may hold a memory address);
- ``hf_config_dict``: a transformers config's ``to_dict()`` without ``HF_EXCLUDED`` at any depth;
- ``fields_of``: a config dataclass's fields without an adapter's excluded ones;
- ``settings_digest``: xxh3-128 of the canonical JSON.

Every field is in unless an exclusion list names it with the reason it cannot change the KV: a
setting added by a new engine release is covered the day it appears (at worst it splits sharing
between engines whose settings differ where the KV does not). docs/consistency.md ("Runtime
settings") lists what is in and what is out.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
from collections.abc import Collection, Mapping
from typing import Any

import xxhash

__all__ = ["HF_EXCLUDED", "canonical", "fields_of", "hf_config_dict", "settings_digest"]

FORMAT = b"kvstrata-model-settings-1\0"
MAX_DEPTH = 24  # config trees are a few levels deep; deeper is a reference cycle

# Keys of a transformers config (at any depth of ``to_dict()``) that cannot change the KV.
HF_EXCLUDED: dict[str, str] = {
    "_name_or_path": "the folder or hub id the config was read from: a path differs between machines, "
                     "and the weights version already fingerprints the files",
    "_commit_hash": "the hub commit of the files: in the weights version",
    "transformers_version": "the transformers release that wrote or read the config",
    "bos_token_id": "a special token id: tokenization and stopping, not the forward pass over given ids",
    "eos_token_id": "a special token id: stopping",
    "pad_token_id": "a special token id: batching in transformers; vLLM and SGLang never pad a prompt",
    "sep_token_id": "a special token id: tokenization",
    "tokenizer_class": "tokenization: keys are on token ids",
    "id2label": "a classification head's labels, applied after the last hidden state",
    "label2id": "a classification head's labels",
    "problem_type": "a classification head's loss",
    "task_specific_params": "transformers pipelines' generation defaults",
    "output_attentions": "what a transformers forward call returns, not what it computes",
    "output_hidden_states": "what a transformers forward call returns",
    "return_dict": "what a transformers forward call returns",
    "use_cache": "whether transformers keeps its own KV cache; the engine always does",
}


def canonical(value: Any, _depth: int = 0) -> Any:
    """``value`` as JSON-ready data that is equal for equal settings in any process."""
    if _depth > MAX_DEPTH:
        return "<too deep>"
    d = _depth + 1
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):  # before str/int: StrEnum and IntEnum are both
        inner = value.value
        return canonical(inner, d) if isinstance(inner, (str, int, float, bool)) else value.name
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):  # 1000 and 1000.0 are one setting; repr of a float is exact
        value = float(value)
        return int(value) if value.is_integer() else value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): canonical(v, d) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v, d) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v, d) for v in value), key=_dumps)
    if isinstance(value, (bytes, bytearray)):
        return "xxh3:" + xxhash.xxh3_128_hexdigest(bytes(value))
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    if hasattr(value, "to_dict") and callable(value.to_dict):  # transformers configs, quant configs
        return _without(canonical(value.to_dict(), d), HF_EXCLUDED)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars, tensors
        return canonical(value.tolist(), d)
    if dataclasses.is_dataclass(value):
        return {f.name: canonical(getattr(value, f.name, None), d) for f in dataclasses.fields(value)}
    struct_fields = getattr(type(value), "__struct_fields__", None)  # msgspec.Struct
    if struct_fields is not None:
        return {name: canonical(getattr(value, name, None), d) for name in struct_fields}
    if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic models
        return canonical(value.model_dump(), d)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A transformers config (or its dict) as canonical data, ``HF_EXCLUDED`` removed at every depth."""
    if config is None:
        return {}
    return _without(canonical(config), HF_EXCLUDED)


def fields_of(config: Any, excluded: Collection[str]) -> dict[str, Any]:
    """A config dataclass's fields (or an object's attributes) as canonical data, ``excluded`` left out."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config):
        names = [f.name for f in dataclasses.fields(config)]
    else:
        names = list(vars(config))
    return {n: canonical(getattr(config, n, None)) for n in names if n not in excluded}


def settings_digest(settings: Mapping[str, Any]) -> str:
    """xxh3-128 (hex) of the canonical JSON of ``settings``."""
    return xxhash.xxh3_128_hexdigest(FORMAT + _dumps(canonical(settings)).encode())


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _without(value: Any, excluded: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {k: _without(v, excluded) for k, v in value.items() if k not in excluded}
    if isinstance(value, list):
        return [_without(v, excluded) for v in value]
    return value
