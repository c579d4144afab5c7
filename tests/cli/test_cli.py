"""The ``kvstrata`` command line and the README, run as a user would."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from kvstrata import BlockStore, Namespace, StrataConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)


def kvstrata(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", *args], capture_output=True, text=True,
                         timeout=600)
    if check and res.returncode:
        raise AssertionError(f"kvstrata {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
    return res


def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvstrata.yaml"
    path.write_text(f"l1:\n  size: 64MiB\nl2:\n  path: {tmp_path / 'l2'}\n  size: 256MiB\n")
    return path


def fill(path: Path, prompts: int = 3) -> None:
    with BlockStore(load_config(path)) as store:
        for p in range(prompts):
            epoch, chain = store.chain(NS, np.arange(p * 1000, p * 1000 + 40))
            store.save_now(NS, epoch, chain, torch.full((len(chain.keys), 1024), p, dtype=torch.uint8))


def test_replay_serves_only_correct_blocks_and_hits_across_processes(tmp_path):
    res = kvstrata("replay", "--config", str(config_file(tmp_path)), "--conversations", "6")
    assert "every served block matched a recomputed one" in res.stdout
    row_b = next(line for line in res.stdout.splitlines() if line.startswith("│ B"))
    cells = [c.strip() for c in row_b.strip("│ ").split("│")]
    assert int(cells[4]) > 0, res.stdout  # instance B loaded from the disk tier A filled
    assert cells[6] == "100%" and cells[7] == "0"


def test_stats_reports_tiers_namespaces_and_epochs(tmp_path):
    cfg = config_file(tmp_path)
    fill(cfg)
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json").stdout)
    assert data["tiers"]["l2"]["blocks"] == 9
    current = data["current_epochs"][NS.id]
    assert data["namespaces"][NS.id] == {current: {"blocks": 9, "bytes": 9 * 1024}}
    assert "kvstrata tiers" in kvstrata("stats", "--config", str(cfg)).stdout


def test_stats_shows_what_each_tenant_holds_against_its_share(tmp_path):
    """Two engines' namespaces (tenants a and b) described on one disk tier: ``kvstrata stats``, a
    process serving neither, names each tenant from the namespaces' descriptors."""
    cfg = config_file(tmp_path)
    cfg.write_text(cfg.read_text() + "tenants:\n  shares:\n    l2:\n      a: 0.25\n      '*': 64MiB\n")
    with BlockStore(load_config(cfg)) as store:
        for tenant, prompts in (("a", 2), ("b", 1)):
            ns = dataclasses.replace(NS, tenant=tenant)
            store.describe(ns)
            for p in range(prompts):
                epoch, chain = store.chain(ns, np.arange(p * 1000, p * 1000 + 40))
                store.save_now(ns, epoch, chain, torch.full((len(chain.keys), 1024), p, dtype=torch.uint8))
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json").stdout)["tenants"]["l2"]
    assert data["a"]["blocks"] == 6 and data["b"]["blocks"] == 3
    assert data["a"]["share_bytes"] == 64 << 20 and data["b"]["share_bytes"] == 64 << 20
    out = kvstrata("stats", "--config", str(cfg)).stdout
    assert "tenants (namespace.tenant)" in out and "64.0 MiB" in out


def test_invalidate_then_gc_empties_the_namespace(tmp_path):
    cfg = config_file(tmp_path)
    fill(cfg)
    assert "unknown namespace" in kvstrata("invalidate", "--config", str(cfg), "--namespace", "nope",
                                           check=False).stderr
    out = kvstrata("invalidate", "--config", str(cfg), "--namespace", NS.id).stdout
    assert out.startswith(f"{NS.id}: new epoch ")
    epoch = out.split()[-1]
    assert json.loads(kvstrata("gc", "--config", str(cfg)).stdout)["removed"] == {"l1": 0, "l2": 0}
    data = json.loads(kvstrata("stats", "--config", str(cfg), "--json").stdout)
    assert data["tiers"]["l2"]["blocks"] == 0 and data["current_epochs"][NS.id] == epoch
    assert not list((tmp_path / "l2" / "blocks").glob("*/*.kvb"))


def test_gc_reports_old_epoch_blocks_that_landed_after_the_invalidation(tmp_path):
    """A writer of the old epoch that finishes after ``invalidate`` leaves blocks no reader
    serves. The end of the disk tier's background count drops them before gc's own pass, and gc
    still reports every one it removed."""
    cfg = config_file(tmp_path)
    fill(cfg)
    blocks = tmp_path / "l2" / "blocks"
    late = {p.relative_to(blocks): p.read_bytes() for p in blocks.glob("*/*.kvb")}
    assert len(late) == 9
    kvstrata("invalidate", "--config", str(cfg), "--namespace", NS.id)
    assert not list(blocks.glob("*/*.kvb"))
    for rel, data in late.items():  # the late writer's files land now
        (blocks / rel).parent.mkdir(parents=True, exist_ok=True)
        (blocks / rel).write_bytes(data)
    assert json.loads(kvstrata("gc", "--config", str(cfg)).stdout)["removed"]["l2"] == 9
    assert not list(blocks.glob("*/*.kvb"))


def test_check_finds_and_fixes_a_corrupted_block(tmp_path):
    cfg = config_file(tmp_path)
    fill(cfg)
    files = sorted((tmp_path / "l2" / "blocks").glob("*/*.kvb"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    res = kvstrata("check", "--config", str(cfg), "--json", check=False)
    report = json.loads(res.stdout)
    assert res.returncode == 1 and report["bad"] == 1 and report["ok"] == 8
    assert "checksum" in report["problems"][0]
    fixed = json.loads(kvstrata("check", "--config", str(cfg), "--fix", "--json").stdout)
    assert fixed["bad"] == 1 and not files[0].exists()
    assert json.loads(kvstrata("check", "--config", str(cfg), "--json").stdout)["bad"] == 0


def test_bench_store_quick_prints_every_field():
    res = kvstrata("bench", "store", "--quick", "--json")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    for field in ("memcpy_gbps", "l1_put_gbps", "l1_get_gbps", "pwrite_gbps", "pread_gbps",
                  "disk_put_gbps", "disk_get_gbps", "lookup_us_per_1k_blocks",
                  "engine_hash_us_per_1k_blocks", "index_bytes_per_entry",
                  # the scale section, tiny in --quick (scale_blocks says how many)
                  "open_ms_empty", "open_ms_at_1m", "first_lookup_ms_at_1m", "recovery_s_at_1m",
                  "lookup_us_per_1k_blocks_at_1m", "index_bytes_per_entry_at_1m", "check_s_at_1m"):
        assert field in data, field
        assert data[field] is None or data[field] > 0, field
    assert set(data["by_block_size"]) == {"256KiB", "1MiB", "4MiB"}
    # both key schemes beside vLLM's own hashing, in one run, and their ratios
    for name in ("blake3", "xxh3"):
        assert data[f"lookup_us_per_1k_blocks_{name}"] > 0
        assert data["ratios"][f"lookup_vs_engine_hash_{name}"] == data[f"lookup_vs_engine_hash_{name}"] > 0
    assert data["lookup_us_per_1k_blocks"] == data["lookup_us_per_1k_blocks_blake3"]
    assert data["ratios"]["lookup_vs_engine_hash"] == data["lookup_vs_engine_hash_blake3"]
    assert data["scale_blocks"] == 2_000
    # SGLang's file backend beside StrataStorage is a comparative benchmark of the repository
    # (python -m benchmarks store-sglang, tests/engines/test_bench_sglang.py), not the package's
    assert not any(name.startswith("sglang") for name in data)


def _keys(model: type, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            out += _keys(ann, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_configuration_page_documents_every_config_key_and_default_yaml_has_them():
    """docs/configuration.md (the YAML reference the README links) has a row per key; the README
    keeps the two set-up commands, and CI runs the test one."""
    reference = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_.]+)` \|", reference, re.M))
    assert set(_keys(StrataConfig)) <= documented
    readme = (ROOT / "README.md").read_text()
    assert "docs/configuration.md" in readme
    default = (ROOT / "configs" / "default.yaml").read_text()
    for key in _keys(StrataConfig):
        assert re.search(rf"^\s*{key.split('.')[-1]}:", default, re.M), key
    assert "make test" in readme and "make demo" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
