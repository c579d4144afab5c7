"""key_schemes.py: how block keys and fingerprints are computed: ``KeyScheme`` (``root_key``,
``group_root``, ``chain_keys``, ``chain_digests``, ``rooted_digests``, ``block_key``), its two
schemes (``Blake3Keys``, the default, collision resistant and keyed by the deployment secret;
``Xxh3Keys``, the keys before schemes), the registry ``SCHEMES`` and ``key_scheme``. ``keys``
says what goes into a key and why; it re-exports all of this.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from itertools import accumulate
from typing import Callable, ClassVar, Sequence

import blake3
import numpy as np
import xxhash

from kvstrata.block_inputs import NO_EXTRA, TOKEN_DTYPE, BlockChain, Extra, as_tokens

FP_SEED = 0x6B7673747261  # "kvstra": seeds xxh3's independent fingerprint

_h128 = xxhash.xxh3_128_digest
_h64 = xxhash.xxh3_64_intdigest


KeyFp = Callable[[bytes], "tuple[bytes, int]"]


class KeyScheme(ABC):
    """How block keys and fingerprints are computed: a scheme names the hash (``name``), roots a
    namespace's chain (``root_key``, ``group_root``), hashes one block's data into its key and
    fingerprint (``hasher``) and runs a chain (``_chain``, its own loop: the hot path); what goes
    into each block is built here, the same for every scheme."""

    name: ClassVar[str]
    collision_resistant: ClassVar[bool]
    keyed: bool  # whether a deployment secret keys it (its keys cannot be computed without it)

    @abstractmethod
    def hasher(self) -> KeyFp:
        """A function from one block's data to its (16-byte key, 64-bit fingerprint), for the
        calling thread only (it may keep hashing state between calls): one per chain."""

    @staticmethod
    @abstractmethod
    def namespace_seed(blob: bytes) -> bytes:
        """The 16-byte seed of a namespace's canonical JSON: unkeyed (``keys`` says why)."""

    @abstractmethod
    def _chain(self, prev: bytes, blob: bytes, bounds: Sequence[int]) -> tuple[list[bytes], list[int]]:
        """Keys and fingerprints of the blocks ``H(key_{i-1} || blob[bounds[i]:bounds[i + 1]])``,
        ``key_{-1}`` being ``prev``."""

    @abstractmethod
    def root_key(self, ns_seed: bytes, epoch: int) -> bytes:
        """Key of block -1: the namespace seed combined with the namespace's epoch."""

    @abstractmethod
    def group_root(self, root: bytes, tag: bytes) -> bytes:
        """Key of block -1 of one KV-cache group of a hybrid model, under ``root``.

        Every group (full attention, sliding window, SSM state) keeps its own chain under the one
        namespace and epoch (``root`` is ``root_key(seed, epoch)``), so a single ``invalidate`` or
        epoch confirmation covers all groups at once; the tag only separates their keys."""

    def describe(self) -> str:
        """For the start-up log line; never the secret."""
        return f"{self.name}, keyed by the deployment secret" if self.keyed else self.name

    def chain_keys(self, root: bytes, tokens: np.ndarray, block_size: int, extra: Extra = NO_EXTRA, *,
                   partial: bool = True, limit: int | None = None) -> BlockChain:
        """Keys for the full blocks of ``tokens`` (and the trailing partial block if ``partial``).

        The blocks' token ids and extra digests are laid out in one buffer by numpy (each block's
        ``token ids || extra digest`` after the other), then each block costs one slice, one
        concatenation with its parent key and one hash: no per-token Python work. ``limit`` stops
        after that many blocks. ``extra``: one digest for every block, or ``BlockInputs`` asked for
        each block's.
        """
        tokens = as_tokens(tokens)
        n_full = len(tokens) // block_size
        n = n_full + (1 if partial and len(tokens) % block_size else 0)
        if limit is not None:
            n, n_full = min(n, limit), min(n_full, limit)
        if isinstance(extra, bytes):
            extras = np.frombuffer(extra, np.uint8)
        else:  # the last block may be the partial tail
            extras = np.frombuffer(b"".join(extra.digest(i * block_size, min((i + 1) * block_size, len(tokens)))
                                            for i in range(n)), np.uint8).reshape(n, len(NO_EXTRA))
        step = block_size * TOKEN_DTYPE.itemsize
        rows = np.empty((n_full, step + len(NO_EXTRA)), np.uint8)
        rows[:, :step] = tokens[: n_full * block_size].view(np.uint8).reshape(n_full, step)
        rows[:, step:] = extras[:n_full] if extras.ndim == 2 else extras
        blob = rows.tobytes()
        bounds = list(range(0, len(blob) + 1, rows.shape[1]))
        lengths = [block_size] * n_full
        if n > n_full:  # the partial tail: fewer token bytes, so a key of its own
            tail = tokens[n_full * block_size:]
            blob += tail.tobytes() + (extras[n_full] if extras.ndim == 2 else extras).tobytes()
            bounds.append(len(blob))
            lengths.append(len(tail))
        keys, fps = self._chain(root, blob, bounds)
        return BlockChain(keys, [root, *keys[:-1]], fps, lengths)

    def chain_digests(self, root: bytes, digests: Sequence[bytes], ntok: int) -> BlockChain:
        """Chain keys over blocks an engine already identifies by digests (e.g. a trace's hash ids).

        ``key_i = H(key_{i-1} || digest_i)``: the index then checks the parent chain exactly as
        for token blocks, and the fingerprint covers the whole prefix of digests. ``digests`` must
        start at the first block of the sequence (the engine's prefix keys included).
        """
        keys, fps = self._chain(root, b"".join(digests), [0, *accumulate(len(d) for d in digests)])
        return BlockChain(keys, [root, *keys[:-1]], fps, [ntok] * len(keys))

    def rooted_digests(self, root: bytes, digests: Sequence[bytes], ntok: int) -> BlockChain:
        """Keys for blocks whose engine digests already chain the whole prefix (SGLang's page hash):
        block i is keyed by ``H(root || digest_i)``, under ``root`` alone rather than under block
        i-1, so that it is found whatever the engine still caches before it."""
        key_fp = self.hasher()
        pairs = [key_fp(root + d) for d in digests]
        return BlockChain([k for k, _ in pairs], [root] * len(pairs), [f for _, f in pairs], [ntok] * len(pairs))

    def block_key(self, parent: bytes, tokens: np.ndarray, extra: bytes = NO_EXTRA) -> tuple[bytes, int]:
        """Key and fingerprint of one block (full or partial) after ``parent``."""
        return self.hasher()(parent + as_tokens(tokens).tobytes() + extra)


class Xxh3Keys(KeyScheme):
    """``xxh3``: XXH3-128 keys, seeded XXH3-64 fingerprints, two calls per block; no secret (a
    seeded xxh3 is no keyed hash). The keys kvstrata wrote before key schemes."""

    name = "xxh3"
    collision_resistant = False

    def __init__(self, secret: bytes | None = None) -> None:
        self.keyed = False  # the secret is ignored: these keys stay those written before schemes

    def hasher(self) -> KeyFp:
        return _xxh3_key_fp

    def _chain(self, prev: bytes, blob: bytes, bounds: Sequence[int]) -> tuple[list[bytes], list[int]]:
        keys: list[bytes] = []
        fps: list[int] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            data = prev + blob[a:b]
            prev = _h128(data)
            keys.append(prev)
            fps.append(_h64(data, FP_SEED))
        return keys, fps

    @staticmethod
    def namespace_seed(blob: bytes) -> bytes:
        return _h128(blob)

    def root_key(self, ns_seed: bytes, epoch: int) -> bytes:
        return _h128(ns_seed + epoch.to_bytes(8, "little"))

    def group_root(self, root: bytes, tag: bytes) -> bytes:
        return _h128(root + tag)


def _xxh3_key_fp(data: bytes) -> tuple[bytes, int]:
    return _h128(data), _h64(data, FP_SEED)


_KEY_FP = struct.Struct("<16sQ")  # 24 bytes of BLAKE3 output: the key, then the fingerprint


class Blake3Keys(KeyScheme):
    """``blake3``: one keyed BLAKE3 call per block (24 bytes out: key and fingerprint), keyed by a
    key derived from the deployment secret, else from a public constant. Roots (``root_key``,
    ``group_root``) are hashed under a second derived key, so no root is ever a block's key."""

    name = "blake3"
    collision_resistant = True
    _CONTEXT = "kvstrata 2026-12 block keys v1"  # apart from the MAC's key (auth._CONTEXT)
    _NS_CONTEXT = "kvstrata 2026-12 namespace seed v1"

    def __init__(self, secret: bytes | None = None) -> None:
        b3 = blake3.blake3
        self.keyed = secret is not None
        master = b3(secret or b"", derive_key_context=self._CONTEXT).digest()
        self._blocks = b3(key=b3(b"blocks", key=master).digest())
        self._roots = b3(key=b3(b"roots", key=master).digest())

    def hasher(self) -> KeyFp:
        # One hasher per chain, returned to its keyed state by ``reset``: cheaper than a copy per block.
        h = self._blocks.copy()
        reset, update, digest, unpack = h.reset, h.update, h.digest, _KEY_FP.unpack

        def key_fp(data: bytes) -> tuple[bytes, int]:
            reset()
            update(data)
            return unpack(digest(24))

        return key_fp

    def _chain(self, prev: bytes, blob: bytes, bounds: Sequence[int]) -> tuple[list[bytes], list[int]]:
        h = self._blocks.copy()  # as ``hasher``, inlined: this loop is a lookup's hot path
        reset, update, digest, unpack = h.reset, h.update, h.digest, _KEY_FP.unpack
        keys: list[bytes] = []
        fps: list[int] = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            reset()
            update(prev + blob[a:b])
            prev, fp = unpack(digest(24))
            keys.append(prev)
            fps.append(fp)
        return keys, fps

    @staticmethod
    def namespace_seed(blob: bytes) -> bytes:
        return blake3.blake3(blob, derive_key_context=Blake3Keys._NS_CONTEXT).digest(16)

    def _root(self, kind: bytes, data: bytes) -> bytes:
        h = self._roots.copy()
        h.update(kind + data)
        return h.digest(16)

    def root_key(self, ns_seed: bytes, epoch: int) -> bytes:
        return self._root(b"epoch:", ns_seed + epoch.to_bytes(8, "little"))

    def group_root(self, root: bytes, tag: bytes) -> bytes:
        return self._root(b"group:", root + tag)


SCHEMES: dict[str, type[KeyScheme]] = {s.name: s for s in (Blake3Keys, Xxh3Keys)}


def key_scheme(name: str, secret: bytes | None = None) -> KeyScheme:
    """The scheme ``name`` (``SCHEMES``), keyed by ``secret`` where the scheme is keyed."""
    if name not in SCHEMES:
        raise ValueError(f"key scheme {name!r} is not one of {sorted(SCHEMES)}")
    return SCHEMES[name](secret)
