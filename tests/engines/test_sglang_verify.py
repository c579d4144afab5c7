"""Verified hits through ``StrataStorage``: over SGLang's own host pool in-process, and on a real
SGLang server (CPU, tiny local model, the test-only shims) at ``verify.sample_rate: 1.0``, where a
planted page (a valid checksum, another prompt's KV, written through the store API under the
victim's key) is caught, and every answer is the engine's own computation.

The unit tests of the sampling and the comparison (no SGLang): tests/adapters/test_sglang_verify.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.launchers import PAGE, ids, needs_sglang, sglang_config, sglang_generate, sglang_log, sglang_probe
from kvstrata.adapters.sglang.namespace import digests_of, load_strata_config
from kvstrata.keys import BlockChain
from kvstrata.store import BlockStore
from tests.harness.sglang_server import SGLangServer

pytestmark = pytest.mark.timeout(900)

VICTIM, DONOR = ids(4101, 600), ids(4102, 600)  # 37 full pages each
FULL = len(VICTIM) // PAGE
PLANTED = 2  # the victim's first pages, stored with the donor's KV before the victim is ever computed


def page_keys(tokens: list[int]) -> list[str]:
    """SGLang's storage keys of a prompt without extra key or cache salt: page i is the hex SHA-256
    of page i-1's digest and page i's token ids as uint32 little-endian (``get_storage_hash_str``;
    a wrong key here plants nothing, and the test fails for want of a mismatch)."""
    keys, prev = [], b""
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        prev = hashlib.sha256(prev + np.asarray(tokens[start:start + PAGE], dtype="<u4").tobytes()).digest()
        keys.append(prev.hex())
    return keys


def open_beside(config: Path) -> BlockStore:
    """A store of this process over the server's disk tier (the server's own config, a small L1)."""
    extra = json.loads(config.read_text())
    return BlockStore(load_strata_config({**extra, "l1": {"size": "16MiB"}}))


def server_namespace(store: BlockStore):
    (ns,) = [ns for ns in store.descriptors().values() if ns.engine == "sglang"]
    return ns


def page_bytes(ns) -> int:
    """From the namespace's layout (``PageRows.signature``: ``pool:layout:[page shape]:dtype``)."""
    shape = json.loads(ns.layout.split(":")[2])
    return math.prod(shape) * getattr(torch, ns.kv_dtype.removeprefix("torch.")).itemsize


def plant(config: Path, victim: list[str], donor: list[str]) -> None:
    """The donor's stored pages written under the victim's keys, through the store API."""
    store = open_beside(config)
    try:
        ns = server_namespace(store)
        epoch = store.current_epoch(ns)
        donor_chain = store.page_chain(ns, epoch, digests_of(donor))
        hit = store.lookup_chain(ns, epoch, donor_chain, pin=True)
        try:
            assert hit.num_blocks == len(donor), f"the donor has {hit.num_blocks} of {len(donor)} pages stored"
            kv = torch.empty((len(donor), page_bytes(ns)), dtype=torch.uint8)
            assert store.load_into(hit, kv) == len(donor)
        finally:
            store.complete_load(hit)
        victim_chain = store.page_chain(ns, epoch, digests_of(victim))
        assert store.save_now(ns, epoch, victim_chain, kv) == len(victim)
        store.flush()
    finally:
        store.close()


def stored_mask(config: Path, keys: list[str]) -> list[bool]:
    store = open_beside(config)
    try:
        ns = server_namespace(store)
        epoch = store.current_epoch(ns)
        chain = store.page_chain(ns, epoch, digests_of(keys))
        return [store.lookup_chain(ns, epoch, BlockChain(*([part[i]] for part in chain))).num_blocks == 1
                for i in range(len(keys))]
    finally:
        store.close()


def counter(server: SGLangServer, name: str) -> float:
    """The sum of a ``kvstrata_*`` counter's samples over its labels."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"kvstrata_{name}_total{{"))


def wait_counter(server: SGLangServer, name: str, want: float, timeout: float = 90) -> float:
    """Write-backs are asynchronous and the scheduler exports between its steps (an idle one
    sleeps): a one-token request wakes it until the counter reaches ``want``."""
    deadline = time.monotonic() + timeout
    while (value := counter(server, name)) < want and time.monotonic() < deadline:
        server.generate(ids(4199, 8), 1)
        time.sleep(0.5)
    return value


@needs_sglang
def test_sampled_queries_compare_the_write_back_over_sglangs_host_pool():
    """Scenario: StrataStorage in-process over SGLang's real MHATokenToKVPoolHost, both layouts
    and both interfaces, at sample_rate 1.0: 5 pages stored, page 2 planted with page 9's bytes;
    the query hides them all (twice alike), the write-back compares them (1 mismatch), reports
    every page written, and page 2 is gone; at sample_rate 0 a query reports what is stored."""
    out = sglang_probe(PROBE, [])
    for case, got in out.items():
        assert got["hidden"] == [0, 0], case
        assert got["set"] is True or got["set"] == [True] * 5, (case, got)
        assert (got["checks"], got["mismatches"]) == (5, 1), (case, got)
        assert got["after"] == 2 and got["stored"] == [True, True, False, True, True], (case, got)
        assert got["off"] == 5, case


PROBE = r"""
import hashlib, tempfile
from pathlib import Path
from kvstrata.adapters.sglang import StrataStorage, digests_of
from tests.harness.sglang_pool import extra_info, host_pool, storage_config

def scenario(tmp, layout, v1, rate):
    pool = host_pool(256, layers=3, heads=2, head_dim=8, page=16, layout=layout)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(torch.bfloat16))
    cfg = storage_config({"interface_v1": int(v1), "l1": {"size": "16MiB"}, "l2": {"path": str(tmp / "l2")},
                          "namespace": {"model_version": "v1"}, "verify": {"sample_rate": rate}},
                         model_name="tiny-test", page_first=layout == "page_first")
    s = StrataStorage(cfg, {})
    s.register_mem_pool_host(pool)
    keys, prev = [], b""
    for i in range(5):
        prev = hashlib.sha256(prev + f"{layout}:{i}".encode()).digest()
        keys.append(prev.hex())

    def put(ks, first):
        idx = torch.arange(first * 16, (first + len(ks)) * 16)
        if v1:
            return s.batch_set_v1(ks, idx, extra_info([]))
        return s.batch_set(ks, [pool.get_data_page(int(idx[i * 16]), flat=True) for i in range(len(ks))])

    put(keys[:2], 0); put(keys[2:3], 9); put(keys[3:], 3)  # page 2: page 9's bytes under its key
    if rate == 0:
        return s.batch_exists(keys, extra_info([]))
    hidden = [s.batch_exists(keys, extra_info([])), s.batch_exists(keys[1:], extra_info(keys[:1]))]
    result = put(keys, 0)  # SGLang computed the pages and writes them back
    assert s.store.wait_verified(30)  # compared on the store's comparison thread
    snap = s.store.snapshot()
    s.checks.sampled.rate = 0.0
    epoch = s.store.current_epoch(s.ns)
    chain = s.store.page_chain(s.ns, epoch, digests_of(keys))
    out = {"hidden": hidden, "set": result, "after": s.batch_exists(keys, extra_info([])),
           "checks": sum(v for k, v in snap.items() if k.startswith("verify_checks_")),
           "mismatches": sum(v for k, v in snap.items() if k.startswith("verify_mismatches_")),
           "stored": s.store.stored_mask(s.ns, epoch, chain).tolist()}
    s.close()
    return out

results = {}
for layout in ("layer_first", "page_first"):
    for v1 in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            got = scenario(Path(tmp), layout, v1, 1.0)
        with tempfile.TemporaryDirectory() as tmp:
            got["off"] = scenario(Path(tmp), layout, v1, 0.0)
        results[f"{layout}/{'v1' if v1 else 'flat'}"] = got
print("RESULT " + json.dumps(results))
"""


@needs_sglang
def test_a_planted_page_is_caught_on_a_real_server_and_every_answer_is_sglangs_own(sglang_server, tmp_path):
    """Scenario (one server, sample_rate 1.0, metrics on): the donor prompt is computed and stored;
    its first pages' KV is written through the store API under the victim prompt's first page
    keys (valid checksums, another prompt's KV) before the victim is ever computed. After a
    flush, the donor again: its hit is sampled, computed and its write-back compared, all equal;
    then the victim: its planted hit is sampled, computed, and its write-back compared: the two
    planted pages differ, are counted, logged and deleted, and the victim's other pages stored.
    Every output equals SGLang's own computation of the prompt with no storage hit (a cold run
    under a cache salt, whose keys nothing else has)."""
    config = sglang_config(tmp_path / "verify.json", tmp_path / "l2", verify={"sample_rate": 1.0})
    server = sglang_server(config, metrics=True)
    cold_victim = sglang_generate(server, VICTIM, cache_salt="cold")
    first_donor = sglang_generate(server, DONOR)
    assert cold_victim["storage"] == 0 and first_donor["storage"] == 0
    victim_keys, donor_keys = page_keys(VICTIM), page_keys(DONOR)
    deadline = time.monotonic() + 60
    while not all(stored_mask(config, donor_keys[:FULL])):  # backups are asynchronous
        assert time.monotonic() < deadline, "the donor's pages did not reach the store"
        time.sleep(0.5)
    plant(config, victim_keys[:PLANTED], donor_keys[:PLANTED])
    server.flush()

    again_donor = sglang_generate(server, DONOR)
    honest = wait_counter(server, "verify_checks", FULL)
    assert counter(server, "verify_mismatches") == 0, "an honest recomputation was reported as a mismatch"
    victim = sglang_generate(server, VICTIM)
    checks = wait_counter(server, "verify_checks", honest + PLANTED)
    mismatches = wait_counter(server, "verify_mismatches", PLANTED)

    assert again_donor["storage"] == 0 and victim["storage"] == 0  # hits sampled: computed, not loaded
    assert again_donor["tokens"] == first_donor["tokens"]
    assert victim["tokens"] == cold_victim["tokens"]
    assert honest >= FULL and checks == honest + PLANTED and mismatches == PLANTED, (honest, checks, mismatches)
    log = sglang_log(server)
    assert log.count("verified hit MISMATCH") == PLANTED, log[-4000:]
    deadline = time.monotonic() + 60
    while not all(mask := stored_mask(config, victim_keys[:FULL])[PLANTED:]):  # the rest is written back
        assert time.monotonic() < deadline, mask
        time.sleep(0.5)
    assert stored_mask(config, victim_keys[:PLANTED]) == [False] * PLANTED  # deleted: the next query misses
