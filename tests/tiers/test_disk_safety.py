"""L2 safety: corrupt and torn files, writers killed mid-stream, two processes on one folder."""

from __future__ import annotations

import os
import queue
import random
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.builders import (BLOCK_BYTES, assert_payloads_match, load_hit, make_config, payload_for,
                            random_tokens, store_prompt)
from kv_child import CRASH_PROMPT_TOKENS, crash_prompt
from kvstrata.format.block import HEADER_SIZE, payload_checksum, unpack_header
from kvstrata.metrics import Counters
from kvstrata.store import BlockStore
from kvstrata.tiers import DiskTier

CHILD = Path(__file__).resolve().parent / "kv_child.py"
ROOT = Path(__file__).resolve().parents[2]


def _damage(path: Path, kind: str) -> None:
    data = bytearray(path.read_bytes())
    if kind == "payload_flip":
        data[HEADER_SIZE + 37] ^= 0x40
    elif kind == "truncated_payload":
        del data[HEADER_SIZE + BLOCK_BYTES // 2 :]
    elif kind == "header_flip":
        data[60] ^= 0x01  # inside the fingerprint field, covered by the header checksum
    elif kind == "truncated_header":
        del data[HEADER_SIZE // 2 :]
    else:
        raise ValueError(kind)
    path.write_bytes(bytes(data))


DAMAGE = ["payload_flip", "truncated_payload", "header_flip", "truncated_header"]


def _stored_prompt(tmp_path: Path, ns):
    tokens = random_tokens("p", 4 * 16)
    with BlockStore(make_config(tmp_path)) as writer:
        chain, stored = store_prompt(writer, ns, tokens)
        paths = [writer.l2.path(k) for k in chain.keys]
    assert stored == 4
    return tokens, chain, paths


# -------------------------------------------------------------------------- corruption
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_block_and_its_successors_are_not_loaded_by_a_store_that_indexed_it(tmp_path, ns, kind):
    """Scenario: a store reopens a folder holding a 4-block prompt (recovering all 4 from disk),
    then block 2's file is damaged. Loading reports 2 blocks (the damaged one and the one after
    it are not loaded), the first 2 are intact, checksum_failures counts it, the bad file is
    deleted, and the next lookup stops before it."""
    tokens, chain, _paths = _stored_prompt(tmp_path, ns)
    with BlockStore(make_config(tmp_path)) as store:
        hit = store.lookup(ns, tokens)
        assert hit.num_blocks == 4
        bad = store.l2.path(chain.keys[2])
        _damage(bad, kind)

        n, out = load_hit(store, hit)
        assert n == 2
        assert_payloads_match(chain.keys, out, 2)
        assert store.counters.get("checksum_failures") == 1
        assert not bad.exists()
        assert store.l2.path(chain.keys[3]).exists()  # only the bad copy is deleted
        assert store.lookup(ns, tokens).num_blocks == 2


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_block_found_by_a_fresh_store_is_not_served_and_is_deleted(tmp_path, ns, kind):
    """Scenario: block 2 of a stored 4-block prompt is damaged while no store is open; a fresh
    store (recovering the folder) serves only blocks 0-1 with intact bytes (whether it notices
    at lookup or at load), counts the corruption, and deletes the bad file."""
    tokens, chain, paths = _stored_prompt(tmp_path, ns)
    bad = paths[2]
    assert bad.is_file()
    _damage(bad, kind)
    with BlockStore(make_config(tmp_path)) as store:
        assert store.l2.path(chain.keys[2]) == bad
        hit = store.lookup(ns, tokens)
        assert hit.num_blocks in (2, 4)
        n, out = load_hit(store, hit)
        assert min(n, hit.num_blocks) == 2
        assert_payloads_match(chain.keys, out, 2)
        assert store.lookup(ns, tokens).num_blocks == 2
        # Whichever met the file first, the load or the background recovery, deleted and counted
        # it; the recovery reports its counts when it has scanned the whole folder.
        assert store.wait_recovered(60)
        counted = store.counters.get("checksum_failures") + store.counters.get("l2_bad_headers")
        assert counted >= 1
        assert not bad.exists(), "a corrupt block file must not stay on disk"


# ------------------------------------------------------------------------ crash safety
class _Lines:
    """Lines of a child's stdout, read by a thread so that waits can time out."""

    def __init__(self, proc: subprocess.Popen, stderr: Path) -> None:
        self.proc = proc
        self.stderr = stderr
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.queue.put(line.strip())
        self.queue.put(None)

    def next(self, timeout: float = 60.0) -> str:
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("child process did not answer in time") from None
        assert line is not None, f"child process died: {self.stderr.read_text()}"
        return line


def test_writers_killed_at_random_points_leave_only_complete_blocks(tmp_path, ns):
    """Scenario: five rounds, each a fresh writer process (forked by a helper subprocess) putting
    4-block prompts (16 KiB blocks, key-derived payloads, write-through, 4 MiB L2 so capacity
    deletions happen too) in a loop until SIGKILLed after a random 0.05-0.5 s. A torn temp file
    of the last dead writer is also left behind. Reopening the folder then: removes every .tmp
    file, finds only block files whose header and payload are complete and equal to what their
    key implies, serves every prompt it hits with exactly the expected bytes, and still has the
    last prompt each finished put returned for the final round."""
    size, l2_size, rounds = 16 << 10, 4 << 20, 5
    rng = random.Random(1234)
    progress: dict[int, int] = {}
    last_pid = 0
    stderr = tmp_path / "writers.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), "crash-forker", str(tmp_path), str(size), str(l2_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    lines = _Lines(proc, stderr)
    try:
        assert lines.next() == "loaded"
        for r in range(rounds):
            proc.stdin.write(f"{r}\n")
            proc.stdin.flush()
            pid, done = 0, []
            while not (pid and done):  # the writer's pid and its first finished put
                word, *rest = lines.next().split()
                if word == "pid":
                    pid = int(rest[0])
                elif word == "done":
                    done.append(int(rest[1]))
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(pid, signal.SIGKILL)
            while True:
                word, *rest = lines.next().split()
                if word == "done":
                    done.append(int(rest[1]))
                elif word == "exit":
                    assert int(rest[0]) == pid
                    assert os.WIFSIGNALED(int(rest[1])) and os.WTERMSIG(int(rest[1])) == signal.SIGKILL
                    break
            progress[r] = max(done)
            last_pid = pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    root = tmp_path / "l2"
    # A torn write of the dead writer: what SIGKILL between open() and rename() leaves behind.
    # (Named like DiskTier.write names its temps, next to where the block would be published.)
    key = bytes(range(16))
    final = DiskTier(Counters(), root, l2_size).path(key)
    torn = final.with_name(f".{final.stem}.{last_pid}.7.tmp")
    torn.write_bytes(payload_for(key, HEADER_SIZE // 2).numpy().tobytes())
    assert list(root.rglob("*.tmp"))

    with BlockStore(make_config(tmp_path, **{"l1.size": 64 * size, "l2.size": l2_size})) as store:
        assert store.wait_recovered(30)
        assert not list(root.rglob("*.tmp")), "a dead writer's temp file survived recovery"
        assert store.counters.get("l2_temp_removed") >= 1

        files = list(root.rglob("*.kvb"))
        assert files
        for f in files:
            raw = f.read_bytes()
            meta = unpack_header(raw[:HEADER_SIZE], str(f))
            assert f.name == meta.key.hex() + ".kvb"
            assert len(raw) == HEADER_SIZE + meta.size == HEADER_SIZE + size
            assert payload_checksum(raw[HEADER_SIZE:]) == meta.checksum
            assert raw[HEADER_SIZE:] == payload_for(meta.key, size).numpy().tobytes()

        hits = 0
        for r, last in progress.items():
            for i in range(last + 2):  # +1: the put that was in flight when the writer died
                hit = store.lookup(ns, crash_prompt(r, i))
                n, out = load_hit(store, hit, size)
                assert n == hit.num_blocks
                assert_payloads_match(hit.chain.keys, out, n, size)
                hits += n
        last_put = store.lookup(ns, crash_prompt(rounds - 1, progress[rounds - 1]))
        assert last_put.num_tokens == CRASH_PROMPT_TOKENS
        assert hits > 0
        assert store.counters.get("checksum_failures") == 0


# -------------------------------------------------------------- two processes, one disk
def test_second_process_discovers_blocks_written_by_another(tmp_path, ns):
    """Scenario: store B is opened first (its index is empty); process A then stores a 100-token
    prompt on the shared folder and exits. B discovers every block by header probing, including
    the 4-token partial tail via its marker, and loads bytes identical to A's."""
    tokens = random_tokens("shared", 100)
    with BlockStore(make_config(tmp_path)) as b:
        assert b.lookup(ns, tokens).num_blocks == 0
        res = subprocess.run([sys.executable, str(CHILD), "put", str(tmp_path), "shared", "100"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["stored", "7"]

        hit = b.lookup(ns, tokens)
        assert hit.num_tokens == 100 and hit.num_blocks == 7
        assert hit.chain.lengths[-1] == 4
        _, chain = b.chain(ns, tokens)
        assert hit.chain.keys == chain.keys
        n, out = load_hit(b, hit)
        assert n == 7
        assert_payloads_match(chain.keys, out, 7)
        assert b.counters.get("hit_blocks_l2") == 7
        longer = b.lookup(ns, list(tokens) + [1, 2, 3])
        assert longer.num_tokens == 100


def test_disk_tier_files_are_0600_and_folders_0700(tmp_path, ns):
    """Scenario: after blocks (with a partial tail) are stored and the namespace invalidated
    once, every folder under l2.path is mode 0700 and every file 0600."""
    with BlockStore(make_config(tmp_path)) as store:
        store_prompt(store, ns, random_tokens("p", 100))
        store.invalidate(ns.seed)
        store_prompt(store, ns, random_tokens("q", 40))
    root = tmp_path / "l2"
    dirs = [root] + [p for p in root.rglob("*") if p.is_dir()]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".kvb" for p in files) and len(dirs) > 4
    bad_dirs = {str(d.relative_to(tmp_path)): oct(stat.S_IMODE(d.stat().st_mode))
                for d in dirs if stat.S_IMODE(d.stat().st_mode) != 0o700}
    bad_files = {str(f.relative_to(tmp_path)): oct(stat.S_IMODE(f.stat().st_mode))
                 for f in files if stat.S_IMODE(f.stat().st_mode) != 0o600}
    assert not bad_files
    assert not bad_dirs
