"""format/seal.py: the confidential tier (``remote.encrypt``, ``l2.encrypt``): ``Seal`` encrypts and
authenticates a block's payload in one AEAD operation, so that whoever reads the shared tier
(a Redis dump, the shared folder's files) without the deployment secret learns no payload byte.

- Cipher: AES-256-GCM (``cryptography``'s OpenSSL), chosen over ChaCha20-Poly1305 by measurement
  on this machine (one core: ~12-13 GB/s against ~3.7 GB/s, ``docs/consistency.md``); its
  streaming interface takes a detached tag (the tag lives in the header, so a value stays
  header + payload in size), writes straight into the destination (``update_into``: no copy
  besides the cipher's own pass) and releases the GIL (the pool of ``tiers/redis.py`` decrypts a
  large hit on several cores).
- Key: one per namespace, ``Auth.aead_key`` (keyed BLAKE3 of the namespace seed under a root
  derived from the secret with its own context; cached, ``_MAX_KEYS``). The seed includes
  ``namespace.tenant``, so keys are per tenant. Each block is sealed under a subkey of it, the
  keyed BLAKE3 of the block key (one ~1 us call per block).
- Nonce: 96 random bits per write (``os.urandom``), in the header's nonce field. Under per-block
  subkeys two writes share a key only when they write the same block again, so the bound on
  random GCM nonces (2^32 messages per key, NIST SP 800-38D) is never approached, however many
  blocks a namespace writes.
- Associated data: what the MAC of an authenticated tier covers (``auth``): the tier (domain),
  the storage key the reader asked for and every header field before the tag (key, parent,
  namespace, epoch, fingerprint, size, token count, flags), except the payload checksum: a
  sealed header holds the xxh3 of the *ciphertext* (the checksum of the plaintext would let a
  reader confirm a guessed payload), computed after the cipher ran, and it stays checkable by
  ``kvstrata check`` without the secret.

A value that fails (not sealed, another key, namespace, epoch or tier, one flipped bit) is a
``Mismatch`` of kind ``auth``; the caller counts it as a MAC failure. Decryption writes into the
destination before the tag is checked: on failure the destination holds garbage, never to be used.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

from kvstrata.format.auth import Auth
from kvstrata.format.block import (CHECKSUM_AT, HEADER_SIZE, NONCE_AT, NONCE_SIZE, TAG_AT, TAG_SIZE, Mismatch,
                                   is_sealed, pack_header, payload_checksum, stored_header)
from kvstrata.index import EntryMeta

_MAX_KEYS = 4096  # cached namespace keys; past it the cache starts again (a key is one BLAKE3 call)
_NO_CHECKSUM = bytes(8)


def _cipher():  # imported only where a tier is sealed
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError as e:  # a dependency of kvstrata; say what to install if it is missing
        raise RuntimeError(f"an encrypted tier needs the cryptography package ({e}): pip install cryptography") from e
    return Cipher, algorithms.AES, modes.GCM, InvalidTag


class Seal:
    """AES-256-GCM of block payloads under per-namespace keys of one deployment secret."""

    def __init__(self, auth: Auth) -> None:
        import blake3  # a dependency of kvstrata (``auth``)

        self._auth = auth
        self._b3 = blake3.blake3
        self._cipher, self._aes, self._gcm, self._invalid = _cipher()
        self._keys: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _key(self, meta: EntryMeta) -> bytes:
        """The AES-256 key of block ``meta``: its namespace's key, narrowed to its block key."""
        ns_key = self._keys.get(meta.ns_seed)
        if ns_key is None:
            ns_key = self._auth.aead_key(meta.ns_seed)
            with self._lock:
                if len(self._keys) >= _MAX_KEYS:
                    self._keys.clear()
                self._keys[meta.ns_seed] = ns_key
        return self._b3(meta.key, key=ns_key).digest()

    @staticmethod
    def _aad(domain: bytes, key: bytes, header: bytes | bytearray | memoryview) -> bytes:
        """(tier, storage key, header before the tag with the checksum field zeroed), length-prefixed
        as the MAC's inputs are (``Auth._mac``)."""
        kind = b"block:" + domain
        return b"".join((len(kind).to_bytes(2, "little"), kind, len(key).to_bytes(2, "little"), key,
                         bytes(header[:CHECKSUM_AT]), _NO_CHECKSUM, bytes(header[CHECKSUM_AT + 8 : TAG_AT])))

    def scratch(self, nbytes: int) -> memoryview:
        """A per-thread buffer of ``nbytes`` (reused across calls) for ciphertext on its way to or
        from a file: a fresh one per block would be page-faulted every time."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    def seal(self, domain: bytes, meta: EntryMeta, parts: Sequence[memoryview], out: memoryview) -> bytes:
        """Encrypt the payload ``parts`` (``meta.size`` bytes in all) into ``out`` (as many bytes,
        not overlapping them) and return the sealed header to store before it."""
        nonce = os.urandom(NONCE_SIZE)
        enc = self._cipher(self._aes(self._key(meta)), self._gcm(nonce)).encryptor()
        enc.authenticate_additional_data(self._aad(domain, meta.key, pack_header(meta, nonce=nonce)))
        at = 0
        for part in parts:
            n = part.nbytes
            enc.update_into(part, out[at : at + n])
            at += n
        assert at == meta.size == out.nbytes, "the payload runs must fill meta.size bytes"
        enc.finalize()
        return pack_header(meta._replace(checksum=payload_checksum(out)), enc.tag, nonce)

    def open(self, domain: bytes, meta: EntryMeta, header: bytes | bytearray | memoryview, payload_size: int,
             sealed: memoryview, parts: Sequence[memoryview], where: str) -> Mismatch | None:
        """Decrypt the stored payload ``sealed`` (read under ``meta.key``) into ``parts`` (writable
        runs of ``meta.size`` bytes) and check it: None when it is that block, sealed by a holder
        of the secret; else why not (kind ``auth`` when the AEAD fails or the value is not sealed)."""
        if len(header) < HEADER_SIZE:
            return Mismatch("auth", f"{where}: {len(header)} header bytes")
        if payload_size != meta.size or sealed.nbytes != meta.size:
            return Mismatch("wrong_size", f"it holds {payload_size} payload bytes, the index entry says {meta.size}")
        if not is_sealed(header):
            return Mismatch("auth", "it is not sealed (a plaintext value in an encrypted tier)")
        tag = bytes(header[TAG_AT : TAG_AT + TAG_SIZE])
        nonce = bytes(header[NONCE_AT : NONCE_AT + NONCE_SIZE])
        dec = self._cipher(self._aes(self._key(meta)), self._gcm(nonce, tag)).decryptor()
        dec.authenticate_additional_data(self._aad(domain, meta.key, header))
        at = 0
        for part in parts:
            n = part.nbytes
            dec.update_into(sealed[at : at + n], part)
            at += n
        try:
            dec.finalize()
        except self._invalid:
            return Mismatch("auth", "it fails its AEAD tag (forged, damaged, or sealed for another key, namespace, "
                                    "epoch or secret)")
        stored = stored_header(header, meta, where)
        return stored if isinstance(stored, Mismatch) else None
