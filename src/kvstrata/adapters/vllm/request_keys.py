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

Multimodal items are the exception: vLLM names an item by its ``identifier``, which may be a
per-process counter or a client's ``multi_modal_uuids`` value, not its content. Its keys are
dropped and each block instead carries ``("mm", content, offset in the block)`` for every item
that overlaps it, ``content`` being the digest of the item's processed tensors
(``mm_items.item_digest``), its modality and its placeholder's embedding mask. An item that cannot
be hashed gets random bytes there: its blocks and all after them are this request's alone.

Whether the per-block part is needed is asked of vLLM's own function once per request (over the
whole prompt), so a future vLLM that keys blocks on a new input is covered without a change here;
a prompt with embedding rows or multimodal items needs it anyway, and is not asked (for embedding
rows that would hash every row once more: each block's rows are hashed, once, by vLLM and by its
own digest). A value of a kind this module cannot encode canonically gives its block a random
digest (logged once): the block is then never shared, never served as another request's.
The token ids are ``request.all_token_ids``, what vLLM hashes: embedding positions hold 0 there,
and their rows are in the digest.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvstrata.adapter_versions import AdapterVersions
from kvstrata.keys import Extra, digest16, extra_digest

from kvstrata.adapters.vllm.mm_items import item_digest

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
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
    """``keys.BlockInputs`` of one request: per block, the request-wide digest, what
    ``generate_block_hash_extra_keys`` gives for the block's token range but its multimodal keys,
    and the content of the multimodal items that overlap the range (cached per range)."""

    def __init__(self, request: "Request", base: bytes) -> None:
        self._request = request
        self._base = base
        self._digests: dict[tuple[int, int], bytes] = {}
        self._contents: list[bytes] = []  # per item of request.mm_features, in order: its content digest
        self._starts = self._ends = np.zeros(0, np.int64)
        self._add_items()  # now, while the EngineCore holds the items' data

    def digest(self, start: int, end: int) -> bytes:
        out = self._digests.get((start, end))
        if out is None:
            keys, _ = generate_block_hash_extra_keys(self._request, start, end, 0)
            own = [k for k in keys or () if not _request_wide(k) and not _item_name(k)]  # the rest: base, contents
            own += self._items_in(start, end)
            try:
                out = digest16(self._base + encode(own)) if own else self._base
            except TypeError as e:  # a kind of input no key can name: this block is this request's alone
                if not _unencodable:
                    log.warning("%s; such blocks are keyed apart and never shared", e)
                _unencodable.add(type(e))
                out = os.urandom(len(self._base))
            self._digests[(start, end)] = out
        return out

    def _items_in(self, start: int, end: int) -> list[tuple[str, bytes, int]]:
        """``("mm", content, offset - start)`` of each item whose placeholder overlaps
        ``[start, end)`` (vLLM's ``_gen_mm_extra_hash_keys`` rule), in prompt order."""
        if len(self._request.mm_features) != len(self._contents):
            self._add_items()  # items added to a running request (streaming input)
        if not self._contents:
            return []
        hit = np.flatnonzero((self._starts < end) & (self._ends > start))
        return [("mm", self._contents[i], int(self._starts[i]) - start) for i in hit]

    def _add_items(self) -> None:
        features = self._request.mm_features
        self._contents += [_content(f) for f in features[len(self._contents):]]
        self._starts = np.array([f.mm_position.offset for f in features], np.int64)
        self._ends = self._starts + np.array([f.mm_position.length for f in features], np.int64)


def _content(feature: "MultiModalFeatureSpec") -> bytes:
    """What one multimodal item of a request is keyed on: its processed data's digest, its modality
    and which of its placeholder's tokens take its embeddings; random bytes when its data cannot
    be hashed (``mm_items``: counted and logged there)."""
    data = item_digest(feature.data)
    if data is None:
        return os.urandom(16)
    mask = feature.mm_position.is_embed
    return digest16(encode((feature.modality, data, None if mask is None else mask.to(torch.uint8).numpy().tobytes())))


_unencodable: set[type] = set()  # logged once per process


def request_keys(request: "Request", adapters: AdapterVersions) -> RequestKeys | None:
    """The keys of ``request``'s blocks, or None when it must not be served or stored: its LoRA
    adapter's files changed since this engine loaded it (``AdapterVersions``)."""
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
        wide.append(f"lora:{lora.lora_name}:{lora.lora_path}:{version}")
    base = extra_digest(wide)
    if request.prompt_embeds is None and not request.mm_features:
        keys, _ = generate_block_hash_extra_keys(request, 0, request.num_prompt_tokens, 0)
        if not keys or all(_request_wide(k) for k in keys):
            return RequestKeys(tokens, base, adapter)
    return RequestKeys(tokens, EngineBlockInputs(request, base), adapter)


def _request_wide(key: Any) -> bool:
    return isinstance(key, tuple) and bool(key) and key[0] in REQUEST_WIDE


def _item_name(key: Any) -> bool:
    """vLLM's key of a multimodal item (``("mm", identifier, offset)``): replaced by its content."""
    return isinstance(key, tuple) and bool(key) and key[0] == "mm"


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
