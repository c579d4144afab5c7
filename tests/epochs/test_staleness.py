"""A shared tier that is slow, hung, refusing or unmounted costs hits, never a retired epoch.

An instance that cannot read the shared epoch state cannot know that another instance retired an
epoch. So a lookup uses an epoch only within ``remote.invalidation_ms +
remote.confirm_margin_ms`` of the read that confirmed it, stamped when the read was *sent*; past
that it misses (``unconfirmed_epoch_misses``). A reset that cannot be written fails and this
instance serves nothing of the namespace until it is. Redis is reached through
``kvstrata.tools.torture.faults.FaultyProxy`` (a real TCP proxy), the shared folder through a
link that is removed the way a mount goes away.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import redis

from tests.harness import redisutil
from kvstrata import BlockStore, Namespace
from kvstrata.config import load_config
from kvstrata.epochs.base import Retired
from kvstrata.epochs.polled import PolledEpochs, T
from kvstrata.tools.torture.faults import FaultyProxy

NS = Namespace("test", "tiny", "v1", "bfloat16", "4x[2,16,64]", 16)
SIZE = 1024
FAST = {"remote.invalidation_ms": 20, "remote.confirm_margin_ms": 100, "remote.timeout_ms": 100,
        "remote.breaker.reset_ms": 100, "remote.breaker.max_backoff_ms": 200}
BOUND_S = 0.12  # invalidation_ms + confirm_margin_ms of FAST
needs_redis = pytest.mark.skipif(redisutil.REDIS is None, reason="redis-server is not installed")


def open_store(tmp: Path, name: str, remote: dict[str, object], **extra: object) -> BlockStore:
    overrides = {"l1.size": "1MiB", "l1.pin_memory": False, "l2.path": str(tmp / name / "l2"),
                 "remote.enabled": True, **{f"remote.{k}": v for k, v in remote.items()}, **FAST, **extra}
    return BlockStore(load_config(None, overrides))


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, 4 * 16, dtype=np.uint32)


def store_prompt(store: BlockStore, seed: int = 0) -> None:
    import torch

    epoch, chain = store.chain(NS, tokens(seed))
    rows = [np.frombuffer(k * (SIZE // 16), np.uint8) for k in chain.keys]
    assert store.save_now(NS, epoch, chain, torch.from_numpy(np.stack(rows).copy())) == 4
    store.flush()


def wait_until(what: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if what():
            return True
        time.sleep(0.02)
    return False


def reset_elsewhere_is_not_served(a: BlockStore, b: BlockStore, seconds: float) -> None:
    """``b`` resets the namespace while ``a`` cannot reach the shared state: of ``a``'s lookups of
    the prompt, back to back for ``seconds``, none that starts past the bound finds a block, and
    ``a`` counts the misses."""
    assert b.invalidate(NS.seed) is not None
    reset_at = time.monotonic()
    seen = []
    while time.monotonic() < reset_at + seconds:
        started = time.monotonic()
        seen.append((started, a.lookup(NS, tokens()).num_blocks))
        time.sleep(0.005)
    late = [n for started, n in seen if started > reset_at + BOUND_S]
    assert late and not any(late), seen
    assert a.counters.get("unconfirmed_epoch_misses") > 0


# ----------------------------------------------------------------------------- the clock rule
class Shared(PolledEpochs):
    """Epoch state in a dict, with a read that can be made slow or failing."""

    def __init__(self, refresh_s: float = 0.02, bound_s: float = 0.1) -> None:
        super().__init__(Retired(), refresh_s=refresh_s, bound_s=bound_s)
        self.value = 11
        self.read_delay = 0.0
        self.down = False

    def _read(self, ns_seed: bytes) -> int | None:
        value = self.value  # the service answers now ...
        time.sleep(self.read_delay)  # ... and the reply reaches a descheduled process late
        if self.down:
            raise OSError("unreachable")
        return value

    def _write(self, ns_seed: bytes, epoch: int, expected: int | None) -> bool:
        if self.down:
            raise OSError("unreachable")
        if expected is not None and self.value != expected:
            return False
        self.value = epoch
        return True

    def _attempt(self, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except OSError:
            return default

    def describe(self, ns_seed: bytes, blob: bytes) -> None:
        pass

    def descriptor(self, ns_seed: bytes) -> bytes | None:
        return None


def test_a_late_reply_confirms_from_when_it_was_sent_not_when_it_arrived():
    """Scenario: a poll whose reply arrives 0.3 s late (a starved process), longer than the 0.1 s
    bound, then the service goes away. A lookup that starts once the reply is in may not use it:
    the epoch was confirmed when the read was sent, 0.3 s ago. A lookup that started before
    the read was sent may (the value was current after it started)."""
    epochs = Shared()
    seed = b"s" * 16
    early = time.monotonic()
    epochs.read_delay = 0.3
    assert epochs.lookup_epoch(seed, early) == (11, True)
    epochs.down, epochs.read_delay = True, 0.0
    assert epochs.lookup_epoch(seed, time.monotonic()) == (11, False)
    epochs.down = False
    assert epochs.lookup_epoch(seed, time.monotonic()) == (11, True)  # answers again: hits resume


def test_a_retired_epoch_is_not_used_after_the_bound_while_polls_fail():
    epochs = Shared()
    seed = b"s" * 16
    start = time.monotonic()
    assert epochs.lookup_epoch(seed, start) == (11, True)  # its read was sent after ``start``
    epochs.down = True
    epochs.value = 12  # retired elsewhere while this process cannot read
    assert epochs.lookup_epoch(seed, start + 0.09) == (11, True)  # within the bound: allowed
    time.sleep(0.12)
    assert epochs.lookup_epoch(seed, time.monotonic())[1] is False
    epochs.down = False
    assert epochs.lookup_epoch(seed, time.monotonic()) == (12, True)


def test_a_bump_that_cannot_be_written_serves_nothing_until_it_is():
    epochs = Shared()
    seed = b"s" * 16
    assert epochs.get(seed) == 11
    epochs.down = True
    assert epochs.bump(seed) is None
    pending = epochs.get(seed)  # saves go under the new epoch meanwhile
    assert pending != 11 and epochs.value == 11
    assert epochs.lookup_epoch(seed, time.monotonic()) == (pending, False)
    epochs.down = False
    assert epochs.lookup_epoch(seed, time.monotonic()) == (pending, True)  # written at the next use
    assert epochs.value == pending and (seed, 11) in epochs.retired


def test_concurrent_lookups_share_one_read():
    """Scenario: eight threads look up while a poll is due and the service takes 0.2 s to answer.
    One read goes out; the others wait for its answer (a slow tier is not hit once per thread)."""
    epochs = Shared(refresh_s=2.0, bound_s=3.0)  # long enough for every thread to come, however loaded the machine
    seed = b"s" * 16
    reads = []
    original = epochs._read

    def counted(ns_seed: bytes) -> int | None:
        reads.append(1)
        return original(ns_seed)

    epochs._read = counted  # type: ignore[method-assign]
    epochs.read_delay = 0.2
    results = []
    together = threading.Barrier(8)

    def look() -> None:
        together.wait()
        results.append(epochs.lookup_epoch(seed, time.monotonic()))

    threads = [threading.Thread(target=look) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [(11, True)] * 8
    assert len(reads) == 1


# ---------------------------------------------------------------------------- Redis, faulty
@pytest.fixture
def redis_url(tmp_path):
    if redisutil.REDIS is None:
        pytest.skip("redis-server is not installed")
    with redisutil.standalone(tmp_path / "redis") as (url, _port, _procs):
        yield url


@needs_redis
@pytest.mark.parametrize("mode", ["slow", "hang", "refuse"])
def test_a_reset_elsewhere_is_not_served_past_the_bound_while_redis_is(tmp_path, redis_url, mode):
    """Scenario: instance A reaches Redis through a proxy, B directly. A holds the prompt in its
    own L1 and disk. The proxy turns slow (300 ms), hung or refusing, and B resets the namespace.
    No lookup of A that starts more than the bound after the reset finds a block; those misses
    are counted. When the proxy forwards again A learns the new epoch: the old blocks stay
    misses, and what A stores now is hit again."""
    with FaultyProxy(redis_url) as proxy, open_store(tmp_path, "a", {"url": proxy.url}) as a, \
            open_store(tmp_path, "b", {"url": redis_url}) as b:
        store_prompt(a)
        assert a.lookup(NS, tokens()).num_blocks == 4
        proxy.set_mode(mode)
        reset_elsewhere_is_not_served(a, b, 1.0)
        proxy.set_mode("pass")
        assert wait_until(lambda: a.lookup(NS, tokens(1)).epoch == b.current_epoch(NS))
        assert a.lookup(NS, tokens()).num_blocks == 0  # the old epoch, on A's own disk
        store_prompt(a)
        assert a.lookup(NS, tokens()).num_blocks == 4


@needs_redis
@pytest.mark.parametrize("mode", ["slow", "hang", "refuse"])
def test_hits_resume_when_redis_answers_again(tmp_path, redis_url, mode):
    with FaultyProxy(redis_url) as proxy, open_store(tmp_path, "a", {"url": proxy.url}) as a:
        store_prompt(a)
        proxy.set_mode(mode)
        time.sleep(BOUND_S)
        assert wait_until(lambda: a.lookup(NS, tokens()).num_blocks == 0)  # unconfirmed: a miss
        proxy.set_mode("pass")
        assert wait_until(lambda: a.lookup(NS, tokens()).num_blocks == 4)  # the same epoch, confirmed


@needs_redis
def test_a_reset_that_cannot_reach_redis_fails_and_serves_nothing_until_written(tmp_path, redis_url):
    """Scenario: A resets while Redis refuses it. The reset reports failure (None, counted), A
    serves nothing of the namespace (its own disk holds the old blocks), while B, which never
    heard of it, still serves the old epoch: that is what a failed reset leaves. When Redis
    answers, A's next use writes the new epoch, and B stops serving the old one."""
    with FaultyProxy(redis_url) as proxy, open_store(tmp_path, "a", {"url": proxy.url}) as a, \
            open_store(tmp_path, "b", {"url": redis_url}) as b:
        store_prompt(a)
        assert b.lookup(NS, tokens()).num_blocks == 4  # from Redis
        old = b.current_epoch(NS)
        proxy.set_mode("refuse")
        assert a.invalidate(NS.seed) is None
        assert a.counters.get("invalidation_failures") == 1 and a.counters.get("invalidations") == 0
        for _ in range(20):
            assert a.lookup(NS, tokens()).num_blocks == 0
            time.sleep(0.01)
        assert b.current_epoch(NS) == old and b.lookup(NS, tokens()).num_blocks == 4
        pending = a.current_epoch(NS)
        proxy.set_mode("pass")
        assert wait_until(lambda: int(redis.Redis.from_url(redis_url).get(f"kvstrata:epoch:{NS.seed.hex()}")) == pending)
        assert wait_until(lambda: b.lookup(NS, tokens()).num_blocks == 0)
        assert b.current_epoch(NS) == pending


@needs_redis
def test_cli_invalidate_says_what_was_not_invalidated_and_exits_1(tmp_path, redis_url):
    with FaultyProxy(redis_url) as proxy:
        config = tmp_path / "kvstrata.yaml"
        config.write_text(f"l2:\n  path: {tmp_path / 'cli' / 'l2'}\nremote:\n  enabled: true\n  url: {proxy.url}\n"
                          f"  timeout_ms: 2000\n")  # refused connections fail at once; a loaded machine's proxy is slow
        with BlockStore(load_config(config)) as store:
            store_prompt(store)
        proxy.set_mode("refuse")
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "invalidate", "--all", "--config", str(config)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 1, res.stdout + res.stderr
        assert f"{NS.seed[:8].hex()}: NOT invalidated" in res.stderr and "1 of 1" in res.stderr
        proxy.set_mode("pass")
        res = subprocess.run([sys.executable, "-m", "kvstrata.cli.main", "invalidate", "--all", "--config", str(config)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "new epoch" in res.stdout, res.stdout + res.stderr


# ----------------------------------------------------------------------------- shared folder
def test_a_shared_folder_that_goes_away_costs_hits_never_a_retired_epoch(tmp_path):
    """Scenario: A mounts the shared folder through a link (its mount point), B directly. A's
    mount goes away (the link removed), B resets the namespace. Past the bound A serves nothing
    of the namespace, though its own disk holds the old blocks; when the mount is back A reads
    the new epoch and the old blocks stay misses."""
    shared = tmp_path / "shared"
    mount = tmp_path / "mnt"
    shared.mkdir(mode=0o700)
    mount.symlink_to(shared)
    with open_store(tmp_path, "a", {"backend": "fs", "path": str(mount)}) as a, \
            open_store(tmp_path, "b", {"backend": "fs", "path": str(shared)}) as b:
        store_prompt(a)
        assert a.lookup(NS, tokens()).num_blocks == 4
        mount.unlink()
        reset_elsewhere_is_not_served(a, b, 0.5)
        mount.symlink_to(shared)
        assert wait_until(lambda: a.lookup(NS, tokens(1)).epoch == b.current_epoch(NS))
        assert a.lookup(NS, tokens()).num_blocks == 0
