"""tiers/redis.py: L3 on Redis or Valkey (standalone or Cluster), ``RedisTier``: blocks shared by
every instance. Its epochs are ``epochs/redis.py``; the client and value reporting ``redis_client``;
with ``tenants.shares.remote``, the tenants' account of the key space ``redis_shares`` (``self.shares``).

Keys (``P`` is ``remote.key_prefix``; ``{hex}`` is a Cluster hash tag, so a block's keys share a
slot and a node):

    P:{<key hex>}:p      128-byte header (format/block.py) + payload, binary; never pickled
    P:{<key hex>}:i      the committed index entry: the same header alone
    P:{<parent hex>}:t   set of token counts of partial blocks stored after that parent
    P:epoch:<ns hex>     namespace epoch (random u64, see ``epochs/base.py``), announced on ``P:epochs``

With a secret (``remote.auth_key_file``, see ``auth``), ``P`` is ``<key_prefix>:<key id>`` (the
secret's own key space), a block value's header carries its MAC tag, and an index entry is the
header followed by a 16-byte tag of its own. A value that fails its MAC is a miss, counted
(``remote_auth_blocks``, ``remote_auth_entries``; both also in ``remote_auth_failures``) and
deleted: nobody holding the secret wrote it, and the key space is the secret's. With
``remote.encrypt`` a block value's payload is AES-256-GCM ciphertext instead, its header carrying
the AEAD's nonce and tag (``format.seal``): a value that fails, or is not sealed, counts the same
(``remote_auth_blocks``); index entries stay MAC'd, not encrypted.

Publication writes the payload, then the index entry, in that order on one connection to the
slot's node (a hash tag puts both in one slot), so Redis applies them in order: the index entry's
SET is the commit. Readers only follow index entries, so they never see a block without its
payload; a writer that dies between the two leaves an invisible payload that LRU reclaims. We do
not wrap the pair in MULTI/EXEC: it adds no safety for readers that follow index entries, and it
costs write throughput. If Redis's own
eviction (``allkeys-lru``) drops a payload, the read is a miss, never an error.

Nothing read from Redis is trusted: any host that can write there can put anything under these
names. Every value is checked before it is used, and a bad one is a miss (the engine recomputes),
counted by kind and logged (at most once a minute per kind, values cut to 80 characters):

    remote_bad_headers   not a kvstrata header (garbage, truncated header, header checksum)
    remote_wrong_key     a valid header of another block (key, parent, namespace, epoch)
    remote_wrong_size    header size not the destination's, or payload length not the header's
    remote_wrong_type    the key holds a hash, list, ... instead of a string
    remote_bad_tails     a member of a tail set that is not a token count
    checksum_failures    payload bytes that do not match the header's checksum
    remote_bad_epochs, remote_bad_messages, remote_unstable_epochs: see ``epochs/redis.py``

A bad block value is deleted (both keys: the next save of that block publishes it again); a bad
index entry is left for that next save to overwrite. A key of the wrong type reads as absent
through MGET, so an index entry of the wrong type is a plain miss (one command per lookup is what
a lookup costs; asking each key's type would double it); a payload, tail set or epoch key of the
wrong type is seen, counted and replaced.

A lookup of N blocks is one MGET of index entries and a load is one MGET of payloads (in Cluster
mode, one batch per node). Every call runs through a circuit breaker with ``timeout_ms`` socket
timeouts: a dead or slow server costs one timeout, then nothing until it is retried. The breaker
takes client and network errors only; a bug raises.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from kvstrata.format.auth import Auth
from kvstrata.format.seal import Seal
from kvstrata.format.block import HEADER_SIZE, TAG_SIZE, FormatError, pack_header, unpack_header, verify_block
from kvstrata.config import RemoteConfig
from kvstrata.index import EntryMeta
from kvstrata.metrics import Counters
from kvstrata.tiers.base import BlockTier
from kvstrata.tiers.breaker import Breaker
from kvstrata.tiers.redis_client import Rejections, connect, is_wrong_type, protocol_error, service_errors, shown
from kvstrata.tiers.redis_shares import RedisShares
from kvstrata.tenants import TierShares

_MAX_TAILS = 1024  # tail lengths read per parent: a set bloated by someone costs one bounded reply
_MAX_TAIL_TOKENS = 1 << 24  # format/block.py's bound on a block's token count
_COUNTERS = {"bad_header": "remote_bad_headers", "wrong_key": "remote_wrong_key",  # format.block.Mismatch kinds
             "wrong_size": "remote_wrong_size", "checksum": "checksum_failures", "auth": "remote_auth_blocks"}
_DOMAIN = b"redis"  # the tier a block's MAC is bound to (a valid disk block copied here fails)
_PARALLEL_BYTES = 1 << 20  # a load at least this large checks its MACs (or decrypts) on the pool's threads
_POOL_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="kvstrata-mac"))
        return _POOL[0]


class RedisTier(BlockTier):
    name = "remote"
    bit = 4

    def __init__(self, counters: Counters, cfg: RemoteConfig, client: Any = None, auth: Auth | None = None,
                 seal: Seal | None = None, shares: TierShares | None = None,
                 tenant_of: Callable[[bytes], str] | None = None) -> None:
        super().__init__(counters)
        assert seal is None or auth is not None, "a sealed tier lives in its secret's key space"
        self._cfg = cfg
        self.auth = auth
        self.seal = seal
        self.prefix = cfg.key_prefix if auth is None else f"{cfg.key_prefix}:{auth.key_id}"
        self.client = client if client is not None else connect(cfg)
        self.breaker = Breaker(cfg.breaker, self.name, counters, service_errors())
        self.reject = Rejections(counters)
        self._local = threading.local()
        # with ``tenants.shares.remote``: kvstrata keeps the key space within ``remote.size`` itself
        self.shares = None if shares is None or tenant_of is None else RedisShares(self, cfg.cluster, shares, cfg.size,
                                                                                   tenant_of)

    def _k(self, key: bytes, kind: str) -> str:
        return f"{self.prefix}:{{{key.hex()}}}:{kind}"

    def _mget(self, names: list[str]) -> list[object]:
        values = self.client.mget_nonatomic(names) if self._cfg.cluster else self.client.mget(names)
        if len(values) != len(names):  # never pair a value with the wrong name
            raise protocol_error(f"MGET of {len(names)} keys returned {len(values)} values")
        return values

    # ------------------------------------------------------------------ lookup
    def probe_many(self, keys: list[bytes]) -> list[EntryMeta | None]:
        raw = self.breaker.call(lambda: self._mget([self._k(k, "i") for k in keys]), None)
        if raw is None:
            return []
        out: list[EntryMeta | None] = []
        for key, value in zip(keys, raw):
            meta = None if value is None else self._entry(key, value)
            out.append(meta)
            if meta is None:
                break
        return out

    def _entry(self, key: bytes, value: object) -> EntryMeta | None:
        """The index entry ``value`` read under ``key``, or None (counted) if it is not one."""
        name = self._k(key, "i")
        if not isinstance(value, bytes):
            self.reject("remote_wrong_type", "%s holds a %s, not an index entry", name, type(value).__name__)
            return None
        if self.auth is not None:
            if len(value) != HEADER_SIZE + TAG_SIZE or not self.auth.check(
                    b"entry:redis", key, value[:HEADER_SIZE], value[HEADER_SIZE:]):
                self.auth_failed("remote_auth_entries", "dropping block %s: its index entry %s fails its MAC: %s",
                                 key.hex(), name, shown(value))
                self.delete(key)
                return None
            value = value[:HEADER_SIZE]
        if len(value) != HEADER_SIZE:
            self.reject("remote_bad_headers", "%s holds %d bytes, not a %d-byte index entry: %s",
                        name, len(value), HEADER_SIZE, shown(value))
            return None
        try:
            meta = unpack_header(value, name)
        except FormatError as e:
            self.reject("remote_bad_headers", "%s", e)
            return None
        if meta.key != key:
            self.reject("remote_wrong_key", "%s holds the index entry of block %s", name, meta.key.hex())
            return None
        return meta

    def auth_failed(self, counter: str, message: str, *args: object) -> None:
        """A value that fails its MAC: counted by kind and in ``remote_auth_failures``, logged."""
        self.counters.inc("remote_auth_failures")
        self.reject(counter, message, *args)

    def probe(self, key: bytes) -> EntryMeta | None:
        found = self.probe_many([key])
        return found[0] if found else None

    def tail_lengths(self, parent: bytes) -> list[int]:
        name = self._k(parent, "t")

        def fetch() -> list[object] | None:
            try:
                return self.client.srandmember(name, _MAX_TAILS)  # every member, up to the bound
            except Exception as e:
                if is_wrong_type(e):
                    return None
                raise

        members = self.breaker.call(fetch, [])
        if members is None:
            self.reject("remote_wrong_type", "%s is not a set of tail lengths; deleting it", name)
            self.breaker.call(lambda: self.client.delete(name), None)
            return []
        lengths, bad = [], []
        for m in members:
            if isinstance(m, bytes) and 0 < len(m) <= 8 and m.isdigit() and 0 < int(m) < _MAX_TAIL_TOKENS:
                lengths.append(int(m))
            else:
                bad.append(m)
        if bad:
            self.reject("remote_bad_tails", "%s holds %d members that are not token counts, e.g. %s",
                        name, len(bad), shown(bad[0]))
        return sorted(lengths, reverse=True)

    # -------------------------------------------------------------------- read
    def read_many(self, metas: list[EntryMeta], outs: list[torch.Tensor]) -> int:
        raw = self.breaker.call(lambda: self._mget([self._k(m.key, "p") for m in metas]), None)
        if raw is None:
            return 0
        checked = self._check_all(metas, raw, outs)
        for i, (meta, value, out) in enumerate(zip(metas, raw, outs)):
            if value is None:
                self._missing(meta)
                return i
            problem = checked[i] if checked is not None else self._check(meta, value, out)
            if problem is not None:
                counter, why, damaged = problem
                (self.auth_failed if counter == _COUNTERS["auth"] else self.reject)(
                    counter, "dropping block %s: %s", meta.key.hex(), why)
                if damaged:
                    self.delete(meta.key)
                return i
            assert isinstance(value, bytes)  # _check said so
            if self.seal is None:  # a sealed value was decrypted into ``out`` by its check
                out.numpy()[:] = np.frombuffer(value, np.uint8, meta.size, HEADER_SIZE)
            self.counters.inc("remote_bytes_read", meta.size)
        if self.shares is not None:
            self.shares.touch(metas)  # their LRU scores, off this (the engine's) thread
        return len(metas)

    def _check_all(self, metas: list[EntryMeta], raw: list[object],
                   outs: list[torch.Tensor]) -> list[tuple[str, str, bool] | None] | None:
        """With a secret, the checks of a batch of at least ``_PARALLEL_BYTES`` on ``_POOL``'s
        threads (BLAKE3 and OpenSSL's AES-GCM release the GIL: the MACs or decryptions of a hit
        run on every core the pool has); None when the batch is checked inline, one at a time."""
        if self.auth is None or len(metas) < 2 or sum(m.size for m in metas) < _PARALLEL_BYTES:
            return None
        return list(_pool().map(lambda a: None if a[1] is None else self._check(*a), zip(metas, raw, outs)))

    def _check(self, meta: EntryMeta, value: object, out: torch.Tensor) -> tuple[str, str, bool] | None:
        """Why ``value`` (read under ``meta.key``) cannot fill ``out``: (counter, why, whether the
        value is damaged and should go), or None when it is the block, intact. A sealed tier
        decrypts into ``out`` here (garbage when the check fails)."""
        if not isinstance(value, bytes):
            return "remote_wrong_type", f"the value is a {type(value).__name__}", True
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != meta.size:
            return ("remote_wrong_size", f"its header says {meta.size} bytes, the destination holds "
                    f"{out.numel() * out.element_size()}", True)
        where, body = f"redis block {meta.key.hex()}", memoryview(value)[HEADER_SIZE:]
        if self.seal is not None:
            bad = self.seal.open(_DOMAIN, meta, value[:HEADER_SIZE], len(body), body, [memoryview(out.numpy())], where)
        else:
            verify = verify_block if self.auth is None else partial(self.auth.verify_block, _DOMAIN)
            bad = verify(meta, value[:HEADER_SIZE], len(body), [body], where)
        return None if bad is None else (_COUNTERS[bad.kind], bad.why, bad.corrupt)

    def _missing(self, meta: EntryMeta) -> None:
        """A payload MGET returned nothing for: evicted (a plain miss), or a key of another type
        (MGET reads those as absent), which is counted and deleted so the block can be saved again.
        One TYPE command, on a load that failed anyway."""
        name = self._k(meta.key, "p")
        kind = self.breaker.call(lambda: self.client.type(name), b"none")
        if kind in (b"none", b"string", "none", "string"):  # gone, or written again just now
            self.counters.inc("remote_missing")
            return
        self.reject("remote_wrong_type", "dropping block %s: %s is a %s, not a block value",
                    meta.key.hex(), name, shown(kind))
        self.delete(meta.key)

    def read(self, meta: EntryMeta, out: torch.Tensor) -> bool:
        return self.read_many([meta], [out]) == 1

    # ------------------------------------------------------------------- write
    def write_many(self, metas: list[EntryMeta], payloads: list[torch.Tensor]) -> list[bool]:
        if not metas:
            return []

        ttl = self._cfg.block_ttl_s or None  # volatile-lru evicts these keys, never control state

        def publish() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            view = memoryview(self._staging(sum(HEADER_SIZE + m.size for m in metas)))
            off = 0
            tails: list[tuple[int, EntryMeta]] = []  # (reply index of the SADD, block)
            n = 0
            spans = []
            for meta in metas:
                end = off + HEADER_SIZE + meta.size
                spans.append((off, end))
                off = end
            headers = self._headers(metas, [memoryview(p[: m.size].numpy()) for m, p in zip(metas, payloads)],
                                    [view[a + HEADER_SIZE : b] for a, b in spans])
            for meta, (off, end), (header, entry) in zip(metas, spans, headers):
                view[off : off + HEADER_SIZE] = header
                pipe.set(self._k(meta.key, "p"), view[off:end], ex=ttl)  # sent from the buffer, no copy
                pipe.set(self._k(meta.key, "i"), entry, ex=ttl)  # after the payload: the commit
                n += 2
                if meta.tail:
                    pipe.sadd(self._k(meta.parent, "t"), str(meta.ntok))
                    tails.append((n, meta))
                    n += 1
                    if ttl:
                        pipe.expire(self._k(meta.parent, "t"), ttl)
                        n += 1
            replies = pipe.execute(raise_on_error=False)
            self._repair_tail_sets(tails, replies)
            failed = next((r for r in replies if isinstance(r, Exception)), None)
            if failed is not None:  # a refused SET (full Redis, read-only replica): a service error
                raise failed
            return [True] * len(metas)

        if self.shares is not None:
            self.shares.make_room(metas)
        done = self.breaker.call(publish, [False] * len(metas))
        if self.shares is not None and done and done[0]:
            self.shares.account(metas)
        if done and done[0]:
            self.counters.inc("remote_bytes_written", sum(m.size for m in metas))
        return done

    def _headers(self, metas: list[EntryMeta], payloads: list[memoryview],
                 bodies: list[memoryview]) -> list[tuple[bytes, bytes]]:
        """Fill each value's ``body`` (in the staging buffer) from its payload and return the
        (value header, index entry) of each block. With a secret, the MACs of what is sent (the
        staged copies): one pass over each payload, inline (saves run on background threads; on
        the pool they were slower here, 2 busy cores: 178-340 ms for 32 MiB against 129-133).
        Sealed, the cipher writes the body straight from the payload (no copy besides its pass)."""
        auth, seal = self.auth, self.seal
        out = []
        for meta, payload, body in zip(metas, payloads, bodies):
            if seal is not None:
                header = seal.seal(_DOMAIN, meta, [payload], body)
            else:
                body[:] = payload
                header = pack_header(meta) if auth is None else auth.seal_header(_DOMAIN, meta, [body])
            out.append((header, header if auth is None else header + auth.tag(b"entry:redis", meta.key, header)))
        return out

    def _repair_tail_sets(self, tails: list[tuple[int, EntryMeta]], replies: list[object]) -> None:
        """A tail set that someone turned into another type refuses SADD: count it, replace it by
        a set holding this tail (its other members are lost: those tails become misses)."""
        for at, meta in tails:
            reply = replies[at]
            if isinstance(reply, Exception) and is_wrong_type(reply):
                name = self._k(meta.parent, "t")
                self.reject("remote_wrong_type", "%s is not a set of tail lengths; replacing it", name)
                self.client.delete(name)
                self.client.sadd(name, str(meta.ntok))
                if self._cfg.block_ttl_s:
                    self.client.expire(name, self._cfg.block_ttl_s)
                replies[at] = 1

    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool:
        return self.write_many([meta], [payload])[0]

    def _staging(self, nbytes: int) -> bytearray:
        """A per-thread buffer for header + payload values, reused across calls: a fresh bytes
        object per block would be mmap'ed and page-faulted by malloc every time."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return buf

    # ------------------------------------------------------------------ admin
    def delete(self, key: bytes) -> None:
        names = [self._k(key, "i"), self._k(key, "p")]  # one hash tag: one slot, even in a Cluster
        self.breaker.call(lambda: self.client.delete(*names), None)

    @property
    def used_bytes(self) -> int:
        return 0  # the store never evicts here: Redis' maxmemory does, or ``self.shares`` on each write

    @property
    def capacity_bytes(self) -> int:
        return self._cfg.size if self.shares is not None else 1 << 62

    def tenant_usage(self) -> dict[str, tuple[int, int]] | None:
        return None if self.shares is None else self.shares.cached()

    def close(self) -> None:
        if self.shares is not None:
            self.shares.close()
        try:
            self.client.close()
        except Exception:  # closing a dead connection is not an error worth reporting
            pass
