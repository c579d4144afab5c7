"""The content digest of a vLLM multimodal item: ``item_digest``.

vLLM names each multimodal item of a request by its ``identifier``, which is a content hash only in
vLLM's default setup: with prefix caching off and ``mm_processor_cache_gb=0`` it is a per-process
counter (``renderer0-mm-1-image-0`` again after every restart), and a client's
``multi_modal_uuids`` value (or an image's EXIF ImageID) becomes the identifier as given. A
shared store keyed on it would serve one image's KV for another's. kvstrata keys an item on what
the model computes from instead: the processed tensors the EngineCore holds
(``MultiModalFeatureSpec.data``, a ``MultiModalKwargsItem``).

The digest is BLAKE3 over a canonical, length-framed encoding of every key of the item (sorted),
its field's kind and the parameters that change what the model computes (a flat field's ``dim``;
not a batch's ``slices`` or ``batch_size``, which depend on the other items processed with it,
nor ``keep_on_cpu``, a placement), and each tensor's dtype, shape and bytes (hashed from a byte
view, no per-element work). An item is hashed once for as long as it lives: vLLM's LRU receiver
cache hands one object to every request that reuses the item.

An item with no tensors to hash (its data stripped, the address of SHM-cached data, a value of a
kind this module does not canonicalize) has no digest (None): the caller keys it apart
(``unhashed_items`` counts them; logged once per process).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

import blake3
import torch

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalKwargsItem

log = logging.getLogger(__name__)

SCHEME = b"kvstrata-mm-item/1\x00"  # changes whenever the encoding below does


class Unhashable(TypeError):
    """A value of an item this module cannot hash canonically."""


def item_digest(item: "MultiModalKwargsItem | None") -> bytes | None:
    """16-byte content digest of ``item``, or None when it has no content that can be hashed
    (counted: ``unhashed_items``). Cached per item object while it lives."""
    if item is None:
        return _unhashed("its data is not in the EngineCore")
    key = id(item)
    entry = _cache.get(key)
    if entry is not None and entry[0]() is item:  # a dead object's id may be reused: check identity
        return entry[1]
    try:
        digest = _hash_item(item)
    except Unhashable as e:
        return _unhashed(str(e))
    try:
        ref = weakref.ref(item, _forget(key))
    except TypeError:  # an object without weakref support: hashed per request
        return digest
    _cache[key] = (ref, digest)
    return digest


def unhashed_items() -> int:
    """Items of this process that got no digest so far."""
    return _unhashed_count


# id(item) -> (a weak reference to it, its digest); the entry goes when the item does
_cache: dict[int, tuple[weakref.ref, bytes]] = {}
_unhashed_count = 0
_unhashed_lock = threading.Lock()


def _forget(key: int) -> Any:
    def callback(ref: weakref.ref) -> None:
        entry = _cache.get(key)
        if entry is not None and entry[0] is ref:
            _cache.pop(key, None)
    return callback


def _unhashed(why: str) -> None:
    global _unhashed_count
    with _unhashed_lock:
        _unhashed_count += 1
        first = _unhashed_count == 1
    if first:
        log.warning("kvstrata: a multimodal item cannot be keyed by its content (%s); the blocks from such an item "
                    "on are keyed apart and never shared (logged once per process)", why)
    return None


def _hash_item(item: "MultiModalKwargsItem") -> bytes:
    h = blake3.blake3(SCHEME)
    if not item:
        raise Unhashable("an empty item")
    keys = list(item.keys())
    if not all(isinstance(k, str) for k in keys):
        raise Unhashable("an item key that is not a string")
    for name in sorted(keys):
        elem = item[name]
        field = getattr(elem, "field", None)
        if field is None:
            raise Unhashable(f"item key {name!r} holds no field element")
        _frame(h, name.encode())
        _frame(h, type(field).__name__.encode())
        _frame(h, str(getattr(field, "dim", "")).encode())  # a flat field's concatenation axis
        _value(h, elem.data)
    return h.digest(16)


def _value(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        _tensor(h, value)
    elif isinstance(value, (list, tuple)):  # NestedTensors: a tuple is a list to the model
        h.update(b"L" + len(value).to_bytes(8, "little"))
        for v in value:
            _value(h, v)
    elif value is None:
        raise Unhashable("its data was stripped (None)")
    else:  # e.g. the int address of SHM-cached data: names the data, is not its content
        raise Unhashable(f"a value of type {type(value).__name__}")


def _tensor(h: Any, t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.is_quantized:
        raise Unhashable(f"a tensor of layout {t.layout}")
    if t.device.type != "cpu":
        t = t.cpu()  # data decoded on an accelerator and handed over as is (rare): copied once to hash
    h.update(b"T")
    _frame(h, str(t.dtype).encode())
    _frame(h, b"".join(int(n).to_bytes(8, "little") for n in t.shape))
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    h.update(raw.numel().to_bytes(8, "little"))
    if raw.numel():
        h.update(memoryview(raw.numpy()))


def _frame(h: Any, chunk: bytes) -> None:
    h.update(len(chunk).to_bytes(8, "little"))
    h.update(chunk)
