"""``kvstrata stats`` and ``kvstrata invalidate`` in the operator's words, run as a user would:
blocks of two models stored through a real ``BlockStore``, then the CLI in a subprocess.

``stats`` names each namespace's model, weights version, dtype, layout and tenant (its descriptor,
written beside the epochs by ``BlockStore.describe``) with sizes in binary units;
``invalidate --model`` bumps exactly that model's namespaces; descriptors are read back as
untrusted input (a planted FIFO, link, garbage or another namespace's descriptor).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace, load_config

BLOCK = 16
SIZE = 1024
PROMPTS = 3  # of 40 tokens: 2 full blocks and a partial one each
A = Namespace("vllm", "org/model-a", "sha-a1", "bfloat16", "cpu:x86;4x[2,16,64]", BLOCK, tenant="team-a")


def ns_b(folder: Path) -> Namespace:
    """Model B is served from a local folder, as vLLM records it (an absolute path)."""
    return Namespace("sglang", str(folder), "sha-b7", "float16", "8x[2,8,32]", BLOCK, world_size=2)


def kvstrata(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstrata.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def ok(*args: str, cwd: Path | None = None) -> str:
    res = kvstrata(*args, cwd=cwd)
    assert res.returncode == 0, f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def prompt(p: int) -> np.ndarray:
    return np.arange(p * 1000, p * 1000 + 40)


def write_config(tmp_path: Path, name: str = "kvstrata.yaml", l2: str = "l2", extra: str = "") -> Path:
    path = tmp_path / name
    path.write_text(f"l1:\n  size: 64MiB\n  pin_memory: false\nl2:\n  path: {tmp_path / l2}\n  size: 256MiB\n{extra}")
    return path


def fill(cfg: Path, spaces: list[Namespace]) -> None:
    """What an engine does: describe its namespace once at start, then save blocks."""
    with BlockStore(load_config(cfg)) as store:
        for ns in spaces:
            store.describe(ns)
            for p in range(PROMPTS):
                epoch, chain = store.chain(ns, prompt(p))
                src = torch.full((len(chain.keys), SIZE), p, dtype=torch.uint8)
                assert store.save_now(ns, epoch, chain, src) == len(chain.keys)


def hit_blocks(cfg: Path, ns: Namespace) -> int:
    with BlockStore(load_config(cfg)) as store:
        return sum(store.lookup(ns, prompt(p)).num_blocks for p in range(PROMPTS))


@pytest.fixture
def two_models(tmp_path: Path) -> tuple[Path, Namespace]:
    folder = tmp_path / "models" / "model-b"
    folder.mkdir(parents=True)
    cfg, b = write_config(tmp_path), ns_b(folder)
    fill(cfg, [A, b])
    assert hit_blocks(cfg, A) == hit_blocks(cfg, b) == 3 * PROMPTS
    return cfg, b


def namespace_lines(out: str, ns_id: str) -> str:
    """The lines ``stats`` prints for one namespace: its header, then the indented details."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {ns_id}  "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return "\n".join(lines[start:end])


def test_stats_names_each_model_with_human_sizes(two_models):
    cfg, b = two_models
    out = ok("stats", "--config", str(cfg))
    for ns in (A, b):
        lines = namespace_lines(out, ns.id)
        assert lines.startswith(f"  {ns.id}  {ns.model}\n"), out
        for label, value in (("weights", ns.model_version), ("dtype", ns.kv_dtype), ("layout", ns.layout),
                             ("tenant", ns.tenant or "-")):
            assert f"    {label:<10} {value}\n" in lines, (label, out)
        assert f"    engine     {ns.engine}: 16-token blocks, rank 0 of {ns.world_size}" in lines, out
        assert "9 blocks, 9.0 KiB (epoch " in lines, out  # 3 prompts x 3 blocks x 1 KiB
    assert "18.0 KiB" in out and "256.0 MiB" in out, out  # the disk tier: used, capacity
    assert not re.search(rf"\b({9 * SIZE}|{18 * SIZE})\b", out), out  # no raw byte counts


def test_stats_json_keeps_its_keys_and_adds_the_descriptors(two_models):
    cfg, b = two_models
    data = json.loads(ok("stats", "--config", str(cfg), "--json"))
    assert {"tiers", "namespaces", "current_epochs", "counters"} <= set(data)
    assert data["tiers"]["l2"]["blocks"] == 18
    for ns in (A, b):
        current = data["current_epochs"][ns.id]
        assert data["namespaces"][ns.id] == {current: {"blocks": 9, "bytes": 9 * SIZE}}
        assert Namespace(**data["descriptors"][ns.id]) == ns


def test_invalidate_model_hides_that_models_blocks_and_no_others(two_models):
    cfg, b = two_models
    before = json.loads(ok("stats", "--config", str(cfg), "--json"))["current_epochs"]
    out = ok("invalidate", "--config", str(cfg), "--model", A.model)
    assert out.startswith(f"{A.id}: new epoch ") and A.model in out and b.id not in out, out
    assert hit_blocks(cfg, A) == 0
    assert hit_blocks(cfg, b) == 3 * PROMPTS
    after = json.loads(ok("stats", "--config", str(cfg), "--json"))["current_epochs"]
    assert after[A.id] != before[A.id] and after[b.id] == before[b.id]


def test_invalidate_model_by_another_spelling_of_its_path(two_models):
    """Scenario: the engine was given an absolute path; the operator types it relative, with a
    trailing slash, from another folder."""
    cfg, b = two_models
    out = ok("invalidate", "--config", str(cfg), "--model", "model-b/", cwd=Path(b.model).parent)
    assert out.startswith(f"{b.id}: new epoch "), out
    assert hit_blocks(cfg, b) == 0 and hit_blocks(cfg, A) == 3 * PROMPTS


def test_invalidate_all_hides_every_model(two_models):
    cfg, b = two_models
    out = ok("invalidate", "--config", str(cfg), "--all")
    assert A.id in out and b.id in out
    assert hit_blocks(cfg, A) == hit_blocks(cfg, b) == 0


def test_invalidate_unknown_model_fails_naming_it_and_bumps_nothing(two_models):
    cfg, b = two_models
    before = json.loads(ok("stats", "--config", str(cfg), "--json"))["current_epochs"]
    res = kvstrata("invalidate", "--config", str(cfg), "--model", "org/no-such-model", "--model", A.model)
    assert res.returncode == 2 and "unknown model: org/no-such-model" in res.stderr, res
    assert A.model in res.stderr and b.model in res.stderr  # what could have been meant
    assert json.loads(ok("stats", "--config", str(cfg), "--json"))["current_epochs"] == before
    assert hit_blocks(cfg, A) == 3 * PROMPTS


def test_invalidate_where_the_epochs_cannot_be_written_fails_clearly(two_models):
    """Scenario: model A's epoch file is a folder nobody can replace (a planted one; as root no
    mode bit stops a write). The command names the namespace and why, exits 1, and the other
    model is invalidated as asked."""
    cfg, b = two_models
    epochs = cfg.parent / "l2" / "epochs"
    blocker = epochs / A.seed.hex()
    blocker.unlink()
    (blocker / "planted").mkdir(parents=True)
    res = kvstrata("invalidate", "--config", str(cfg), "--model", A.model, "--model", b.model)
    assert res.returncode == 1, res
    assert f"{A.id}: NOT invalidated" in res.stderr and "1 of 2" in res.stderr, res.stderr
    assert str(blocker) in res.stderr  # the log line says what could not be written
    assert f"{b.id}: new epoch" in res.stdout
    assert hit_blocks(cfg, b) == 0 and hit_blocks(cfg, A) == 0  # A: its epoch cannot be confirmed


def test_invalidate_without_a_choice_bumps_nothing(two_models):
    cfg, _ = two_models
    res = kvstrata("invalidate", "--config", str(cfg))
    assert res.returncode == 2 and "--model" in res.stderr and "--all" in res.stderr
    assert hit_blocks(cfg, A) == 3 * PROMPTS


def _plant(kind: str, path: Path, other: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":  # to a valid descriptor, of another namespace
        path.symlink_to(other)
    elif kind == "folder":
        path.mkdir()
    elif kind == "other namespace":  # well-formed, but it would name the wrong model
        path.write_bytes(other.read_bytes())
    elif kind == "oversized":
        path.write_bytes(b" " * (1 << 20) + other.read_bytes())
    elif kind == "deeply nested":
        path.write_bytes(b"[" * 8000 + b"]" * 8000)  # under the size cap: the parser's depth
    elif kind == "wrong types":
        data = json.loads(other.read_bytes())
        data["namespace"]["block_size"] = True
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(b"\x00garbage\xff{")


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder", "other namespace", "oversized",
                                  "deeply nested", "wrong types", "garbage"])
def test_planted_descriptor_never_hangs_or_crashes_stats(two_models, kind):
    cfg, b = two_models
    epochs = cfg.parent / "l2" / "epochs"
    path, other = epochs / f"{A.seed.hex()}.json", epochs / f"{b.seed.hex()}.json"
    path.unlink()
    _plant(kind, path, other)
    out = ok("stats", "--config", str(cfg))
    assert f"  {A.id}  (model unknown" in out and f"  {b.id}  {b.model}" in out, out
    data = json.loads(ok("stats", "--config", str(cfg), "--json"))
    assert A.id not in data["descriptors"] and data["counters"]["bad_descriptors"] == 1
    res = kvstrata("invalidate", "--config", str(cfg), "--model", A.model)  # A is not named by it
    assert res.returncode == 2 and hit_blocks(cfg, A) == 3 * PROMPTS


def test_describe_replaces_a_planted_descriptor(two_models):
    """Scenario: garbage sits where A's descriptor belongs; the next start of A's engine fixes it
    (replacing a planted link itself, never the file it points to)."""
    cfg, b = two_models
    epochs = cfg.parent / "l2" / "epochs"
    path, other = epochs / f"{A.seed.hex()}.json", epochs / f"{b.seed.hex()}.json"
    path.unlink()
    path.symlink_to(other)
    kept = other.read_bytes()
    with BlockStore(load_config(cfg)) as store:
        store.describe(A)
    assert not path.is_symlink() and other.read_bytes() == kept
    assert json.loads(ok("stats", "--config", str(cfg), "--json"))["descriptors"][A.id]["model"] == A.model


@pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")
def test_stats_on_another_host_names_the_model_through_the_shared_tier(tmp_path):
    """Scenario: host 1 stores blocks of model A with a Redis shared tier; host 2 (its own disk,
    the same Redis) runs stats and invalidate --model. A key of the wrong type or garbage where a
    descriptor belongs is counted, never fatal."""
    import redis

    with redisutil.standalone(tmp_path / "redis") as (url, port, _procs):
        remote = f"remote:\n  enabled: true\n  url: {url}\n  invalidation_ms: 1\n"
        host1 = write_config(tmp_path, "host1.yaml", "host1", remote)
        host2 = write_config(tmp_path, "host2.yaml", "host2", remote)
        b = ns_b(tmp_path / "model-b")
        fill(host1, [A, b])
        out = ok("stats", "--config", str(host2))
        assert f"  {A.id}  {A.model}" in out and "tenant     team-a" in out, out
        client = redis.Redis.from_url(url)
        client.delete(f"kvstrata:ns:{b.seed.hex()}")
        client.hset(f"kvstrata:ns:{b.seed.hex()}", "x", "y")
        out = ok("stats", "--config", str(host2))
        assert f"  {b.id}  (model unknown" in out and f"  {A.id}  {A.model}" in out, out
        client.set(f"kvstrata:ns:{A.seed.hex()}", b"\xff" * 100)
        data = json.loads(ok("stats", "--config", str(host2), "--json"))
        assert A.id not in data["descriptors"] and data["counters"]["bad_descriptors"] == 1
        assert data["counters"]["remote_wrong_type"] == 1
        with BlockStore(load_config(host1)) as store:  # host 1's engine starts again
            store.describe(A)
        ok("invalidate", "--config", str(host2), "--model", A.model)
        assert hit_blocks(host1, A) == 0 and hit_blocks(host1, b) == 3 * PROMPTS


def test_every_subcommand_has_a_one_line_help_in_the_users_words():
    import argparse

    from kvstrata.cli.main import _parser

    def helps(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, str]:
        out: dict[str, str] = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                shown = {a.dest: a.help for a in action._choices_actions}
                for name, sub in action.choices.items():
                    out[prefix + name] = shown.get(name) or ""
                    out.update(helps(sub, f"{prefix}{name} "))
        return out

    found = helps(_parser(["--help"]))
    assert {"stats", "check", "invalidate", "gc", "config check", "bench store", "demo"} <= set(found)
    for name, text in found.items():
        assert text and "\n" not in text and "``" not in text and len(text) <= 100, (name, text)
    top = kvstrata("--help")
    assert top.returncode == 0 and "COMMANDS" not in top.stdout and "``" not in top.stdout, top.stdout
    for flag in ("--model", "--namespace", "--all"):
        assert flag in kvstrata("invalidate", "--help").stdout
