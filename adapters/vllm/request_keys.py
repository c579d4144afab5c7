"""What a vLLM request's blocks are keyed on beyond their token ids (placeholder, rewritten below)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.keys import extra_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request


def request_extra(request: "Request") -> bytes:
    """Per-request identity that is not in the tokens: cache salt, LoRA, multimodal inputs."""
    keys: list[object] = []
    if getattr(request, "cache_salt", None):
        keys.append(f"salt:{request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        keys.append(f"lora:{lora.lora_name}:{lora.lora_int_id}")
    for feature in getattr(request, "mm_features", None) or ():
        keys.append(f"mm:{getattr(feature, 'identifier', feature)}")
    return extra_digest(keys)
