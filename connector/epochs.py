"""Namespace epochs: bumping one hides every older entry of that namespace at once.

The epoch is part of block -1's key (see keys.root_key), so after a bump no key of the old epoch
is ever computed again, and the index also rejects any entry whose epoch differs. Where the epoch
lives decides who sees a bump: ``MemoryEpochs`` (this process), ``FileEpochs`` (every process
sharing a folder: one small file per namespace, replaced atomically, checked with one stat()).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path


class EpochStore(ABC):
    @abstractmethod
    def get(self, ns_seed: bytes) -> int:
        """Current epoch of a namespace (0 if never bumped)."""

    @abstractmethod
    def bump(self, ns_seed: bytes) -> int:
        """Advance the epoch; returns the new value."""

    def known(self) -> list[bytes]:
        """Namespace seeds this store has an epoch for."""
        return []

    def close(self) -> None:
        """Stop background work (subscribers); epochs already written stay."""


class MemoryEpochs(EpochStore):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: dict[bytes, int] = {}

    def get(self, ns_seed: bytes) -> int:
        return self._epochs.get(ns_seed, 0)

    def bump(self, ns_seed: bytes) -> int:
        with self._lock:
            self._epochs[ns_seed] = self._epochs.get(ns_seed, 0) + 1
            return self._epochs[ns_seed]

    def known(self) -> list[bytes]:
        return list(self._epochs)


class FileEpochs(EpochStore):
    """``<root>/<seed hex>``: the epoch as text. Readers re-read only when stat() shows a change.

    No locks (NFS has none): two concurrent bumps may both write old+1, which still hides every
    older entry; that is all a bump has to do.
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cache: dict[bytes, tuple[tuple[int, int, int], int]] = {}

    def _path(self, ns_seed: bytes) -> Path:
        return self._root / ns_seed.hex()

    def get(self, ns_seed: bytes) -> int:
        path = self._path(ns_seed)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return 0
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(ns_seed)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            value = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            return cached[1] if cached else 0
        with self._lock:
            self._cache[ns_seed] = (stamp, value)
        return value

    def bump(self, ns_seed: bytes) -> int:
        with self._lock:
            self._cache.pop(ns_seed, None)
        value = self.get(ns_seed) + 1
        path = self._path(ns_seed)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(f"{value}\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return value

    def known(self) -> list[bytes]:
        return [bytes.fromhex(p.name) for p in self._root.iterdir() if not p.name.startswith(".")]
