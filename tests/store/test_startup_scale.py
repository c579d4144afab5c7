"""Start-up over a large L2: a store opens without reading its folder, serves at once by header,
counts the folder in the background (``store/recovery.py``, ``tiers/ledger.py``), never exceeds
``l2.size`` meanwhile, and loses nothing if it is killed mid-scan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.builders import assert_payloads_match, load_hit, make_config, payload_for, payloads_for
from kvstrata.format.block import HEADER_SIZE, payload_checksum
from kvstrata.index import EntryMeta
from kvstrata.keys import BlockChain, Namespace
from kvstrata.metrics import Counters
from kvstrata.store import BlockStore, recovery
from kvstrata.tiers import DiskTier
from kvstrata.tiers.ledger import SUMMARY
from kvstrata.tiers.recover import recover_shards
from kvstrata.tiers.scan import BLOCK, scan_folder

ROOT = Path(__file__).resolve().parents[2]  # on the path of the child below (tests.builders)
SIZE = 64  # payload bytes per block
PROMPT_BLOCKS = 100


def _prompt(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return rng.integers(0, 50_000, PROMPT_BLOCKS * 16, dtype=np.uint32)


def _fill(root: Path, ns: Namespace, prompts: range, **overrides: object) -> None:
    """Store every block of ``prompts`` (``PROMPT_BLOCKS`` each) on L2, through the store."""
    cfg = make_config(root, **{"l1.size": 1 << 20, "l2.size": 1 << 30, **overrides})
    with BlockStore(cfg) as store:
        for i in prompts:
            epoch, chain = store.chain(ns, _prompt(i))
            assert store.save_now(ns, epoch, chain, payloads_for(chain, SIZE)) == PROMPT_BLOCKS


def _full_scan(root: Path) -> tuple[int, int, int]:
    """(blocks, payload bytes, file bytes) of a folder, by the one folder scan, fixing nothing."""
    found = [f for f in scan_folder(root / "l2", fix=False, stale_temp=lambda *_: False) if f.kind == BLOCK]
    return len(found), sum(f.meta.size for f in found if f.meta), sum(f.size for f in found)


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "l2" / "blocks").rglob("*.kvb"))


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Namespace]:
    """50,000 blocks (500 prompts of 100 blocks) in one L2 folder, written through the store."""
    from tests.builders import make_namespace

    ns = make_namespace()
    root = tmp_path_factory.mktemp("big")
    _fill(root, ns, range(500))
    return root, ns


def _serve(store: BlockStore, ns: Namespace, i: int) -> BlockChain:
    """Look up prompt ``i`` (every block), load it, check its bytes; its chain."""
    hit = store.lookup(ns, _prompt(i))
    assert hit.num_blocks == PROMPT_BLOCKS, f"prompt {i}: {hit.num_blocks} blocks found"
    n, out = load_hit(store, hit, SIZE)
    assert n == PROMPT_BLOCKS
    assert_payloads_match(hit.chain.keys, out, n, SIZE)
    return hit.chain


def test_reopened_store_over_50k_blocks_serves_before_its_scan_and_then_counts_every_byte(big_folder, monkeypatch):
    """Scenario: a store reopens a folder of 50,000 blocks while its background scan is slowed
    (10 ms per shard folder: over 2.5 s). Before the scan is done it answers lookups for prompts
    written before the restart (first, middle, last) and loads their exact bytes, found by header.
    After the scan its index holds every block once (the adopted ones not twice), ``stats`` and
    the tier's used bytes equal a full scan of the folder, and the blocks used since open are the
    last the LRU would evict."""
    root, ns = big_folder
    monkeypatch.setattr(recovery, "PAUSE_S", 0.01)
    blocks, payload, files = _full_scan(root)
    assert blocks == 50_000
    with BlockStore(make_config(root, **{"l1.size": 1 << 20, "l2.size": 1 << 30})) as store:
        used = [_serve(store, ns, i) for i in (0, 250, 499)]
        assert not store.recovery.done, "the lookups waited for the scan"
        assert store.wait_recovered(120)
        stats = store.stats()
        assert stats["tiers"]["l2"] == {"blocks": blocks, "bytes": payload, "capacity_bytes": 1 << 30}
        assert len(store.index) == blocks
        assert store.l2.used_bytes == files
        spaces = stats["namespaces"][ns.seed[:8].hex()]
        assert sum(e["blocks"] for e in spaces.values()) == blocks
        assert store.counters.get("adopt_wrong_size") == 0
        victims = set(store.index.lru_victims(store.l2.bit, blocks - 3 * PROMPT_BLOCKS))
        kept = store.index.rows_of([k for chain in used for k in chain.keys])
        assert not victims & set(kept.tolist()), "blocks used since open would be evicted before unused ones"


_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.builders import make_config, make_namespace, payloads_for
from kvstrata.store import BlockStore, recovery
import numpy as np
recovery.PAUSE_S = 0.02
store = BlockStore(make_config(sys.argv[2], **{"l1.size": 1 << 20, "l2.size": 1 << 30}))
ns = make_namespace()
tokens = np.arange(10 * 16, dtype=np.uint32) + 7
epoch, chain = store.chain(ns, tokens)
print("saved", store.save_now(ns, epoch, chain, payloads_for(chain, 64)), flush=True)
while True:
    print("shards", store.recovery.shards, flush=True)
    time.sleep(0.05)
"""


def test_sigkill_during_the_background_scan_loses_nothing_and_the_next_start_removes_leftovers(tmp_path, monkeypatch):
    """Scenario: a folder holds 20 prompts and the temp file of a writer that died after the last
    store closed there. A process opens it, saves a 10-block prompt and is SIGKILLed while its
    background scan is a few dozen shards in (before the temp file's shard). A new store then
    serves every prompt (the 20 and the killed process's) with exact bytes, and once its scan is
    done the temp file is gone and the index matches a full scan."""
    from tests.builders import make_namespace

    ns = make_namespace()
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        leftover = tmp_path / "l2" / "blocks" / "ab" / f".ab{'0' * 30}.{writer.pid}.3.tmp"
        leftover.parent.mkdir(parents=True)
        leftover.write_bytes(b"x" * 100)
        _fill(tmp_path, ns, range(20))  # the writer is alive: its temp file is a write in progress
    finally:
        writer.kill()
        writer.wait()
    assert leftover.exists()
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ROOT), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["saved", "10"]
        while int(child.stdout.readline().split()[1]) < 30:
            pass
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert leftover.exists(), "the killed scan was past shard ab: slow it down"
    monkeypatch.setattr(recovery, "PAUSE_S", 0.0)
    with BlockStore(make_config(tmp_path, **{"l1.size": 1 << 20, "l2.size": 1 << 30})) as store:
        for i in range(20):
            _serve(store, ns, i)
        tokens = np.arange(10 * 16, dtype=np.uint32) + 7
        hit = store.lookup(ns, tokens)
        n, out = load_hit(store, hit, SIZE)
        assert n == 10, (hit.num_blocks, hit.tiers, store.counters.snapshot())
        assert_payloads_match(hit.chain.keys, out, n, SIZE)
        assert store.wait_recovered(60)
        assert not list((tmp_path / "l2").rglob("*.tmp"))
        assert store.counters.get("l2_temp_removed") >= 1
        blocks, payload, files = _full_scan(tmp_path)
        assert blocks == 20 * PROMPT_BLOCKS + 10 == len(store.index)
        assert store.stats()["tiers"]["l2"]["bytes"] == payload
        assert store.l2.used_bytes == files


@pytest.mark.parametrize("summary", [True, False], ids=["clean_restart", "after_a_crash"])
def test_capacity_holds_while_the_folder_is_still_being_counted(tmp_path, monkeypatch, summary):
    """Scenario: a folder holds 2,000 blocks; a store reopens it with ``l2.size`` at exactly what
    they take and its scan slowed (over 1 s), with the usage summary of the last clean close, or
    without one (a crash: the bound comes from ``l2.size`` and the filesystem). Right away it
    saves twice ``l2.size`` of new prompts. After every save, the folder holds at most ``l2.size``
    bytes (measured on disk) and the tier never claims more; afterwards the count is exact and
    the newest prompts are served."""
    from tests.builders import make_namespace

    ns = make_namespace()
    _fill(tmp_path, ns, range(20))
    capacity = _folder_bytes(tmp_path)
    assert capacity == 20 * PROMPT_BLOCKS * (HEADER_SIZE + SIZE)
    summary_file = tmp_path / "l2" / SUMMARY
    assert summary_file.is_file()
    if not summary:
        summary_file.unlink()
    monkeypatch.setattr(recovery, "PAUSE_S", 0.005)
    with BlockStore(make_config(tmp_path, **{"l1.size": 1 << 20, "l2.size": capacity})) as store:
        assert store.l2.used_bytes >= capacity  # it cannot know it is not full yet
        stored = 0
        for i in range(1000, 1040):  # 40 prompts: twice the capacity
            epoch, chain = store.chain(ns, _prompt(i))
            stored += store.save_now(ns, epoch, chain, payloads_for(chain, SIZE))
            assert store.l2.used_bytes <= capacity
            assert _folder_bytes(tmp_path) <= capacity, f"over l2.size after prompt {i}"
        assert stored == 40 * PROMPT_BLOCKS  # L1 took them all; L2 only what fitted
        assert store.wait_recovered(60)
        assert store.l2.used_bytes == _folder_bytes(tmp_path) <= capacity
        _serve(store, ns, 1039)


def _block(shard: int, i: int, size: int = SIZE) -> tuple[EntryMeta, torch.Tensor]:
    key = bytes([shard]) + i.to_bytes(15, "little")
    payload = payload_for(key, size)
    meta = EntryMeta(key, bytes(16), i, 16, b"s" * 16, 1, size, payload_checksum(memoryview(payload.numpy())))
    return meta, payload


@pytest.mark.parametrize("action", ["delete_listed", "delete_unscanned", "write_here", "write_unscanned",
                                    "rewrite_listed"])
@pytest.mark.parametrize("at", [1, 5, 12])
def test_the_count_is_exact_whatever_this_process_writes_and_deletes_while_a_shard_is_counted(tmp_path, action, at):
    """Scenario: shards 00 and 01 hold 8 blocks each; the recovery scan of the tier runs, and at
    its ``at``-th step (while listing or examining shard 00) this process deletes or writes a
    block in the shard being counted or in one not reached yet, or writes a listed block again.
    When the scan is done the tier's used bytes are exactly the bytes of the block files on disk
    (one rewrite aside, counted twice: never less), and no block it deleted is handed over for
    the index."""
    root = tmp_path / "l2"
    tier = DiskTier(Counters(), root, 1 << 30)
    for shard in (0, 1):
        for i in range(8):
            assert tier.write(*_block(shard, i))
    tier = DiskTier(Counters(), root, 1 << 60)  # reopened: the 16 blocks are not counted yet
    tier.begin_recovery()  # (bound: the filesystem's usage, under this capacity: room to write)
    deleted: list[bytes] = []
    steps = [0]

    def pace() -> None:
        steps[0] += 1
        if steps[0] != at:
            return
        if action in ("delete_listed", "delete_unscanned"):
            meta, _ = _block(0 if action == "delete_listed" else 1, 3)
            tier.delete(meta.key)
            deleted.append(meta.key)
        elif action == "rewrite_listed":
            assert tier.write(*_block(0, 3))
        else:
            assert tier.write(*_block(0 if action == "write_here" else 1, 100))

    handed: list[bytes] = []
    for shard, found in recover_shards(tier, pace):
        with tier.ledger.shard_locks[shard]:
            handed += [f.meta.key for f in found if f.meta and f.meta.key not in tier.ledger.gone]
            tier.ledger.shard_done()
    assert not tier.ledger.counting
    on_disk = sum(p.stat().st_size for p in (root / "blocks").rglob("*.kvb"))
    extra = (HEADER_SIZE + SIZE) if action == "rewrite_listed" else 0
    assert on_disk <= tier.used_bytes <= on_disk + extra
    assert not set(deleted) & set(handed)


def test_an_invalidation_during_the_scan_reclaims_the_old_epoch_everywhere(tmp_path, monkeypatch):
    """Scenario: a folder holds 20 prompts; a store reopens it with its scan slowed and, before
    the scan is done, invalidates the namespace (its gc sees only the blocks indexed so far).
    Once the scan is done every file of the old epoch is gone, and the prompts miss."""
    from tests.builders import make_namespace

    ns = make_namespace()
    _fill(tmp_path, ns, range(20))
    monkeypatch.setattr(recovery, "PAUSE_S", 0.005)
    with BlockStore(make_config(tmp_path, **{"l1.size": 1 << 20, "l2.size": 1 << 30})) as store:
        store.invalidate(ns.seed)
        assert not store.recovery.done
        assert list((tmp_path / "l2" / "blocks").rglob("*.kvb")), "nothing left for the scan to find"
        assert store.wait_recovered(240)  # the scan runs at a lowered priority: slow on a loaded machine
        assert not list((tmp_path / "l2" / "blocks").rglob("*.kvb"))
        assert store.lookup(ns, _prompt(0)).num_blocks == 0
        assert len(store.index) == 0


def test_stats_count_every_namespace_epoch_and_tier_like_a_loop_over_the_entries(tmp_path):
    """Scenario: two namespaces, one of them invalidated between saves (two epochs), blocks
    of two sizes, some only in L1 (``l2.write: on_evict``) and some demoted to L2. ``stats``
    (vectorized over the index columns) gives the same blocks and bytes per namespace, epoch
    and tier as a Python loop over every entry."""
    from tests.builders import make_namespace

    a, b = make_namespace(model="a"), make_namespace(model="b")
    cfg = make_config(tmp_path, **{"l1.size": 40 * 256, "l2.write": "on_evict"})
    with BlockStore(cfg) as store:
        for i, (ns, size) in enumerate([(a, 256), (b, 256), (a, 256), (b, 128)]):
            if i == 2:  # b's first epoch stays indexed while pinned (gc spares pinned rows)
                pinned = store.lookup(b, _prompt(1)[: 30 * 16], pin=True)
                assert pinned.num_blocks == 30
                store.invalidate(b.seed)
            epoch, chain = store.chain(ns, _prompt(i)[: 30 * 16])
            store.save_now(ns, epoch, chain, payloads_for(chain, size))
        store.flush()
        expect_tiers = {t.name: [0, 0] for t in store.tiers}
        expect_spaces: dict[str, dict[str, list[int]]] = {}
        for _row, meta, bits in store.index.entries():
            e = expect_spaces.setdefault(meta.ns_seed[:8].hex(), {}).setdefault(f"{meta.epoch:016x}", [0, 0])
            e[0] += 1
            e[1] += meta.size
            for t in store.tiers:
                if bits & t.bit:
                    expect_tiers[t.name][0] += 1
                    expect_tiers[t.name][1] += meta.size
        stats = store.stats()
        store.complete_load(pinned)
    assert {k: [v["blocks"], v["bytes"]] for k, v in stats["tiers"].items()} == expect_tiers
    assert {ns: {ep: [v["blocks"], v["bytes"]] for ep, v in eps.items()}
            for ns, eps in stats["namespaces"].items()} == expect_spaces
    assert len(expect_spaces) == 2 and sum(len(e) for e in expect_spaces.values()) == 3
    assert expect_tiers["l1"][0] and expect_tiers["l2"][0]


def test_stats_of_a_folder_still_being_counted_says_it_is_estimating(tmp_path):
    """Scenario: ``kvstrata stats --wait 0`` on a folder of 20 prompts answers before its count is
    done (a fresh process: the count takes longer than no time): the JSON says how many shard
    folders were counted and estimates L2's blocks; with the default wait the count is complete
    and there is no estimate."""
    import json

    from tests.builders import make_namespace

    ns = make_namespace()
    _fill(tmp_path, ns, range(20))
    cfg = tmp_path / "kvstrata.yaml"
    cfg.write_text(f"l2:\n  path: {tmp_path / 'l2'}\n  size: 1GiB\nl1:\n  size: 1MiB\n  pin_memory: false\n")

    def stats(*extra: str) -> dict:
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "stats", "--config", str(cfg), "--json", *extra],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    quick = stats("--wait", "0")
    assert quick["estimating"]["of"] == 256 and quick["estimating"]["shard_folders_counted"] < 256
    full = stats()
    assert "estimating" not in full
    assert full["tiers"]["l2"]["blocks"] == 20 * PROMPT_BLOCKS
