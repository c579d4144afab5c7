"""A namespace's verification record (``kvstrata/verify/record.py``): encoded as bounded JSON and
read back as untrusted input; kept beside the epoch by every epoch store (memory, folder with and
without a secret, Redis); added to by the store's ``Verifier`` at once after a mismatch, at most
every ``RECORD_EVERY_S`` after checks, and at close; never failing a verification when it cannot be
written."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvstrata.config import load_config
from kvstrata.epochs.base import MemoryEpochs
from kvstrata.epochs.folder import FileEpochs
from kvstrata.format.auth import Auth
from kvstrata.metrics import Counters
from kvstrata.store import BlockStore
from kvstrata.store import verify as store_verify
from kvstrata.verify.compare import segments_of
from kvstrata.verify.record import MAX_BYTES, Mismatch, Record, decode, encode, mismatch
from tests.builders import BLOCK_BYTES, BLOCK_SIZE, make_config, make_namespace, random_tokens
from tests.harness import redisutil

SEGMENTS = segments_of(BLOCK_BYTES, 4, torch.float32)
SEED = bytes(range(16))
LAST = Mismatch(1_700_000_000.5, "ab" * 16, "l2", 0.41, 1e-3, 3)
SECRET = b"s" * 48


# ------------------------------------------------------------------ encoding
def test_a_record_reads_back_as_written():
    for record in (Record(), Record(5, 0, None), Record(7, 2, LAST), Record(1, 1, LAST._replace(error=None))):
        blob = encode(record)
        assert blob.isascii() and len(blob) <= MAX_BYTES
        assert decode(blob) == record


def test_a_non_finite_error_is_recorded_as_none():
    assert mismatch(1.0, b"\x01" * 16, "l1", float("nan"), 1e-3, 0).error is None
    assert mismatch(1.0, b"\x01" * 16, "l1", float("inf"), 1e-3, 0).error is None
    assert decode(encode(Record(1, 1, mismatch(1.0, b"\x01" * 16, "l1", float("nan"), 1e-3, 0)))) is not None


def test_added_sums_the_counts_and_keeps_the_later_mismatch():
    older, newer = LAST, LAST._replace(time=LAST.time + 5, key="cd" * 16)
    assert Record(3, 1, older).added(Record(4, 1, newer)) == Record(7, 2, newer)
    assert Record(3, 1, newer).added(Record(4, 1, older)) == Record(7, 2, newer)
    assert Record(3, 1, older).added(Record(4, 0, None)) == Record(7, 1, older)


def _field(name: str, value: object) -> bytes:
    data = json.loads(encode(Record(7, 2, LAST)))
    if name in data:
        data[name] = value
    else:
        data["last_mismatch"][name] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize("raw", [
    None, "text", b"", b"\x00garbage\xff{", b"[]", b"{}", b"[" * 900 + b"]" * 900,
    b" " * (MAX_BYTES + 1) + encode(Record(1)),  # oversized, however valid the end
    encode(Record(1)).replace(b'"kvstrata_verify":1', b'"kvstrata_verify":2'),  # a later format
    _field("checks", -1), _field("checks", True), _field("checks", 1.5), _field("checks", 1 << 64),
    _field("mismatches", "2"), _field("last_mismatch", []), _field("time", "now"), _field("time", None),
    _field("key", "xyz"), _field("key", "a" * 200), _field("key", ""), _field("tier", 3),
    _field("tier", "l2\n\x1b[31m"), _field("error", "0.4"), _field("tolerance", None), _field("segment", -1),
    encode(Record(7, 2, LAST)).replace(b"0.41", b"NaN"), encode(Record(7, 2, LAST)).replace(b"0.41", b"1e999"),
    encode(Record(7, 2, LAST)).replace(b'"segment":3', b'"segment":3,"writer":"me"'),
])
def test_anything_but_a_record_decodes_to_none(raw):
    assert decode(raw) is None


# ------------------------------------------------------------------ epoch stores
def file_epochs(tmp_path, auth: Auth | None = None, counters: Counters | None = None) -> FileEpochs:
    return FileEpochs(tmp_path / "epochs", auth=auth, counters=counters)


def test_memory_and_folder_stores_keep_a_record_beside_the_epoch(tmp_path):
    blob = encode(Record(7, 2, LAST))
    for epochs in (MemoryEpochs(), file_epochs(tmp_path), file_epochs(tmp_path / "a", Auth(SECRET))):
        assert epochs.verify_record(SEED) is None
        assert epochs.record_verify(SEED, blob)
        assert epochs.verify_record(SEED) == blob
    assert (tmp_path / "epochs" / f"{SEED.hex()}.verify").read_bytes() == blob
    assert file_epochs(tmp_path).known() == []  # no namespace listed for a record alone


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_planted_record_reads_as_not_one_and_is_replaced_in_place(tmp_path, kind, caplog):
    epochs = file_epochs(tmp_path)
    path, target = tmp_path / "epochs" / f"{SEED.hex()}.verify", tmp_path / "target"
    target.write_bytes(encode(Record(99)))
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(target)
    else:
        path.mkdir()
    assert epochs.verify_record(SEED) == b""  # at once: a FIFO never blocks, a link is never followed
    blob = encode(Record(1))
    assert epochs.record_verify(SEED, blob) == (kind != "folder")  # a folder stays: not written, no raise
    assert ("cannot record the verified hits" in caplog.text) == (kind == "folder")
    if kind != "folder":
        assert not path.is_symlink() and path.read_bytes() == blob and decode(target.read_bytes()) == Record(99)


def test_a_record_that_fails_its_mac_is_absent_and_counted(tmp_path):
    counters = Counters()
    writer = file_epochs(tmp_path, Auth(b"w" * 48))
    assert writer.record_verify(SEED, encode(Record(5)))
    reader = file_epochs(tmp_path, Auth(SECRET), counters)
    assert reader.verify_record(SEED) is None
    assert counters.get("l2_auth_descriptors") == 1 and counters.get("l2_auth_failures") == 1
    (tmp_path / "epochs" / f"{SEED.hex()}.verify").write_bytes(encode(Record(5)))  # no MAC at all
    assert reader.verify_record(SEED) is None


@pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")
@pytest.mark.parametrize("secret", [None, SECRET])
def test_redis_keeps_a_record_beside_the_descriptor(tmp_path, secret):
    import redis

    from kvstrata.tiers import REMOTE_BACKENDS

    with redisutil.standalone(tmp_path / "redis") as (url, _port, procs):
        cfg = load_config(None, {"remote.enabled": True, "remote.url": url}).remote
        counters = Counters()
        tier, epochs = REMOTE_BACKENDS["redis"](counters, cfg, None, None if secret is None else Auth(secret))
        try:
            blob = encode(Record(7, 2, LAST))
            assert epochs.verify_record(SEED) is None
            assert epochs.record_verify(SEED, blob) and epochs.verify_record(SEED) == blob
            client = redis.Redis.from_url(url)
            (key,) = [k for k in client.keys("*") if b":verify:" in k]
            assert key.endswith(SEED.hex().encode())
            client.delete(key)
            client.hset(key, "x", "y")  # a key of another type: not a record, counted, replaced by a write
            assert epochs.verify_record(SEED) == b"" and counters.get("remote_wrong_type") == 1
            assert epochs.record_verify(SEED, blob) and epochs.verify_record(SEED) == blob
            if secret is not None:
                client.set(key, blob)  # unsealed
                assert epochs.verify_record(SEED) is None and counters.get("remote_auth_descriptors") == 1
            procs[0].kill()
            procs[0].wait()
            with pytest.raises(OSError):  # unreadable is not "none": a writer must not replace the totals
                epochs.verify_record(SEED)
            assert epochs.record_verify(SEED, blob) is False
        finally:
            epochs.close()
            tier.close()


# ------------------------------------------------------------------ the store's verifier
def floats(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, BLOCK_BYTES // 4), generator=g).view(torch.uint8)


class Engine:
    """A store with four full blocks stored, and verification rounds of them as an engine makes."""

    def __init__(self, tmp_path, name: str = "verify", **overrides: object) -> None:
        self.store = BlockStore(make_config(tmp_path, {"l2.write": "through", **overrides}))
        assert self.store.wait_recovered(30)
        self.ns = make_namespace(kv_dtype="float32")
        self.store.describe(self.ns)
        self.tokens = random_tokens(name, 4 * BLOCK_SIZE)
        self.epoch, self.chain = self.store.chain(self.ns, self.tokens)
        self.kv = floats(1, len(self.chain.keys))
        self.store.save_now(self.ns, self.epoch, self.chain, self.kv)  # 0 when an earlier engine stored them
        assert self.store.lookup(self.ns, self.tokens).num_blocks == 4

    def round(self, bad: int | None = None) -> None:
        """Four blocks verified; block ``bad`` computed otherwise (a mismatch: deleted, so save again)."""
        res = self.store.prepare_verify(self.ns, self.epoch, self.chain, BLOCK_BYTES)
        computed = self.kv[: len(res.slots)].clone()
        if bad is not None:
            computed[bad] = floats(99, 1)[0]
        for slot, row in zip(res.slots, computed):
            self.store.arena.data[slot, : row.numel()] = row
        results = self.store.complete_verify(res, SEGMENTS, wait=True)
        assert [r.ok for r in results] == [i != bad for i in range(4)]
        if bad is not None:
            self.store.save_now(self.ns, self.epoch, self.chain, self.kv)


def stored(tmp_path, seed: bytes) -> Record | None:
    raw = (tmp_path / "l2" / "epochs" / f"{seed.hex()}.verify").read_bytes()
    return decode(raw)


def test_checks_are_written_at_most_every_interval_and_a_mismatch_at_once(tmp_path):
    engine = Engine(tmp_path)
    engine.round()
    assert stored(tmp_path, engine.ns.seed) == Record(4)  # the first checks: written at once
    engine.round()
    engine.round()
    assert stored(tmp_path, engine.ns.seed) == Record(4)  # within RECORD_EVERY_S: not written again
    assert engine.store.stats()["verify"][engine.ns.seed.hex()]["checks"] == 12  # counted here all the same
    engine.round(bad=2)
    record = stored(tmp_path, engine.ns.seed)
    assert (record.checks, record.mismatches) == (16, 1)  # at once, with the checks it waited for
    assert record.last.key == engine.chain.keys[2].hex() and record.last.tier in ("l1", "l2")
    assert record.last.error > record.last.tolerance == store_verify.TOLERANCES[torch.float32]
    engine.round()
    assert stored(tmp_path, engine.ns.seed).checks == 16
    engine.store.close()  # what is pending goes at close
    assert stored(tmp_path, engine.ns.seed) == Record(20, 1, record.last)


def test_checks_are_written_again_once_the_interval_has_passed(tmp_path, monkeypatch):
    engine = Engine(tmp_path)
    engine.round()
    monkeypatch.setattr(store_verify, "RECORD_EVERY_S", 0.0)
    engine.round()
    assert stored(tmp_path, engine.ns.seed) == Record(8)
    engine.store.close()


def test_processes_sharing_the_epochs_add_to_one_record(tmp_path):
    first = Engine(tmp_path)
    first.round(bad=0)
    first.round()
    first.store.close()
    second = Engine(tmp_path)  # another engine process, later, on the same disk tier
    second.round()
    second.round(bad=3)
    assert second.store.stats()["verify"][second.ns.seed.hex()]["checks"] == 8  # its own
    second.store.close()
    record = stored(tmp_path, first.ns.seed)
    assert (record.checks, record.mismatches) == (16, 2) and record.last.key == second.chain.keys[3].hex()
    with BlockStore(make_config(tmp_path)) as reader:
        assert reader.stats()["verified"][first.ns.id] == record.as_dict()


def test_a_damaged_record_is_counted_and_replaced(tmp_path):
    engine = Engine(tmp_path)
    path = tmp_path / "l2" / "epochs" / f"{engine.ns.seed.hex()}.verify"
    path.write_bytes(b"\x00garbage")
    with BlockStore(make_config(tmp_path)) as reader:
        assert engine.ns.id not in reader.stats()["verified"]
        assert reader.snapshot()["bad_verify_records"] == 1
    engine.round()
    assert engine.store.snapshot()["bad_verify_records"] == 1
    assert stored(tmp_path, engine.ns.seed) == Record(4)
    engine.store.close()


def test_a_record_that_cannot_be_written_never_fails_a_verification(tmp_path, caplog):
    engine = Engine(tmp_path)
    path = tmp_path / "l2" / "epochs" / f"{engine.ns.seed.hex()}.verify"
    path.mkdir()  # neither read nor replaced
    engine.round(bad=1)  # no raise: the comparison, the deletion and the counters happen all the same
    snap = engine.store.snapshot()
    assert snap.get("verify_mismatches_l1", 0) + snap.get("verify_mismatches_l2", 0) == 1
    assert engine.store.lookup(engine.ns, engine.tokens).num_blocks == 4  # saved again
    path.rmdir()
    engine.round(bad=0)  # the next write carries what the failed one could not
    record = stored(tmp_path, engine.ns.seed)
    assert (record.checks, record.mismatches) == (8, 2)
    engine.store.close()


def test_the_record_is_the_namespaces_whatever_its_epoch(tmp_path):
    engine = Engine(tmp_path)
    engine.round(bad=0)
    assert engine.store.invalidate(engine.ns.seed) is not None  # an operator's flush: a new epoch
    engine.store.close()
    again = Engine(tmp_path)  # stores the blocks again under the new epoch
    again.round()
    again.store.close()
    record = stored(tmp_path, engine.ns.seed)
    assert (record.checks, record.mismatches) == (8, 1)
