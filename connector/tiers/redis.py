"""L3 on Redis or Valkey (standalone or Cluster): blocks shared by every instance, and the epochs.

Keys (``P`` is ``remote.key_prefix``; ``{hex}`` is a Cluster hash tag, so a block's keys share a
slot and a node):

    P:{<key hex>}:p      128-byte header (blockfmt) + payload, binary; never pickled
    P:{<key hex>}:i      the committed index entry: the same header alone
    P:{<parent hex>}:t   set of token counts of partial blocks stored after that parent
    P:epoch:<ns hex>     namespace generation (random u64, see ``epochs``), announced on ``P:epochs``

Publication writes the payload, then the index entry, in that order on one connection to the
slot's node (a hash tag puts both in one slot), so Redis applies them in order: the index entry's
SET is the commit. Readers only follow index entries, so they never see a block without its
payload; a writer that dies between the two leaves an invisible payload that LRU reclaims. We do
not wrap the pair in MULTI/EXEC: it adds no safety for readers that follow index entries, and
measured here it halved write throughput (0.43 vs 0.81 of raw pipelined SETs). If Redis's own
eviction (``allkeys-lru``) drops a payload, the read is a miss, never an error.

Nothing read from Redis is trusted: any host that can write there can put anything under these
names. Every value is checked before it is used, and a bad one is a miss (the engine recomputes),
counted by kind and logged (at most once a minute per kind, values cut to 80 characters):

    remote_bad_headers   not a kvstrata header (garbage, truncated header, header checksum)
    remote_wrong_key     a valid header of another block (key, parent, namespace, generation)
    remote_wrong_size    header size not the destination's, or payload length not the header's
    remote_wrong_type    the key holds a hash, list, ... instead of a string
    remote_bad_tails     a member of a tail set that is not a token count
    checksum_failures    payload bytes that do not match the header's checksum
    remote_bad_epochs, remote_bad_messages, remote_unstable_epochs: see ``RedisEpochs``

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

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..blockfmt import HEADER_SIZE, FormatError, pack_header, payload_checksum, unpack_header
from ..breaker import Breaker
from ..config import RemoteConfig
from ..epochs import EpochStore, Retired, new_generation, parse_generation
from ..index import EntryMeta
from ..metrics import Counters
from .base import BlockTier

log = logging.getLogger(__name__)

_MAX_TAILS = 1024  # tail lengths read per parent: a set bloated by someone costs one bounded reply
_MAX_TAIL_TOKENS = 1 << 24  # blockfmt's bound on a block's token count
_EPOCH_BYTES = 64  # a generation is at most 20 digits; read no more than this of an epoch value
_WARN_EVERY_S = 60.0


def connect(cfg: RemoteConfig, blocking: bool = False) -> Any:
    """A redis-py client (Cluster-aware when ``cluster``) with the configured timeouts, or
    without a read timeout for a long-lived subscriber (``blocking``)."""
    import redis
    from redis.cluster import RedisCluster

    timeout = cfg.timeout_ms / 1000
    kwargs: dict[str, Any] = dict(socket_timeout=None if blocking else timeout, socket_connect_timeout=timeout)
    if cfg.tls_ca is not None:
        kwargs["ssl_ca_certs"] = str(cfg.tls_ca)
    if cfg.cluster:
        return RedisCluster.from_url(cfg.url, **kwargs)
    return redis.Redis.from_url(cfg.url, retry_on_timeout=False, **kwargs)


def service_errors() -> tuple[type[BaseException], ...]:
    """What a Redis call raises when the service (not kvstrata) fails: client, protocol, Cluster
    routing and socket errors. The breaker turns these into misses; anything else is a bug."""
    import redis
    from redis.exceptions import RedisClusterException

    return (redis.RedisError, RedisClusterException, OSError)


def is_wrong_type(err: BaseException) -> bool:
    """Whether a Redis error says the key holds another type (a hash where a string belongs)."""
    import redis

    return isinstance(err, redis.ResponseError) and str(err).startswith("WRONGTYPE")


def shown(value: object) -> str:
    """``value`` for a log line: its repr cut to 80 characters, with its length if it was cut."""
    text = repr(bytes(value[:80]) if isinstance(value, (bytes, bytearray, memoryview)) else value)
    if len(text) <= 80:
        return text
    size = f" ({len(value)} bytes)" if isinstance(value, (bytes, bytearray, memoryview)) else ""
    return f"{text[:77]}...{size}"


class Rejections:
    """Counts rejected values by kind and logs them: a warning for the first of each kind in a
    minute, debug lines for the rest (a flood of bad values must not flood the log)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._warned: dict[str, float] = {}

    def __call__(self, counter: str, message: str, *args: object) -> None:
        self._counters.inc(counter)
        now = time.monotonic()
        with self._lock:
            loud = now - self._warned.get(counter, -_WARN_EVERY_S) >= _WARN_EVERY_S
            if loud:
                self._warned[counter] = now
        log.log(logging.WARNING if loud else logging.DEBUG, "kvstrata remote: " + message + " (%s)", *args, counter)


class RedisTier(BlockTier):
    name = "remote"
    bit = 4

    def __init__(self, counters: Counters, cfg: RemoteConfig, client: Any = None) -> None:
        super().__init__(counters)
        self._cfg = cfg
        self._p = cfg.key_prefix
        self.client = client if client is not None else connect(cfg)
        self.breaker = Breaker(cfg.breaker, self.name, counters, service_errors())
        self.reject = Rejections(counters)
        self._local = threading.local()

    def _k(self, key: bytes, kind: str) -> str:
        return f"{self._p}:{{{key.hex()}}}:{kind}"

    def _mget(self, names: list[str]) -> list[object]:
        values = self.client.mget_nonatomic(names) if self._cfg.cluster else self.client.mget(names)
        if len(values) != len(names):  # never pair a value with the wrong name
            raise _protocol_error(f"MGET of {len(names)} keys returned {len(values)} values")
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
        for i, (meta, value, out) in enumerate(zip(metas, raw, outs)):
            if value is None:
                self._missing(meta)
                return i
            problem = self._verify(meta, value, out)
            if problem is not None:
                counter, message, args, damaged = problem
                self.reject(counter, "dropping block %s: " + message, meta.key.hex(), *args)
                if damaged:
                    self.delete(meta.key)
                return i
            assert isinstance(value, bytes)
            out.numpy()[:] = np.frombuffer(value, np.uint8, meta.size, HEADER_SIZE)
            self.counters.inc("remote_bytes_read", meta.size)
        return len(metas)

    def _verify(self, meta: EntryMeta, value: object,
                out: torch.Tensor) -> tuple[str, str, tuple[object, ...], bool] | None:
        """Why ``value`` (read under ``meta.key``) cannot fill ``out``: (counter, message, args,
        whether the value is damaged and should go), or None when it is the block, intact."""
        if not isinstance(value, bytes):
            return "remote_wrong_type", "the value is a %s", (type(value).__name__,), True
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != meta.size:
            return ("remote_wrong_size", "its header says %d bytes, the destination holds %d",
                    (meta.size, out.numel() * out.element_size()), True)
        if len(value) < HEADER_SIZE:
            return ("remote_bad_headers", "%d bytes, shorter than a header: %s",
                    (len(value), shown(value)), True)
        if not meta.checksum or value[:HEADER_SIZE] != pack_header(meta):
            try:
                stored = unpack_header(value[:HEADER_SIZE], f"redis block {meta.key.hex()}")
            except FormatError as e:
                return "remote_bad_headers", "%s", (e,), e.corrupt  # another format version: not ours to delete
            if (stored.key, stored.parent, stored.ns_seed, stored.epoch, stored.fp, stored.ntok, stored.tail) != (
                    meta.key, meta.parent, meta.ns_seed, meta.epoch, meta.fp, meta.ntok, meta.tail):
                return ("remote_wrong_key", "the value holds block %s (parent %s)",
                        (stored.key.hex(), stored.parent.hex()), True)
            if stored.size != meta.size:
                return ("remote_wrong_size", "its value's header says %d bytes, the index entry %d",
                        (stored.size, meta.size), True)
            meta = stored  # the same block, possibly written again by another host (its own checksum)
        if len(value) != HEADER_SIZE + meta.size:
            return ("remote_wrong_size", "the value holds %d payload bytes, its header says %d",
                    (len(value) - HEADER_SIZE, meta.size), True)
        if payload_checksum(memoryview(value)[HEADER_SIZE:]) != meta.checksum:
            return "checksum_failures", "payload checksum mismatch", (), True
        return None

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

        def publish() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            view = memoryview(self._staging(sum(HEADER_SIZE + m.size for m in metas)))
            off = 0
            tails: list[tuple[int, EntryMeta]] = []  # (reply index of the SADD, block)
            n = 0
            for meta, payload in zip(metas, payloads):
                header = pack_header(meta)
                end = off + HEADER_SIZE + meta.size
                view[off : off + HEADER_SIZE] = header
                view[off + HEADER_SIZE : end] = memoryview(payload[: meta.size].numpy())
                pipe.set(self._k(meta.key, "p"), view[off:end])  # sent from the buffer, no copy
                pipe.set(self._k(meta.key, "i"), header)  # after the payload: the commit
                off, n = end, n + 2
                if meta.tail:
                    pipe.sadd(self._k(meta.parent, "t"), str(meta.ntok))
                    tails.append((n, meta))
                    n += 1
            replies = pipe.execute(raise_on_error=False)
            self._repair_tail_sets(tails, replies)
            failed = next((r for r in replies if isinstance(r, Exception)), None)
            if failed is not None:  # a refused SET (full Redis, read-only replica): a service error
                raise failed
            return [True] * len(metas)

        done = self.breaker.call(publish, [False] * len(metas))
        if done and done[0]:
            self.counters.inc("remote_bytes_written", sum(m.size for m in metas))
        return done

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
                replies[at] = 1

    def write(self, meta: EntryMeta, payload: torch.Tensor) -> bool:
        return self.write_many([meta], [payload])[0]

    def _staging(self, nbytes: int) -> bytearray:
        """A per-thread buffer for header + payload values, reused across calls: a fresh bytes
        object per block would be mmap'ed and page-faulted by malloc every time (measured: it
        halved throughput against raw SETs of ready-made values)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = bytearray(nbytes)
        return buf

    # ------------------------------------------------------------------ admin
    def delete(self, key: bytes) -> None:
        names = [self._k(key, "i"), self._k(key, "p")]  # one hash tag: one slot, even in a Cluster
        self.breaker.call(lambda: self.client.delete(*names), None)

    def scan(self) -> Iterator[EntryMeta]:
        names = self.breaker.call(lambda: list(self.client.scan_iter(match=f"{self._p}:*:i", count=1000)), [])
        for start in range(0, len(names), 512):
            batch = names[start : start + 512]
            for name, value in zip(batch, self.breaker.call(lambda: self._mget(batch), [])):
                if value is None:
                    continue
                if not isinstance(value, bytes) or len(value) != HEADER_SIZE:
                    self.reject("remote_bad_headers", "%s is not a %d-byte index entry: %s",
                                shown(name), HEADER_SIZE, shown(value))
                    continue
                try:
                    yield unpack_header(value, f"redis entry {shown(name)}")
                except FormatError as e:
                    self.reject("remote_bad_headers", "%s", e)

    @property
    def used_bytes(self) -> int:
        return 0  # Redis enforces its own maxmemory (allkeys-lru); the store never evicts here

    @property
    def capacity_bytes(self) -> int:
        return 1 << 62

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # closing a dead connection is not an error worth reporting
            pass


def _protocol_error(message: str) -> Exception:
    import redis

    return redis.exceptions.InvalidResponse(message)


class RedisEpochs(EpochStore):
    """Namespace generations in Redis (see ``epochs``): ``SET NX`` creates, ``SET`` bumps, and a
    PUBLISH tells every instance to re-read at once.

    The value is the generation as decimal text. A missing key (evicted, lost in a restart,
    flushed) is lost state: the first reader creates a fresh generation with ``SET NX`` and every
    instance reads the winner, so older blocks become misses, never valid again. A value that is
    not a generation (garbage, out of range, over 64 bytes: only its first 64 are ever read), a key
    of another type, or a generation this instance (or its disk, the local floor) has seen replaced
    is replaced by a fresh generation with a compare-and-set, and counted (``remote_bad_epochs``,
    ``remote_wrong_type``, ``remote_epoch_rollbacks``). A value that changes under every repair
    gives no generation (``remote_unstable_epochs``): the last known one is kept, as while Redis
    is unreachable. Announcements carry only the namespace: they make the next ``get`` re-read
    Redis, so a forged or delayed message can cost a round trip but never set a generation
    (``remote_bad_messages`` counts those that name no namespace). ``get`` also re-reads a
    namespace whose value is older than ``invalidation_ms``, which covers a missed message. While
    Redis is unreachable the last known generation is used; a namespace never read gets a
    process-local one (misses, and saves nobody else can see).
    """

    # Replace the value only if it still begins with what we read: two instances that both found
    # it bad agree on one new generation.
    _CAS = ("if redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1) == ARGV[1] then "
            "return redis.call('SET', KEYS[1], ARGV[2]) end return 0")
    # Replace a key of another type only if it still has that type (SET replaces any type).
    _RETYPE = ("if redis.call('TYPE', KEYS[1]).ok == ARGV[1] then "
               "return redis.call('SET', KEYS[1], ARGV[2]) end return 0")

    def __init__(self, tier: RedisTier, cfg: RemoteConfig, floor: Path | None = None) -> None:
        self._tier, self._cfg = tier, cfg
        self._lock = threading.Lock()
        self._known: dict[bytes, tuple[int, float]] = {}
        self.retired = Retired(floor)
        self._channel = f"{cfg.key_prefix}:epochs"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="kvstrata-epochs", daemon=True)
        self._thread.start()

    def _key(self, ns_seed: bytes) -> str:
        return f"{self._cfg.key_prefix}:epoch:{ns_seed.hex()}"

    def _remember(self, ns_seed: bytes, gen: int, at: float) -> int:
        with self._lock:
            previous = self._known.get(ns_seed)
            self._known[ns_seed] = (gen, at)
        if previous is not None and previous[0] != gen:
            self.retired.add(ns_seed, previous[0])
        return gen

    def get(self, ns_seed: bytes) -> int:
        with self._lock:
            known = self._known.get(ns_seed)
        if known is not None and time.monotonic() - known[1] < self._cfg.invalidation_ms / 1000:
            return known[0]
        gen = self._tier.breaker.call(lambda: self._read(ns_seed), None)
        if gen is None:  # unreachable or unstable: keep the last known generation, or a private one
            if known is not None:
                return known[0]
            return self._remember(ns_seed, new_generation(), time.monotonic())
        return self._remember(ns_seed, gen, time.monotonic())

    def _read(self, ns_seed: bytes) -> int | None:
        """The current generation in Redis, creating or repairing it when needed; None if the
        value changed under every repair."""
        client, key, reject = self._tier.client, self._key(ns_seed), self._tier.reject
        created = False
        for _ in range(4):
            try:
                raw = client.getrange(key, 0, _EPOCH_BYTES - 1)  # b"" for a missing key too
            except Exception as e:
                if not is_wrong_type(e):
                    raise
                kind = client.type(key)
                reject("remote_wrong_type", "%s is a %s, not a generation; starting a new one", key, shown(kind))
                client.eval(self._RETYPE, 1, key, kind, str(new_generation()))
                continue
            if raw == b"" and not created:  # missing (or empty): create one, first creator wins
                created = True
                client.set(key, str(new_generation()), nx=True)
                continue
            gen = parse_generation(raw)
            if gen is not None and (ns_seed, gen) not in self.retired:
                return gen
            if gen is None:
                reject("remote_bad_epochs", "%s holds %s, not a generation; starting a new one", key, shown(raw))
            else:
                reject("remote_epoch_rollbacks", "%s went back to generation %d, which was replaced earlier "
                       "(restored snapshot?); starting a new one", key, gen)
            try:
                client.eval(self._CAS, 1, key, raw, str(new_generation()), _EPOCH_BYTES)
            except Exception as e:  # it changed type meanwhile: read it again
                if not is_wrong_type(e) and "WRONGTYPE" not in str(e):
                    raise
        reject("remote_unstable_epochs", "%s changed under every repair; keeping the last known generation", key)
        return None

    def bump(self, ns_seed: bytes) -> int:
        client = self._tier.client
        gen = new_generation()
        with self._lock:
            old = self._known.get(ns_seed)
        client.set(self._key(ns_seed), str(gen))  # raises if Redis is down: a reset must not be lost
        if old is not None:
            self.retired.add(ns_seed, old[0])
        self._remember(ns_seed, gen, time.monotonic())
        try:
            client.publish(self._channel, ns_seed.hex())
        except service_errors() as e:  # the I/O edge: others catch up within invalidation_ms
            log.warning("kvstrata remote: epoch announcement failed (%s); other instances see the "
                        "new generation within remote.invalidation_ms", e)
        return gen

    def known(self) -> list[bytes]:
        names = self._tier.breaker.call(
            lambda: list(self._tier.client.scan_iter(match=f"{self._cfg.key_prefix}:epoch:*")), [])
        out = []
        for name in names:
            seed = _seed_of(name.rsplit(b":", 1)[1] if isinstance(name, bytes) else None)
            if seed is None:
                self._tier.reject("remote_bad_epochs", "%s does not name a namespace", shown(name))
            else:
                out.append(seed)
        return out

    def _forget(self, data: object) -> None:
        """An announcement: re-read that namespace at the next ``get``."""
        seed = _seed_of(data.split(b":", 1)[0] if isinstance(data, bytes) and len(data) <= 256 else None)
        if seed is None:
            self._tier.reject("remote_bad_messages", "ignoring a message on %s that names no namespace: %s",
                              self._channel, shown(data))
            return
        with self._lock:
            known = self._known.get(seed)
            if known is not None:
                self._known[seed] = (known[0], 0.0)

    def _listen(self) -> None:
        errors, failing = service_errors(), False
        while not self._stop.is_set():
            client = None
            try:
                client = connect(self._cfg, blocking=True)
                pubsub = client.pubsub()
                pubsub.subscribe(self._channel)
                if failing:
                    log.warning("kvstrata remote: epoch subscriber connected again")
                    failing = False
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self._forget(msg.get("data"))
            except errors as e:  # reconnect with a pause; polling in get() covers the gap
                if self._stop.is_set():  # closed, and then the server went: nothing to report
                    break
                log.log(logging.DEBUG if failing else logging.WARNING,
                        "kvstrata remote: epoch subscriber lost its connection (%s); reconnecting, and "
                        "re-reading epochs every remote.invalidation_ms meanwhile", e)
                failing = True
                self._stop.wait(min(5.0, self._cfg.breaker.reset_ms / 1000))
            except Exception:  # a bug: say so loudly (once), then keep the thread (polling still works)
                log.log(logging.DEBUG if failing else logging.ERROR, "kvstrata remote: epoch subscriber failed",
                        exc_info=True)
                failing = True
                self._stop.wait(min(5.0, self._cfg.breaker.reset_ms / 1000))
            finally:
                if client is not None:
                    try:
                        client.close()
                    except Exception:  # closing a dead connection is not worth reporting
                        pass

    def close(self) -> None:
        self._stop.set()


def _seed_of(text: object) -> bytes | None:
    """A namespace seed from its 32 hex digits (bytes), or None."""
    if not isinstance(text, bytes) or len(text) != 32:
        return None
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
