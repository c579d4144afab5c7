"""keys.py: content addressing: ``Namespace`` (with its seed), and, re-exported from the modules
that hold them, the key schemes that chain block keys (``key_schemes``: ``KeyScheme`` with
``root_key``, ``group_root``, ``chain_keys``, ``chain_digests``, ``rooted_digests``,
``block_key``; the registry ``SCHEMES`` and ``key_scheme``) and the extra digest of what a block's
KV depends on beyond its token ids (``block_inputs``: ``extra_digest``, ``BlockInputs``). The
module functions ``root_key``, ``chain_keys``, ... are the xxh3 scheme's.

A *namespace* names everything that makes KV bytes incompatible (engine, model and weights version,
KV dtype and layout, parallel rank, storage format, tenant, key scheme). Its seed, together with
the namespace's current epoch, is the key of block -1. The key of block i is::

    data_i       = key_{i-1} || token ids of block i (one uint32-LE ``tobytes()``) || extra digest (16 B)
    key_i, fp_i  = H(data_i)          (a 16-byte key and a 64-bit fingerprint)

``H`` is the store's key scheme (``keys.hash`` in the config, ``SCHEMES``):

- ``blake3`` (the default): one keyed BLAKE3 call per block with 24 bytes of output, the key its
  first 16 and the fingerprint its last 8. The BLAKE3 key is derived from the deployment secret
  (``remote.auth_key_file`` or ``$KVSTRATA_AUTH_KEY``, the one the shared tier's MAC uses, under
  another context) where one is set, else from a public constant. Collision resistant: whoever
  chooses prompts cannot search for two blocks with one key, as they can under xxh3 (vLLM moved
  its own prefix hash to SHA-256 for this, CVE-2025-25183), and without the secret cannot even
  compute a key. The index matches key and fingerprint together, 192 bits of one output.
- ``xxh3``: ``key_i = xxh3_128(data_i)``, ``fp_i = xxh3_64(data_i, seed=FP_SEED)``: kvstrata's
  keys before schemes existed (caches written then stay readable under ``keys.hash: xxh3``).
  Fast, not collision resistant, never keyed.

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

The namespace seed is the scheme's *unkeyed* hash of the namespace's canonical JSON (its public
name: file names, ``kvstrata stats``, descriptors any CLI checks); the secret enters at block -1,
so every key below it is keyed. The scheme's name is a field of the namespace, so two schemes never
share a namespace (``xxh3`` namespaces leave it out of the JSON and keep their old seeds).

Nothing here depends on PYTHONHASHSEED or any random state: keys are identical across processes and
machines that hold the same secret (tests pin golden vectors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

from kvstrata.block_inputs import NO_EXTRA, TOKEN_DTYPE, BlockChain, BlockInputs, Extra, as_tokens, digest16, extra_at, \
    extra_digest
from kvstrata.key_schemes import FP_SEED, SCHEMES, Blake3Keys, KeyScheme, Xxh3Keys, key_scheme

__all__ = ["DEFAULT_KEY_SCHEME", "FORMAT_VERSION", "FP_SEED", "LEGACY_KEY_SCHEME", "NO_EXTRA", "SCHEMES", "TOKEN_DTYPE",
           "XXH3", "Blake3Keys", "BlockChain", "BlockInputs", "Extra", "KeyScheme", "Namespace", "Xxh3Keys",
           "as_tokens", "block_key", "digest16", "chain_digests", "chain_keys", "extra_at", "extra_digest", "group_root",
           "key_scheme", "root_key", "rooted_digests"]

FORMAT_VERSION = 1
DEFAULT_KEY_SCHEME = "blake3"
LEGACY_KEY_SCHEME = "xxh3"  # the keys before schemes: its namespaces keep their seeds


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
    key_scheme: str = DEFAULT_KEY_SCHEME  # ``SCHEMES``: a store keys every namespace by its own (``BlockStore``)

    def __post_init__(self) -> None:
        if self.key_scheme not in SCHEMES:
            raise ValueError(f"key scheme {self.key_scheme!r} is not one of {sorted(SCHEMES)}")

    def __hash__(self) -> int:
        return hash(self.seed)

    @cached_property
    def seed(self) -> bytes:
        """16-byte namespace fingerprint: the key scheme's unkeyed hash of the canonical JSON of
        all fields (``xxh3``: all but ``key_scheme``, the JSON of namespaces before schemes)."""
        fields = asdict(self)
        if self.key_scheme == LEGACY_KEY_SCHEME:
            del fields["key_scheme"]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return SCHEMES[self.key_scheme].namespace_seed(blob)

    @property
    def id(self) -> str:
        """Short printable id (first 8 bytes of the seed), used in file names, stats and the CLI."""
        return self.seed[:8].hex()


# The xxh3 scheme's functions, as module functions: for ``keys.hash: xxh3``, the golden vectors,
# and tools that key data no store shares. A store's keys are ``BlockStore.keys``.
XXH3 = Xxh3Keys()
root_key = XXH3.root_key
group_root = XXH3.group_root
chain_keys = XXH3.chain_keys
chain_digests = XXH3.chain_digests
rooted_digests = XXH3.rooted_digests
block_key = XXH3.block_key
