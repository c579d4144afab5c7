"""``python -m benchmarks remote``'s AEAD figures: one core's throughput of the two AEADs a
confidential tier could use (``remote.encrypt``; ``kvstrata.format.seal`` chose AES-256-GCM), at
the block sizes the benchmark moves (256 KiB values, 3 MiB hit blocks) and beside them.

- ``aes256gcm_seal_gbps`` / ``aes256gcm_open_gbps``: ``Seal.seal`` / ``Seal.open`` as the tiers call
  them (OpenSSL's streaming GCM, detached tag, header built, ciphertext xxh3 on seal);
- ``aes256gcm_gbps``, ``chacha20poly1305_gbps``: the bare one-shot encryption (``encrypt_into``) of
  each cipher, so that the two compare on equal terms.

Single thread, medians of 5 passes over at least 64 MiB each.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

from kvstrata.format.auth import Auth
from kvstrata.format.block import HEADER_SIZE, payload_checksum
from kvstrata.format.seal import Seal
from kvstrata.index import EntryMeta

SIZES = (64 << 10, 256 << 10, 1 << 20, 3 << 20)


def _gbps(size: int, fn: Callable[[], Any]) -> float:
    reps = max(4, (64 << 20) // size)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return round(size / statistics.median(times) / 1e9, 2)


def aead_gbps(sizes: tuple[int, ...] = SIZES) -> dict[str, dict[str, float]]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    seal, key, aad, nonce = Seal(Auth(os.urandom(32))), os.urandom(32), os.urandom(HEADER_SIZE), os.urandom(12)
    aes, chacha = AESGCM(key), ChaCha20Poly1305(key)
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        payload = os.urandom(size)
        meta = EntryMeta(b"k" * 16, b"p" * 16, 1, 16, b"n" * 16, 1, size, payload_checksum(payload))
        sealed, opened, tagged = bytearray(size), bytearray(size), bytearray(size + 16)
        header = seal.seal(b"redis", meta, [memoryview(payload)], memoryview(sealed))
        ciphertext = memoryview(bytes(sealed))

        def open_() -> None:
            assert seal.open(b"redis", meta, header, size, ciphertext, [memoryview(opened)], "bench") is None

        out[f"{size >> 10}KiB"] = {
            "aes256gcm_seal_gbps": _gbps(size, lambda: seal.seal(b"redis", meta, [memoryview(payload)],
                                                                 memoryview(sealed))),
            "aes256gcm_open_gbps": _gbps(size, open_),
            "aes256gcm_gbps": _gbps(size, lambda: aes.encrypt_into(nonce, payload, aad, tagged)),
            "chacha20poly1305_gbps": _gbps(size, lambda: chacha.encrypt_into(nonce, payload, aad, tagged)),
        }
    return out
