"""Content versions of the adapters (LoRA) an engine serves: ``AdapterVersions``.

An adapter's name and integer id say nothing about its weights: a name can be re-pointed at
another folder, a folder overwritten in place, and a restarted engine numbers its adapters from 1
again. So an adapter is keyed by its files, fingerprinted as a model folder is
(``identity.model_identity``: cached by file stat in ``identity.json``).
"""

from __future__ import annotations

import logging
import threading

from kvstrata.identity import model_files, model_identity

__all__ = ["AdapterVersions"]

log = logging.getLogger(__name__)


class AdapterVersions:
    """Content versions of the adapters an engine serves, as the engine loaded them: fingerprinted
    once per (id, path) an engine loads, and checked again (one ``stat`` per file) at every use.
    When the files change under a running engine, what the engine holds is unknown (it keeps the
    adapter it loaded until it evicts it, then reads the new files), so the adapter has no version
    in this process
    (``version`` returns None: the caller serves and stores nothing for it) and a warning says so;
    unless the caller says the engine re-reads the files at this use (vLLM's ``load_inplace``),
    in which case the new files are fingerprinted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], tuple[str | None, tuple]] = {}  # (id, path) -> (version, stat)

    def version(self, adapter_id: int, path: str, *, reloaded: bool = False) -> str | None:
        """The version of the adapter ``adapter_id`` loaded from ``path``; None when this process
        cannot know which files the engine holds (changed since it loaded them)."""
        signature = _signature(path)
        with self._lock:
            seen = self._seen.get((adapter_id, path))
        if seen is not None and seen[1] == signature and (seen[0] is not None or not reloaded):
            return seen[0]
        if seen is not None and not reloaded:
            if seen[0] is not None:
                log.warning("kvstrata: the files of adapter %d at %s changed after this engine loaded it; it gets no "
                            "cache hits and stores nothing in this process (restart the engine, or load the new "
                            "files under a new path or with load_inplace)", adapter_id, path)
            with self._lock:
                self._seen[(adapter_id, path)] = (None, signature)
            return None
        version = model_identity(path).version
        with self._lock:
            self._seen[(adapter_id, path)] = (version, signature)
        return version


def _signature(path: str) -> tuple:
    """(name, size, mtime, inode) of every file of an adapter: what tells a rewrite apart."""
    try:
        return tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino) for rel, _, st in model_files(path))
    except OSError:
        return ()
