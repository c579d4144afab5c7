"""The shared tier over the transports a production Redis asks for: TLS (``rediss://``, a CA
made here, with and without client certificates) and an ACL user limited to kvstrata's key
prefix and epoch channel. A real ``redis-server`` on loopback, kvstrata's real Redis tier built by
the store from a config (``REMOTE_BACKENDS``), no engine.

What each refusal must look like: a client that cannot connect (wrong CA, no client
certificate, wrong password) makes the shared tier a miss, never an exception in the caller, and
the log names the cause. The ACL user's own connection is refused by Redis (NOPERM) outside the
prefix, and kvstrata, repair paths included, never needs more than the ACL line of docs/shared-tier.md grants.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import redis
import torch

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.config import ConfigError, load_config
from kvstrata.tiers.redis_client import redact_url

pytestmark = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 2048
PREFIX = "kvstrata"  # remote.key_prefix's default: keys P:..., epoch channel P:epochs
USER, PASSWORD = "kvstrata", "s3cret-for-tests"
# docs/shared-tier.md's ACL line, tested here: only kvstrata's keys and channel, only the commands it sends
# (MGET/SET/SADD/SRANDMEMBER/DEL/TYPE for blocks; GETRANGE/SET/EVAL/SCAN/PUBLISH/SUBSCRIBE for
# epochs and descriptors; the scripts' GETRANGE/SET/TYPE run under the same rules).
# With a secret (remote.auth_key_file) keys and channel move under P:<key id>:, still in ~P:*.
ACL_RULES = (f"on >{PASSWORD} resetkeys ~{PREFIX}:* resetchannels &{PREFIX}:epochs &{PREFIX}:*:epochs -@all "
             "+mget +set +getrange +sadd +srandmember +del +type +eval +scan +publish +subscribe +ping "
             "+zadd +zrange +zpopmin +incrby +time +expire")  # the last five: tenants.shares.remote's scripts


# ------------------------------------------------------------------ certificates
def make_certs(folder: Path) -> dict[str, Path]:
    """A CA; signed by it, a server certificate for 127.0.0.1/localhost, a client certificate and
    a server certificate for another name only; a second CA that signed none of them. The openssl
    CLI makes them, else the ``cryptography`` package."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("openssl"):
        _openssl_certs(folder)
    else:
        try:
            import cryptography  # noqa: F401
        except ImportError:
            pytest.skip("neither the openssl CLI nor the cryptography package is available")
        _cryptography_certs(folder)
    return {name: folder / f"{name}.crt" for name in ("ca", "other_ca", *LEAVES)} | {
        f"{name}_key": folder / f"{name}.key" for name in LEAVES}


LEAVES = {"server": ["127.0.0.1", "localhost"], "client": ["127.0.0.1", "localhost"],
          "wrong_name": ["elsewhere.invalid"]}  # certificate name: the names it is valid for


def _openssl_certs(folder: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other_ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
            "-subj", f"/CN=kvstrata test {ca}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for leaf, names in LEAVES.items():
        alt = ",".join(f"IP:{n}" if n[0].isdigit() else f"DNS:{n}" for n in names)
        (folder / f"{leaf}.ext").write_text(
            f"subjectAltName={alt}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
            "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
        run("req", *ec, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
        run("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{leaf}.crt", "-days", "2", "-extfile", f"{leaf}.ext")


def _cryptography_certs(folder: Path) -> None:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        (folder / f"{name}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        (folder / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def build(cn: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
              ca: bool, names: tuple[str, ...] | list[str] = ()) -> x509.CertificateBuilder:
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
        if ca:
            return b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), True)
        return (b.add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), False)
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address(n)) if n[0].isdigit() else x509.DNSName(n)
                     for n in names]), False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), False))

    cas = {}
    for name in ("ca", "other_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvstrata test {name}")])
        cert = build(f"kvstrata test {name}", key, subject, key, True).sign(key, hashes.SHA256())
        write(name, key, cert)
        cas[name] = (key, cert)
    ca_key, ca_cert = cas["ca"]
    for leaf, names in LEAVES.items():
        key = ec.generate_private_key(ec.SECP256R1())
        write(leaf, key, build(leaf, key, ca_cert.subject, ca_key, False, names).sign(ca_key, hashes.SHA256()))


# ------------------------------------------------------------------ servers
@contextlib.contextmanager
def tls_server(folder: Path, certs: dict[str, Path], auth_clients: str = "no", cert: str = "server") -> Iterator[int]:
    """A redis-server that speaks TLS only (``--port 0``) on a free loopback port, showing the
    certificate ``cert``; yields the port."""
    folder.mkdir(parents=True, exist_ok=True)
    port = redisutil.free_port()
    log = folder / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [redisutil.REDIS or "redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(certs[cert]), "--tls-key-file", str(certs[f"{cert}_key"]),
             "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", auth_clients,
             "--save", "", "--appendonly", "no", "--dir", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    admin = admin_client(port, certs)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if admin.ping():
                    break
            except (redis.RedisError, OSError):
                pass
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                if "tls" in text.lower() and ("not supported" in text.lower() or "bad directive" in text.lower()):
                    pytest.skip("this redis-server is built without TLS")
                raise RuntimeError(f"redis-server with TLS did not start:\n{text[-2000:]}")
            assert time.monotonic() < deadline, f"redis-server with TLS did not answer:\n{log.read_text()[-2000:]}"
            time.sleep(0.05)
        yield port
    finally:
        admin.close()
        proc.kill()
        proc.wait(timeout=10)


def admin_client(port: int, certs: dict[str, Path]) -> redis.Redis:
    """The test's own TLS connection (with the client certificate, so it works either way; the
    server's name is not checked, so it reaches the wrong-name server too)."""
    return redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs["ca"]), ssl_check_hostname=False,
                       ssl_certfile=str(certs["client"]), ssl_keyfile=str(certs["client_key"]),
                       socket_connect_timeout=1, socket_timeout=5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("tls"))


# ------------------------------------------------------------------ the store
def store(tmp: Path, name: str, remote: dict) -> BlockStore:
    """A store whose shared tier is built from ``remote.*`` by the store itself (REMOTE_BACKENDS)."""
    overrides = {"l1.size": "4MiB", "l1.pin_memory": False, "l2.path": str(tmp / name / "l2"),
                 **{f"remote.{k}": v for k, v in remote.items()}, "remote.enabled": True}
    return BlockStore(load_config(None, overrides))


payloads = redisutil.key_payloads


def prompt(seed: int, n: int = 8 * 16 + 5) -> np.ndarray:
    return redisutil.random_prompt(seed, n)


def subscribers(server: redis.Redis) -> int:
    """Epoch subscribers connected to ``server`` (each store holds one, on its own connection), on
    ``P:epochs`` or, with a secret, ``P:<key id>:epochs``."""
    channels = [c for c in server.pubsub_channels(f"{PREFIX}:*epochs") if c.endswith(b":epochs")]
    return sum(n for _, n in server.pubsub_numsub(*channels)) if channels else 0


def shares_blocks_and_epochs(tmp: Path, remote: dict, server: redis.Redis) -> None:
    """Two instances on ``remote``: the second hits and loads what the first stored, and a reset on
    the first reaches the second through the epoch key and its announcement."""
    with store(tmp, "a", remote) as a, store(tmp, "b", remote) as b:
        tokens = prompt(1)
        epoch, chain = a.chain(NS, tokens)
        expected = payloads(chain)
        assert a.save_now(NS, epoch, chain, expected) == len(chain.keys)
        hit = b.lookup(NS, tokens)
        assert hit.num_tokens == len(tokens)  # every block, the partial tail included
        out = torch.zeros_like(expected)
        assert b.load_into(hit, out) == len(chain.keys)
        assert torch.equal(out, expected)
        assert b.counters.get("hit_blocks_remote") == len(chain.keys)
        assert server.keys(f"{PREFIX}:*epoch:{NS.seed.hex()}")  # P:epoch:<ns>, or P:<key id>:epoch:<ns>
        deadline = time.monotonic() + 5
        while subscribers(server) < 2:  # both epoch subscribers are in, over the same transport
            assert time.monotonic() < deadline, "the epoch subscribers did not connect"
            time.sleep(0.02)
        assert b.epochs.known() == [NS.seed]  # SCAN
        a.invalidate(NS.seed)
        start = time.monotonic()
        while b.lookup(NS, tokens).num_blocks:
            assert time.monotonic() - start < 2.0, "b still serves the old epoch"
            time.sleep(0.005)
        for s in (a, b):
            assert s.counters.get("remote_errors") == 0, s.snapshot()


def degrades_to_a_miss(tmp: Path, remote: dict, caplog: pytest.LogCaptureFixture, *causes: str) -> None:
    """A store that cannot reach the shared tier: every lookup is a miss, saves stay local, nothing
    raises, the circuit opens and the log names the cause (one of ``causes``, within 5 s: the epoch
    subscriber, retrying every 0.2 s, may be the one that says it)."""
    remote = {"timeout_ms": 500, "breaker.reset_ms": 200, **remote}
    with caplog.at_level(logging.WARNING), store(tmp, "refused", remote) as s:
        tokens = prompt(2)
        epoch, chain = s.chain(NS, tokens)
        assert s.save_now(NS, epoch, chain, payloads(chain)) == len(chain.keys)  # local tiers
        other = prompt(3)
        for _ in range(5):
            assert s.lookup(NS, other).num_blocks == 0
        assert s.counters.get("remote_errors") >= 1
        assert s.counters.get("remote_circuit_opened") >= 1
        assert s.counters.get("hit_blocks_remote") == 0
        deadline = time.monotonic() + 5
        while not any(c.lower() in caplog.text.lower() for c in causes):
            assert time.monotonic() < deadline, f"the log does not say {causes}:\n{caplog.text}"
            time.sleep(0.05)


# ------------------------------------------------------------------ TLS
def test_rediss_carries_blocks_epochs_and_announcements(tmp_path, certs):
    with tls_server(tmp_path / "redis", certs) as port:
        remote = {"url": f"rediss://127.0.0.1:{port}/0", "tls_ca": str(certs["ca"])}
        shares_blocks_and_epochs(tmp_path, remote, admin_client(port, certs))


def test_rediss_with_a_client_certificate(tmp_path, certs, caplog):
    """``--tls-auth-clients yes``: the client certificate and key go in the URL's query
    (redis-py's ``ssl_certfile`` / ``ssl_keyfile``); without them the server refuses the handshake."""
    with tls_server(tmp_path / "redis", certs, auth_clients="yes") as port:
        url = f"rediss://127.0.0.1:{port}/0"
        cert = f"?ssl_certfile={certs['client']}&ssl_keyfile={certs['client_key']}"
        shares_blocks_and_epochs(tmp_path, {"url": url + cert, "tls_ca": str(certs["ca"])},
                                 admin_client(port, certs))
        # TLS 1.3: the client's handshake is done before the server refuses it, so the client
        # learns it at its first read (the server's alert) or write (the socket is closed).
        degrades_to_a_miss(tmp_path, {"url": url, "tls_ca": str(certs["ca"])}, caplog,
                           "CERTIFICATE_REQUIRED", "EOF occurred in violation of protocol")


@pytest.mark.parametrize("ca, cert", [("other_ca", "server"), (None, "server"), ("ca", "wrong_name")],
                         ids=["another-ca", "system-cas", "wrong-name"])
def test_rediss_refuses_a_server_it_cannot_verify_and_misses(tmp_path, certs, caplog, ca, cert):
    """A client refuses a server whose certificate its CA (or, with no ``tls_ca``, the system's)
    did not sign, or that names another host: CERTIFICATE_VERIFY_FAILED in the log, and the
    shared tier is a miss."""
    with tls_server(tmp_path / "redis", certs, cert=cert) as port:
        remote: dict[str, object] = {"url": f"rediss://127.0.0.1:{port}/0"}
        if ca is not None:
            remote["tls_ca"] = str(certs[ca])
        degrades_to_a_miss(tmp_path, remote, caplog, "CERTIFICATE_VERIFY_FAILED")
        if cert == "wrong_name":
            assert "mismatch" in caplog.text
        admin = admin_client(port, certs)
        assert admin.dbsize() == 0  # nothing was written
        admin.close()


@pytest.mark.parametrize("url, ca", [("redis://127.0.0.1:6379/0", "ca"), ("rediss://127.0.0.1:6379/0", "missing")])
def test_a_tls_ca_the_client_cannot_use_fails_at_start(tmp_path, certs, url, ca):
    """``remote.tls_ca`` with a plain URL, or a CA file that cannot be read: the store does not
    start, and says why (before, every call raised TypeError, or missed on an OSError)."""
    path = certs["ca"] if ca == "ca" else tmp_path / "missing.crt"
    with pytest.raises(ConfigError, match="remote.tls_ca"):
        store(tmp_path, "bad", {"url": url, "tls_ca": str(path)})


def test_plain_redis_url_against_a_tls_port_misses(tmp_path, certs, caplog):
    with tls_server(tmp_path / "redis", certs) as port:
        degrades_to_a_miss(tmp_path, {"url": f"redis://127.0.0.1:{port}/0"}, caplog,
                           "Connection reset by peer", "Connection closed by server", "Broken pipe")


# ------------------------------------------------------------------ ACL
@pytest.fixture
def acl_redis(tmp_path) -> Iterator[tuple[int, redis.Redis]]:
    """A plain redis-server with the user ``kvstrata`` set by ``ACL_RULES``; yields its port and an
    admin connection (the default user)."""
    with redisutil.standalone(tmp_path / "redis") as (_url, port, _procs):
        admin = redis.Redis(port=port)
        admin.execute_command("ACL", "SETUSER", USER, *ACL_RULES.split())
        admin.acl_log_reset()
        yield port, admin
        admin.close()


def denied(admin: redis.Redis) -> list[str]:
    """What ACL refused since the last reset, as "reason:object" (redis-py's CLIENT SETINFO at
    connect is left out: refused on 7.2+, unknown on 7.0, and ignored by redis-py either way)."""
    out = []
    for entry in admin.acl_log():
        obj = entry.get("object", "")
        if "setinfo" not in str(obj).lower():
            out.append(f"{entry.get('reason')}:{obj}")
    return out


@pytest.mark.parametrize("secret", [False, True], ids=["unauthenticated", "with-a-secret"])
def test_acl_user_limited_to_the_prefix_runs_kvstrata(tmp_path, acl_redis, secret):
    port, admin = acl_redis
    remote = {"url": f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0"}
    if secret:  # MACs on every value, in the secret's own key space and channel (P:<key id>:...)
        key = tmp_path / "auth.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        remote["auth_key_file"] = str(key)
    shares_blocks_and_epochs(tmp_path, remote, admin)
    assert denied(admin) == []
    names = admin.keys("*")
    assert names and all(n.startswith(f"{PREFIX}:".encode()) for n in names), names


def test_acl_user_runs_kvstrata_repair_paths(tmp_path, acl_redis):
    """The paths that repair hostile values (EVAL compare-and-set of an epoch, TYPE, DEL, SADD)
    work under the ACL user too: planted values are counted and replaced, nothing is refused."""
    port, admin = acl_redis
    remote = {"url": f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0", "invalidation_ms": 20}
    with store(tmp_path, "a", remote) as a, store(tmp_path, "b", remote) as b:
        tokens = prompt(4)
        epoch, chain = a.chain(NS, tokens)
        a.save_now(NS, epoch, chain, payloads(chain))
        epoch_key = f"{PREFIX}:epoch:{NS.seed.hex()}"
        admin.set(epoch_key, b"not an epoch")  # GETRANGE, then EVAL (GETRANGE + SET) to replace it
        time.sleep(0.05)  # past invalidation_ms: the next use reads the epoch again
        hit = b.lookup(NS, tokens)
        assert a.counters.get("remote_bad_epochs") + b.counters.get("remote_bad_epochs") >= 1  # who read first
        assert admin.get(epoch_key) != b"not an epoch"
        assert hit.num_blocks == 0  # a fresh epoch: the old blocks are misses
        time.sleep(0.05)  # a reads the fresh epoch too
        tokens = prompt(5)
        epoch, chain = a.chain(NS, tokens)
        assert a.save_now(NS, epoch, chain, payloads(chain)) == len(chain.keys)
        payload = f"{PREFIX}:{{{chain.keys[3].hex()}}}:p"
        admin.delete(payload)
        admin.hset(payload, "x", "y")  # MGET reads it as absent: TYPE, then DEL
        tails = f"{PREFIX}:{{{chain.keys[-2].hex()}}}:t"
        admin.delete(tails)
        admin.set(tails, b"not a set")  # SRANDMEMBER refused: DEL
        longer = np.concatenate([tokens, prompt(6, 3)])  # its own tail is not stored: ask the tail set
        hit = b.lookup(NS, longer)
        assert hit.num_blocks == len(chain.keys) - 1  # the stored 5-token tail is not found
        out = torch.zeros((hit.num_blocks, SIZE), dtype=torch.uint8)
        assert b.load_into(hit, out) == 3
        assert b.counters.get("remote_wrong_type") == 2
        assert not admin.exists(payload, tails)
        for s in (a, b):
            assert s.counters.get("remote_errors") == 0, s.snapshot()
    assert denied(admin) == []


def test_acl_user_is_refused_outside_the_prefix(acl_redis):
    port, admin = acl_redis
    user = redis.Redis(port=port, username=USER, password=PASSWORD)
    user.set(f"{PREFIX}:mine", b"1")
    refused = {
        "SET outside the prefix": lambda: user.set("other:key", b"x"),
        "GETRANGE outside the prefix": lambda: user.getrange("other:key", 0, -1),
        "SET on a look-alike prefix": lambda: user.set(f"{PREFIX}x:key", b"x"),
        "DEL outside the prefix": lambda: user.delete("other:key"),
        "EVAL on a key outside": lambda: user.eval("return redis.call('SET', KEYS[1], 'x')", 1, "other:key"),
        "PUBLISH on another channel": lambda: user.publish("other", b"x"),
        "FLUSHALL": lambda: user.flushall(),
        "CONFIG SET": lambda: user.config_set("maxmemory", "1mb"),
        "KEYS": lambda: user.keys("*"),
    }
    for what, call in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
            pytest.fail(f"{what} was allowed")
    assert not admin.exists("other:key", f"{PREFIX}x:key")
    assert admin.get(f"{PREFIX}:mine") == b"1"
    user.close()


def test_acl_wrong_password_misses_and_says_why(tmp_path, acl_redis, caplog):
    port, admin = acl_redis
    degrades_to_a_miss(tmp_path, {"url": f"redis://{USER}:wrong@127.0.0.1:{port}/0"}, caplog,
                       "invalid username-password pair")
    assert admin.dbsize() == 0


def test_acl_user_with_another_key_prefix_misses_and_says_why(tmp_path, acl_redis, caplog):
    """A ``remote.key_prefix`` the ACL does not cover: Redis refuses (NOPERM) and the tier misses."""
    port, admin = acl_redis
    degrades_to_a_miss(tmp_path, {"url": f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0",
                                  "key_prefix": "elsewhere"}, caplog, "no permissions")
    assert admin.dbsize() == 0
    assert any(d.startswith("key:elsewhere:") for d in denied(admin)), denied(admin)  # ACL LOG sees refusals


@pytest.mark.parametrize("url, shown", [
    ("redis://kvstrata:pa%40ss:word@10.0.0.5:6379/0", "redis://kvstrata:***@10.0.0.5:6379/0"),
    ("rediss://:s3cret@redis.internal/0?ssl_certfile=/c.pem&ssl_password=k3y",
     "rediss://:***@redis.internal/0?ssl_certfile=/c.pem&ssl_password=***"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_a_url_is_logged_without_its_password(url, shown):
    assert redact_url(url) == shown
