"""keys.py: content addressing: ``Namespace`` (with its seed) and chained block keys
(``root_key``, ``group_root``, ``chain_keys``, ``chain_digests``, ``block_key``), and the extra
digest of what a block's KV depends on beyond its token ids (``extra_digest``, ``BlockInputs``).

A *namespace* names everything that makes KV bytes incompatible (engine, model and weights version,
KV dtype and layout, parallel rank, storage format, tenant). Its seed, together with the namespace's
current epoch, is the key of block -1. The key of block i is::

    data_i = key_{i-1} || token ids of block i (one uint32-LE ``tobytes()``) || extra digest (16 B)
    key_i  = xxh3_128(data_i)
    fp_i   = xxh3_64(data_i, seed=FP_SEED)

The extra digest carries every input of a request that changes the KV and is not in its token ids
(cache salt, LoRA adapter, multimodal items, prompt embeddings). Request-wide inputs give one digest
for every block (``bytes``); inputs that belong to positions (an image, embedding rows) give each
block the digest of the inputs that overlap it (a ``BlockInputs``, which the engine's adapter
derives from the engine's own per-block hash inputs), so blocks before the first such position
keep the keys of the same tokens in any other request, and the chain carries the rest.

``fp_i`` is an independent 64-bit fingerprint of the same data. The index stores it (plus the parent
key and the token count) instead of the token ids: 8 bytes instead of ``4 * block_size`` bytes, and
because ``key_{i-1}`` already covers the whole prefix, a matching fingerprint confirms the whole
prefix, not only the block. The extra digest is always 16 bytes, so the byte length of ``data_i``
encodes the token count and a partial block is a different key from any full block.

Nothing here depends on PYTHONHASHSEED or any random state: keys are identical across processes and
machines (tests pin golden vectors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol, Sequence, Union

import numpy as np
import xxhash

FORMAT_VERSION = 1
FP_SEED = 0x6B7673747261  # "kvstra": seeds the independent fingerprint
TOKEN_DTYPE = np.dtype("<u4")
NO_EXTRA = xxhash.xxh3_128_digest(b"")

_h128 = xxhash.xxh3_128_digest
_h64 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two KV blocks to be interchangeable."""

    engine: str
    model: str
    model_version: str
    kv_dtype: str
    layout: str  # per-layer shape signature, e.g. "24x[2,64,128]"
    block_size: int
    rank: int = 0
    world_size: int = 1
    tenant: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict[str, str] = field(default_factory=dict)  # engine-specific identity (e.g. PP rank)

    def __hash__(self) -> int:
        return hash(self.seed)

    @cached_property
    def seed(self) -> bytes:
        """16-byte namespace fingerprint: xxh3-128 of the canonical JSON of all fields."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return _h128(blob)

    @property
    def id(self) -> str:
        """Short printable id (first 8 bytes of the seed), used in file names, stats and the CLI."""
        return self.seed[:8].hex()


def root_key(ns_seed: bytes, epoch: int) -> bytes:
    """Key of block -1: the namespace seed combined with the namespace's epoch."""
    return _h128(ns_seed + epoch.to_bytes(8, "little"))


def group_root(root: bytes, tag: bytes) -> bytes:
    """Key of block -1 of one KV-cache group of a hybrid model: ``xxh3_128(root || tag)``.

    Every group (full attention, sliding window, SSM state) keeps its own chain under the one
    namespace and epoch (``root`` is ``root_key(seed, epoch)``), so a single ``invalidate`` or epoch
    confirmation covers all groups at once; the tag only separates their keys."""
    return _h128(root + tag)


def extra_digest(extra_keys: Sequence[object] | None) -> bytes:
    """16-byte digest of per-request extra keys (LoRA id, multimodal hashes, cache salt)."""
    if not extra_keys:
        return NO_EXTRA
    return _h128(json.dumps([str(k) for k in extra_keys], separators=(",", ":")).encode())


class BlockInputs(Protocol):
    """The inputs a request's blocks depend on beyond their token ids, block by block."""

    def digest(self, start: int, end: int) -> bytes:
        """The 16-byte extra digest of the block of tokens ``[start, end)`` (a full block or a
        partial tail): the same range of the same request always gives the same digest."""


Extra = Union[bytes, BlockInputs]  # one digest for every block, or one per block


def extra_at(extra: Extra, start: int, end: int) -> bytes:
    """The extra digest of the block of tokens ``[start, end)``."""
    return extra if isinstance(extra, bytes) else extra.digest(start, end)


def as_tokens(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous uint32-LE array (no copy when already so)."""
    return np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE)


class BlockChain(NamedTuple):
    """Keys of consecutive blocks; ``parents[i]`` is the key before ``keys[i]``."""

    keys: list[bytes]
    parents: list[bytes]
    fps: list[int]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def pick(self, idx: Sequence[int]) -> "BlockChain":
        """The blocks ``idx`` (any order, gaps allowed): the index checks each block against its
        own parent, so a chain need not be contiguous to be validated or stored."""
        return BlockChain(*([part[i] for i in idx] for part in self))


def chain_keys(
    root: bytes,
    tokens: np.ndarray,
    block_size: int,
    extra: Extra = NO_EXTRA,
    *,
    partial: bool = True,
    limit: int | None = None,
) -> BlockChain:
    """Keys for the full blocks of ``tokens`` (and the trailing partial block if ``partial``).

    One ``tobytes()`` for the whole prompt, then one slice and two hash calls per block: no
    per-token Python work. ``limit`` stops after that many blocks. ``extra``: one digest for
    every block, or ``BlockInputs`` asked for each block's.
    """
    buf = as_tokens(tokens).tobytes()
    step = block_size * TOKEN_DTYPE.itemsize
    n_full = len(buf) // step
    ends = list(range(step, n_full * step + 1, step))
    if partial and len(buf) % step:
        ends.append(len(buf))
    if limit is not None:
        ends = ends[:limit]
    keys: list[bytes] = []
    fps: list[int] = []
    prev, start = root, 0
    size = TOKEN_DTYPE.itemsize
    for end in ends:  # per block, not per token: one slice, one concatenation, two hashes
        data = prev + buf[start:end] + (extra if isinstance(extra, bytes) else extra.digest(start // size, end // size))
        prev = _h128(data)
        keys.append(prev)
        fps.append(_h64(data, FP_SEED))
        start = end
    lengths = [block_size] * len(keys)
    if keys and ends[-1] - (ends[-2] if len(ends) > 1 else 0) != step:
        lengths[-1] = (ends[-1] % step) // TOKEN_DTYPE.itemsize
    return BlockChain(keys, [root, *keys[:-1]], fps, lengths)


def chain_digests(root: bytes, digests: Sequence[bytes], ntok: int) -> BlockChain:
    """Chain keys over blocks an engine already identifies by digests (e.g. SGLang's page hashes).

    ``key_i = xxh3_128(key_{i-1} || digest_i)``: the index then checks the parent chain exactly as
    for token blocks, and the fingerprint covers the whole prefix of digests. ``digests`` must
    start at the first block of the sequence (the engine's prefix keys included).
    """
    keys: list[bytes] = []
    fps: list[int] = []
    prev = root
    for d in digests:
        data = prev + d
        prev = _h128(data)
        keys.append(prev)
        fps.append(_h64(data, FP_SEED))
    return BlockChain(keys, [root, *keys[:-1]], fps, [ntok] * len(keys))


def rooted_digests(root: bytes, digests: Sequence[bytes], ntok: int) -> BlockChain:
    """Keys for blocks whose engine digests already chain the whole prefix (SGLang's page hash):
    block i is keyed by ``xxh3_128(root || digest_i)``, under ``root`` alone rather than under
    block i-1, so that it is found whatever the engine still caches before it."""
    data = [root + d for d in digests]
    return BlockChain([_h128(x) for x in data], [root] * len(data), [_h64(x, FP_SEED) for x in data],
                      [ntok] * len(data))


def block_key(parent: bytes, tokens: np.ndarray, extra: bytes = NO_EXTRA) -> tuple[bytes, int]:
    """Key and fingerprint of one block (full or partial) after ``parent``."""
    data = parent + as_tokens(tokens).tobytes() + extra
    return _h128(data), _h64(data, FP_SEED)
