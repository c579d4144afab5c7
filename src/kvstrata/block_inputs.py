"""block_inputs.py: what a block's key is made of beside its parent key, and what a chain of keys
is: token ids as one uint32-LE buffer (``as_tokens``), the 16-byte extra digest of the inputs
beyond them (``extra_digest``, ``BlockInputs``, ``extra_at``) and ``BlockChain``. The key schemes
(``key_schemes``) hash these; ``keys`` re-exports them beside ``Namespace``.
"""

from __future__ import annotations

import json
from typing import NamedTuple, Protocol, Sequence, Union

import blake3
import numpy as np
import xxhash

TOKEN_DTYPE = np.dtype("<u4")
NO_EXTRA = xxhash.xxh3_128_digest(b"")


def extra_digest(extra_keys: Sequence[object] | None) -> bytes:
    """16-byte digest of per-request extra keys (cache salt, LoRA adapter, multimodal items): BLAKE3
    of their JSON list, collision resistant as the keys are (a user chooses a salt and an image)."""
    if not extra_keys:
        return NO_EXTRA
    return digest16(json.dumps([str(k) for k in extra_keys], separators=(",", ":")).encode())


def digest16(data: bytes) -> bytes:
    """16 bytes of BLAKE3 over ``data``: the extra digests' hash (``extra_digest``, the adapters'
    per-block inputs)."""
    return blake3.blake3(data).digest(16)


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
