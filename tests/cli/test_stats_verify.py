"""``kvstrata stats`` shows the verified hits of every engine process that shared the store: per
namespace the blocks checked, the mismatches and the last one (when, the tier that served it, its
error beside the tolerance, the block key), in its tables and in ``--json``. The engine's counts
reach the CLI's process through the namespace's verification record beside its epoch.

An engine is a real ``BlockStore`` on a disk tier in a tmp folder making verification rounds as the
adapters do; the CLI runs in a subprocess, as a user runs it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvstrata import BlockStore, load_config
from kvstrata.verify.compare import segments_of
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_namespace, random_tokens

SEGMENTS = segments_of(BLOCK_BYTES, 4, torch.float32)
NS = make_namespace(kv_dtype="float32", model="org/verified-model")
QUIET = make_namespace(kv_dtype="float32", model="org/quiet-model")


def kvstrata(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def floats(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, BLOCK_BYTES // 4), generator=g).view(torch.uint8)


def engine_run(cfg: Path, rounds: list[int | None]) -> list[bytes]:
    """An engine process: describes both namespaces, stores four blocks of NS and verifies them once
    per round (``rounds[i]``: the block computed otherwise that round, a mismatch, or None). Returns
    the keys of the mismatching blocks, in order."""
    with BlockStore(load_config(cfg)) as store:
        return verify_rounds(store, rounds)


def verify_rounds(store: BlockStore, rounds: list[int | None]) -> list[bytes]:
    bad_keys = []
    store.wait_recovered(30)
    store.describe(QUIET)
    store.describe(NS)
    tokens = random_tokens("stats-verify", 4 * BLOCK_SIZE)
    epoch, chain = store.chain(NS, tokens)
    kv = floats(1, 4)
    for bad in rounds:
        store.save_now(NS, epoch, chain, kv)  # a mismatching block was deleted: stored again
        res = store.prepare_verify(NS, epoch, chain, BLOCK_BYTES)
        computed = kv.clone()
        if bad is not None:
            computed[bad] = floats(99, 1)[0]
            bad_keys.append(chain.keys[bad])
        for slot, row in zip(res.slots, computed):
            store.arena.data[slot, : row.numel()] = row
        assert [r.ok for r in store.complete_verify(res, SEGMENTS, wait=True)] == [i != bad for i in range(4)]
    return bad_keys


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    path = tmp_path / "kvstrata.yaml"
    path.write_text(f"l1:\n  size: 16MiB\n  pin_memory: false\nl2:\n  path: {tmp_path / 'l2'}\n  size: 64MiB\n"
                    "  write: through\n")
    return path


def namespace_lines(out: str, ns_id: str) -> str:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {ns_id}  "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return "\n".join(lines[start:end])


def test_stats_shows_checks_mismatches_and_the_last_mismatch_of_every_engine(cfg):
    before = time.time()
    first = engine_run(cfg, [None, 1, None])
    second = engine_run(cfg, [None, None, 2])  # another engine process, later, on the same disk tier
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json"))
    verified = data["verified"][NS.id]
    assert verified["checks"] == 24 and verified["mismatches"] == 2
    last = verified["last_mismatch"]
    assert last["key"] == second[-1].hex() != first[-1].hex()
    assert last["tier"] == "l2"  # the second engine started with an empty L1: its blocks came from disk
    assert last["error"] > last["tolerance"] > 0 and last["segment"] >= 0
    assert before <= last["time"] <= time.time()
    assert QUIET.id not in data["verified"]  # never verified: no record
    assert data["verify"] == {}  # the CLI's own process verified nothing

    out = kvstrata("stats", "--config", str(cfg))
    lines = namespace_lines(out, NS.id)
    assert "    verified   24 blocks checked against the engine's own computation, 2 mismatches" in lines, out
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(last["time"]))
    assert f"    mismatch   last {when}" in lines and f"block {second[-1].hex()} from l2" in lines, out
    assert f"error {last['error']:.3g} > tolerance {last['tolerance']:.3g} (segment {last['segment']})" in lines, out
    assert "verified" not in namespace_lines(out, QUIET.id), out


def test_stats_of_checks_without_a_mismatch(cfg):
    engine_run(cfg, [None, None])
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json"))
    assert data["verified"][NS.id] == {"checks": 8, "mismatches": 0, "last_mismatch": None}
    lines = namespace_lines(kvstrata("stats", "--config", str(cfg)), NS.id)
    assert "8 blocks checked against the engine's own computation, 0 mismatches" in lines and "mismatch   " not in lines


@pytest.mark.parametrize("planted", [b"\x00garbage\xff{", b'{"kvstrata_verify":1,"checks":-5,"mismatches":0,'
                                     b'"last_mismatch":null}', "fifo", "symlink"])
def test_a_planted_record_never_hangs_or_crashes_stats(cfg, planted, tmp_path):
    import os

    engine_run(cfg, [None])
    path = tmp_path / "l2" / "epochs" / f"{NS.seed.hex()}.verify"
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "symlink":
        (tmp_path / "elsewhere").write_text('{"kvstrata_verify":1,"checks":99,"mismatches":0,"last_mismatch":null}')
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_bytes(planted)
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json"))
    assert NS.id not in data["verified"] and data["counters"]["bad_verify_records"] == 1
    assert f"  {NS.id}  {NS.model}" in kvstrata("stats", "--config", str(cfg))


def test_stats_in_the_engines_process_shows_its_quarantine(cfg):
    """Scenario: ``stats()`` called inside the engine that quarantined the namespace: the record
    already holds the mismatch (written at once), and the quarantine, local to that process, shows."""
    from rich.console import Console

    from kvstrata.cli.stats_view import render

    cfg.write_text(cfg.read_text() + "verify:\n  on_mismatch: quarantine\n")
    with BlockStore(load_config(cfg)) as store:
        (bad,) = verify_rounds(store, [3])
        out = io.StringIO()
        render(store.stats(), Console(file=out, width=240))
    lines = namespace_lines(out.getvalue(), NS.id)
    assert "4 blocks checked against the engine's own computation, 1 mismatch\n" in lines, lines
    assert any(f"block {bad.hex()} from {tier}" in lines for tier in ("l1", "l2")), lines  # the copy read: at random
    assert "    quarantine this process serves none of it" in lines, lines
    assert "quarantine" not in namespace_lines(kvstrata("stats", "--config", str(cfg)), NS.id)  # another process
