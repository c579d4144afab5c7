"""tools/torture/actor.py: one thread of a worker: a random mix of saves and checked loads, with
chaos on Poisson timers (invalidations, epoch-state loss, flipped bytes on disk and in Redis,
collision and tail probes)."""

from __future__ import annotations

import logging
import os
import random
import time
import traceback
from typing import Callable

import numpy as np
import torch

from kvstrata.epochs.base import parse_epoch
from kvstrata.keys import Namespace, as_tokens

from kvstrata.tools.torture.oracle import check_load, payloads_of
from kvstrata.tools.torture.shared import Worker
from kvstrata.tools.torture.world import BLOCK_TOKENS, L2_BLOCKS, NAMESPACES, PAYLOAD_BYTES, RATES, SENTINEL, VOCAB

log = logging.getLogger(__name__)

class Actor:
    """One thread: a random mix of saves and checked loads, with chaos on Poisson timers."""

    def __init__(self, worker: Worker, tid: int) -> None:
        self.w = worker
        self.store = worker.store
        self.tally = worker.tally
        self.rng = random.Random(f"{worker.spec['seed']}-{worker.spec['wid']}-{tid}")
        self.probe_ns = Namespace("torture", f"probe-{worker.spec['wid']}-{tid}", "v1", "uint8",
                                  f"[{PAYLOAD_BYTES}]", BLOCK_TOKENS)
        self.buf = np.empty((8, PAYLOAD_BYTES), np.uint8)
        chaos: dict[str, Callable[[], None]] = {
            "invalidate": self.invalidate, "epoch_loss": self.lose_epochs, "corrupt_l2": self.corrupt_l2,
            "tail_probe": self.tail_probe, "flush": lambda: self.store.flush(1.0)}
        if worker.redis is not None:
            chaos["corrupt_redis"] = self.corrupt_redis
        if worker.key_bits < 128:
            chaos["collision_probe"] = self.collision_probe
        self.chaos = chaos
        self.due = {name: self._next(name) for name in chaos}

    def _next(self, name: str) -> float:
        return time.monotonic() + self.rng.expovariate(RATES[name] / self.w.threads_total)

    def run(self) -> None:
        while not self.w.stop.is_set():
            try:
                self.step()
            except Exception as e:  # the store raised: count it, keep torturing
                self.tally.add("errors")
                log.error("store error: %s\n%s", e, traceback.format_exc())
            self.tally.add("ops")

    def step(self) -> None:
        now = time.monotonic()
        for name, due in self.due.items():
            if now >= due:
                self.due[name] = self._next(name)
                self.tally.add(f"injected_{name}")
                self.chaos[name]()
                return
        r = self.rng.random()
        ns = self.rng.choice(NAMESPACES)
        tokens = self.prompt()
        if r >= 0.4 and self.w.recent and self.rng.random() < 0.5:
            ns, tokens = self.rng.choice(self.w.recent)
        if r < 0.4:
            if self.rng.random() < 0.3:  # new blocks under a known prefix: evictions everywhere
                keep = self.rng.randrange(0, len(tokens) // BLOCK_TOKENS + 1) * BLOCK_TOKENS
                fresh = [self.rng.randrange(1000, 60000) for _ in range(self.rng.randrange(1, 2 * BLOCK_TOKENS))]
                tokens = np.concatenate([tokens[:keep], as_tokens(fresh)])
            self.save(ns, tokens, sync=self.rng.random() < 0.5)
            self.w.recent.append((ns, tokens))
        elif r < 0.85:
            self.lookup_load(ns, tokens, pin=True)
        else:
            self.lookup_load(ns, tokens, pin=False, load=self.rng.random() < 0.5)

    def prompt(self) -> np.ndarray:
        tokens = self.rng.choices(self.w.universe, cum_weights=self.w.cum)[0]
        r = self.rng.random()
        if r < 0.25:  # a longer request: the stored prompt is a prefix (tails matched inside)
            extra = [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 7))]
            return np.concatenate([tokens, as_tokens(extra)])
        if r < 0.35 and len(tokens) > 1:
            return tokens[: self.rng.randrange(1, len(tokens))]
        return tokens

    # ------------------------------------------------------------------ saves and loads
    def save(self, ns: Namespace, tokens: np.ndarray, sync: bool = True) -> int:
        epoch, chain = self.store.chain(ns, tokens)
        if not chain.keys:
            return 0
        payload = torch.from_numpy(payloads_of(chain.keys))
        self.tally.add("saves")
        if sync:
            return self.store.save_now(ns, epoch, chain, payload)
        self.store.save(ns, epoch, chain, payload)
        return 0

    def lookup_load(self, ns: Namespace, tokens: np.ndarray, pin: bool, load: bool = True) -> int:
        """Look up (and load, check, release); returns the blocks the lookup found."""
        started = time.monotonic_ns()
        hit = self.store.lookup(ns, tokens, pin=pin)
        try:
            self.tally.add("lookups")
            n = hit.num_blocks
            if not load or not n:
                return n
            if n > len(self.buf):
                self.buf = np.empty((n, PAYLOAD_BYTES), np.uint8)
            out = self.buf[:n]
            out.fill(SENTINEL)
            got = self.store.load_into(hit, torch.from_numpy(out))
        finally:
            self.store.complete_load(hit)
        self.tally.add("loads")
        self.tally.add("hit_blocks", n)
        self.tally.add("loads_checked", got)
        wrong, stale, why = check_load(self.w.keys, ns, tokens, hit.epoch, hit.chain.lengths, out[:got], started,
                                       self.w.oracle)
        what = f"ns {ns.model} tokens {tokens.tolist()} epoch {hit.epoch} lengths {hit.chain.lengths} loaded {got}"
        if wrong:
            self.tally.event("wrong", wrong, what)
        if stale:
            self.tally.event("stale", stale, what, why=",".join(why))
        return n

    # ------------------------------------------------------------------------------ chaos
    def invalidate(self) -> None:
        ns = self.rng.choice(NAMESPACES)
        before = self.store.current_epoch(ns)
        if self.store.invalidate(ns.seed) is None:  # not written to the shared tier: nothing retired
            self.tally.add("invalidations_failed")  # (for others; this process serves none of it)
            return
        self.w.oracle.retire([before], time.monotonic_ns(), "invalidate")

    def lose_epochs(self) -> None:
        """Delete the epoch state (files; with Redis the epoch keys), noting the epochs that
        were current there. Read from the state itself, not from this worker's view: a reset of
        this worker that Redis refused is pending, never current, and lands later as a fresh
        epoch (what it saved meanwhile was computed after that reset)."""
        folder = self.w.l2 / "epochs"
        before: list[int] = []
        if self.w.redis is None:
            for ns in NAMESPACES:
                try:
                    epoch = parse_epoch((folder / ns.seed.hex()).read_bytes()[:64])
                except OSError:
                    epoch = None
                before += [epoch] if epoch is not None else []
        for name in os.listdir(folder):
            if not name.startswith("."):  # leave writes in flight alone: they are not state yet
                try:
                    os.unlink(folder / name)
                except FileNotFoundError:
                    pass
        if self.w.redis is not None:
            prefix = self.w.spec["prefix"]
            names = list(self.w.redis.scan_iter(match=f"{prefix}:epoch:*", count=1000))
            pipe = self.w.redis.pipeline(transaction=True)  # read and delete in one step
            for ns in NAMESPACES:
                pipe.get(f"{prefix}:epoch:{ns.seed.hex()}")
            pipe.delete(*names, *(f"{prefix}:epoch:{ns.seed.hex()}" for ns in NAMESPACES))
            before = [g for raw in pipe.execute()[: len(NAMESPACES)] if (g := parse_epoch(raw)) is not None]
        self.w.oracle.retire(before, time.monotonic_ns(), "loss")

    def corrupt_l2(self) -> None:
        """Flip 1-3 bits (header or payload, in place) of the file of a block of a popular prompt,
        which other processes are likely to read, or else of a random committed block file."""
        l2 = self.store.l2
        ns = self.rng.choice(NAMESPACES)
        _epoch, chain = self.store.chain(ns, self.prompt())
        path = l2.path(self.rng.choice(chain.keys))  # the tier's own layout
        if not path.exists():
            for _ in range(16):  # a committed block file of a random shard folder instead
                shard = l2.path(os.urandom(16)).parent
                try:
                    names = [n for n in os.listdir(shard) if not n.startswith(".")]  # not a write in flight
                except (FileNotFoundError, NotADirectoryError):
                    continue
                if names:
                    path = shard / self.rng.choice(names)
                    break
            else:
                return
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            for _ in range(self.rng.randrange(1, 4) if size else 0):
                pos = self.rng.randrange(size)
                byte = os.pread(fd, 1, pos)
                if byte:
                    os.pwrite(fd, bytes([byte[0] ^ (1 << self.rng.randrange(8))]), pos)
        finally:
            os.close(fd)
        self.tally.add("corrupted_l2")

    def corrupt_redis(self) -> None:
        """Flip a bit of a random block value or index entry of this run's prefix."""
        r, prefix = self.w.redis, self.w.spec["prefix"].encode()
        assert r is not None
        for _ in range(8):
            name = r.randomkey()
            if name is None:
                return
            if name.startswith(prefix + b":{") and name.endswith((b":p", b":i")):
                break
        else:
            return
        value = r.get(name)
        if not value:
            return
        data = bytearray(value)
        data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        if r.set(name, bytes(data), xx=True):
            self.tally.add("corrupted_redis")

    def collision_probe(self) -> None:
        ns = self.rng.choice(NAMESPACES)
        pairs = self.w.collision_pairs(ns, self.store.current_epoch(ns))
        if not pairs:
            return
        x, y = self.rng.choice(pairs)
        if self.rng.random() < 0.5:
            x, y = y, x
        self.save(ns, x)
        if not self.lookup_load(ns, y, pin=True):
            self.tally.add("collision_refusals")  # the index found x's entry for y and refused it
        self.save(ns, y)
        self.lookup_load(ns, x, pin=True)
        self.lookup_load(ns, y, pin=self.rng.random() < 0.5)
        self.tally.add("collision_probes")

    def tail_probe(self) -> None:
        """A pinned tail must stay findable while an equal-length sibling is stored and evicted."""
        ns = self.probe_ns
        rng = self.rng
        k = rng.randrange(1, 3)
        prefix = [rng.randrange(VOCAB) for _ in range(k * BLOCK_TOKENS)]
        length = rng.randrange(1, BLOCK_TOKENS)
        tail_b = [rng.randrange(VOCAB) for _ in range(length)]
        tail_a = list(tail_b)
        tail_a[-1] = (tail_a[-1] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        b = as_tokens(prefix + tail_b)
        # A longer request, so that B is found as a stored tail of the request's next block.
        query = as_tokens(prefix + tail_b + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, BLOCK_TOKENS))])
        self.save(ns, b)
        hit = self.store.lookup(ns, b, pin=True)
        try:
            if hit.num_blocks != k + 1:
                self.tally.add("tail_probes_inconclusive")
                return
            self.save(ns, as_tokens(prefix + tail_a))
            for _ in range(2 * L2_BLOCKS // 4 + 1):  # push A out of L1 and L2 (B is pinned)
                self.save(ns, as_tokens([rng.randrange(1000, 60000) for _ in range(4 * BLOCK_TOKENS)]))
            again = self.store.lookup(ns, query)
            if again.epoch != hit.epoch:
                self.tally.add("tail_probes_inconclusive")
                return
            self.tally.add("tail_probes")
            if again.num_tokens < len(b):
                self.tally.event("lost_tails", 1, f"pinned tail {tail_b} after {prefix} not found for "
                                                  f"{query.tolist()} ({again.num_tokens} of {len(b)} tokens)")
        finally:
            self.store.complete_load(hit)
