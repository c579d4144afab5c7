"""epochs/redis.py: ``RedisEpochs``, the namespace epochs (``epochs``) of the Redis
tier: one key per namespace, ``P:epoch:<ns hex>``, and bumps announced on ``P:epochs`` (``P`` is
``remote.key_prefix``). Beside each, ``P:ns:<ns hex>`` holds the namespace's descriptor (see
``describe``), so that ``kvstrata stats`` on any host names the model, and ``P:verify:<ns hex>``
its verification record (``verify/record.py``: Redis's copy only, no floor).

With a secret (``auth``), ``P`` is the secret's key space (``RedisTier.prefix``) and every value
carries a MAC bound to its name: an epoch is ``<epoch>:<tag hex>``, a descriptor or a record
``<json>\n<tag hex>``, an announcement ``<ns hex>:<tag hex>``. An epoch that fails its MAC is lost
state (a fresh epoch, ``remote_auth_epochs``); a descriptor or a record that fails is absent
(``remote_auth_descriptors``); an announcement that fails is ignored (``remote_auth_messages``).
Each also counts in ``remote_auth_failures``. An epoch then also carries a counter, and
``P:floor:<ns hex>`` (and a file in the local floor) the highest one seen (``epochs/floor.py``): a
value written back from an older copy is refused.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from kvstrata.config import RemoteConfig
from kvstrata.epochs.descriptors import MAX_BYTES as _MAX_DESCRIPTOR, read_descriptor, write_descriptor
from kvstrata.epochs.base import Retired, new_epoch, parse_epoch
from kvstrata.epochs.floor import VALUE_BYTES as _EPOCH_BYTES, Floor, open_epoch, seal_epoch
from kvstrata.epochs.polled import PolledEpochs, T
from kvstrata.tiers.redis import RedisTier
from kvstrata.format.block import TAG_SIZE
from kvstrata.tiers.redis_client import connect, is_wrong_type, service_errors, shown
from kvstrata.verify.record import MAX_BYTES as _MAX_RECORD

log = logging.getLogger(__name__)

_UNREACHABLE = b"unreachable"  # what the breaker answers ``_get`` when Redis does not (compared by identity)


class RedisEpochs(PolledEpochs):
    """Namespace epochs in Redis (see ``epochs/base.py``): ``SET NX`` creates, a compare-and-set (a Lua
    script) bumps, and a PUBLISH tells every instance to re-read at once.

    The value is the epoch as decimal text. A missing key (evicted, lost in a restart,
    flushed) is lost state: the first reader creates a fresh epoch with ``SET NX`` and every
    instance reads the winner, so older blocks become misses, never valid again. A value that is
    not an epoch (garbage, out of range, over 64 bytes: only its first 64 are ever read), a key
    of another type, or an epoch this instance (or its disk, the local floor) has seen replaced
    is replaced by a fresh epoch with a compare-and-set, and counted (``remote_bad_epochs``,
    ``remote_wrong_type``, ``remote_epoch_rollbacks``). A value that changes under every repair
    gives no epoch (``remote_unstable_epochs``): a failed read. Announcements carry only the
    namespace: they make the next use re-read Redis, so a forged or delayed message can cost a
    round trip but never set an epoch (``remote_bad_messages`` counts those that name no
    namespace). Every namespace is re-read at its next use once the subscriber is listening (at
    start and after each reconnection: what was announced meanwhile is not lost), and at its
    first use after ``invalidation_ms``, which covers a message lost otherwise.

    Lookups use an epoch only within ``invalidation_ms + confirm_margin_ms`` of the read that
    confirmed it (``PolledEpochs``): while Redis is unreachable, slow or hung, lookups miss once that
    bound has passed (counted by the store as ``unconfirmed_epoch_misses``), and hits resume
    with the first read that succeeds (the breaker lets one through every ``breaker.reset_ms``,
    doubling; the subscriber makes that trial itself when it is due, and at once when it has
    connected again).
    ``allow_stale_epoch`` restores the lenient policy. A namespace never read gets a
    process-local epoch (misses, and saves nobody else can see).
    """

    # Replace the value only if it still begins with what we read: two instances that both found
    # it bad agree on one new epoch.
    _CAS = ("if redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1) == ARGV[1] then "
            "return redis.call('SET', KEYS[1], ARGV[2]) end return 0")
    # Replace a key of another type only if it still has that type (SET replaces any type).
    _RETYPE = ("if redis.call('TYPE', KEYS[1]).ok == ARGV[1] then "
               "return redis.call('SET', KEYS[1], ARGV[2]) end return 0")

    def __init__(self, tier: RedisTier, cfg: RemoteConfig, floor: Path | None = None) -> None:
        refresh_s = cfg.invalidation_ms / 1000
        super().__init__(Retired(floor), refresh_s, None if cfg.allow_stale_epoch else cfg.staleness_bound_s)
        self._tier, self._cfg = tier, cfg
        self._floor = floor
        self._auth = tier.auth
        self._p = tier.prefix
        self._channel = f"{self._p}:epochs"
        self._stop = threading.Event()
        self.listening = threading.Event()  # set while the subscriber is subscribed
        self._high = None if self._auth is None else Floor(
            self._auth, b"epoch", self._key, "redis", floor, self._read_floor, self._write_floor, tier.counters,
            cfg.epoch_max_age_s)
        self._thread = threading.Thread(target=self._listen, name="kvstrata-epochs", daemon=True)
        self._thread.start()

    def _key(self, ns_seed: bytes) -> str:
        return f"{self._p}:epoch:{ns_seed.hex()}"

    def _seal(self, ns_seed: bytes, epoch: int, replaced: int = 0) -> str | bytes:
        """An epoch value as stored: its decimal text, with a secret followed by its MAC, its
        counter (above ``replaced``, the counter of the value it replaces, and the floor) and the
        second it was sealed."""
        if self._auth is None or self._high is None:
            return str(epoch)
        return seal_epoch(self._auth, b"epoch", self._key(ns_seed), epoch, self._high.next(ns_seed, replaced))

    def _fresh(self, ns_seed: bytes) -> int:
        """A new epoch for a value lost or refused: of the newest weights generation the floor knows
        (0 without a secret), so that losing the value never lets an instance that missed a reset
        back in (``joins``)."""
        return new_epoch(0 if self._high is None else self._high.generation(ns_seed))

    def _read_floor(self, ns_seed: bytes) -> bytes | None:
        try:
            return self._tier.client.getrange(f"{self._p}:floor:{ns_seed.hex()}", 0, _EPOCH_BYTES - 1) or None
        except Exception as e:
            if not is_wrong_type(e):
                raise
            return None  # not a floor: the next write replaces it

    def _write_floor(self, ns_seed: bytes, old: bytes | None, new: bytes) -> None:
        """Replace the floor by ``new`` if it still holds ``old`` (None: missing; a key of another type raises)."""
        self._tier.client.eval(self._CAS, 1, f"{self._p}:floor:{ns_seed.hex()}", old or b"", new, _EPOCH_BYTES)

    def _attempt(self, fn: Callable[[], T], default: T) -> T:
        return self._tier.breaker.call(fn, default)

    def _read(self, ns_seed: bytes) -> int | None:
        """The current epoch in Redis, creating or repairing it when needed; None if the
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
                reject("remote_wrong_type", "%s is a %s, not an epoch; starting a new one", key, shown(kind))
                client.eval(self._RETYPE, 1, key, kind, self._seal(ns_seed, self._fresh(ns_seed)))
                continue
            if raw == b"" and not created:  # missing (or empty): create one, first creator wins
                created = True
                client.set(key, self._seal(ns_seed, self._fresh(ns_seed)), nx=True)
                continue
            epoch, counter, sealed = self._parse(key, raw)
            forged = epoch is None and self._auth is not None
            replayed = epoch is not None and self._high is not None and not self._high.allows(
                ns_seed, epoch, counter, sealed)
            if epoch is not None and not replayed and (ns_seed, epoch) not in self.retired:
                if self._high is not None:
                    self._high.raise_to(ns_seed, epoch, counter)
                    if self._high.stale(sealed):
                        self._reseal(ns_seed, key, raw, epoch, counter)
                return epoch
            if replayed:  # counted and logged by the floor
                pass
            elif forged:
                self._tier.auth_failed("remote_auth_epochs", "%s holds %s, which fails its MAC; starting a new "
                                       "epoch", key, shown(raw))
            elif epoch is None:
                reject("remote_bad_epochs", "%s holds %s, not an epoch; starting a new one", key, shown(raw))
            else:
                reject("remote_epoch_rollbacks", "%s went back to epoch %d, which was replaced earlier "
                       "(restored snapshot?); starting a new one", key, epoch)
            try:
                client.eval(self._CAS, 1, key, raw, self._seal(ns_seed, self._fresh(ns_seed), counter), _EPOCH_BYTES)
            except Exception as e:  # it changed type meanwhile: read it again
                if not is_wrong_type(e) and "WRONGTYPE" not in str(e):
                    raise
        reject("remote_unstable_epochs", "%s changed under every repair; no epoch confirmed", key)
        return None

    def _write(self, ns_seed: bytes, epoch: int, expected: int | None) -> bool:
        """A ``SET``, or with ``expected`` a compare-and-set: the value is read, and replaced by
        ``_CAS`` only if it still begins with what was read (two round trips; bumps are rare)."""
        client, key = self._tier.client, self._key(ns_seed)
        if expected is None:
            value = self._seal(ns_seed, epoch)
            client.set(key, value)
            self._raise_floor(key, ns_seed, value)
            return True
        try:
            raw = client.getrange(key, 0, _EPOCH_BYTES - 1)
        except Exception as e:
            if is_wrong_type(e):  # not an epoch: the next read repairs it
                return False
            raise
        stored, counter, _ = self._parse(key, raw)
        if stored != expected:
            return False
        value = self._seal(ns_seed, epoch, counter)
        try:
            written = bool(client.eval(self._CAS, 1, key, raw, value, _EPOCH_BYTES))
        except Exception as e:  # it changed type meanwhile
            if is_wrong_type(e) or "WRONGTYPE" in str(e):
                return False
            raise
        if written:
            self._raise_floor(key, ns_seed, value)
        return written

    def _raise_floor(self, key: str, ns_seed: bytes, value: str | bytes) -> None:
        epoch, counter, _ = self._parse(key, value if isinstance(value, bytes) else value.encode())
        if self._high is not None and epoch is not None:
            self._high.raise_to(ns_seed, epoch, counter)

    def _reseal(self, ns_seed: bytes, key: str, raw: bytes, epoch: int, counter: int) -> None:
        """Seal the value in use again (same epoch, next counter, the time now) if it still holds
        ``raw``: a fleet in use keeps its value younger than ``epoch_max_age_s``. Best effort: another
        instance's re-seal or change wins, and a failure is the next read's to retry."""
        value = self._seal(ns_seed, epoch, counter)
        try:
            if self._tier.client.eval(self._CAS, 1, key, raw, value, _EPOCH_BYTES):
                self._raise_floor(key, ns_seed, value)
        except Exception as e:  # the I/O edge: the value stays as it was, still valid
            log.debug("kvstrata remote: could not seal %s again: %s", key, e)

    def _parse(self, key: str, raw: bytes) -> tuple[int | None, int, int]:
        """The epoch a value holds, its MAC checked with a secret (None for anything else), its
        counter and the second it was sealed (0 and 0 without a secret, or in older formats)."""
        if self._auth is None:
            return parse_epoch(raw[:64]), 0, 0
        opened = open_epoch(self._auth, b"epoch", key, raw)
        return (None, 0, 0) if opened is None else opened

    def _announce(self, ns_seed: bytes) -> None:
        try:
            message = ns_seed.hex().encode()
            if self._auth is not None:
                message = self._auth.seal_text(b"announce", self._channel, message)
            self._tier.client.publish(self._channel, message)
        except service_errors() as e:  # the I/O edge: others catch up within invalidation_ms
            log.warning("kvstrata remote: epoch announcement failed (%s); other instances see the "
                        "new epoch within remote.invalidation_ms", e)

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        """In Redis, for every host, and in the local floor, for this one when Redis is away."""
        if self._floor is not None:
            try:
                write_descriptor(self._floor, ns_seed, blob, 0o600)
            except OSError as e:
                log.warning("kvstrata epochs: cannot record what namespace %s is in %s: %s", ns_seed.hex(),
                            self._floor, e)
        key = f"{self._p}:ns:{ns_seed.hex()}"
        value = blob if self._auth is None else self._auth.seal_text(b"descriptor", key, blob, b"\n")
        if self._tier.breaker.call(lambda: self._tier.client.set(key, value), None) is None:
            log.warning("kvstrata remote: cannot record what namespace %s is in Redis (unreachable); "
                        "other hosts' `kvstrata stats` will show its id only", ns_seed.hex())

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        """Redis's copy, else the local floor's. A key of another type is counted and skipped."""
        try:
            raw = self._get(f"{self._p}:ns:{ns_seed.hex()}", b"descriptor", _MAX_DESCRIPTOR, "a namespace descriptor")
        except OSError:
            raw = None
        if raw is None and self._floor is not None:
            return read_descriptor(self._floor, ns_seed)
        return raw

    def record_verify(self, ns_seed: bytes, blob: bytes) -> bool:
        key = f"{self._p}:verify:{ns_seed.hex()}"
        value = blob if self._auth is None else self._auth.seal_text(b"verify", key, blob, b"\n")
        if self._tier.breaker.call(lambda: self._tier.client.set(key, value), None) is None:
            log.warning("kvstrata remote: cannot record the verified hits of namespace %s in Redis (unreachable)",
                        ns_seed.hex())
            return False
        return True

    def verify_record(self, ns_seed: bytes) -> bytes | None:
        """A key of another type is counted and read as ``b""``: not a record (a write replaces it)."""
        return self._get(f"{self._p}:verify:{ns_seed.hex()}", b"verify", _MAX_RECORD, "a verification record", b"")

    def _get(self, key: str, kind: bytes, limit: int, what: str, wrong_type: bytes | None = None) -> bytes | None:
        """A descriptor or record value (``kind``), at most one byte over ``limit``, its MAC checked:
        None if missing or failing it (counted), ``wrong_type`` for a key of another type (counted).
        Raises ``OSError`` when Redis does not answer."""
        limit += 0 if self._auth is None else 1 + 2 * TAG_SIZE

        def read() -> bytes | None:
            try:
                return self._tier.client.getrange(key, 0, limit) or None  # b"": missing
            except Exception as e:
                if not is_wrong_type(e):
                    raise
                self._tier.reject("remote_wrong_type", "%s is a %s, not %s", key, shown(self._tier.client.type(key)),
                                  what)
                return wrong_type

        raw = self._tier.breaker.call(read, _UNREACHABLE)
        if raw is _UNREACHABLE:
            raise OSError(f"{key}: the shared tier (Redis) does not answer")
        if raw and self._auth is not None:
            blob = self._auth.open_text(kind, key, raw, b"\n")
            if blob is None:
                self._tier.auth_failed("remote_auth_descriptors", "%s holds %s, which fails its MAC; ignored",
                                       key, shown(raw))
            return blob
        return raw

    def known(self) -> list[bytes]:
        names = self._tier.breaker.call(
            lambda: list(self._tier.client.scan_iter(match=f"{self._p}:epoch:*")), [])
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
        if self._auth is not None and data is not None:
            short = isinstance(data, (bytes, str)) and len(data) <= 256
            text = self._auth.open_text(b"announce", self._channel, data) if short else None
            if text is None:
                self._tier.auth_failed("remote_auth_messages", "ignoring a message on %s that fails its MAC: %s",
                                       self._channel, shown(data))
                return
            data = text
        seed = _seed_of(data.split(b":", 1)[0] if isinstance(data, bytes) and len(data) <= 256 else None)
        if seed is None:
            self._tier.reject("remote_bad_messages", "ignoring a message on %s that names no namespace: %s",
                              self._channel, shown(data))
            return
        self.changed(seed)
        self.refresh(seed)  # read it now: an idle instance learns of a reset as it is made

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
                    self._tier.breaker.trial(self._tier.client.ping)  # an open circuit's trial, not a request's
                    self.write_pending()  # a reset Redis refused is written as soon as it answers
                    self.refresh_idle()  # what no lookup read lately (an idle instance) is read here
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self._forget(msg.get("data"))
                    elif msg and msg.get("type") == "subscribe":  # listening (again) from here:
                        self.changed_all()  # what was announced before is re-read now
                        self._tier.breaker.trial(self._tier.client.ping, now=True)  # saves resume now
                        self.listening.set()
            except errors as e:  # reconnect with a pause; polling in get() covers the gap
                self.listening.clear()
                if self._stop.is_set():  # closed, and then the server went: nothing to report
                    break
                log.log(logging.DEBUG if failing else logging.WARNING,
                        "kvstrata remote: epoch subscriber lost its connection (%s); reconnecting, and "
                        "re-reading epochs every remote.invalidation_ms meanwhile", e)
                failing = True
                self._stop.wait(min(5.0, self._cfg.breaker.reset_ms / 1000))
            except Exception:  # a bug: say so loudly (once), then keep the thread (polling still works)
                self.listening.clear()
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
