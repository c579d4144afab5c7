"""tools/torture/oracle.py: the checks that trust nothing the store says. Every payload is a
function of its block key (``payloads_of``); after a load the keys are recomputed from the tokens
(``expected_keys``) and compared (``check_load``); ``RetiredLog`` is the append-only record of
retired epochs that tells a stale load."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from kvstrata.keys import KeyScheme, Namespace

from kvstrata.tools.torture.world import PAYLOAD_BYTES

_RAMP = (np.arange(PAYLOAD_BYTES, dtype=np.uint32) * 7 % 251).astype(np.uint8)

def payloads_of(keys: Sequence[bytes], size: int = PAYLOAD_BYTES) -> np.ndarray:
    """``[len(keys), size]`` uint8: row i is block i's payload, a function of its key alone."""
    k = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), 16)
    return np.tile(k, (1, size // 16)) ^ _RAMP[:size]


def expected_keys(keys: KeyScheme, ns: Namespace, epoch: int, tokens: np.ndarray,
                  lengths: Sequence[int]) -> list[bytes | None]:
    """The keys of a hit of ``lengths`` on ``tokens`` under ``epoch``, recomputed from the tokens
    with ``keys`` (the scheme the store's config names, built from the config, not asked of the
    store): full blocks from the chain, a last block shorter than a block from its tokens.
    None where the lengths cannot describe a prefix of ``tokens`` (no payload can match)."""
    bs = ns.block_size
    root = keys.root_key(ns.seed, epoch)
    full = keys.chain_keys(root, tokens, bs, partial=False, limit=len(lengths)).keys
    out: list[bytes | None] = []
    for i, n in enumerate(lengths):
        if n == bs and i < len(full):
            out.append(full[i])
        elif 0 < n < bs and i == len(lengths) - 1 and i <= len(full) and i * bs + n <= len(tokens):
            out.append(keys.block_key(full[i - 1] if i else root, tokens[i * bs : i * bs + n])[0])
        else:
            out.append(None)
    return out


class RetiredLog:
    """Append-only record of retired epochs, shared by every process of a run.

    One line per retirement: ``<monotonic ns when done> <why> <pid> <epoch> ...``. Lines are
    written with one ``write`` on an ``O_APPEND`` descriptor (atomic among appenders on a local
    filesystem), and read incrementally; only complete lines are parsed.
    """

    def __init__(self, path: Path, grace_s: float = 0.0) -> None:
        self.path = Path(path)
        self.grace_ns = int(grace_s * 1e9)
        self._lock = threading.Lock()
        self._offset = 0
        self._retired: dict[int, dict[str, int]] = {}  # epoch -> why -> earliest (monotonic ns)

    def retire(self, epochs: Sequence[int], done_ns: int, why: str) -> None:
        if not epochs:
            return
        line = f"{done_ns} {why} {os.getpid()} {' '.join(str(int(g)) for g in epochs)}\n".encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _refresh(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            done, why = int(fields[0]), fields[1].decode()
            for g in fields[3:]:
                seen = self._retired.setdefault(int(g), {})
                seen[why] = min(done, seen.get(why, done))

    def retired_before(self, epoch: int, started_ns: int) -> list[str]:
        """How ``epoch`` had been retired (``invalidate``, ``loss``) before ``started_ns``,
        the grace included; empty if it had not."""
        with self._lock:
            self._refresh()
            seen = dict(self._retired.get(int(epoch), {}))
        return sorted(why for why, done in seen.items() if done + self.grace_ns < started_ns)


def check_load(keys: KeyScheme, ns: Namespace, tokens: np.ndarray, epoch: int, lengths: Sequence[int],
               out: np.ndarray, started_ns: int, oracle: RetiredLog) -> tuple[int, int, list[str]]:
    """(wrong, stale, how the epoch was retired) for the loaded blocks ``out``
    (``[n, PAYLOAD_BYTES]``) of a hit of ``lengths`` under ``epoch``, looked up from ``started_ns``."""
    n = len(out)
    if not n:
        return 0, 0, []
    expected = expected_keys(keys, ns, epoch, tokens, lengths[:n])
    known = [i for i, k in enumerate(expected) if k is not None]
    wrong = n - len(known)
    if known:
        want = payloads_of([k for k in expected if k is not None])
        wrong += int((out[known] != want).any(axis=1).sum())
    why = oracle.retired_before(epoch, started_ns)
    return wrong, n if why else 0, why
