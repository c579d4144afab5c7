"""format/auth.py: keyed authentication (a MAC) of what kvstrata reads back from a tier other hosts can
write: the shared tier (Redis, Redis Cluster, the shared folder) and, with ``l2.authenticate``,
the disk tier. Without it, whoever can write there decides which KV is served (checksums catch
damage, not forgery); with it, only a holder of the deployment secret can.

The secret: ``remote.auth_key_file`` (a file that holds it; the YAML names the file, never the
secret), else ``$KVSTRATA_AUTH_KEY``. At least 32 bytes (e.g. ``openssl rand -hex 32``); leading
and trailing whitespace is ignored. The MAC is keyed BLAKE3 (``blake3`` wheel: ~4.7 GB/s on one
core here, against ~1.3 GB/s for HMAC-SHA256 and ~0.5 GB/s for keyed BLAKE2b) under a key derived
from the secret, with a 128-bit tag.

What is covered (``Auth``):

- A block (a Redis payload value, a shared-folder or L2 file): the tag sits in the header's
  padding (``format.block.TAG_AT``), and covers the tier (``domain``), the storage key the reader asked
  for, every header field (key, parent, namespace, epoch, fingerprint, size, token count, tail
  flag, payload checksum) and every payload byte. So a forged payload (its xxh3 recomputed
  or not), a header rewritten to another namespace or epoch, a valid block copied to another key
  or tier: each fails. A block that passes is what a holder of the secret wrote for that key, so
  its payload is not checksummed again (the MAC replaces the xxh3 pass on reads).
- A Redis index entry: the header plus a tag over (domain, storage key, header).
- Control values: an epoch (``<epoch>:<tag hex>:<counter>``, bound to the namespace's storage
  name; the counter under the MAC makes a value written back from an older copy a refused replay:
  ``epochs/floor.py``), a namespace descriptor (``<json>\\n<tag hex>``), an epoch announcement
  (``<ns hex>:<tag hex>``).

Not covered: tail sets (a forged member costs one index probe, which is authenticated); replays
of other values once valid (an old block value is only valid under its own key and epoch); L1
(process memory).

The secret also keys the AEAD of a confidential tier (``remote.encrypt``, ``l2.encrypt``:
``seal``): ``aead_key`` derives one key per namespace from it, under another context.

Different secrets live apart: the key space (Redis names, the shared folder's subfolder) carries
``key_id``, a 32-bit id derived from the secret, so that deployments (tenants) with different
secrets on one Redis never look up, count or delete each other's values, and anything planted
in a space without its secret fails the MAC.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Sequence

from kvstrata.format.block import HEADER_SIZE, TAG_AT, TAG_SIZE, Mismatch, pack_header, stored_header
from kvstrata.index import EntryMeta

ENV = "KVSTRATA_AUTH_KEY"
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
_CONTEXT = "kvstrata 2026-12 tier MAC v1"
_AEAD_CONTEXT = "kvstrata 2026-12 tier AEAD v1"  # a root independent of the MAC key (``seal``)


class SecretError(ValueError):
    """A secret that cannot be used: missing, unreadable, too short or too long."""


def read_secret_file(path: Path) -> bytes:
    """The secret a key file holds (whitespace-trimmed); SecretError saying what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SECRET_BYTES + 1)
    except OSError as e:
        raise SecretError(f"cannot read the key file {path}: {e.strerror or e}") from None
    return check_secret(raw, f"the key file {path}")


def check_secret(raw: bytes, where: str) -> bytes:
    secret = raw.strip()
    if len(raw) > MAX_SECRET_BYTES:
        raise SecretError(f"{where} holds over {MAX_SECRET_BYTES} bytes; expected a secret of "
                          f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{where} holds a secret of {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
                          "needed (e.g. `openssl rand -hex 32`)")
    return secret


def load_secret(key_file: Path | None) -> bytes | None:
    """The deployment secret: ``key_file``'s, else ``$KVSTRATA_AUTH_KEY``'s, else None."""
    if key_file is not None:
        return read_secret_file(key_file)
    env = os.environ.get(ENV)
    if env:
        return check_secret(env.encode(), f"${ENV}")
    return None


def _blake3():  # imported only where a secret is configured
    try:
        import blake3
    except ImportError as e:  # a dependency of kvstrata; say what to install if it is missing
        raise RuntimeError(f"an authenticated tier needs the blake3 package ({e}): pip install blake3") from e
    return blake3.blake3


class Auth:
    """MACs under one deployment secret (see the module docstring)."""

    def __init__(self, secret: bytes) -> None:
        b3 = _blake3()
        self._b3 = b3
        self._key = b3(secret, derive_key_context=_CONTEXT).digest()
        self._aead_root = b3(secret, derive_key_context=_AEAD_CONTEXT).digest()
        self.key_id = b3(b"key id", key=self._key).hexdigest(4)

    def aead_key(self, ns_seed: bytes) -> bytes:
        """The 256-bit AEAD key of one namespace (``seal``): keyed BLAKE3 of its seed under a root
        derived from the secret. The seed includes the tenant, so this is a per-tenant key."""
        return self._b3(b"namespace:" + ns_seed, key=self._aead_root).digest()

    def _mac(self, kind: bytes, name: bytes, parts: Sequence[bytes | memoryview]) -> bytes:
        h = self._b3(key=self._key)
        h.update(len(kind).to_bytes(2, "little") + kind + len(name).to_bytes(2, "little") + name)
        for part in parts:
            h.update(part)
        return h.digest(TAG_SIZE)

    # ------------------------------------------------------------ blocks
    def block_tag(self, domain: bytes, key: bytes, header: bytes | bytearray | memoryview,
                  payload: Sequence[memoryview]) -> bytes:
        return self._mac(b"block:" + domain, key, [bytes(header[:TAG_AT]), *payload])

    def seal_header(self, domain: bytes, meta: EntryMeta, payload: Sequence[memoryview]) -> bytes:
        """``meta``'s header with the tag of (domain, key, header, payload) in it."""
        return pack_header(meta, self.block_tag(domain, meta.key, pack_header(meta), payload))

    def verify_block(self, domain: bytes, meta: EntryMeta, header: bytes | bytearray | memoryview,
                     payload_size: int, payload: Sequence[memoryview], where: str) -> Mismatch | None:
        """``format.block.verify_block`` for a sealed block: the MAC first (a failure is kind ``auth``),
        then the header against ``meta``. The payload's xxh3 is not recomputed: the MAC covers it."""
        if len(header) < HEADER_SIZE:
            return Mismatch("auth", f"{where}: {len(header)} header bytes")
        if payload_size != meta.size:
            return Mismatch("wrong_size", f"it holds {payload_size} payload bytes, the index entry says {meta.size}")
        tag = self.block_tag(domain, meta.key, header, payload)
        if not hmac.compare_digest(tag, bytes(header[TAG_AT : TAG_AT + TAG_SIZE])):
            return Mismatch("auth", "it fails its MAC (forged, or written for another key, namespace, epoch or "
                                    "secret)")
        stored = stored_header(header, meta, where)
        return stored if isinstance(stored, Mismatch) else None

    # ------------------------------------------------------------ index entries and control values
    def tag(self, kind: bytes, name: str | bytes, value: bytes | bytearray | memoryview) -> bytes:
        return self._mac(kind, name.encode() if isinstance(name, str) else name, [value])

    def check(self, kind: bytes, name: str | bytes, value: bytes | bytearray | memoryview, tag: bytes) -> bool:
        return hmac.compare_digest(self.tag(kind, name, value), bytes(tag))

    def seal_text(self, kind: bytes, name: str, text: bytes, sep: bytes = b":") -> bytes:
        """``text`` + ``sep`` + the tag in hex (text values: epochs, descriptors, announcements)."""
        return text + sep + self.tag(kind, name, text).hex().encode()

    def open_text(self, kind: bytes, name: str, sealed: object, sep: bytes = b":") -> bytes | None:
        """The text of ``sealed`` if its tag is right, else None (anything else: never raises)."""
        if isinstance(sealed, str):
            sealed = sealed.encode("utf-8", "replace")
        if not isinstance(sealed, (bytes, bytearray)):
            return None
        text, found, tag_hex = bytes(sealed).rpartition(sep)
        tag_hex = tag_hex.strip()
        if not found or len(tag_hex) != 2 * TAG_SIZE:
            return None
        try:
            tag = bytes.fromhex(tag_hex.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        return text if self.check(kind, name, text, tag) else None


def open_auth(key_file: Path | None) -> Auth | None:
    """The ``Auth`` of the configured secret, or None when none is configured."""
    secret = load_secret(key_file)
    return None if secret is None else Auth(secret)
