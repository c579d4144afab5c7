"""Tier folders hold input kvstrata does not control.

Whoever can write to a tier folder (on a shared folder: every host) can plant symlinks into other
folders, FIFOs, sockets, folders named like blocks, foreign files and blocks of other format
versions. A store opening the folder (the engine's start-up scan), ``kvstrata check`` and
``kvstrata check --fix`` must finish in normal time, read and delete nothing outside the tier,
delete nothing that is not kvstrata's own, and keep serving correct bytes. Also: cleanup of other
hosts' temp files and other engines' L1 arenas, folder modes, a full disk, and ``l2.size``.

Run as a script, this file is the child of the full-disk test on a real (small) tmpfs:
``python tests/tiers/test_folders.py full-disk MOUNTPOINT``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root (tests.builders), run as a script too

import pytest  # noqa: E402
import xxhash  # noqa: E402

from tests.builders import (BLOCK_BYTES, BLOCK_SIZE, assert_payloads_match, load_hit, make_config,  # noqa: E402
                            make_namespace, payloads_for, random_tokens, store_prompt)
from kvstrata.format.block import HEADER, HEADER_SIZE, MAGIC  # noqa: E402
from kvstrata.cli.main import main as cli_main  # noqa: E402
from kvstrata.keys import FORMAT_VERSION  # noqa: E402
from kvstrata.metrics import Counters  # noqa: E402
from kvstrata.store import BlockStore, ByteRuns  # noqa: E402
from kvstrata.tiers import DiskTier  # noqa: E402
from tests.harness.trials import planted as plant_trials  # noqa: E402

NORMAL_S = 5.0  # "normal time" for a store open or a check of a folder of a few dozen files


# ----------------------------------------------------------------------------- helpers
def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _tree(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry under ``path`` (not following links): kind and bytes or link target."""
    out: dict[str, tuple[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(path))] = ("link", os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(path))] = ("file", p.read_bytes())
            else:
                out[str(p.relative_to(path))] = (stat.filemode(st.st_mode)[0], b"")
    return out


def _within(seconds: float, what: str, fn: Callable[[], Any], fifos: list[Path]) -> Any:
    """``fn()``, failing if it takes more than ``seconds``. A call stuck opening one of ``fifos``
    is released (by opening it for writing) so that the test ends either way."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(seconds)
    took = time.monotonic() - start
    if t.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(30)
        raise AssertionError(f"{what} took more than {seconds} s (blocked on a FIFO in the tier folder?)")
    if "error" in result:
        raise result["error"]
    assert took < seconds
    return result["value"]


def _check(cfg: Path, *extra: str) -> dict[str, Any]:
    """``kvstrata check --json [extra]`` (the CLI's entry point, in this process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli_main(["check", "--config", str(cfg), "--json", *extra])
    report = json.loads(out.getvalue())
    report["rc"] = rc
    return report


class Planted(NamedTuple):
    cfg: Path
    root: Path
    outside: Path
    served: list  # (tokens, chain) the store must keep serving
    hidden: list  # tokens whose only stored copy is a planted entry (link, FIFO, other version): never served
    fifos: list[Path]
    entries: list[Path]  # planted entries in the tier that must survive everything
    blocks: int  # servable block files in the tier


def _plant(tmp_path: Path, ns, kinds: set[str]) -> Planted:
    """A tier folder with a stored prompt P (3 full blocks and a 5-token tail), plus what
    ``kinds`` asks for: ``links`` (a shard folder and block files symlinked to copies of real
    blocks and to other files outside the tier, a tail marker folder symlinked outside), ``fifo``
    (a FIFO and a unix socket named like blocks; the FIFO under the key of a prompt Z that is
    then looked up), ``foreign`` (foreign files and folders, a folder named like a block, a
    block of another format version)."""
    root, outside = tmp_path / "l2", tmp_path / "outside"
    cfg = tmp_path / "kvstrata.yaml"
    cfg.write_text(f"l1:\n  size: 1MiB\n  pin_memory: false\nl2:\n  path: {json.dumps(str(root))}\n  size: 64MiB\n")
    outside.mkdir()
    (outside / "notes.txt").write_text("not kvstrata's\n")
    served, hidden, fifos, entries = [], [], [], []
    with BlockStore(make_config(tmp_path)) as store:
        p = random_tokens("P", 3 * BLOCK_SIZE + 5)
        chain_p, stored = store_prompt(store, ns, p)
        assert stored == 4
        served.append((p, chain_p))
        used = {k.hex()[:2] for k in chain_p.keys}
        extra = {}
        for tag in ("X", "Y", "Z", "O"):  # one-block prompts, each in a shard of its own
            for i in range(1000):
                tokens = random_tokens(f"{tag}-{i}", BLOCK_SIZE)
                chain = store.chain(ns, tokens)[1]
                if chain.keys[0].hex()[:2] not in used:
                    used.add(chain.keys[0].hex()[:2])
                    extra[tag] = (tokens, chain)
                    break
        for tag in ("X", "Y", "O"):
            assert store_prompt(store, ns, extra[tag][0])[1] == 1
        path = {tag: store.l2.path(c.keys[0]) for tag, (_t, c) in extra.items()}
    blocks = 4

    if "links" in kinds:
        # X: its shard folder is replaced by a link to a folder outside, holding X's block (a
        # valid one: a store that reads through the link would serve it) and files a scan that
        # follows the link would delete: a damaged "block" and a dead writer's "temp file".
        shard_x = path["X"].parent
        far = outside / "shard"
        far.mkdir()
        shutil.move(str(path["X"]), far / path["X"].name)
        (far / ("ab" * 16 + ".kvb")).write_bytes(b"garbage, not a block")
        (far / f".{shard_x.name}{'0' * 30}.{_dead_pid()}.1.tmp").write_bytes(b"someone's temp")
        (far / "notes.txt").write_text("keep me\n")
        shard_x.rmdir()
        shard_x.symlink_to(far, target_is_directory=True)
        entries.append(shard_x)
        # Y: its block file is a link to a copy of itself outside the tier; another block name
        # links to a file outside that is not a block at all.
        copy_y = outside / "y.kvb"
        shutil.move(str(path["Y"]), copy_y)
        path["Y"].symlink_to(copy_y)
        fake = path["Y"].with_name(path["Y"].name[:2] + "cd" * 15 + ".kvb")
        fake.symlink_to(outside / "notes.txt")
        entries += [path["Y"], fake]
        # A tail marker folder that links outside (a scan following it would "clean" it).
        markers = outside / "markers"
        markers.mkdir()
        (markers / "report.txt").write_text("keep me too\n")
        (markers / f"3.{'ef' * 16}").write_text("")
        parent = root / "tails" / "ee" / ("ee" * 16)
        parent.symlink_to(markers, target_is_directory=True)
        entries.append(parent)
        hidden += [extra["X"][0], extra["Y"][0]]
    else:
        blocks += 2  # X and Y stay ordinary blocks

    if "fifo" in kinds:
        fifo = path["Z"]
        os.mkfifo(fifo)
        fifos.append(fifo)
        sock_path = path["Z"].with_name(path["Z"].name[:2] + "5" * 30 + ".kvb")
        cwd = os.getcwd()
        os.chdir(sock_path.parent)  # a unix socket's path is limited to 108 bytes: bind by name
        try:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(sock_path.name)
            sock.close()
        finally:
            os.chdir(cwd)
        entries += [fifo, sock_path]
        hidden.append(extra["Z"][0])

    if "foreign" in kinds:
        # O: rewritten as a well-formed block of the next format version (a newer kvstrata
        # sharing the folder): never served here, never deleted.
        raw = bytearray(path["O"].read_bytes())
        fields = list(HEADER.unpack(bytes(raw[: HEADER.size])))
        assert fields[0] == MAGIC
        fields[1] = FORMAT_VERSION + 1
        body = HEADER.pack(*fields)
        raw[:HEADER_SIZE] = body + xxhash.xxh3_64_digest(body)
        path["O"].write_bytes(bytes(raw))
        hidden.append(extra["O"][0])
        shard = path["O"].parent
        like_block = shard / (shard.name + "12" * 15 + ".kvb")
        like_block.mkdir()
        (like_block / "inside.kvb").write_text("in a folder named like a block")
        (root / "blocks" / "README").write_text("a file of another program")
        (root / "blocks" / "zz").mkdir()
        (root / "blocks" / "zz" / "a.kvb").write_text("foreign")
        (shard / "notes.txt").write_text("foreign")
        (root / "tails" / "ab" / "foo.txt").write_text("foreign")
        entries += [path["O"], like_block, like_block / "inside.kvb", root / "blocks" / "README",
                    root / "blocks" / "zz" / "a.kvb", shard / "notes.txt", root / "tails" / "ab" / "foo.txt"]
    else:
        blocks += 1  # O stays an ordinary block
        served.append((extra["O"][0], extra["O"][1]))
    return Planted(cfg, root, outside, served, hidden, fifos, entries, blocks)


def _assert_serves(store: BlockStore, ns, planted: Planted) -> None:
    for tokens, chain in planted.served:
        hit = store.lookup(ns, tokens)
        assert hit.num_blocks == len(chain.keys)
        n, out = load_hit(store, hit)
        assert n == len(chain.keys)
        assert_payloads_match(chain.keys, out, n)
    for tokens in planted.hidden:
        assert store.lookup(ns, tokens).num_blocks == 0, "a block reachable only through a planted entry was served"


# --------------------------------------------------------------- planted entries (check --fix)
@pytest.mark.parametrize("kinds", [{"links"}, {"fifo"}, {"foreign"}, {"links", "fifo", "foreign"}],
                         ids=["symlinks", "fifo_and_socket", "foreign_and_other_versions", "everything"])
def test_planted_tier_folder_is_scanned_checked_and_fixed_without_following_blocking_or_deleting(tmp_path, kinds):
    """Scenario: a tier folder holding a stored prompt is planted with symlinks (a shard folder,
    block files and a tail marker folder, pointing outside the tier), a FIFO and a unix socket
    named like blocks, foreign files and folders, a folder named like a block and a block of
    another format version. Then a store opens it (the engine's start-up scan), looks up every
    prompt (the FIFO is under a looked-up key), and ``kvstrata check`` and ``check --fix`` run.
    Each finishes in normal time; nothing outside the tier is read (blocks reachable only through
    links are never served) or changed; every planted entry is still there; the check lists
    what it skipped; and the stored prompt is served with its exact bytes before and after."""
    ns = make_namespace()
    planted = _plant(tmp_path, ns, kinds)
    outside_before = _tree(planted.outside)

    def open_and_serve() -> dict[str, int]:
        with BlockStore(make_config(tmp_path)) as store:
            _assert_serves(store, ns, planted)
            assert store.wait_recovered(NORMAL_S)  # the background scan, through the planted entries
            return store.counters.snapshot()

    counters = _within(NORMAL_S, "a store open and lookups", open_and_serve, planted.fifos)
    report = _within(NORMAL_S, "kvstrata check", lambda: _check(planted.cfg), planted.fifos)
    assert report["rc"] == 0 and report["bad"] == 0, report
    assert report["ok"] == planted.blocks
    assert report["other_versions"] == (1 if "foreign" in kinds else 0)
    listed = "\n".join(report["skipped_entries"])
    if "links" in kinds:
        assert "symbolic link" in listed
    if "fifo" in kinds:
        assert "FIFO" in listed and "socket" in listed
    if "foreign" in kinds:
        assert "README" in listed and "folder" in listed
    fixed = _within(NORMAL_S, "kvstrata check --fix", lambda: _check(planted.cfg, "--fix"), planted.fifos)
    assert fixed["rc"] == 0 and fixed["ok"] == planted.blocks

    assert _tree(planted.outside) == outside_before, "something outside the tier was changed or deleted"
    gone = [str(p) for p in planted.entries if not os.path.lexists(p)]
    assert not gone, f"planted entries kvstrata does not own were deleted: {gone}"
    _within(NORMAL_S, "a store open after check --fix", open_and_serve, planted.fifos)
    assert counters.get("l2_skipped_entries", 0) + counters.get("l2_other_versions", 0) >= 1  # and counted


def test_damaged_blocks_of_this_format_are_still_fixed(tmp_path):
    """Scenario: next to the planted entries, one block file of the stored prompt is damaged
    (payload flipped): ``check`` reports it (exit 1), ``check --fix`` deletes it and only it,
    and a store then serves the prompt up to the damaged block."""
    ns = make_namespace()
    planted = _plant(tmp_path, ns, {"foreign"})
    tokens, chain = planted.served[0]
    bad = DiskTier(Counters(), planted.root, 1 << 30).path(chain.keys[2])
    raw = bytearray(bad.read_bytes())
    raw[HEADER_SIZE + 3] ^= 0x20
    bad.write_bytes(bytes(raw))
    report = _check(planted.cfg)
    assert report["rc"] == 1 and report["bad"] == 1 and "checksum" in report["problems"][0]
    assert _check(planted.cfg, "--fix")["bad"] == 1
    assert not bad.exists()
    assert all(os.path.lexists(p) for p in planted.entries)
    with BlockStore(make_config(tmp_path)) as store:
        assert store.lookup(ns, tokens).num_blocks == 2


def test_links_and_fifos_planted_at_names_kvstrata_will_write_are_replaced_never_written_through(tmp_path):
    """Scenario: before a prompt is ever saved, its block names are taken in the L2 folder: a
    symlink to a file outside, a symlink to a folder outside, and a FIFO. The save publishes by
    rename, which replaces the planted entry itself: the outside file and folder are untouched,
    the FIFO never blocks the write, and the blocks are served from disk with their own bytes."""
    ns = make_namespace()
    tokens = random_tokens(7, 4 * BLOCK_SIZE)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not kvstrata's")
    (outside / "dir").mkdir()
    before = _tree(outside)
    cfg = make_config(tmp_path)
    with BlockStore(cfg) as store:
        _, chain = store.chain(ns, tokens)
    disk = DiskTier(Counters(), Path(cfg.l2.path), 1 << 30)
    planted = [disk.path(k) for k in chain.keys[:3]]
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
    planted[0].symlink_to(outside / "precious")
    planted[1].symlink_to(outside / "dir")
    os.mkfifo(planted[2])

    def save() -> int:
        with BlockStore(cfg) as store:
            n = store_prompt(store, ns, tokens)[1]
            store.flush()
            return n

    assert _within(NORMAL_S, "a save over planted names", save, [planted[2]]) == 4
    assert _tree(outside) == before
    assert all(p.is_file() and not p.is_symlink() for p in planted)
    with BlockStore(make_config(tmp_path)) as store:
        hit = store.lookup(ns, tokens)
        assert hit.num_blocks == 4
        n, out = load_hit(store, hit)
        assert n == 4
        assert_payloads_match(chain.keys, out, 4)


# ----------------------------------------------------------- other hosts' temps, arenas, modes
def test_shared_folder_sweep_leaves_other_hosts_temp_files_until_they_are_stale(tmp_path):
    """Scenario: on a shared folder, a temp file of a writer whose pid is not alive *here* (it
    is another host's, mid-write) and one two hours old are found by the shared tier's sweep
    (``gc``). The fresh one stays (its host may still publish it); the old one is removed."""
    ns = make_namespace()
    shared = tmp_path / "shared"
    overrides = {"remote.enabled": True, "remote.backend": "fs", "remote.path": str(shared),
                 "remote.size": "1MiB", "l2.enabled": False}
    with BlockStore(make_config(tmp_path, overrides)) as store:
        store_prompt(store, ns, random_tokens("s", 2 * BLOCK_SIZE))
        shard = shared / "blocks" / "7f"
        fresh = shard / f".7f{'0' * 30}.{_dead_pid()}.0.tmp"
        old = shard / f".7f{'1' * 30}.{_dead_pid()}.0.tmp"
        fresh.write_bytes(b"another host is writing this")
        old.write_bytes(b"a writer that died long ago")
        two_hours_ago = time.time() - 7200
        os.utime(old, (two_hours_ago, two_hours_ago))
        store.gc()
        assert fresh.exists(), "another host's temp file was deleted on the strength of a local pid check"
        assert not old.exists()


def _hold_arenas(*paths: Path) -> list[subprocess.Popen]:
    """Live peers: one process per path that creates the arena there and keeps running."""
    code = ("import sys, time; from kvstrata.worker.arena import create_shared_arena; "
            "create_shared_arena(sys.argv[1], 2, 4096); print('ready', flush=True); time.sleep(600)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(p)], stdout=subprocess.PIPE, text=True)
             for p in paths]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    return procs


def test_dead_arena_cleanup_spares_arenas_of_live_peers_whose_pid_is_not_visible(tmp_path):
    """Scenario: two L1 arenas in the shared-memory folder are named with a pid that is not
    alive here (as an engine in another PID namespace sharing /dev/shm names its arena) and are
    older than any start-up. One's creator is alive (it holds the arena), the other's has been
    killed. The start-up cleanup (``remove_dead_arenas``, which the vLLM adapter runs) removes
    only the dead one."""
    from kvstrata.worker.arena import remove_dead_arenas

    live = tmp_path / f"kvstrata-{_dead_pid()}-0123abcd"
    dead = tmp_path / f"kvstrata-{_dead_pid()}-4567cdef"
    peer, gone = _hold_arenas(live, dead)
    try:
        gone.kill()
        gone.wait()
        old = time.time() - 3600
        for p in (live, dead):
            os.utime(p, (old, old))
        assert remove_dead_arenas(str(tmp_path)) == [dead.name]
        assert live.exists(), "the arena of a live peer was deleted"
        assert not dead.exists()
    finally:
        peer.kill()
        peer.wait()


def test_existing_l2_folder_keeps_its_mode_and_gets_one_warning(tmp_path, caplog):
    """Scenario: ``l2.path`` is an existing folder of mode 1777 (like /tmp). Opening two stores
    on it leaves its mode as it is and logs one warning naming the folder and its mode; a folder
    kvstrata creates itself is 0700."""
    ns = make_namespace()
    root = tmp_path / "l2"
    root.mkdir()
    os.chmod(root, 0o1777)
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        for _ in range(2):
            with BlockStore(make_config(tmp_path)) as store:
                store_prompt(store, ns, random_tokens("m", 2 * BLOCK_SIZE))
    assert stat.S_IMODE(root.stat().st_mode) == 0o1777
    warnings = [r.getMessage() for r in caplog.records if "0o1777" in r.getMessage()]
    assert len(warnings) == 1 and str(root) in warnings[0]
    other = tmp_path / "new" / "l2"
    with BlockStore(make_config(tmp_path, **{"l2.path": str(other)})):
        pass
    assert stat.S_IMODE(other.stat().st_mode) == 0o700


def test_shared_folder_of_a_group_stays_shared(tmp_path):
    """Scenario: the shared tier's folder exists with mode 2770 (setgid, group rwx: hosts of one
    group share it). After a store writes there, the folder's mode is unchanged, and the folders
    and files kvstrata created carry the group's bits (rwx on folders, r on files)."""
    ns = make_namespace()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    overrides = {"remote.enabled": True, "remote.backend": "fs", "remote.path": str(shared), "l2.enabled": False}
    with BlockStore(make_config(tmp_path, overrides)) as store:
        chain, stored = store_prompt(store, ns, random_tokens("g", 2 * BLOCK_SIZE + 3))
        assert stored == 3
        store.flush()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2770
    shard = shared / "blocks" / "00"
    assert stat.S_IMODE(shard.stat().st_mode) & 0o770 == 0o770
    files = list((shared / "blocks").glob("*/*.kvb"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o640 for f in files)


def test_fresh_folder_opened_by_many_at_once(tmp_path):
    """Scenario: eight openers create one new L2 folder at the same
    moment; every one succeeds and all 256 shards of blocks/ and tails/ are real folders."""
    root = tmp_path / "fresh" / "l2"
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def open_tier() -> None:
        barrier.wait()
        try:
            DiskTier(Counters(), root, 1 << 20)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=open_tier) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for top in ("blocks", "tails"):
        assert sorted(p.name for p in (root / top).iterdir() if p.is_dir() and not p.is_symlink()) == [
            f"{i:02x}" for i in range(256)]


# --------------------------------------------------------------------------------- a full disk
BIG = 64 << 10  # block bytes in the full-disk scenario


def _full_disk_scenario(root: Path, fill: Callable[[], None], free: Callable[[], None]) -> dict[str, Any]:
    """Store prompts on a disk that ``fill`` makes full and ``free`` frees again, twice.
    Returns what was observed: kvstrata's log lines, counters, whether every prompt was served
    with its exact bytes, and what a check of the folder found afterwards."""
    ns = make_namespace()
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.getMessage()}")

    handler = Collect(logging.WARNING)
    logging.getLogger("kvstrata").addHandler(handler)
    served = True
    stored_on_disk: list[int] = []
    try:
        with BlockStore(make_config(root, **{"l1.size": 128 * BIG, "l2.size": "64MiB"})) as store:
            def round_(tag: str) -> None:
                nonlocal served
                before = store.counters.get("l2_bytes_written")
                prompts = [random_tokens(f"{tag}-{i}", 4 * BLOCK_SIZE) for i in range(4)]
                for tokens in prompts:
                    epoch, chain = store.chain(ns, tokens)
                    store.save_now(ns, epoch, chain, payloads_for(chain, BIG))
                for tokens in prompts:  # every request is still served, with exact bytes
                    hit = store.lookup(ns, tokens)
                    n, out = load_hit(store, hit, BIG)
                    served = served and n == hit.num_blocks == 4
                    assert_payloads_match(hit.chain.keys, out, n, BIG)
                stored_on_disk.append((store.counters.get("l2_bytes_written") - before) // BIG)

            for burst in ("a", "b"):
                fill()
                round_(f"full-{burst}")
                free()
                round_(f"free-{burst}")
            counters = store.counters.snapshot()
    finally:
        logging.getLogger("kvstrata").removeHandler(handler)
    from kvstrata.cli.check import check_disk

    report = check_disk(root / "l2", progress=False)
    return {"lines": lines, "counters": counters, "served": served, "stored_on_disk": stored_on_disk,
            "check": {k: report[k] for k in ("ok", "bad", "temp_leftovers")}}


def _assert_full_disk_handled(seen: dict[str, Any], folder: Path) -> None:
    lines = seen["lines"]
    full = [line for line in lines if "is full" in line]
    back = [line for line in lines if "space is back" in line]
    assert len(full) == 2, lines  # once per burst, not once per block
    assert all(str(folder) in line and "No space left on device" in line for line in full), full
    assert len(back) == 2 and all(str(folder) in line and "were dropped" in line for line in back), back
    assert not [line for line in lines if "short write" in line or "write of" in line], lines
    assert seen["served"]
    full_a, free_a, full_b, free_b = seen["stored_on_disk"]
    assert full_a < 16 and full_b < 16 and free_a == 16 and free_b == 16, seen["stored_on_disk"]
    assert seen["counters"]["l2_full_drops"] >= 2
    assert seen["check"]["bad"] == 0 and seen["check"]["temp_leftovers"] == 0
    assert seen["check"]["ok"] == sum(seen["stored_on_disk"])


def _userns_tmpfs_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_full_disk_on_a_real_tmpfs_is_logged_once_per_burst_and_saves_resume(tmp_path):
    """Scenario: L2 on a real 4 MiB tmpfs (mounted in a user namespace). A ballast file leaves
    room for a few 64 KiB blocks; 16 blocks are stored; the ballast is deleted; 16 more are
    stored; twice. Each full burst is logged once, naming the folder and ENOSPC (never a short
    write, never once per block); each return of space is logged once with what was dropped;
    every request is served with exact bytes; all 16 blocks reach the disk once space is back;
    and the folder holds only complete blocks and no temp files."""
    if not _userns_tmpfs_works():
        pytest.skip("user namespaces are not available here, so no tmpfs can be mounted; "
                    "test_full_disk_simulated_at_the_write_call covers the same scenario")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" "$3" full-disk "$1"'
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(mnt), sys.executable, __file__],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_full_disk_handled(json.loads(res.stdout.splitlines()[-1]), mnt / "l2")


def _full_disk_child(mnt: Path) -> None:
    ballast = mnt / "ballast"

    def fill() -> None:
        free_now = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        with open(ballast, "wb") as f:
            f.write(b"\0" * max(0, free_now - 3 * (BIG + 4096)))

    def free() -> None:
        ballast.unlink()

    seen = _full_disk_scenario(mnt, fill, free)
    print(json.dumps(seen))


def test_full_disk_simulated_at_the_write_call(tmp_path, monkeypatch):
    """Scenario: as on the real tmpfs, with the full disk simulated where the kernel reports it:
    the file write calls. Past a byte budget, ``pwritev`` returns a short count and the next
    write fails with ENOSPC, as Linux does on a full filesystem; freeing space lifts the budget."""
    budget = {"left": 0}
    real_pwritev, real_pwrite = os.pwritev, os.pwrite

    def take(n: int) -> int:
        got = min(n, budget["left"])
        budget["left"] -= got
        return got

    def pwritev(fd: int, bufs, offset: int) -> int:
        total = sum(memoryview(b).nbytes for b in bufs)
        got = take(total)
        if got == total:
            return real_pwritev(fd, bufs, offset)
        if got == 0:
            raise OSError(28, os.strerror(28))
        joined = b"".join(bytes(b) for b in bufs)
        return real_pwrite(fd, joined[:got], offset)

    def pwrite(fd: int, data, offset: int) -> int:
        got = take(memoryview(data).nbytes)
        if got == 0:
            raise OSError(28, os.strerror(28))
        return real_pwrite(fd, memoryview(data)[:got], offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "pwrite", pwrite)

    def fill() -> None:
        budget["left"] = 3 * (BIG + HEADER_SIZE) + 1000  # room for three blocks and a bit

    def free() -> None:
        budget["left"] = 1 << 40

    seen = _full_disk_scenario(tmp_path, fill, free)
    _assert_full_disk_handled(seen, tmp_path / "l2")


# ------------------------------------------------------------------------------- l2.size holds
def _files_bytes(blocks: Path) -> int | None:
    """Bytes of every regular file under ``blocks`` (temp files included), or None when the
    folder changed while it was walked (two walks differ): then no instant was observed."""
    def walk() -> set[tuple[str, int]]:
        seen = set()
        for shard in os.scandir(blocks):
            with os.scandir(shard.path) as it:
                for e in it:
                    try:
                        seen.add((e.name, e.stat(follow_symlinks=False).st_size))
                    except FileNotFoundError:
                        pass
        return seen

    first = walk()
    return sum(size for _, size in first) if walk() == first else None


@pytest.mark.parametrize("path", ["write_through", "direct"])
def test_l2_never_exceeds_its_size_while_a_batch_is_written(tmp_path, path, monkeypatch):
    """Scenario: ``l2.size`` holds 8 blocks; prompts of 6 blocks are saved one after another
    (write-through from L1, or a ``save`` of ``ByteRuns`` straight from the caller's memory) on
    a slow disk (40 ms per block: time for the sampler's walks even on a busy machine). A sampler walks the folder meanwhile: the bytes of the files in
    it (temp files included) never exceed ``l2.size`` at any observed instant, and the last
    prompt is on disk."""
    ns = make_namespace()
    cost = HEADER_SIZE + BLOCK_BYTES
    plant_trials(monkeypatch, l2_write_delay_ms=40)
    cfg = make_config(tmp_path, **{"l2.size": 8 * cost})
    peak, samples, stop = [0], [0], threading.Event()

    def sample(blocks: Path) -> None:
        while not stop.is_set():
            total = _files_bytes(blocks)
            if total is not None:
                peak[0] = max(peak[0], total)
                samples[0] += 1

    with BlockStore(cfg) as store:
        sampler = threading.Thread(target=sample, args=(tmp_path / "l2" / "blocks",), daemon=True)
        sampler.start()
        try:
            for i in range(4):
                tokens = random_tokens(f"cap-{i}", 6 * BLOCK_SIZE)
                epoch, chain = store.chain(ns, tokens)
                data = payloads_for(chain)
                if path == "direct":
                    runs = ByteRuns(BLOCK_BYTES, lambda k: [memoryview(data[k].numpy())])
                    assert store.save_runs(ns, epoch, chain, runs) == 6
                else:
                    store.save_now(ns, epoch, chain, data)
        finally:
            stop.set()
            sampler.join()
        assert store.l2.used_bytes <= 8 * cost
        last = [store.l2.path(k) for k in chain.keys]
    assert samples[0] >= 5, "the sampler observed too few instants to tell"
    assert peak[0] <= 8 * cost, f"L2 held {peak[0]} bytes, l2.size is {8 * cost}"
    assert all(p.exists() for p in last)


# ---------------------------------------------------------------- the epochs folder, planted
@pytest.mark.parametrize("plant", ["fifo", "symlink", "folder"])
def test_planted_epoch_file_neither_hangs_nor_is_followed_and_makes_a_new_epoch(tmp_path, plant):
    """Scenario: the epochs folder (beside the tier, and on a shared folder) is writable by
    others. Someone puts a FIFO, a link to a file outside (holding a valid-looking epoch)
    or a folder where a namespace's epoch file and its floor (``.retired``) go. Opening a store
    and looking up must not wait on the FIFO, must not read or change the file outside, and the
    namespace gets a fresh epoch (older blocks are misses, never valid again)."""
    ns = make_namespace()
    with BlockStore(make_config(tmp_path)) as a:
        store_prompt(a, ns, random_tokens("epoch", 48))
        old = a.epochs.get(ns.seed)
    epochs = tmp_path / "l2" / "epochs"
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "epoch"
    target.write_text(f"{old}\n")
    before = target.stat()
    for path in (epochs / ns.seed.hex(), epochs / f"{ns.seed.hex()}.retired"):
        path.unlink(missing_ok=True)
        if plant == "fifo":
            os.mkfifo(path)
        elif plant == "symlink":
            path.symlink_to(target)
        else:
            path.mkdir()
    t0 = time.monotonic()
    done: list[Any] = []

    def open_and_look() -> None:
        with BlockStore(make_config(tmp_path)) as b:
            done.append((b.epochs.get(ns.seed), b.lookup(ns, random_tokens("epoch", 48)).num_blocks))

    worker = threading.Thread(target=open_and_look, daemon=True)
    worker.start()
    worker.join(NORMAL_S * 4)
    assert done, f"a store open with a planted {plant} did not finish in {NORMAL_S * 4} s"
    assert time.monotonic() - t0 < NORMAL_S * 4
    epoch, hit = done[0]
    if plant != "folder":  # a folder cannot be replaced by a file: that namespace stays private
        assert epoch != old and hit == 0
    assert target.read_text() == f"{old}\n" and target.stat().st_mtime_ns == before.st_mtime_ns


def test_shared_folder_epochs_carry_the_groups_bits(tmp_path):
    """Scenario: a shared folder of mode 2770 (a group of engine hosts). The epoch files every
    instance must read and replace are group-readable in a group-writable folder; before, they
    were 0600 in a 0700 folder, so another uid of the group could not see a reset."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    cfg = make_config(tmp_path, **{"remote.enabled": True, "remote.backend": "fs", "remote.path": str(shared)})
    ns = make_namespace()
    with BlockStore(cfg) as s:
        s.epochs.bump(ns.seed)
        s.epochs.bump(ns.seed)
    folder = shared / "epochs"
    assert stat.S_IMODE(folder.stat().st_mode) & 0o070 == 0o070
    for name in (ns.seed.hex(), f"{ns.seed.hex()}.retired"):
        assert stat.S_IMODE((folder / name).stat().st_mode) & 0o040, name


if __name__ == "__main__":
    if sys.argv[1] == "full-disk":
        _full_disk_child(Path(sys.argv[2]))
