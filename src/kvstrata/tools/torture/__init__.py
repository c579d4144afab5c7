"""``kvstrata torture``: several processes share one tiny store and try to make it serve wrong or
stale KV; every block served is checked against an oracle the store cannot influence.

What runs. The parent starts ``--procs`` worker processes of ``--threads`` threads. Each opens a
``BlockStore`` on one shared L2 folder with tiny capacities (L1 12 blocks, L2 32 blocks of 512
bytes, 4 tokens per block), plus the shared Redis tier with ``--redis``; odd-numbered workers key
their index by 2 bytes (``BlockStore(config, key_bits=16)``), so that different blocks share index entries.
Threads mix at random: saves (``save_now``, and queued ``save``) of prompts drawn from a seeded universe
of 1-4 block prompts with partial tails, built so that prompts share prefixes and tails of equal
length sit under one parent; lookups with ``pin=True`` then ``load_into`` then ``complete_load`` (as the
engine adapters do); lookups without a pin, loaded or not. On timers they also invalidate a namespace,
lose the epoch state (the files of ``<l2>/epochs``; with Redis the ``<prefix>:epoch:*`` keys), flip
bytes in block files and Redis values, run collision probes (blocks whose keys share the indexed
bytes, stored and loaded in turn) and tail probes (below). The parent SIGKILLs a random worker
every few seconds and starts a new one on the same folder (the recovery path).

How it checks, trusting nothing the store says:

- ``wrong``: every payload is derived from its block key (the key tiled, XOR a ramp). After a
  load, the keys the hit must have are recomputed from the prompt's tokens, the hit's epoch
  and block lengths (``keys.chain_keys``/``block_key``, not read from the hit), and the loaded
  blocks are compared with those keys' payloads in one numpy compare. Any difference counts,
  including a block the store reports loaded but never wrote (buffers start as a sentinel).
- ``stale``: an append-only log (``retired.log``) outside the store records retired
  epochs. An invalidation appends the epoch seen as current just before it, with the
  time ``invalidate`` returned; an epoch-state loss appends the epochs current before the
  deletion, with the time it finished. A loaded block is stale when its hit's epoch had
  been retired before the lookup started (plus ``remote.invalidation_ms`` and a scheduling
  slack with Redis: other instances learn of a bump within that bound; none without, since the
  epoch files are read on every lookup). Times are CLOCK_MONOTONIC, one clock for all
  processes of a host. Recording completion and comparing with the lookup's start is what keeps
  concurrent bumps from producing false positives: a lookup that began before a bump finished
  may use the old epoch; one that began after may not.
- ``lost_tails``: a tail probe stores ``P + B`` (B a partial block), pins it by a lookup, stores
  ``P + A`` (A another tail of B's length under the same parent), churns twice the process's L2
  capacity through its tiers so that A is evicted everywhere, then looks up a longer request
  ``P + B + x`` (B can only be found as a stored tail). B is pinned, so nothing may evict it: if
  that lookup ran on the same epoch and did not return B, a committed tail was lost.
- ``errors``: exceptions raised by the store (tracebacks in ``<dir>/run/worker-*.log``).

The run exits 1 if a block was wrong or stale or a pinned tail was lost. ``RetiredLog`` and
``check_load`` are the oracle; tests use them directly.

The package: ``world`` (the tiny store, namespaces, rates, prompt universe), ``oracle`` (payloads,
expected keys, the retired-epoch log), ``actor`` (one thread's saves, loads and chaos),
``worker`` (a worker process), ``shared`` (what an actor sees of its worker), ``fleet`` (the
parent's processes and the summary); here, the run and its flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvstrata.tools.torture.fleet import Fleet, collect, print_summary, summarize
from kvstrata.tools.torture.oracle import RetiredLog, check_load, expected_keys, payloads_of
from kvstrata.tools.torture.world import NAMESPACES, PAYLOAD_BYTES, store_config

__all__ = ["NAMESPACES", "PAYLOAD_BYTES", "RetiredLog", "add_arguments", "check_load", "expected_keys",
           "payloads_of", "run", "store_config"]

log = logging.getLogger(__name__)

def _delete_prefix(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        batch = []
        for name in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(name)
            if len(batch) == 1000:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    if args.procs < 1 or args.threads < 1 or args.seconds <= 0:
        print("kvstrata torture: --procs, --threads and --seconds must be positive", file=sys.stderr)
        return 2
    if args.net_faults and not args.redis:
        print("kvstrata torture: --net-faults needs --redis URL (the faults are between the workers and Redis)",
              file=sys.stderr)
        return 2
    invalidation_ms = 50
    if args.redis:
        import redis

        try:
            redis.Redis.from_url(args.redis, socket_timeout=2, socket_connect_timeout=2).ping()
        except (redis.RedisError, ValueError) as e:
            print(f"kvstrata torture: cannot reach {args.redis}: {e}", file=sys.stderr)
            return 2
    own = args.dir is None
    # tmpfs when there is one: the torture is about interleavings, and a journaled disk's renames
    # and unlinks would take most of the time.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="kvstrata-torture-", dir=shm) if own else args.dir)
    run_dir = root / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "counts").mkdir(parents=True)
    prefix = f"kvstrata-torture-{os.getpid()}-{args.seed}"
    base = dict(run=str(run_dir), l2=str(root / "l2"), seed=args.seed, procs=args.procs, threads=args.threads,
                redis=args.redis, redis_direct=args.redis, prefix=prefix, invalidation_ms=invalidation_ms,
                parent=os.getpid())
    # The grace is the bound the README promises: an epoch is used at most
    # invalidation_ms + confirm_margin_ms after the shared tier last confirmed it (none without it:
    # the epoch files are read at every lookup).
    grace_ms = args.grace_ms if args.grace_ms is not None else (
        store_config(dict(base, l2=str(root / "l2"))).remote.staleness_bound_s * 1000 if args.redis else 0.0)
    base["grace_s"] = grace_ms / 1000
    proxy = None
    if args.net_faults:
        from kvstrata.tools.torture.faults import FaultyProxy

        proxy = FaultyProxy(args.redis)
        base["redis"] = proxy.url  # the workers' stores reach Redis through the proxy only

    fleet = Fleet(base)  # the workers open the fresh folder together: concurrent first opens too
    rng = random.Random(f"parent-{args.seed}")
    interrupted = False
    start = time.monotonic()

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        fleet.warm_up()
        start = time.monotonic()
        base["deadline_ns"] = time.monotonic_ns() + int((args.seconds + 15) * 1e9)
        for _ in range(args.procs):
            fleet.spawn()
        if proxy is not None:
            proxy.start_cycling(args.seed)
        _supervise(fleet, run_dir, rng, start, args)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        elapsed = time.monotonic() - start
        fleet.close()
        if proxy is not None:
            proxy.close()
        signal.signal(signal.SIGTERM, previous)
    counts, store, events = collect(run_dir)
    summary = summarize(counts, store, events, fleet, elapsed, args)
    summary["grace_ms"] = grace_ms
    summary["net_faults_s"] = proxy.seconds_in() if proxy is not None else None
    caught = [e["t"] for e in events if "t" in e]
    summary["first_catch_s"] = round(min(caught) - start, 1) if caught else None
    failed = bool(summary["wrong"] or summary["stale"] or summary["lost_tails"])
    if args.redis:
        try:
            _delete_prefix(args.redis, prefix)
        except Exception as e:  # cleanup only: the verdict stands
            log.warning("kvstrata torture: could not delete %s:* from Redis: %s", prefix, e)
    if own and not failed:
        shutil.rmtree(root, ignore_errors=True)
        summary["dir"] = None
    else:
        summary["dir"] = str(root)
    print_summary(summary, to_stderr=args.json)
    if summary["dir"]:
        print(f"work folder (logs in run/): {summary['dir']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    return 1 if failed else (130 if interrupted else 0)


def _supervise(fleet: Fleet, run_dir: Path, rng: random.Random, start: float, args: argparse.Namespace) -> None:
    """Until ``--seconds``: replace dead workers, kill one now and then, show progress."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    end = start + args.seconds
    def gap() -> float:
        return rng.uniform(0.5, 1.5) * args.kill_every

    next_kill = start + gap() if args.kill_every > 0 else float("inf")
    console = Console(stderr=True)
    with Progress(TextColumn("torture"), BarColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                  console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("torture", total=args.seconds, info="")
        while (now := time.monotonic()) < end:
            time.sleep(min(0.25, end - now))
            fleet.reap()
            if fleet.crashed > 3 * args.procs:
                raise RuntimeError(f"workers keep crashing: see {run_dir}/worker-*.log")
            now = time.monotonic()
            if now >= next_kill and now < end - 2:
                fleet.kill_one(rng)
                next_kill = now + gap()
            counts, _store, _events = collect(run_dir)
            info = (f"{counts['ops'] / max(now - start, 1e-9):.0f} ops/s  {counts['loads_checked']} checked  "
                    f"wrong {counts['wrong']}  stale {counts['stale']}  lost {counts['lost_tails']}  "
                    f"kills {fleet.killed}")
            progress.update(task, completed=min(now - start, args.seconds), info=info)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="run time (default 60)")
    p.add_argument("--procs", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--threads", type=int, default=3, help="threads per worker (default 3)")
    p.add_argument("--dir", default=None, help="work folder, kept (L2 in DIR/l2, logs in DIR/run); default: "
                                                "a temp folder (in /dev/shm if any), deleted unless the run fails")
    p.add_argument("--redis", default=None, metavar="URL", help="also torture the shared tier on this server "
                                                                "(keys under a private prefix, deleted after)")
    p.add_argument("--net-faults", action="store_true",
                   help="with --redis: put a loopback proxy between the workers and Redis that cycles through "
                        "forwarding, 300 ms late, hung and refusing, every 1-3 s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-every", type=float, default=6.0,
                   help="SIGKILL a random worker about this often, in seconds, and start a new one (0: never)")
    p.add_argument("--grace-ms", type=float, default=None,
                   help="how long after a retirement a load of the old epoch is still allowed "
                        "(default 0; with --redis the promised bound, remote.invalidation_ms + "
                        "remote.confirm_margin_ms)")
    p.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
