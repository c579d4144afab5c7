"""Model identity: the weights version a namespace is keyed on, and whether it can be trusted.

KV computed with one set of weights is wrong for any other, and every block's namespace covers the
model version, so the version must change whenever the weights' bytes change. That includes a
fine-tune saved over the old files (same names, same sizes). It must also stay the same across
restarts and machines while the bytes are the same, or nothing is ever reused. Hashing every weight
byte would take minutes on a large model at every start, so a model folder is fingerprinted
cheaply:

- files under 1 MiB (config, tokenizer, ...) and text files under 64 MiB are hashed whole;
- a larger file (weights) gives its size, its safetensors header (8-byte length and JSON: dtypes,
  shapes, offsets) and an xxh3 of fixed windows, read with ``os.pread`` on one open file: 64 evenly
  spaced 4 KiB windows (first and last included) and the first 4 KiB of up to 192 tensors (every
  tensor of a typical shard), so new values in any tensor are seen, however small the tensor;
- a snapshot in a Hugging Face hub cache (``models--org--name/snapshots/<commit>/``) adds its commit.

Per-file results are cached in ``$KVSTRATA_CACHE_DIR/identity.json`` (default
``~/.cache/kvstrata``) keyed by (path, size, mtime_ns, inode), so a restart costs one ``stat()`` per
file. A file modified less than 2 s ago is not cached: it may still be being written, and a rewrite
within the file system's timestamp granularity would keep its mtime (git's "racy clean" rule).

A hub id is looked up in the local hub cache (``refs/<revision>`` names the commit). When identity
cannot be established, the version is random per process and ``trusted`` is False: local tiers
still work inside the process, but nothing is shared across restarts or instances under a guessed
identity. ``namespace.model_version`` in the YAML overrides all of this (``resolve_model_version``).

Limit: a change confined to bytes no window covers (a few values in the middle of a large tensor,
leaving its size, header and first 4 KiB alone) is not seen; set ``namespace.model_version`` when
weights are edited that way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import xxhash

__all__ = ["ModelIdentity", "model_identity", "resolve_model_version", "hub_cache_dir", "cache_path"]

log = logging.getLogger(__name__)

SMALL_FILE = 1 << 20  # hashed whole below this size
TEXT_FILE = 64 << 20  # text files (tokenizer.json can be several MiB) hashed whole below this size
TEXT_SUFFIXES = frozenset({".json", ".txt", ".model", ".jinja", ".py", ".tiktoken", ".vocab", ".md"})
WINDOW = 4096
SPACED_WINDOWS = 64
TENSOR_WINDOWS = 192
MAX_HEADER = 100 << 20  # the safetensors format's own limit
RACY_NS = 2_000_000_000
CACHE_FORMAT = 1
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")

_unverified: dict[tuple[str, str | None], str] = {}  # per process: one random version per model


class ModelIdentity(NamedTuple):
    version: str  # goes into Namespace.model_version
    trusted: bool  # False: random per process, never shared across restarts or instances
    source: str  # how it was established, for logs


def resolve_model_version(cfg_version: str | None, model: str, revision: str | None = None, *,
                          hub_cache: str | None = None) -> str:
    """The adapters' model version: ``namespace.model_version`` when set, else ``model_identity``."""
    if cfg_version is not None:
        return cfg_version
    ident = model_identity(model, revision, hub_cache=hub_cache)
    log.info("kvstrata: model version %s (%s)", ident.version, ident.source)
    return ident.version


def model_identity(model: str, revision: str | None = None, *, hub_cache: str | None = None) -> ModelIdentity:
    """Identity of ``model``: a local folder or single-file model (GGUF), or a hub id resolved in
    the local hub cache (``hub_cache``, default ``hub_cache_dir()``). Reads sampled bytes of files it
    has not seen with this (size, mtime, inode) before; logs one warning per model and process when
    untrusted."""
    if os.path.exists(model):
        folder, commit = model, _snapshot_commit(model)
    else:
        found = _hub_snapshot(model, revision, hub_cache or hub_cache_dir())
        if found is None:
            return _unverified_identity(model, revision, "not a local folder, and not in the local hub "
                                        f"cache {hub_cache or hub_cache_dir()} at {revision or 'main'}")
        folder, commit = found
    try:
        digest, read, total = _fingerprint(folder, commit)
    except OSError as e:
        return _unverified_identity(model, revision, f"cannot read {folder}: {e}")
    if not total:
        return _unverified_identity(model, revision, f"no files in {folder}")
    where = f"hub snapshot {commit} in {folder}" if commit else f"local {folder}"
    version = f"{commit}-{digest}" if commit else digest
    return ModelIdentity(version, True, f"{where}: {total} files, {read} read, {total - read} from cache")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it (environment read at call time)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return os.path.expanduser(env)
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    try:
        from huggingface_hub import constants
        return constants.HF_HUB_CACHE
    except ImportError:
        return os.path.expanduser("~/.cache/huggingface/hub")


def cache_path() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE_DIR") or "~/.cache/kvstrata").expanduser() / "identity.json"


# ---------------------------------------------------------------------------- where the files are
def _snapshot_commit(folder: str) -> str | None:
    """The commit when ``folder`` (or a file) is inside ``.../models--org--name/snapshots/<commit>/``."""
    base = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    parts = Path(os.path.realpath(base)).parts  # a snapshot's files are links into blobs/: not them
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and _COMMIT.fullmatch(parts[i + 1]) and parts[i - 1].startswith("models--"):
            return parts[i + 1]
    return None


def _hub_snapshot(repo_id: str, revision: str | None, hub_cache: str) -> tuple[str, str] | None:
    if not _REPO_ID.fullmatch(repo_id):
        return None
    repo = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"))
    commit = revision or "main"
    if not _COMMIT.fullmatch(commit):
        try:
            with open(os.path.join(repo, "refs", commit)) as f:
                commit = f.read().strip()
        except OSError:
            return None
    snapshot = os.path.join(repo, "snapshots", commit)
    return (snapshot, commit) if _COMMIT.fullmatch(commit) and os.path.isdir(snapshot) else None


def _unverified_identity(model: str, revision: str | None, why: str) -> ModelIdentity:
    key = (model, revision)
    if key not in _unverified:
        _unverified[key] = f"unverified:{uuid.uuid4().hex}"
        log.warning("kvstrata: cannot establish the identity of model %r (%s). Its KV is kept for this "
                    "process only, never shared across restarts or instances. Set namespace.model_version "
                    "in the kvstrata YAML to the weights' version (a commit, a checkpoint id) to share it.",
                    model, why)
    return ModelIdentity(_unverified[key], False, f"unverified: {why}")


# ---------------------------------------------------------------------------- fingerprints
def _fingerprint(folder: str, commit: str | None) -> tuple[str, int, int]:
    """(digest of the folder, files read, files in total)."""
    cache = _load_cache()
    fresh: dict[str, list] = {}
    h = xxhash.xxh3_128(b"kvstrata-identity-1\0" + (commit or "").encode())
    files = model_files(folder)
    read = 0
    for rel, path, st in files:
        real = os.path.realpath(path)  # a hub snapshot links into blobs/: key the blob itself
        entry = cache.get(real)
        if entry is not None and entry[:3] == [st.st_size, st.st_mtime_ns, st.st_ino]:
            digest = entry[3]
        else:
            digest = _file_digest(real, st.st_size)
            read += 1
            if time.time_ns() - st.st_mtime_ns > RACY_NS:
                fresh[real] = [st.st_size, st.st_mtime_ns, st.st_ino, digest]
        h.update(f"{rel}\0{digest}\n".encode())
    if fresh:
        _save_cache(fresh)
    return h.hexdigest(), read, len(files)


def model_files(root: str) -> list[tuple[str, str, os.stat_result]]:
    """(relative name, path, stat) of every regular file, sorted; hidden names (.git, .cache) and
    symlinked folders (no cycles) are skipped, symlinked files are followed. A file is its own list."""
    if not os.path.isdir(root):
        st = os.stat(root)
        return [(os.path.basename(root), root, st)] if stat.S_ISREG(st.st_mode) else []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # a dangling link: the engine cannot load it either
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((os.path.relpath(path, root), path, st))
    return sorted(out, key=lambda f: f[0])


def _file_digest(path: str, size: int) -> str:
    """Whole-file hash of a small or text file; else size, safetensors header and sampled windows."""
    with open(path, "rb") as f:
        if size < SMALL_FILE or (size < TEXT_FILE and os.path.splitext(path)[1] in TEXT_SUFFIXES):
            return "whole:" + xxhash.xxh3_128_hexdigest(f.read())
        fd = f.fileno()
        h = xxhash.xxh3_128(size.to_bytes(8, "little"))
        tensors: list[tuple[int, int]] = []
        if path.endswith(".safetensors"):
            header, tensors = _safetensors_header(fd, size)
            h.update(header)
        spaced = [((size - WINDOW) * i // (SPACED_WINDOWS - 1), WINDOW) for i in range(SPACED_WINDOWS)]
        if len(tensors) > TENSOR_WINDOWS:
            tensors = [tensors[i * len(tensors) // TENSOR_WINDOWS] for i in range(TENSOR_WINDOWS)]
        for offset, length in sorted(set(spaced + tensors)):
            h.update(os.pread(fd, length, offset))
        return "sampled:" + h.hexdigest()


def _safetensors_header(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]]:
    """The raw header (length prefix included) and the first window of every tensor, by offset."""
    prefix = os.pread(fd, 8, 0)
    n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
    if not 0 < n <= min(MAX_HEADER, size - 8):
        return prefix, []
    raw = os.pread(fd, n, 8)
    try:
        meta = json.loads(raw)
        spans = sorted(v["data_offsets"] for k, v in meta.items() if k != "__metadata__")
        windows = [(8 + n + begin, min(WINDOW, end - begin)) for begin, end in spans if end > begin]
    except (ValueError, TypeError, KeyError, AttributeError):
        windows = []  # not a valid header: its bytes are still hashed
    return prefix + raw, windows


# ---------------------------------------------------------------------------- the cache file
def _load_cache() -> dict[str, list]:
    path = cache_path()
    try:
        with open(path) as f:
            data = json.load(f)
        files = data["files"] if data.get("format") == CACHE_FORMAT else {}
        return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 4}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.debug("kvstrata: ignoring unreadable identity cache %s: %s", path, e)
        return {}


def _save_cache(fresh: dict[str, list]) -> None:
    """Merge ``fresh`` into the cache file (re-read first, entries of vanished files dropped) and
    replace it atomically; concurrent writers can only lose each other's entries, never corrupt."""
    path = cache_path()
    files = {k: v for k, v in _load_cache().items() if os.path.exists(k)}
    files.update(fresh)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".identity-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": CACHE_FORMAT, "files": files}, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.debug("kvstrata: cannot write identity cache %s: %s", path, e)
