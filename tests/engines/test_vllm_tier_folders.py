"""Tier folders holding hostile entries, end to end on the real vLLM engine.

tests/tiers/test_folders.py proves the folder scans on a store; here the same is proven where it
matters: a vLLM engine (CPU, tiny model) starting on a planted L2 folder, the ``kvstrata check``
CLI on it, and two engines starting at the same moment on one new shared folder.

Every prompt is LONG, under its own cache salt where it needs its own keys (the outputs are the
same), so the session's runs without kvstrata (``baseline``) check every answer. Every engine here
is about its start on a folder: two for the planted folder, two (together) for the new shared folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstrata.format.block import HEADER, HEADER_SIZE, MAGIC, FormatError, unpack_header
from kvstrata.config import load_config
from kvstrata.keys import FORMAT_VERSION, NO_EXTRA, KeyScheme, extra_digest
from kvstrata.store.parts import open_keys
from engines.launchers import BS, LONG, StepEngine, gen

pytest.importorskip("vllm")

CANDIDATES = [f"cand-{i}" for i in range(6)]  # salts of the prompts that become hidden ones
BLOCKS = len(LONG) // BS + 1  # 15 full blocks and the partial tail
CLI_S = 60.0  # a `kvstrata check` of a few hundred files, interpreter start included

# Run as ``python -c BARRIER ME PEER STEPS SPEC`` (``StepEngine(prefix=...)``): vllm_steps.py, with each opening of a disk tier
# folder (``DiskTier.__init__``: L2, then the shared folder) held until the peer engine reaches
# the same point, so that both create the new folders at the same moment, not seconds apart.
BARRIER = r"""
import os, runpy, sys, time
me, peer, steps, spec = sys.argv[1:5]
from kvstrata.tiers import disk
opened, calls = disk.DiskTier.__init__, [0]
def held(self, *args, **kwargs):
    n, calls[0] = calls[0], calls[0] + 1
    open(f"{me}.{n}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(f"{peer}.{n}") and time.monotonic() < deadline:
        time.sleep(0.001)
    opened(self, *args, **kwargs)
disk.DiskTier.__init__ = held
sys.argv = [steps, spec]
runpy.run_path(steps, run_name="__main__")
"""


def l2_config(tmp: Path, l2: Path, remote: Path | None = None) -> Path:
    """``tmp/kvstrata.yaml``: L1, L2 at ``l2`` and, with ``remote``, a shared folder there."""
    lines = ["l1:", "  size: 128MiB", "l2:", f"  path: {json.dumps(str(l2))}"]
    if remote is not None:
        lines += ["remote:", "  enabled: true", "  backend: fs", f"  path: {json.dumps(str(remote))}"]
    path = tmp / "kvstrata.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_check(config: Path, *extra: str) -> dict:
    """``kvstrata check --json`` in its own process, which must finish within ``CLI_S``."""
    start = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "check", "--config", str(config), "--json",
                              *extra], capture_output=True, text=True, timeout=CLI_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kvstrata check {' '.join(extra)} did not finish within {CLI_S:.0f} s "
                             "(blocked on a FIFO in the tier folder?)") from None
    assert res.stdout.strip(), f"kvstrata check {' '.join(extra)} printed nothing:\n{res.stderr[-3000:]}"
    report = json.loads(res.stdout.splitlines()[-1])
    report.update(rc=res.returncode, took=time.monotonic() - start)
    return report


# ------------------------------------------------------------------------- folder helpers
def _entry(path: Path) -> tuple:
    """What an entry is, without following it: kind and link target or bytes."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        return ("file", path.read_bytes())
    return (stat.filemode(st.st_mode)[0],)


def _outside(outside: Path) -> dict[str, tuple]:
    """Every entry under ``outside``: kind, bytes or link target, and mtime (ns)."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(outside):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            seen[str(p.relative_to(outside))] = (*_entry(p), p.lstat().st_mtime_ns)
    return seen


def _age_atimes(paths: list[Path]) -> dict[Path, int]:
    """Set each path's atime an hour before its mtime and return the atimes. On a ``relatime``
    mount (the default), any read of such a file or listing of such a folder then moves its atime."""
    for p in paths:
        st = p.lstat()
        os.utime(p, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns), follow_symlinks=False)
    return {p: p.lstat().st_atime_ns for p in paths}


def _atime_tracked(folder: Path) -> bool:
    """Whether reads move atimes on this filesystem (not mounted ``noatime``)."""
    probe = folder / "atime-probe"
    probe.write_bytes(b"x")
    before = _age_atimes([probe])[probe]
    probe.read_bytes()
    moved = probe.stat().st_atime_ns != before
    probe.unlink()
    return moved


def _tier_root_key(l2: Path, keys: KeyScheme) -> bytes:
    """The key before the first block of every prompt stored in ``l2`` (one namespace, epoch)."""
    block = next((l2 / "blocks").glob("*/*.kvb"))
    meta = unpack_header(block.read_bytes()[:HEADER_SIZE])
    return keys.root_key(meta.ns_seed, meta.epoch)


def _keys(keys: KeyScheme, root: bytes, salt: str | None) -> list[bytes]:
    extra = extra_digest([f"salt:{salt}"]) if salt else NO_EXTRA
    return keys.chain_keys(root, np.array(LONG, np.uint32), BS, extra, partial=True).keys


def _block(l2: Path, key: bytes) -> Path:
    return l2 / "blocks" / key.hex()[:2] / f"{key.hex()}.kvb"


def _servable_blocks(l2: Path) -> int:
    """Regular files named like this version's blocks in the real shard folders of ``l2``."""
    n = 0
    for shard in (l2 / "blocks").iterdir():
        if shard.is_symlink() or not shard.is_dir():
            continue
        for f in shard.iterdir():
            if f.name.endswith(".kvb") and f.name.startswith(shard.name) and len(f.name) == 36 and not f.is_symlink() \
                    and f.is_file():
                try:
                    with open(f, "rb") as fh:
                        unpack_header(fh.read(HEADER_SIZE))
                except (OSError, FormatError):
                    continue
                n += 1
    return n


def _wait_for(done, engines: list[StepEngine], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for e in engines:
            assert e.proc.poll() is None, f"an engine exited early:\n{e.tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plant(l2: Path, outside: Path, keys: KeyScheme) -> tuple[dict[str, str], dict[Path, tuple], list[Path]]:
    """Plant the L2 folder a first engine filled with LONG (no salt) and LONG under each of
    ``CANDIDATES``. Four candidates get roles; what is done to their first block file:

    - ``X``: its whole shard folder is moved outside and replaced by a symlink to it; next to the
      block there, a damaged "block" and a dead writer's "temp file" (a scan through the link
      would delete both) and a foreign file;
    - ``Y``: moved outside, a symlink to it left in its place (a valid block: served if followed);
    - ``Z``: replaced by a FIFO (opening it for reading blocks until a writer comes);
    - ``O``: rewritten as a well-formed block of the next format version.

    X, Y and Z are "hidden": their only first block is a planted entry, so they must be recomputed.
    Also planted: a block-named symlink to a foreign file outside, a block-named FIFO and unix
    socket under keys nobody asks for, a tail marker folder symlinked outside, a folder named like
    a block, and foreign files and folders. Returns the roles (salts), the entries that must come
    out of everything unchanged (and what they are), and the entries at names of blocks the engine
    later saves itself (Y's link, Z's FIFO): kvstrata may replace those with its own block."""
    root = _tier_root_key(l2, keys)
    served = {k.hex()[:2] for k in _keys(keys, root, None)}
    firsts = {salt: _keys(keys, root, salt)[0] for salt in CANDIDATES}
    for salt in [None, *CANDIDATES]:
        assert all(_block(l2, k).is_file() for k in _keys(keys, root, salt)), f"the first engine did not store {salt}"
    # X's shard may hold no block LONG needs and no other candidate's first block.
    x = next((s for s, k in firsts.items() if k.hex()[:2] not in served
              and all(o.hex()[:2] != k.hex()[:2] for t, o in firsts.items() if t != s)), None)
    assert x is not None, "no candidate's first block sits in a shard of its own"
    y, z, o = [s for s in CANDIDATES if s != x][:3]
    roles = {"X": x, "Y": y, "Z": z, "O": o}
    keep: list[Path] = []
    outside.mkdir()
    (outside / "notes.txt").write_text("not kvstrata's\n")

    shard_x = _block(l2, firsts[x]).parent
    far = outside / "shard"
    shutil.move(str(shard_x), far)  # a rename: nothing is read
    (far / f"{shard_x.name}{'ab' * 15}.kvb").write_bytes(b"garbage, not a block")
    (far / f".{shard_x.name}{'0' * 30}.{_dead_pid()}.1.tmp").write_bytes(b"someone's temp file")
    (far / "notes.txt").write_text("keep me\n")
    shard_x.symlink_to(far, target_is_directory=True)
    keep.append(shard_x)

    path_y = _block(l2, firsts[y])
    shutil.move(str(path_y), outside / "y.kvb")
    path_y.symlink_to(outside / "y.kvb")
    fake = path_y.with_name(path_y.name[:2] + "cd" * 15 + ".kvb")
    fake.symlink_to(outside / "notes.txt")
    keep.append(fake)

    markers = outside / "markers"
    markers.mkdir()
    (markers / "report.txt").write_text("keep me too\n")
    (markers / f"3.{'ef' * 16}").write_text("")
    (l2 / "tails" / "ee" / ("ee" * 16)).symlink_to(markers, target_is_directory=True)
    keep.append(l2 / "tails" / "ee" / ("ee" * 16))

    path_z = _block(l2, firsts[z])
    path_z.unlink()
    os.mkfifo(path_z)
    idle_fifo = path_z.with_name(path_z.name[:2] + "6" * 30 + ".kvb")
    os.mkfifo(idle_fifo)
    sock = path_z.with_name(path_z.name[:2] + "5" * 30 + ".kvb")
    cwd = os.getcwd()
    os.chdir(sock.parent)  # a unix socket's path is limited to 108 bytes: bind by name
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(sock.name)
    finally:
        os.chdir(cwd)
    keep += [idle_fifo, sock]

    path_o = _block(l2, firsts[o])
    raw = bytearray(path_o.read_bytes())
    fields = list(HEADER.unpack(bytes(raw[: HEADER.size])))
    assert fields[0] == MAGIC
    fields[1] = FORMAT_VERSION + 1
    body = HEADER.pack(*fields)
    raw[:HEADER_SIZE] = body + xxhash.xxh3_64_digest(body)
    path_o.write_bytes(bytes(raw))
    keep.append(path_o)

    shard_o = path_o.parent
    like_block = shard_o / (shard_o.name + "12" * 15 + ".kvb")
    like_block.mkdir()
    (like_block / "inside.kvb").write_text("in a folder named like a block")
    (l2 / "blocks" / "zz").mkdir()
    (l2 / "blocks" / "zz" / "a.kvb").write_text("foreign")
    (l2 / "blocks" / "README").write_text("a file of another program")
    (shard_o / "notes.txt").write_text("foreign")
    (l2 / "tails" / "ab" / "foo.txt").write_text("foreign")
    keep += [like_block, like_block / "inside.kvb", l2 / "blocks" / "zz", l2 / "blocks" / "zz" / "a.kvb",
             l2 / "blocks" / "README", shard_o / "notes.txt", l2 / "tails" / "ab" / "foo.txt"]
    return roles, {p: _entry(p) for p in keep}, [path_y, path_z]


def _assert_untouched(keep: dict[Path, tuple], replaceable: list[Path]) -> None:
    gone = [str(p) for p in keep if not os.path.lexists(p)]
    assert not gone, f"planted entries kvstrata does not own were deleted: {gone}"
    changed = [str(p) for p, was in keep.items() if _entry(p) != was]
    assert not changed, f"planted entries kvstrata does not own were changed: {changed}"
    for p in replaceable:  # the planted entry, or kvstrata's own block of that name (never nothing)
        assert os.path.lexists(p), f"{p.name} was deleted"
        if p.is_file() and not p.is_symlink():
            assert unpack_header(p.read_bytes()[:HEADER_SIZE]).key.hex() + ".kvb" == p.name


# ----------------------------------------------------------------------------------- tests
def test_vllm_serves_from_a_planted_tier_folder_and_check_fix_touches_nothing_foreign(model, baseline, tmp_path):
    """Scenario: a first engine stores LONG and six salted copies of it in its L2 folder. Then the
    folder is planted (``_plant``): a shard folder and block files symlinked to valid kvstrata
    blocks outside the tier, a FIFO and a unix socket named like blocks, a tail folder symlinked
    outside, a folder named like a block, foreign files and a block of another format version.
    A second engine starts on it in normal time (its background scan reads the folder), serves LONG from
    L2 and the hidden prompts (reachable only through planted entries) by recomputing, all with
    the outputs of vLLM alone. Then ``kvstrata check`` and ``check --fix`` finish in normal time.
    Nothing outside the tier was read (atimes), changed or deleted, and every planted entry
    kvstrata does not own is still there, unchanged."""
    l2, outside = tmp_path / "l2", tmp_path / "outside"
    cfg = l2_config(tmp_path, l2)
    with StepEngine(model, tmp_path, cfg, name="first") as first:
        usual = first.wait_ready(600)
        stored = first.run([gen(LONG), *[gen(LONG, salt=s) for s in CANDIDATES]])
    assert all(r["tokens"] == baseline(LONG) for r in stored)

    roles, keep, replaceable = _plant(l2, outside, open_keys(load_config(cfg)))  # the engine's key scheme
    before = _outside(outside)
    tracked = _atime_tracked(tmp_path)
    atimes = _age_atimes([outside / rel for rel in before] + [outside])

    with StepEngine(model, tmp_path, cfg, name="second") as second:
        up = second.wait_ready(2 * usual + 30)  # else hung in its start-up scan of the tier folder
        served, *hidden, counters = second.run([gen(LONG), *[gen(LONG, salt=roles[r]) for r in "XYZ"],
                                                {"op": "counters"}])
    assert served["tokens"] == baseline(LONG) and served["cached"] == len(LONG) - 1
    assert counters.get("hit_blocks_l2") == BLOCKS  # LONG, all from disk; nothing else was served
    for role, out in zip("XYZ", hidden):
        assert out["cached"] == 0, f"{role}: a block reachable only through a planted entry was served"
        assert out["tokens"] == baseline(LONG), role
    assert counters.get("l2_skipped_entries", 0) >= 1 and counters.get("l2_other_versions") == 1

    report = cli_check(cfg)
    assert report["rc"] == 0 and report["bad"] == 0, report
    assert report["ok"] == _servable_blocks(l2) and report["other_versions"] == 1, report
    listed = "\n".join(report["skipped_entries"])
    for what in ("symbolic link", "FIFO", "socket", "folder"):
        assert what in listed, f"check does not list the planted {what}: {listed}"
    fixed = cli_check(cfg, "--fix")
    assert fixed["rc"] == 0 and fixed["ok"] == report["ok"], fixed

    if tracked:
        read = [str(p) for p, t in atimes.items() if p.lstat().st_atime_ns != t]
        assert not read, f"files or folders outside the tier were read: {read}"
    assert _outside(outside) == before, "something outside the tier was changed or deleted"
    _assert_untouched(keep, replaceable)
    replaced = [p.name for p in replaceable if not p.is_symlink() and p.is_file()]
    print(f"usual start {usual:.1f} s, start on the planted folder {up:.1f} s, check {report['took']:.1f} s, "
          f"check --fix {fixed['took']:.1f} s; replaced by kvstrata's own blocks: {replaced}")


def test_two_vllm_servers_started_at_the_same_moment_on_one_new_shared_folder_both_come_up(model, baseline, tmp_path):
    """Scenario: two engines share an L2 folder and a shared-folder remote tier (``backend: fs``),
    neither of which exists yet. Both processes are launched together, and each holds its opening
    of each tier folder until the other gets there too, so both create the same new folders at the
    same moment. Both come up and serve; each then gets every block of what the other stored
    through the shared folders; every output equals vLLM alone. Afterwards both folders hold every
    block of both prompts, intact, in 256 real shard folders."""
    new = tmp_path / "new"
    cfg = l2_config(tmp_path, new / "l2", new / "shared")
    gates = tmp_path / "gate-a", tmp_path / "gate-b"
    engines = [StepEngine(model, tmp_path, cfg, name=n, prefix=["-c", BARRIER, str(me), str(peer)])
               for n, me, peer in (("a", *gates), ("b", *gates[::-1]))]
    try:
        ups = [e.wait_ready(600) for e in engines]
        owns = [e.run([gen(LONG, salt=n)])[0] for n, e in zip("ab", engines)]
        # Saves reach the folders in the background: go on once both hold both prompts.
        _wait_for(lambda: all(_servable_blocks(f) == 2 * BLOCKS for f in (new / "l2", new / "shared")), engines, 60,
                  f"{2 * BLOCKS} blocks in each shared folder")
        outs = [(own, *e.run([gen(LONG, salt=theirs), {"op": "counters"}]))
                for own, e, theirs in zip(owns, engines, "ba")]
    finally:
        for e in engines:
            e.close()
    assert all(Path(f"{g}.1").exists() for g in gates), "both engines opened both folders through the barrier"
    for name, (own, other, counters) in zip("ab", outs):
        assert own["cached"] == 0 and own["tokens"] == baseline(LONG), name
        assert other["cached"] == len(LONG) - 1, f"engine {name} did not hit what the other stored"
        assert other["tokens"] == baseline(LONG), name
        assert counters.get("hit_blocks_l2", 0) + counters.get("hit_blocks_remote", 0) == BLOCKS, counters

    from kvstrata.cli.check import check_disk

    for folder in (new / "l2", new / "shared"):
        report = check_disk(folder, progress=False)
        assert report["ok"] == 2 * BLOCKS and report["bad"] == 0 and report.get("skipped", 0) == 0, (folder, report)
        for top in ("blocks", "tails"):
            assert sorted(p.name for p in (folder / top).iterdir() if p.is_dir() and not p.is_symlink()) == [
                f"{i:02x}" for i in range(256)]
    print(f"both engines up after {ups[0]:.1f} s and {ups[1]:.1f} s")
