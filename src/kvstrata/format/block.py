"""format/block.py: a stored block's bytes (disk files, remote values): the 128-byte header, then the
payload. Owns ``pack_header`` / ``unpack_header``, the payload checksum, and ``verify_block``: the
one check of a block read back from a tier that leaves the process.

Layout (little endian): magic ``KVSB``, format version u16, flags u16 (bit 0: partial block;
bit 1: sealed, the payload is AEAD ciphertext: see ``seal``), key, parent key and namespace seed
(16 B each), fingerprint, payload checksum (xxh3-64 of the stored payload bytes: the ciphertext
of a sealed block), epoch and payload size (u64 each), token count u32, the MAC or AEAD tag (16
bytes, zero unless the tier is authenticated: see ``auth``), the AEAD nonce (12 bytes, zero
unless sealed; padding in headers written before it), then an xxh3-64 of the preceding 120 bytes.
Nothing read back is trusted: every field is bounds-checked and the header has its own checksum,
so a torn or foreign file is rejected before its size is used. Never pickle.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import xxhash

from kvstrata.index import EntryMeta
from kvstrata.keys import FORMAT_VERSION

MAGIC = b"KVSB"
HEADER = struct.Struct("<4sHH16s16s16sQQQQI16s12s")
HEADER_SIZE = HEADER.size + 8
MAX_BLOCK_BYTES = 1 << 32
_TAIL, _SEALED = 1, 2  # flag bits
FLAGS_AT = 6
CHECKSUM_AT = 64  # the payload checksum's 8 bytes (a sealed block's AEAD covers the header without them)
TAG_AT, TAG_SIZE = 92, 16  # where the MAC tag sits (``auth``): right after the fields it covers
NONCE_AT, NONCE_SIZE = 108, 12  # a sealed block's AEAD nonce (``seal``): the former padding
NO_TAG, NO_NONCE = bytes(TAG_SIZE), bytes(NONCE_SIZE)
assert HEADER_SIZE == 128 and struct.calcsize("<4sHH16s16s16sQQQQI") == TAG_AT == NONCE_AT - TAG_SIZE
assert struct.calcsize("<4sHH16s16s16sQ") == CHECKSUM_AT and struct.calcsize("<4sH") == FLAGS_AT


class FormatError(ValueError):
    """A stored header is not a valid kvstrata block header.

    ``corrupt`` is False only for a well-formed header of another format version (a different
    kvstrata may share the folder: leave its files alone); everything else is damage.
    """

    def __init__(self, message: str, corrupt: bool = True) -> None:
        super().__init__(message)
        self.corrupt = corrupt


def pack_header(meta: EntryMeta, tag: bytes = NO_TAG, nonce: bytes | None = None) -> bytes:
    """``meta``'s header; with a ``nonce``, a sealed block's (the sealed flag set, ``seal``)."""
    flags = (_TAIL if meta.tail else 0) | (0 if nonce is None else _SEALED)
    body = HEADER.pack(
        MAGIC, FORMAT_VERSION, flags, meta.key, meta.parent, meta.ns_seed,
        meta.fp, meta.checksum, meta.epoch, meta.size, meta.ntok, tag, NO_NONCE if nonce is None else nonce,
    )
    return body + xxhash.xxh3_64_digest(body)


def is_sealed(header: bytes | bytearray | memoryview) -> bool:
    """Whether ``header`` (at least its first 8 bytes) has the sealed flag: AEAD ciphertext follows."""
    return bool(header[FLAGS_AT] & _SEALED)


def unpack_header(buf: bytes | memoryview, where: str = "block") -> EntryMeta:
    """Parse and check a header; raise FormatError naming ``where`` and the bad field."""
    if len(buf) < HEADER_SIZE:
        raise FormatError(f"{where}: header truncated ({len(buf)} < {HEADER_SIZE} bytes)")
    body = bytes(buf[: HEADER.size])
    if xxhash.xxh3_64_digest(body) != bytes(buf[HEADER.size : HEADER_SIZE]):
        raise FormatError(f"{where}: header checksum mismatch")
    magic, version, flags, key, parent, ns_seed, fp, checksum, epoch, size, ntok, _tag, _nonce = HEADER.unpack(body)
    if magic != MAGIC:
        raise FormatError(f"{where}: bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"{where}: format version {version}, expected {FORMAT_VERSION}", corrupt=False)
    if not 0 < size <= MAX_BLOCK_BYTES:
        raise FormatError(f"{where}: payload size {size} out of range (0, {MAX_BLOCK_BYTES}]")
    if not 0 < ntok < 1 << 24:
        raise FormatError(f"{where}: token count {ntok} out of range")
    return EntryMeta(key, parent, fp, ntok, ns_seed, epoch, size, checksum, bool(flags & _TAIL))


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def payload_hasher() -> "xxhash.xxh3_64":
    """A streaming ``payload_checksum``: ``update`` it with the payload in pieces, then ``intdigest``."""
    return xxhash.xxh3_64()


def payload_checksum_of(parts: Sequence[memoryview]) -> int:
    """``payload_checksum`` of the concatenation of ``parts``, streamed without joining them.

    xxh3's streaming digest equals its one-shot digest of the same bytes, so a payload written or
    read as scattered runs (an engine's host pool page) carries the same checksum as a contiguous one.
    """
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


class Mismatch(NamedTuple):
    """Why a stored block is not the block asked for. ``kind``: ``bad_header`` (not a header of
    this format), ``wrong_key`` (another block's header), ``wrong_size`` (sizes disagree) or
    ``checksum`` (payload bytes changed); with a secret (``auth``), ``auth`` (it fails its MAC). ``corrupt`` is False only for a well-formed header of
    another format version: not this kvstrata's to delete."""

    kind: str
    why: str
    corrupt: bool = True


def stored_header(header: bytes | bytearray, meta: EntryMeta, where: str) -> Mismatch | EntryMeta:
    """The block ``header`` describes, or why it is not the block ``meta`` names (another format,
    another block or epoch, another size)."""
    try:
        stored = unpack_header(header, where)
    except FormatError as e:
        return Mismatch("bad_header", str(e), e.corrupt)
    if (stored.key, stored.parent, stored.ns_seed, stored.epoch, stored.fp, stored.ntok, stored.tail) != (
            meta.key, meta.parent, meta.ns_seed, meta.epoch, meta.fp, meta.ntok, meta.tail):
        return Mismatch("wrong_key", f"it holds another block or epoch: block {stored.key.hex()}, "
                                     f"parent {stored.parent.hex()}, epoch {stored.epoch}")
    if stored.size != meta.size:
        return Mismatch("wrong_size", f"its header says {stored.size} bytes, the index entry {meta.size}")
    return stored


def verify_block(meta: EntryMeta, header: bytes | bytearray, payload_size: int,
                 payload: Sequence[memoryview], where: str) -> Mismatch | None:
    """Check a block read back from a tier against ``meta``, the entry it was read for: its
    ``header`` bytes, ``payload_size`` (the payload bytes the tier holds) and the ``payload`` read
    (runs, checksummed as one). None when it is that block, intact.

    The fast path is one comparison with the header ``meta`` packs to. Otherwise the header is
    parsed, only to say what is wrong, to learn a checksum ``meta`` lacks, or to accept the same
    block written again by another writer, with its own checksum. A sealed (encrypted) block is
    a ``bad_header`` here: only a tier that holds its key reads it (``seal``)."""
    if len(header) > FLAGS_AT and is_sealed(header):
        return Mismatch("bad_header", "it is sealed (encrypted), and this tier holds no key to open it")
    if not meta.checksum or header != pack_header(meta):
        stored = stored_header(header, meta, where)
        if isinstance(stored, Mismatch):
            return stored
        meta = stored
    if payload_size != meta.size:
        return Mismatch("wrong_size", f"it holds {payload_size} payload bytes, its header says {meta.size}")
    if payload_checksum_of(payload) != meta.checksum:
        return Mismatch("checksum", "payload checksum mismatch")
    return None
