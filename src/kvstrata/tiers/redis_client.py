"""tiers/redis_client.py: talking to Redis for the L3 tier and its epochs: ``connect`` (a client
with kvstrata's timeouts and TLS settings, ``tls_options``), the URL for a log line without its
password (``redact_url``), which errors are the service's (``service_errors``,
``is_wrong_type``), and how a value that fails its checks is reported (``Rejections``, ``shown``).

Nothing read from Redis is trusted: any host that can write there can put anything under
kvstrata's names. A bad value is a miss (the engine recomputes), counted by kind and logged: a
warning for the first of each kind in a minute, debug lines for the rest, values cut to 80
characters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from kvstrata.config import ConfigError, RemoteConfig
from kvstrata.metrics import Counters

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0


def connect(cfg: RemoteConfig, blocking: bool = False) -> Any:
    """A redis-py client (Cluster-aware when ``cluster``) with the configured timeouts, or
    without a read timeout for a long-lived subscriber (``blocking``)."""
    try:
        import redis
        from redis.cluster import RedisCluster
    except ImportError as e:
        raise RuntimeError(f"remote.backend: redis needs the redis package in this environment ({e}): "
                           "pip install 'kvstrata[redis]'") from e

    timeout = cfg.timeout_ms / 1000
    kwargs: dict[str, Any] = dict(socket_timeout=None if blocking else timeout, socket_connect_timeout=timeout)
    kwargs.update(tls_options(cfg))
    if cfg.cluster:
        return RedisCluster.from_url(cfg.url, **kwargs)
    return redis.Redis.from_url(cfg.url, retry_on_timeout=False, **kwargs)


def tls_options(cfg: RemoteConfig) -> dict[str, Any]:
    """redis-py's TLS arguments for ``cfg``. With ``rediss://`` the server's certificate is
    verified against ``tls_ca`` (else the system's CAs) and must name the URL's host (redis-py
    before 6 did not check the name unless asked). A client certificate, where the server asks for
    one, goes in the URL's query: ``?ssl_certfile=...&ssl_keyfile=...`` (query arguments win).

    Raises ``ConfigError`` at start-up for a ``tls_ca`` the client would fail on at every call: with
    a ``redis://`` or ``unix://`` URL (redis-py raises TypeError, a bug to the breaker) or a file
    that cannot be read (every call an OSError, so the tier would only ever miss)."""
    tls = cfg.url.startswith("rediss://")
    if cfg.tls_ca is not None:
        if not tls:
            raise ConfigError(f"remote.tls_ca is set ({cfg.tls_ca}) but remote.url is not a rediss:// URL: "
                              "use rediss:// for TLS, or remove remote.tls_ca")
        if not os.access(cfg.tls_ca, os.R_OK) or not cfg.tls_ca.is_file():
            raise ConfigError(f"remote.tls_ca: cannot read the CA bundle {cfg.tls_ca}")
    if not tls:
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if cfg.tls_ca is not None:
        options["ssl_ca_certs"] = str(cfg.tls_ca)
    return options


def redact_url(url: str) -> str:
    """``url`` for a log line or a message: an ACL password (``user:password@``) and any
    ``password`` query argument shown as ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        auth, host = netloc.rsplit("@", 1)
        user, sep, _password = auth.partition(":")
        netloc = f"{user}{sep}{'***' if sep else ''}@{host}"
    query = "&".join(f"{k}=***" if k.lower().endswith("password") else f"{k}={v}" if v else k
                     for k, _, v in (q.partition("=") for q in parts.query.split("&") if q))
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


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


def protocol_error(message: str) -> Exception:
    """A reply that breaks the protocol (raised inside a breaker call: it counts as a service error)."""
    import redis

    return redis.exceptions.InvalidResponse(message)
