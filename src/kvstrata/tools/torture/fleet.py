"""tools/torture/fleet.py: the parent's side: worker processes started, killed and replaced
(``Fleet``), and the run's summary from what they logged (``collect``, ``summarize``,
``print_summary``)."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kvstrata.tools.torture.worker import worker_main
from kvstrata.tools.torture.world import REJECTION

class Fleet:
    """The parent's worker processes: started, SIGKILLed and replaced, and always reaped by
    ``close`` (SIGTERM, then SIGKILL). Workers are forked by a forkserver that has imported the
    store once, so a restart costs milliseconds instead of a torch import. Workers also stop by
    themselves at the deadline or when the parent is gone."""

    def __init__(self, base: dict[str, Any]) -> None:
        import multiprocessing as mp

        self.base = base
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["kvstrata.tools.torture", "kvstrata.store"])
        self.procs: dict[int, Any] = {}
        self.next_wid = 0
        self.started = self.killed = self.crashed = 0

    def warm_up(self) -> None:
        """Start the forkserver (it imports torch and the store) before the clock starts."""
        proc = self.ctx.Process(target=os.getpid)
        proc.start()
        proc.join()

    def spawn(self) -> None:
        wid = self.next_wid
        self.next_wid += 1
        proc = self.ctx.Process(target=worker_main, args=(dict(self.base, wid=wid),), name=f"torture-{wid}",
                                daemon=True)
        proc.start()
        self.procs[wid] = proc
        self.started += 1

    def kill_one(self, rng: random.Random) -> None:
        wid = rng.choice(sorted(self.procs))
        proc = self.procs.pop(wid)
        proc.kill()
        proc.join()
        self.killed += 1
        self.spawn()  # a fresh process on the same folder: recovery

    def reap(self) -> None:
        """Replace workers that died by themselves (a crash, counted when the exit is not 0)."""
        for wid, proc in list(self.procs.items()):
            if proc.exitcode is not None:
                del self.procs[wid]
                self.crashed += proc.exitcode != 0
                self.spawn()

    def close(self, grace_s: float = 8.0) -> None:
        for proc in self.procs.values():
            if proc.exitcode is None:
                proc.terminate()
        end = time.monotonic() + grace_s
        for proc in self.procs.values():
            proc.join(max(0.0, end - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self.procs.clear()


def collect(run_dir: Path) -> tuple[Counter[str], Counter[str], list[dict[str, Any]]]:
    """Summed worker counts, summed store counters, and the events (wrong, stale, lost) logged.

    Wrong/stale/lost totals are taken from the append-only events log, which a kill cannot
    undo; the per-worker count files lag by up to half a second."""
    counts: Counter[str] = Counter()
    store: Counter[str] = Counter()
    for path in (run_dir / "counts").glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        counts.update(data["counts"])
        store.update(data["store"])
    events = []
    try:
        with open(run_dir / "events.log", "rb") as f:
            for line in f.read().splitlines():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    for kind in ("wrong", "stale", "lost_tails"):
        counts[kind] = sum(e["blocks"] for e in events if e["kind"] == kind)
    return counts, store, events


def summarize(counts: Counter[str], store: Counter[str], events: list[dict[str, Any]], fleet: Fleet,
              seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    injected = {k.removeprefix("injected_"): v for k, v in sorted(counts.items()) if k.startswith("injected_")}
    injected.update(corrupted_l2_files=counts["corrupted_l2"], corrupted_redis_values=counts["corrupted_redis"],
                    kills=fleet.killed)
    return {
        "seconds": round(seconds, 2),
        "ops": counts["ops"],
        "ops_per_s": round(counts["ops"] / max(seconds, 1e-9), 1),
        "lookups": counts["lookups"],
        "loads": counts["loads"],
        "hit_blocks": counts["hit_blocks"],
        "loads_checked": counts["loads_checked"],
        "wrong": counts["wrong"],
        "stale": counts["stale"],
        "stale_by_cause": {why: sum(e["blocks"] for e in events if e["kind"] == "stale" and why in e["why"])
                           for why in ("invalidate", "loss")},
        "lost_tails": counts["lost_tails"],
        "tail_probes": counts["tail_probes"],
        "collision_probes": counts["collision_probes"],
        "errors": counts["errors"],
        "invalidations_failed": counts["invalidations_failed"],
        "unconfirmed_epoch_misses": store["unconfirmed_epoch_misses"],
        "injected": injected,
        "rejections": {**{k: v for k, v in sorted(store.items()) if REJECTION.search(k)},
                       "collision_refusals": counts["collision_refusals"]},
        "store_counters": dict(sorted(store.items())),
        "workers": {"started": fleet.started, "killed": fleet.killed, "crashed": fleet.crashed},
        "redis": bool(args.redis),
        "seed": args.seed,
        "examples": [e for e in events if e["kind"] != "error"][:5],
    }


def print_summary(s: dict[str, Any], to_stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=to_stderr)
    table = Table(title=f"kvstrata torture: {s['seconds']:.0f} s, seed {s['seed']}"
                        + (", with Redis" if s["redis"] else "") + (" behind network faults" if s.get("net_faults_s") else ""))
    table.add_column("measure")
    table.add_column("value", justify="right")
    for label, key in (("operations per second", "ops_per_s"), ("operations", "ops"),
                       ("loads checked (blocks)", "loads_checked"), ("wrong blocks served", "wrong"),
                       ("stale-epoch blocks served", "stale"), ("pinned tails lost", "lost_tails"),
                       ("tail probes", "tail_probes"), ("collision probes", "collision_probes"),
                       ("store errors (exceptions)", "errors")):
        bad = key in ("wrong", "stale", "lost_tails", "errors") and s[key]
        table.add_row(label, f"[red]{s[key]}[/red]" if bad else str(s[key]))
    if s.get("first_catch_s") is not None:
        table.add_row("first case caught after (s)", f"[red]{s['first_catch_s']}[/red]")
    for why, v in s["stale_by_cause"].items():
        if v:
            table.add_row(f"  stale after {'an invalidation' if why == 'invalidate' else 'a state loss'}",
                          f"[red]{v}[/red]")
    for name, v in s["injected"].items():
        table.add_row(f"injected: {name}", str(v))
    for mode, seconds in (s.get("net_faults_s") or {}).items():
        table.add_row(f"network {mode} (s)", f"{seconds:.1f}")
    if s.get("net_faults_s"):
        table.add_row("invalidations not written (refused)", str(s["invalidations_failed"]))
        table.add_row("lookups missed: epoch unconfirmed", str(s["unconfirmed_epoch_misses"]))
    for name, v in s["rejections"].items():
        table.add_row(f"rejected: {name}", str(v))
    w = s["workers"]
    table.add_row("workers started / killed / crashed", f"{w['started']} / {w['killed']} / {w['crashed']}")
    console.print(table)
    for e in s["examples"]:
        console.print(f"[red]{e['kind']}[/red] ({e['blocks']} blocks, worker {e['wid']}): {e['detail']}")
