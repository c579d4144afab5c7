"""What a vLLM request's blocks are keyed on beyond their token ids: ``request_keys``.

vLLM's own prefix cache keys each block on the extra keys ``generate_block_hash_extra_keys``
(``v1/core/kv_cache_utils.py``) gives for it: the LoRA adapter's name and path, the cache salt (first
block), the multimodal items that overlap the block (with their offset in it) and a SHA-256 of the
block's prompt-embedding rows. kvstrata's keys are never smaller than that:

- request-wide inputs (the cache salt, the adapter's name, path and *content version*:
  ``identity.AdapterVersions``) give one digest that every block carries;
- when the engine's inputs for the prompt hold anything else (multimodal items, embedding rows, or
  a kind of key this adapter does not know), each block's digest also covers what vLLM's function
  gives for that block (beyond the request-wide part), so a block that has nothing of its own (a
  shared prefix before an image) keeps the keys of the same tokens in any request, and nothing from
  the image on matches another image.

Whether that second part is needed is asked of vLLM's own function once per request (over the
whole prompt), so a future vLLM that keys blocks on a new input is covered without a change here;
a prompt with embedding rows needs it anyway, and is not asked (that would hash every row once
more: each block's rows are hashed, once, by vLLM and by its own digest). A value of a kind this
module cannot encode canonically gives its block a random digest (logged once): the block is then
never shared, never served as another request's.
The token ids are ``request.all_token_ids``, what vLLM hashes: embedding positions hold 0 there,
and their rows are in the digest.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvstrata.adapter_versions import AdapterVersions
from kvstrata.keys import Extra, digest16, extra_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Tags of vLLM's extra keys that are the same for every block of a request and are in the
# request-wide digest already (its adapter, its salt).
REQUEST_WIDE = frozenset({"lora", "cache_salt"})


class RequestKeys(NamedTuple):
    """A request's token ids as keyed, and the extra digest of its blocks."""

    tokens: np.ndarray  # the prompt's token ids (uint32), as vLLM hashes them
    extra: Extra  # one digest for every block, or ``EngineBlockInputs``
    adapter: tuple[int, str, str] | None  # (id, path, version) the keys were made for, if any


class EngineBlockInputs:
    """``keys.BlockInputs`` of one request: per block, the request-wide digest and what
    ``generate_block_hash_extra_keys`` gives for the block's token range (cached per range)."""

    def __init__(self, request: "Request", base: bytes) -> None:
        self._request = request
        self._base = base
        self._digests: dict[tuple[int, int], bytes] = {}

    def digest(self, start: int, end: int) -> bytes:
        out = self._digests.get((start, end))
        if out is None:
            keys, _ = generate_block_hash_extra_keys(self._request, start, end, 0)
            own = [k for k in keys or () if not _request_wide(k)]  # the rest is in the base already
            try:
                out = digest16(self._base + encode(own)) if own else self._base
            except TypeError as e:  # a kind of input no key can name: this block is this request's alone
                if not _unencodable:
                    log.warning("%s; such blocks are keyed apart and never shared", e)
                _unencodable.add(type(e))
                out = os.urandom(len(self._base))
            self._digests[(start, end)] = out
        return out


_unencodable: set[type] = set()  # logged once per process


def request_keys(request: "Request", adapters: AdapterVersions, *, lora_version: bool = True) -> RequestKeys | None:
    """The keys of ``request``'s blocks, or None when it must not be served or stored: its LoRA
    adapter's files changed since this engine loaded it (``AdapterVersions``). ``lora_version``
    False is the test-only identity hole (``testing.identity_hole: lora_version``)."""
    tokens = np.asarray(request.all_token_ids[: request.num_prompt_tokens], dtype=np.uint32)
    wide: list[object] = []
    if request.cache_salt:
        wide.append(f"salt:{request.cache_salt}")
    adapter = None
    lora = request.lora_request
    if lora is not None:
        version = adapters.version(lora.lora_int_id, lora.lora_path, reloaded=lora.load_inplace)
        if version is None:
            return None
        adapter = (lora.lora_int_id, lora.lora_path, version)
        wide.append(f"lora:{lora.lora_name}:{lora.lora_path}" + (f":{version}" if lora_version else ""))
    base = extra_digest(wide)
    if request.prompt_embeds is None:
        keys, _ = generate_block_hash_extra_keys(request, 0, request.num_prompt_tokens, 0)
        if not keys or all(_request_wide(k) for k in keys):
            return RequestKeys(tokens, base, adapter)
    return RequestKeys(tokens, EngineBlockInputs(request, base), adapter)


def _request_wide(key: Any) -> bool:
    return isinstance(key, tuple) and bool(key) and key[0] in REQUEST_WIDE


def adapter_unchanged(request: "Request", adapters: AdapterVersions, keyed: tuple[int, str, str] | None) -> bool:
    """Whether the adapter a request's keys were made for is still the one the engine holds
    (checked before each save: a request whose adapter changed meanwhile stores nothing)."""
    if keyed is None:
        return True
    lora = request.lora_request
    return adapters.version(keyed[0], keyed[1], reloaded=lora is not None and lora.load_inplace) == keyed[2]


def encode(value: Any) -> bytes:
    """Canonical bytes of vLLM's extra keys (nested tuples of str, bytes, int, float, None):
    type-tagged and length-prefixed, so no two different keys encode alike, in any process."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"T" if value else b"F"
    if isinstance(value, int):
        return b"I" + str(value).encode() + b";"
    if isinstance(value, float):
        return b"D" + value.hex().encode() + b";"
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        return b"S" + str(len(raw)).encode() + b":" + raw
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return b"B" + str(len(raw)).encode() + b":" + raw
    if isinstance(value, (tuple, list)):
        return b"(" + b"".join(encode(v) for v in value) + b")"
    raise TypeError(f"kvstrata: cannot key on a vLLM extra key of type {type(value).__name__}: {value!r}")
