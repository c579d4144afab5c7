"""Model identity (kvstrata.identity) on real model folders, hub-cache layouts and cache files."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstrata.identity import cache_path, model_identity, resolve_model_version

safetensors_numpy = pytest.importorskip("safetensors.numpy")

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HOUR_AGO_NS = 3600 * 10**9


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "identity-cache"))
    return cache_path()


def write_weights(path: Path, seed: int, only: str | None = None) -> None:
    """A safetensors file (about 8 MiB, so sampled rather than hashed whole) whose values come from
    ``seed``; with ``only``, every tensor but that one keeps the values of seed 0. An existing file
    is overwritten in place (same inode)."""
    shapes = {"embed.weight": (4096, 1024), "layers.0.norm.weight": (512,), "layers.0.mlp.weight": (256, 512)}
    tensors = {}
    for name, shape in shapes.items():
        rng = np.random.default_rng(seed if only in (None, name) else 0)
        tensors[name] = rng.standard_normal(shape).astype(np.float16)
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(safetensors_numpy.save(tensors))
        f.truncate()


def make_model(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 512, "num_hidden_layers": 1}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    write_weights(folder / "model.safetensors", seed)
    age(folder)
    return folder


def age(folder: Path, ns_ago: int = HOUR_AGO_NS) -> None:
    """Files written an hour ago: old enough to be cached (recent ones may still be being written)."""
    when = os.stat(folder).st_mtime_ns - ns_ago
    for path in folder.rglob("*"):
        if path.is_file():
            os.utime(path, ns=(when, when))


def test_weights_replaced_in_place_change_the_identity(tmp_path):
    """Scenario: a fine-tune of the same architecture saved over the old files. Names,
    sizes and config.json are unchanged, so a names-and-sizes fingerprint kept the old version and
    the next start served the old weights' KV."""
    model = make_model(tmp_path / "model")
    weights = model / "model.safetensors"
    before = model_identity(str(model))
    size, inode = weights.stat().st_size, weights.stat().st_ino
    write_weights(weights, seed=1)
    assert (weights.stat().st_size, weights.stat().st_ino) == (size, inode)  # replaced in place
    after = model_identity(str(model))
    assert before.trusted and after.trusted
    assert after.version != before.version
    write_weights(weights, seed=0)  # the same bytes again: the same identity, from any process
    assert model_identity(str(model)).version == before.version


def test_new_values_in_one_small_tensor_change_the_identity(tmp_path):
    """Every tensor's first bytes are sampled, not only evenly spaced windows: a 1 KiB norm weight
    inside an 8 MiB file is seen (e.g. a fine-tune of the norms alone)."""
    model = make_model(tmp_path / "model")
    before = model_identity(str(model)).version
    write_weights(model / "model.safetensors", seed=1, only="layers.0.norm.weight")
    assert model_identity(str(model)).version != before


def test_cached_identity_costs_only_stat_calls_and_is_keyed_on_mtime(tmp_path):
    model = make_model(tmp_path / "model")
    weights = model / "model.safetensors"
    first = model_identity(str(model))
    assert "3 files, 3 read" in first.source
    again = model_identity(str(model))
    assert again.version == first.version and "0 read, 3 from cache" in again.source

    # New bytes with the old (size, mtime_ns, inode): the cached result is returned, which proves
    # the file was not read again.
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.seek(st.st_size - 100)
        f.write(os.urandom(100))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    stale = model_identity(str(model))
    assert stale.version == first.version and "0 read" in stale.source

    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # another mtime: read again
    fresh = model_identity(str(model))
    assert "1 read" in fresh.source and fresh.version != first.version


def test_file_modified_just_now_is_not_cached(tmp_path):
    """A file written within the last 2 s may still be being written: it is read on every call."""
    model = make_model(tmp_path / "model")
    model_identity(str(model))  # caches all three (written an hour ago)
    write_weights(model / "model.safetensors", seed=1)
    assert "1 read" in model_identity(str(model)).source
    assert "1 read" in model_identity(str(model)).source


def test_only_regular_visible_files_count(tmp_path):
    """A FIFO is skipped (opening it would block), hidden folders (.git, .cache) are ignored, and
    symlinked files are followed."""
    model = make_model(tmp_path / "model")
    base = model_identity(str(model)).version
    os.mkfifo(model / "pipe")
    (model / ".git").mkdir()
    (model / ".git" / "index").write_bytes(os.urandom(64))
    assert model_identity(str(model)).version == base

    target = tmp_path / "elsewhere.json"
    target.write_text('{"a": 1}')
    (model / "generation_config.json").symlink_to(target)
    linked = model_identity(str(model)).version
    assert linked != base
    target.write_text('{"a": 2}')
    assert model_identity(str(model)).version != linked


def make_hub_repo(hub: Path, repo_id: str, commit: str, seed: int = 0) -> Path:
    """The Hugging Face cache layout: files in blobs/, snapshot entries are symlinks to them."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    built = make_model(repo / "build", seed)
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in sorted(built.iterdir()):
        blob = repo / "blobs" / f"{commit[:8]}-{path.name}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    built.rmdir()
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_resolves_in_the_local_hub_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snapshot = make_hub_repo(hub, "org/name", COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    by_id = model_identity("org/name")
    assert by_id.trusted and COMMIT in by_id.version
    by_path = model_identity(str(snapshot))  # the snapshot folder given as a path
    assert by_path.trusted and by_path.version == by_id.version
    assert model_identity("org/name", COMMIT).version == by_id.version  # a commit as the revision
    one_file = model_identity(str(snapshot / "model.safetensors"))  # a single-file model in a snapshot
    assert one_file.trusted and one_file.version.startswith(COMMIT)

    other = "fedcba9876543210fedcba9876543210fedcba98"
    make_hub_repo(hub, "org/other", other)
    assert model_identity("org/other").version != by_id.version


def test_unknown_hub_id_is_untrusted_random_per_process_and_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    name = f"org/unknown-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="kvstrata.identity"):
        first = model_identity(name)
        second = model_identity(name)
    assert not first.trusted and first.version.startswith("unverified:")
    assert second.version == first.version  # stable inside the process: local tiers keep working
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "namespace.model_version" in warnings[0].getMessage()

    code = f"from kvstrata.identity import model_identity; print(model_identity({name!r}).version)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ))
    assert other.stdout.strip().startswith("unverified:") and other.stdout.strip() != first.version

    assert resolve_model_version("ft-2026-11", name) == "ft-2026-11"  # the YAML always wins


@pytest.mark.parametrize("content", [b"\x00\xffnot json", b'{"format": 1, "files": {"/x": [1, 2', b'{"format": 1, "files": [1, 2]}',
                                     b'{"format": 1, "files": {"/x": "y"}}', b"[]"])
def test_corrupt_cache_file_is_ignored_and_replaced(tmp_path, own_cache, content):
    model = make_model(tmp_path / "model")
    want = model_identity(str(model)).version
    own_cache.write_bytes(content)
    got = model_identity(str(model))
    assert got.version == want and "3 read" in got.source
    assert json.loads(own_cache.read_text())["format"] == 1  # rewritten whole
    assert "0 read" in model_identity(str(model)).source


def test_single_file_model_is_fingerprinted_and_an_empty_folder_is_not_trusted(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(os.urandom(2 << 20))
    first = model_identity(str(weights))
    assert first.trusted
    with open(weights, "r+b") as f:
        f.write(os.urandom(4096))
    assert model_identity(str(weights)).version != first.version

    (tmp_path / "empty").mkdir()
    assert not model_identity(str(tmp_path / "empty")).trusted
