"""``kvstrata torture``: the oracle on its own (fast), then the whole command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from kvstrata.cli.main import main
from kvstrata.keys import key_scheme
from kvstrata.store import BlockStore
from kvstrata.tools.torture import (NAMESPACES, PAYLOAD_BYTES, RetiredLog, check_load, expected_keys,
                                    payloads_of, store_config)
from tests.harness.redisutil import REDIS, standalone

NS = NAMESPACES[0]
KEYS = key_scheme(NS.key_scheme)  # the stores here hold no secret


def loaded(tmp_path, tokens):
    """A real store holding ``tokens``; returns (hit, the loaded blocks, the lookup's start)."""
    spec = {"l2": str(tmp_path / "l2")}
    with BlockStore(store_config(spec)) as store:
        epoch, chain = store.chain(NS, tokens)
        store.save_now(NS, epoch, chain, torch.from_numpy(payloads_of(chain.keys)))
        started = time.monotonic_ns()
        hit = store.lookup(NS, tokens, pin=True)
        out = np.full((hit.num_blocks, PAYLOAD_BYTES), 0xA5, np.uint8)
        got = store.load_into(hit, torch.from_numpy(out))
        store.complete_load(hit)
    assert got == hit.num_blocks == len(chain.keys)
    return hit, out, started


def test_an_epoch_retired_before_the_lookup_makes_the_load_stale(tmp_path):
    tokens = np.arange(10, dtype=np.uint32)  # two full blocks and a tail of two tokens
    hit, out, started = loaded(tmp_path, tokens)
    oracle = RetiredLog(tmp_path / "retired.log")
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, out, started, oracle) == (0, 0, [])
    oracle.retire([hit.epoch + 1], started - 10, "invalidate")  # another epoch: not this load's
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, out, started, oracle) == (0, 0, [])
    oracle.retire([hit.epoch], started + 10, "invalidate")  # retired after the lookup began: allowed
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, out, started, oracle) == (0, 0, [])
    oracle.retire([hit.epoch], started - 10, "loss")  # retired before it began: stale, every block
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, out, started, oracle) == (0, 3, ["loss"])
    graced = RetiredLog(tmp_path / "retired.log", grace_s=1.0)  # within the grace: allowed
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, out, started, graced) == (0, 0, [])


def test_a_partial_retired_log_line_is_not_read_until_complete(tmp_path):
    oracle = RetiredLog(tmp_path / "retired.log")
    (tmp_path / "retired.log").write_bytes(b"100 loss 1 7\n200 invalidate 1 ")
    assert oracle.retired_before(7, 101) == ["loss"] and oracle.retired_before(8, 10**12) == []
    with open(tmp_path / "retired.log", "ab") as f:
        f.write(b"8\n")
    assert oracle.retired_before(8, 201) == ["invalidate"]


def test_bytes_of_another_block_or_never_written_count_as_wrong(tmp_path):
    tokens = np.arange(10, dtype=np.uint32)
    hit, out, started = loaded(tmp_path, tokens)
    oracle = RetiredLog(tmp_path / "retired.log")
    swapped = out[[1, 0, 2]]  # blocks 0 and 1 hold each other's bytes
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, swapped, started, oracle)[0] == 2
    unwritten = out.copy()
    unwritten[2] = 0xA5  # reported loaded, never written
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, unwritten, started, oracle)[0] == 1
    flipped = out.copy()
    flipped[0, 100] ^= 1
    assert check_load(KEYS, NS, tokens, hit.epoch, hit.chain.lengths, flipped, started, oracle)[0] == 1
    # The keys come from the tokens, not from the hit: a hit for other tokens is wrong too.
    other = tokens.copy()
    other[9] += 1
    assert check_load(KEYS, NS, other, hit.epoch, hit.chain.lengths, out, started, oracle)[0] == 1


def test_expected_keys_of_a_hit_ending_in_a_shorter_stored_tail(tmp_path):
    tokens = np.arange(11, dtype=np.uint32)  # the request goes on past a stored 2-token tail
    stored = tokens[:10]
    hit, out, started = loaded(tmp_path, stored)
    keys = expected_keys(KEYS, NS, hit.epoch, tokens, hit.chain.lengths)
    assert keys == hit.chain.keys
    assert expected_keys(KEYS, NS, hit.epoch, tokens, [4, 4, 4, 2])[3] is None  # past the request's end
    assert expected_keys(KEYS, NS, hit.epoch, tokens, [2, 4])[0] is None  # a short block before a full one


def torture(tmp_path, seconds: int, seed: int) -> dict:
    """``kvstrata torture`` through the CLI, with a real Redis behind ``--net-faults`` when the
    machine has redis-server; its JSON summary, after the checks every run must pass."""
    with (standalone(tmp_path) if REDIS else nullcontext()) as server:
        cmd = [sys.executable, "-m", "kvstrata.cli.main", "torture", "--seconds", str(seconds), "--json",
               "--seed", str(seed)]
        if server:
            cmd += ["--redis", server[0], "--net-faults"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 3 + 120)
    assert res.stdout.strip(), res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    detail = json.dumps(summary, indent=1)
    assert summary["wrong"] == 0 and summary["stale"] == 0 and summary["lost_tails"] == 0, detail
    assert res.returncode == 0, detail
    assert summary["errors"] == 0 and summary["workers"]["crashed"] == 0, detail
    if server:  # the proxy went through every mode, and the oracle's grace is the promised bound
        assert all(summary["net_faults_s"][mode] > 0 for mode in ("pass", "slow", "hang", "refuse")), detail
        assert summary["grace_ms"] == 250.0, detail
        assert summary["unconfirmed_epoch_misses"] > 0, detail
    return summary


def test_torture_serves_nothing_wrong_or_stale(tmp_path):
    """Scenario: 60 s of three worker processes (kills, restarts, corruption, invalidations,
    epoch-state loss, collisions, tail probes), through the CLI, with a real Redis when the
    machine has redis-server, reached through a proxy that cycles through passing, slow (300 ms),
    hung and refusing. Every loaded block is checked; none may be wrong or stale."""
    summary = torture(tmp_path, 60, 7)
    detail = json.dumps(summary, indent=1)
    assert summary["loads_checked"] > 2000, detail
    assert summary["tail_probes"] > 5 and summary["collision_probes"] > 5, detail
    assert summary["injected"]["kills"] > 0 and summary["injected"]["epoch_loss"] > 0, detail
    assert summary["injected"]["invalidate"] > 0, detail
    rejected = summary["rejections"]
    caught = sum(rejected.get(k, 0) for k in ("checksum_failures", "l2_bad_headers", "remote_bad_headers"))
    assert caught > 0, detail  # flipped bytes were caught (payload checksums, header checksums)
    assert rejected["collision_refusals"] > 0, detail  # 2-byte index keys shared, other block refused
    if REDIS:
        assert summary["injected"]["corrupted_redis_values"] > 0, detail


def test_torture_beside_cpu_burners_serves_nothing_stale(tmp_path):
    """Scenario: the same torture, 20 s, with two processes spinning on the CPU beside it (on this
    2-core machine every worker and the proxy are starved for time slices). The bound is checked
    against when a read was sent, so starvation costs hits, never a stale block."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        summary = torture(tmp_path, 20, 11)
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    assert summary["loads_checked"] > 200, json.dumps(summary, indent=1)


@pytest.mark.parametrize("argv", [["--procs", "0"], ["--seconds", "0"]])
def test_torture_refuses_nonsense_arguments(argv, capsys):
    assert main(["torture", *argv]) == 2
    assert "must be positive" in capsys.readouterr().err
