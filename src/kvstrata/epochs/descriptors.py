"""epochs/descriptors.py: namespace descriptors, what a namespace id stands for (``encode``, ``decode``,
``matches_model``; in a folder ``read_descriptor``, ``write_descriptor``), so that ``kvstrata stats`` names the model and ``kvstrata invalidate --model``
finds its namespaces.

The store knows a namespace only by its seed, a hash of every field of ``keys.Namespace``. An
adapter calls ``BlockStore.describe(ns)`` once at start; the store gives ``encode(ns)`` to its
epoch store, which keeps it beside the namespace's epoch: ``<epochs folder>/<seed hex>.json``
on disk, ``P:ns:<seed hex>`` in Redis. A CLI on any host that shares that state can then name the
model. Nothing here runs on a lookup or save path.

A descriptor is read back as untrusted input (any process that can write the folder or the Redis
can put anything there): at most ``MAX_BYTES`` are read, never through a symlink or from a FIFO,
and it is accepted only if its fields hash to the seed it is stored under. Garbage, a truncated
file, or a well-formed descriptor of another namespace (one that would name the wrong model) is
ignored; the store counts it (``bad_descriptors``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from kvstrata.epochs.base import read_head, write_atomic
from kvstrata.keys import LEGACY_KEY_SCHEME, SCHEMES, Namespace

MAX_BYTES = 16 * 1024  # a namespace's fields are well under 1 KiB; a model path is at most 4 KiB
SUFFIX = ".json"  # a descriptor file is the epoch file's name plus this
_VERSION = 1
# The JSON type of each Namespace field: decoding checks these before building a Namespace.
_TYPES: dict[str, type] = {"engine": str, "model": str, "model_version": str, "kv_dtype": str, "layout": str,
                           "block_size": int, "rank": int, "world_size": int, "tenant": str,
                           "format_version": int, "extra": dict, "key_scheme": str}
assert set(_TYPES) == {f.name for f in fields(Namespace)}, "describe._TYPES must list every Namespace field"


def encode(ns: Namespace) -> bytes | None:
    """The descriptor of ``ns`` (UTF-8 JSON), or None if it would exceed ``MAX_BYTES``."""
    blob = json.dumps({"kvstrata_namespace": _VERSION, "namespace": asdict(ns)}, sort_keys=True,
                      separators=(",", ":")).encode()
    return blob if len(blob) <= MAX_BYTES else None


def decode(raw: object, seed: bytes) -> Namespace | None:
    """The namespace a stored descriptor describes, or None unless it is a descriptor whose fields
    hash to ``seed``. Any type, size or content is answered, never raised on."""
    if not isinstance(raw, (bytes, bytearray)) or not raw or len(raw) > MAX_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: deeply nested arrays
        return None
    if not isinstance(data, dict) or data.get("kvstrata_namespace") != _VERSION:
        return None
    values = data.get("namespace")
    if isinstance(values, dict) and "key_scheme" not in values:  # described before key schemes: xxh3
        values["key_scheme"] = LEGACY_KEY_SCHEME
    if not isinstance(values, dict) or set(values) != set(_TYPES):
        return None
    for name, kind in _TYPES.items():
        value = values[name]
        if not isinstance(value, kind) or isinstance(value, bool):  # bool is an int to isinstance
            return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in values["extra"].items()):
        return None
    if values["key_scheme"] not in SCHEMES:  # a later kvstrata's scheme, or garbage
        return None
    ns = Namespace(**values)
    return ns if ns.seed == seed else None


def matches_model(ns: Namespace, wanted: str) -> bool:
    """Whether ``wanted`` (what an operator typed: a hub id, a served path, a relative path) names
    the model of ``ns``: the same text, or the same file or folder once paths are resolved."""
    if ns.model == wanted or ns.model.rstrip("/") == wanted.rstrip("/"):
        return True
    if not os.path.exists(wanted) or not os.path.exists(ns.model):
        return False
    try:
        return os.path.samefile(wanted, ns.model)
    except OSError:
        return False


def read_descriptor(root: Path, ns_seed: bytes) -> bytes | None:
    """A namespace's descriptor file in ``root`` as stored (untrusted, at most one byte over the
    limit, so that an oversized one shows): None if there is none, ``b""`` if what is there is
    not a readable regular file (a planted link, FIFO or folder)."""
    try:
        return read_head(root / f"{ns_seed.hex()}{SUFFIX}", MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError:
        return b""


def write_descriptor(root: Path, ns_seed: bytes, blob: bytes, mode: int) -> None:
    """Replace the descriptor file atomically, unless it already holds ``blob``. Raises OSError."""
    if read_descriptor(root, ns_seed) != blob:  # every instance describes at start: write once
        write_atomic(root / f"{ns_seed.hex()}{SUFFIX}", blob.decode("ascii"), mode)
