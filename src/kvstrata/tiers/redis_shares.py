"""tiers/redis_shares.py: ``RedisShares``, the Redis tier's own account of what each tenant holds
there, and the blocks each gives up, when the tier has shares (``tenants.shares.remote``, within
``remote.size``). Without shares the tier keeps no account and Redis' own ``maxmemory`` evicts.

Instances on many hosts write one Redis: no process's index knows what the key space holds, and a
SCAN of it costs O(keys). So writers keep per-tenant counters, beside a sorted set that orders each
tenant's blocks by recency (``P`` is the tier's prefix, ``<t>`` the tenant's name in hex: a hash
tag, so a tenant's three keys share one Cluster slot and one Lua script updates them atomically):

    P:{t:<t>}:lru      sorted set: member ``<block key hex>:<bytes>``, score its last write or hit (Redis' clock, ms)
    P:{t:<t>}:bytes    the sum of the members' bytes (a block's value and index entry)
    P:{t:<t>}:blocks   how many members
    P:tenants          the tenants' names (SADD by a process on its first write for one)

Usage is one SRANDMEMBER and one MGET (``usage``), never a SCAN. Before a batch is published
(``make_room``) the writer reads it; past ``remote.size`` the holders of shares
``TierShares.eviction_order`` names give up their oldest blocks (a script pops those of the
holder's tenant with the oldest, no newer than its next tenant's oldest, and lowers the counters;
their values are then deleted: ``"*"``, the tenants not named, gives as one LRU), else the oldest
block of all goes (``lru``). Once published, a script adds the members and counts the new ones
(``account``). A hit renews its scores on this object's thread (``touch``); the gauges read a
copy at most ``_REFRESH_S`` old (``cached``), renewed there too.

Limits (docs/tenants.md): a soft bound (concurrent writers may pass ``remote.size`` by a batch
each, until the next write); a block deleted outside the account (a bad value, a verified
mismatch, Redis' own eviction) leaves its member, so the counters overstate until eviction pops
it: Redis' ``maxmemory`` must be above every key space's ``remote.size``, else the tier is
under-used (never wrong: a block whose values are gone is a miss). What is read here is
untrusted: a bad counter reads as 0 (``remote_bad_counters``), a bad name or member is skipped
(``remote_bad_members``), a key of another type is replaced by the scripts.
"""

from __future__ import annotations

import logging
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

from kvstrata.format.block import HEADER_SIZE, TAG_SIZE
from kvstrata.index import EntryMeta
from kvstrata.tenants import LRU, TierShares
from kvstrata.format.auth import Auth
from kvstrata.metrics import Counters
from kvstrata.tiers.breaker import Breaker
from kvstrata.tiers.redis_client import Rejections, shown

log = logging.getLogger(__name__)

_REFRESH_S = 1.0  # the gauges' copy of the usage is renewed when older than this
_MAX_TENANTS = 1024  # names read from the registry: a set bloated by someone costs one bounded reply
_POP_MOST = 256  # blocks one eviction script pops at most (Redis runs nothing else meanwhile)
_MAX_ROUNDS = 64  # eviction scripts per write at most
_MAX_COUNTER = 1 << 62

# Every script first replaces keys of another type (someone's), so that it never fails on them.
_PRELUDE = """
local ty = redis.call('TYPE', KEYS[1]).ok
if ty ~= 'zset' and ty ~= 'none' then redis.call('DEL', KEYS[1], KEYS[2], KEYS[3]) end
local function add(key, delta)
  local v = redis.pcall('INCRBY', key, delta)
  if type(v) == 'table' then redis.call('DEL', key); v = redis.call('INCRBY', key, delta) end
  if v < 0 then redis.call('SET', key, 0) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS: lru, bytes, blocks; ARGV: member, bytes, member, bytes, ... -> members new to the set
_ADD = _PRELUDE + """
local nbytes, n = 0, 0
for i = 1, #ARGV, 2 do
  if redis.call('ZADD', KEYS[1], now, ARGV[i]) == 1 then nbytes = nbytes + tonumber(ARGV[i + 1]); n = n + 1 end
end
if n > 0 then add(KEYS[2], nbytes); add(KEYS[3], n) end
return n
"""
# ARGV: bytes to free, the newest score to take after the first block (-1: any), most blocks
# -> the members popped, oldest first
_POP = _PRELUDE + """
local target, bound, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local freed, out = 0, {}
while freed < target and #out < most do
  local m = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if #m == 0 or (#out > 0 and bound >= 0 and tonumber(m[2]) > bound) then break end
  redis.call('ZPOPMIN', KEYS[1])
  freed = freed + (tonumber(string.match(m[1], ':(%d+)$')) or 0)
  out[#out + 1] = m[1]
end
if #out > 0 then add(KEYS[2], -freed); add(KEYS[3], -#out) end
return out
"""
# ARGV: members -> 0 (a member no longer in the set stays out: its block was evicted)
_TOUCH = _PRELUDE + """
for i = 1, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
return 0
"""


class _Tier(Protocol):  # what is used of ``RedisTier`` (which holds this object)
    client: Any
    prefix: str
    auth: Auth | None
    breaker: Breaker
    counters: Counters
    reject: Rejections


class RedisShares:
    """The account of one Redis tier's key space, per tenant; see the module docstring."""

    def __init__(self, tier: _Tier, cluster: bool, policy: TierShares, capacity: int,
                 tenant_of: Callable[[bytes], str]) -> None:
        self.tier, self.policy, self.capacity = tier, policy, capacity
        self._cluster = cluster
        self._tenant_of = tenant_of
        self._registry = f"{tier.prefix}:tenants"
        self._entry_extra = TAG_SIZE if tier.auth is not None else 0  # an index entry's MAC
        self._lock = threading.Lock()  # guards the fields below
        self._usage: dict[str, tuple[int, int]] = {}
        self._read_at = float("-inf")
        self._refreshing = False
        self._registered: set[str] = set()  # tenants this process has put in the registry
        self._touched: dict[str, set[str]] = {}  # tenant -> members hit, not sent yet
        self._touching = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-redis-shares")

    # ------------------------------------------------------------------ names
    def names(self, tenant: str) -> list[str]:
        """The tenant's sorted set, bytes and blocks counters (one hash tag: one slot)."""
        tag = f"{self.tier.prefix}:{{t:{tenant.encode().hex()}}}"
        return [f"{tag}:lru", f"{tag}:bytes", f"{tag}:blocks"]

    def stored(self, size: int) -> int:
        """Bytes of ``remote.size`` a block of ``size`` payload bytes takes: its value (header and
        payload) and its index entry (the header, and a MAC with a secret)."""
        return 2 * HEADER_SIZE + self._entry_extra + size

    def member(self, meta: EntryMeta) -> str:
        return f"{meta.key.hex()}:{self.stored(meta.size)}"

    def _by_tenant(self, metas: Sequence[EntryMeta]) -> dict[str, list[EntryMeta]]:
        out: dict[str, list[EntryMeta]] = {}
        for meta in metas:
            out.setdefault(self._tenant_of(meta.ns_seed), []).append(meta)
        return out

    # ------------------------------------------------------------------ usage
    def usage(self) -> dict[str, tuple[int, int]] | None:
        """(bytes, blocks) per tenant, read now (two round trips); None if Redis does not answer.
        Renews the copy the gauges read."""
        got = self.tier.breaker.call(self._read, None)
        if got is not None:
            with self._lock:
                self._usage, self._read_at = got, time.monotonic()
        return got

    def _read(self) -> dict[str, tuple[int, int]]:
        client = self.tier.client
        tenants = self._tenant_names(client.srandmember(self._registry, _MAX_TENANTS))
        missing = [t for t in self._registered if t not in tenants]
        if missing:  # the registry lost them (deleted, or evicted by Redis): put them back
            client.sadd(self._registry, *missing)
            tenants += missing
        if not tenants:
            return {}
        names = [name for t in tenants for name in self.names(t)[1:]]
        values = client.mget_nonatomic(names) if self._cluster else client.mget(names)
        return {t: (self._count(names[2 * i], values[2 * i]), self._count(names[2 * i + 1], values[2 * i + 1]))
                for i, t in enumerate(tenants)}

    def _tenant_names(self, raw: object) -> list[str]:
        out = []
        for name in raw if isinstance(raw, list) else []:
            try:
                text = name.decode() if isinstance(name, bytes) else None
            except UnicodeDecodeError:
                text = None
            if text is None or not 0 < len(text) <= 64 or not text.isprintable():
                self.tier.reject("remote_bad_members", "%s holds %s, not a tenant's name", self._registry, shown(name))
            else:
                out.append(text)
        return sorted(out)

    def _count(self, name: str, value: object) -> int:
        if value is None:
            return 0
        if isinstance(value, bytes) and 0 < len(value) <= 20 and value.lstrip(b"-").isdigit():
            return min(max(int(value), 0), _MAX_COUNTER)
        self.tier.reject("remote_bad_counters", "%s holds %s, not a count", name, shown(value))
        return 0

    def cached(self) -> dict[str, tuple[int, int]]:
        """The last usage read, renewed on this object's thread when older than ``_REFRESH_S``:
        never a network call on the caller's thread (the engine's metrics)."""
        with self._lock:
            stale = not self._refreshing and time.monotonic() - self._read_at > _REFRESH_S
            self._refreshing = self._refreshing or stale
            usage = dict(self._usage)
        if stale:
            self._submit(self._refresh)
        return usage

    def _refresh(self) -> None:
        try:
            self.usage()
        finally:
            with self._lock:
                self._refreshing = False

    # ---------------------------------------------------------------- writes
    def make_room(self, metas: Sequence[EntryMeta]) -> None:
        """Before ``metas`` (one tenant's batch) are published: evict until they fit in
        ``remote.size``, by the holders' shares (``TierShares.eviction_order``), else by LRU."""
        if not metas:
            return
        writer = self._tenant_of(metas[0].ns_seed)
        incoming = sum(self.stored(m.size) for m in metas)
        usage = self.usage()
        if usage is None:
            return  # Redis does not answer: the write will not either
        need = sum(b for b, _ in usage.values()) + incoming - self.capacity
        if need <= 0:
            return
        held = {t: b for t, (b, _) in usage.items()}
        for holder, cause, over in self.policy.eviction_order(held, self.capacity, writer, incoming):
            if need <= 0:
                break
            need -= self._evict_oldest(self.policy.members(holder, held), min(over, need), cause)
        if need > 0:  # no holder over its share (any more): the oldest block of all
            self._evict_oldest(list(held), need, LRU)

    def _evict_oldest(self, tenants: list[str], target: int, cause: str) -> int:
        """Pop the oldest blocks of ``tenants`` together (one holder, or all) until ``target``
        bytes are freed, at most ``_MAX_ROUNDS`` scripts; the bytes freed."""
        freed = 0
        for _ in range(_MAX_ROUNDS):
            if freed >= target or not tenants:
                break
            oldest = self._oldest(tenants) if len(tenants) > 1 else [(0, tenants[0])]
            if not oldest:
                break
            bound = oldest[1][0] if len(oldest) > 1 else -1  # no newer than the next tenant's oldest
            got, n = self._evict(oldest[0][1], target - freed, bound, cause)
            if not n:
                break
            freed += got
        return freed

    def _oldest(self, tenants: list[str]) -> list[tuple[int, str]]:
        """(score of its oldest block, tenant) of the tenants holding blocks, oldest first."""
        def read() -> list[object]:
            pipe = self.tier.client.pipeline(transaction=False)
            for t in tenants:
                pipe.zrange(self.names(t)[0], 0, 0, withscores=True)
            return pipe.execute(raise_on_error=False)

        replies = self.tier.breaker.call(read, [])
        out = []
        for t, reply in zip(tenants, replies):
            if isinstance(reply, list) and reply and isinstance(reply[0], tuple):
                out.append((int(reply[0][1]), t))
        return sorted(out)

    def _evict(self, tenant: str, target: int, bound: int, cause: str) -> tuple[int, int]:
        """Pop ``tenant``'s oldest blocks until ``target`` bytes are freed (no newer than ``bound``
        after the first, -1: any) and delete their values; (bytes freed, blocks popped)."""
        keys = self.names(tenant)
        popped = self.tier.breaker.call(
            lambda: self.tier.client.eval(_POP, 3, *keys, max(target, 1), bound, _POP_MOST), None)
        if not isinstance(popped, list) or not popped:
            return 0, 0
        freed, doomed = 0, []
        for member in popped:
            key_hex, _, size = (member.decode(errors="replace") if isinstance(member, bytes) else "").rpartition(":")
            if not 0 < len(key_hex) <= 64 or not all(c in string.hexdigits for c in key_hex) or not size.isdigit():
                self.tier.reject("remote_bad_members", "%s held %s, not a block's member", keys[0], shown(member))
                continue
            freed += int(size)
            doomed += [f"{self.tier.prefix}:{{{key_hex}}}:i", f"{self.tier.prefix}:{{{key_hex}}}:p"]  # RedisTier's names

        def delete() -> None:
            pipe = self.tier.client.pipeline(transaction=False)
            for name in doomed:  # one key per DEL: a Cluster pipeline routes each on its own
                pipe.delete(name)
            pipe.execute(raise_on_error=False)

        if doomed:
            self.tier.breaker.call(delete, None)
        n = len(popped)
        self.tier.counters.inc("remote_evicted", n)
        self.tier.counters.inc(f"remote_evicted_{cause}", n)
        log.debug("kvstrata remote: tenant %s gave up %d blocks (%d bytes, %s)", tenant, n, freed, cause)
        return freed, n

    def account(self, metas: Sequence[EntryMeta]) -> None:
        """After ``metas`` were published: their members, and the counters for the new ones."""
        for tenant, ms in self._by_tenant(metas).items():
            keys = self.names(tenant)
            args = [x for m in ms for x in (self.member(m), self.stored(m.size))]
            self.tier.breaker.call(lambda: self.tier.client.eval(_ADD, 3, *keys, *args), None)
            if tenant not in self._registered:
                if self.tier.breaker.call(lambda: self.tier.client.sadd(self._registry, tenant), None) is not None:
                    self._registered.add(tenant)

    # ------------------------------------------------------------------ hits
    def touch(self, metas: Sequence[EntryMeta]) -> None:
        """``metas`` were read: renew their scores, on this object's thread (a hit does not wait)."""
        with self._lock:
            for tenant, ms in self._by_tenant(metas).items():
                self._touched.setdefault(tenant, set()).update(self.member(m) for m in ms)
            if self._touching:
                return  # the thread sends these with the ones before
            self._touching = True
        self._submit(self._send_touches)

    def _send_touches(self) -> None:
        sent = False
        try:
            while True:
                with self._lock:
                    touched, self._touched = self._touched, {}
                    if not touched:  # in the same hold as the check in ``touch``: none is left behind
                        self._touching, sent = False, True
                        return
                for tenant, members in touched.items():
                    keys = self.names(tenant)
                    self.tier.breaker.call(lambda: self.tier.client.eval(_TOUCH, 3, *keys, *members), None)
        finally:
            if not sent:  # a bug raised: the next hit starts the thread again
                with self._lock:
                    self._touching = False

    def _submit(self, job: Callable[[], None]) -> None:
        try:
            self._thread.submit(job)
        except RuntimeError:  # closed
            with self._lock:
                self._refreshing = self._touching = False

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
