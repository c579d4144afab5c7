"""``kvstrata`` command line: config check, stats, integrity check, invalidate, gc, and the tools.

The store's own subcommands are functions here, registered in ``COMMANDS``. Each tool lives in
``kvstrata.tools`` and is imported only when its subcommand runs: ``TOOLS`` names the modules that
implement a subcommand whole (their ``add_arguments`` and ``run``), so building the parser for one
subcommand never imports another's module. ``main`` only parses and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from typing import Any, Callable, Sequence

from kvstrata.config import ConfigError, load_config
from kvstrata.keys import Namespace
from kvstrata.cli.progress import SHARD_FOLDERS, ShardBar, shard_bar
from kvstrata.store import BlockStore
from kvstrata.tiers.redis_client import redact_url

log = logging.getLogger("kvstrata")
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}
DESCRIPTION = ("kvstrata: a tiered KV-cache store for vLLM and SGLang. Inspect, check and clean a store; "
               "benchmark, simulate, estimate and demonstrate it.")
_POLL_S = 0.1  # progress updates while L2 is counted
JSON_HELP = "print one JSON object instead of tables (for scripts; keys are kept across versions)"
# Subcommands a tool module implements whole: ``add_arguments(parser)`` and ``run(args) -> exit code``.
TOOLS = {"bench identity": "kvstrata.tools.bench.identity", "bench copy": "kvstrata.tools.bench.copy",
         "bench verify": "kvstrata.tools.bench.verify",
         "estimate": "kvstrata.tools.estimate",
         "torture": "kvstrata.tools.torture"}


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn
    return register


def _open(args: argparse.Namespace) -> BlockStore:
    """The store, with L2's blocks all in its index: ``stats``, ``gc`` and ``invalidate`` act on
    every block, so they wait for the background recovery an engine serves during."""
    store = BlockStore(load_config(args.config))
    store.wait_recovered()
    return store


@command("config check")
def config_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    print(f"{args.file}: ok")
    dump = cfg.model_dump(mode="json")
    dump["remote"]["url"] = redact_url(cfg.remote.url)  # an ACL password stays out of the log
    log.debug("config: %s", json.dumps(dump))
    return 0


def _await_count(store: BlockStore, timeout: float | None, bar: ShardBar) -> bool:
    """Wait for the background count of L2's folder (``wait_recovered``), up to ``timeout``
    seconds (None: until done), showing its progress; True if it finished."""
    recovery = store.recovery
    if recovery is None or recovery.done:
        return True
    bar.stage("counting the disk tier")
    deadline = None if timeout is None else time.monotonic() + timeout
    trimming = False
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, max(deadline - time.monotonic(), 0.0))
        done = store.wait_recovered(left)
        if not trimming:
            bar.update(recovery.shards, recovery.blocks)
        if done or (deadline is not None and time.monotonic() >= deadline):
            return done
        if recovery.shards >= SHARD_FOLDERS and not trimming:  # counted: older epochs go, then trim to l2.size
            bar.stage("trimming the disk tier", shards=False)
            trimming = True


@command("stats")
def stats(args: argparse.Namespace) -> int:
    with BlockStore(load_config(args.config)) as store:
        with shard_bar(not args.json) as bar:
            counted = _await_count(store, args.wait, bar)
        data = store.stats()
        recovery = store.recovery
        if not counted and recovery is not None:  # L2 is counted shard by shard: say what is known
            share = max(recovery.shards, 1) / 256
            l2 = data["tiers"]["l2"]  # type: ignore[index]
            data["estimating"] = {"shard_folders_counted": recovery.shards, "of": 256,
                                  "l2_blocks": round(l2["blocks"] / share), "l2_bytes": round(l2["bytes"] / share)}
    if args.json:
        print(json.dumps(data))
        return 0
    from rich.console import Console

    from kvstrata.cli.stats_view import render

    render(data, Console())
    return 0


@command("check")
def check(args: argparse.Namespace) -> int:
    from kvstrata.cli.check import check_disk

    cfg = load_config(args.config)
    if not cfg.l2.enabled:
        print("no disk tier configured (l2.enabled: false): nothing to check")
        return 0
    report = check_disk(cfg.l2.path, fix=args.fix, progress=not args.json)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 1 if report["bad"] and not args.fix else 0


@command("invalidate")
def invalidate(args: argparse.Namespace) -> int:
    if not (args.namespace or args.model or args.all):
        print("kvstrata invalidate: say what to invalidate: --model NAME_OR_PATH, --namespace ID "
              "(ids from `kvstrata stats`) or --all", file=sys.stderr)
        return 2
    with _open(args) as store:
        wanted = _chosen(store, args)
        if wanted is None:
            return 2
        if not wanted:
            print("no namespaces stored: nothing to invalidate")
        failed = []
        for ns_id, (seed, ns) in wanted.items():
            joins = store.counters.get("epoch_joins")
            epoch = store.reset(seed) if args.weights else store.invalidate(seed)
            if epoch is None:
                failed.append(ns_id)
                print(f"{ns_id}: NOT invalidated: the new epoch could not be written where the engines read "
                      "it (the shared tier, or the epochs folder; the log line above says why)", file=sys.stderr)
            elif store.counters.get("epoch_joins") > joins:  # an engine's reset came first: it is the new one
                print(f"{ns_id}: new epoch {epoch:016x}, made by an engine's reset at the same moment (new weights: "
                      "each engine serves none of it until it resets itself)")
            elif args.weights:
                print(f"{ns_id}: new epoch {epoch:016x} (new weights: each engine serves none of it until it resets "
                      "itself)")
            else:
                print(f"{ns_id}: new epoch {epoch:016x}")
            if ns is not None:
                print(f"    model {ns.model}, weights {ns.model_version}, dtype {ns.kv_dtype}, "
                      f"tenant {ns.tenant or '-'}")
    if failed:
        print(f"kvstrata invalidate: {len(failed)} of {len(wanted)} namespace(s) not invalidated "
              f"({', '.join(failed)}); the engines keep serving them: run it again once that is fixed",
              file=sys.stderr)
        return 1
    return 0


def _chosen(store: BlockStore, args: argparse.Namespace) -> dict[str, tuple[bytes, Namespace | None]] | None:
    """The namespaces ``invalidate`` bumps (id -> seed and descriptor), or None after printing why
    a namespace id or a model named on the command line matches nothing."""
    from kvstrata.epochs.descriptors import matches_model

    known = {seed[:8].hex(): seed for seed in store.namespaces()}
    described = store.descriptors(known.values())
    unknown = [ns_id for ns_id in args.namespace or () if ns_id not in known]
    if unknown:
        print(f"unknown namespace(s): {', '.join(unknown)}; known: {', '.join(known) or 'none'}", file=sys.stderr)
        return None
    ids = list(known) if args.all else list(dict.fromkeys(args.namespace or ()))
    for model in args.model or ():
        found = [seed[:8].hex() for seed, ns in described.items() if matches_model(ns, model)]
        if not found:
            models = sorted({ns.model for ns in described.values()})
            print(f"unknown model: {model}; models with stored namespaces: {', '.join(models) or 'none'}"
                  + (" (namespaces without a descriptor can be named with --namespace)"
                     if len(described) < len(known) else ""), file=sys.stderr)
            return None
        ids += [ns_id for ns_id in found if ns_id not in ids]
    return {ns_id: (known[ns_id], described.get(known[ns_id])) for ns_id in ids}


@command("gc")
def gc(args: argparse.Namespace) -> int:
    with BlockStore(load_config(args.config)) as store, shard_bar(True) as bar:
        _await_count(store, None, bar)  # gc acts on every block: all of L2 in the index first
        bar.stage("gc: dropping older epochs, trimming every tier to its size", shards=False)
        removed = store.gc()
    print(json.dumps({"removed": removed}))
    return 0


@command("bench store")
def bench_store(args: argparse.Namespace) -> int:
    from kvstrata.tools.bench.store import run

    result = run(quick=args.quick, progress=not args.json, scale=args.scale)
    print(json.dumps(result))
    return 0


@command("replay")
def replay(args: argparse.Namespace) -> int:
    from kvstrata.tools.replay import run

    return run(load_config(args.config), conversations=args.conversations)


@command("simulate")
def simulate(args: argparse.Namespace) -> int:
    from kvstrata.config import parse_size
    from kvstrata.tools.simulate import run
    from kvstrata.tools.trace import load_trace

    trace = load_trace(args.trace)
    if args.requests:
        trace = trace[args.start : args.start + args.requests]
    sizes = {"l1": parse_size(args.l1), "l2": parse_size(args.l2), "l3": parse_size(args.l3 or 0)}
    return run(trace, sizes, parse_size(args.block_bytes), args.json)


@command("demo")
def demo(args: argparse.Namespace) -> int:
    from kvstrata.tools.demo import run

    return run(args.model, args.config, args.prompt_tokens, args.dtype)


def _named(argv: Sequence[str]) -> str:
    """The subcommand on a command line ("bench store", "stats"), read before parsing: the top level
    has no option that takes a value, so the first words that are not options name it."""
    words = [a for a in argv if not a.startswith("-")]
    return " ".join(words[:2] if words[:1] in (["bench"], ["config"]) else words[:1])


def _parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The whole command line; only the subcommand named in ``argv`` gets a tool module's flags."""
    p = argparse.ArgumentParser(prog="kvstrata", description=DESCRIPTION,
                                epilog="`kvstrata COMMAND --help` shows a command's options.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="cmd", required=True)
    wanted = _named(argv)

    def add(group: Any, name: str, help: str) -> argparse.ArgumentParser:
        """``name`` is the whole subcommand ("bench copy"); its last word is the one in ``group``."""
        sp = group.add_parser(name.split()[-1], help=help, description=help)
        if name == wanted and name in TOOLS:
            importlib.import_module(TOOLS[name]).add_arguments(sp)
        return sp

    def with_config(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--config", help="YAML config (default: $KVSTRATA_CONFIG, else embedded)")
        return sp

    cfg = add(sub, "config", "check a config file before starting an engine")
    checks = cfg.add_subparsers(dest="sub", required=True)
    add(checks, "config check", "validate a config file (exit 2 with the reasons if it is wrong)").add_argument(
        "file", help="the YAML file")
    st = with_config(add(sub, "stats", "what is stored: size per tier, and per model (namespace)"))
    st.epilog = ("stats opens the store; the disk tier is counted in the background (a progress bar on "
                 "stderr when it is a terminal and not --json): past --wait the figures are an estimate, "
                 "said so. Memory: the store's index, about 200 bytes per block counted so far.")
    st.add_argument("--json", action="store_true", help=JSON_HELP)
    st.add_argument("--wait", type=float, default=10.0, metavar="S",
                    help="seconds to wait for the disk tier to be counted (default 10); past that, the "
                         "figures are what is counted so far, with an estimate of the whole")
    chk = with_config(add(sub, "check", "verify every block on the disk tier (exit 1 if any is bad)"))
    chk.add_argument("--fix", action="store_true", help="delete bad blocks and leftovers")
    chk.add_argument("--json", action="store_true", help=JSON_HELP)
    inv = with_config(add(sub, "invalidate", "stop serving a model's stored KV (--weights: after a weight update)"))
    inv.epilog = ("Without --weights the engines go on at once under the new epoch: no weights changed, so what "
                  "they store is good for all. With --weights (the weights were changed, e.g. updated in memory "
                  "in place) every running engine serves and saves nothing of the namespace until it resets itself "
                  "(vLLM: reset_prefix_cache(reset_connector=True)), so that an engine still holding the old weights "
                  "never stores KV under the new epoch. An engine started afterwards joins it at once.")
    inv.add_argument("--weights", action="store_true",
                     help="the weights changed: every engine must reset itself to serve this namespace again")
    inv.add_argument("--model", action="append", metavar="NAME_OR_PATH",
                     help="every namespace of this model, as the engine was given it (repeatable)")
    inv.add_argument("--namespace", action="append", metavar="ID", help="one namespace, by its id in "
                     "`kvstrata stats` (repeatable)")
    inv.add_argument("--all", action="store_true", help="every namespace in the store")
    gcp = with_config(add(sub, "gc", "delete blocks of older epochs, trim tiers to their sizes"))
    gcp.epilog = ("gc opens the store and waits until every block of the disk tier is in its index (a "
                  "progress bar on stderr when it is a terminal), then acts on the index: its memory grows "
                  "with the tier, about 400 bytes per block on the disk tier (the index's ~200, plus the "
                  "scan's; 390 MB measured at 1M blocks). "
                  "`kvstrata check` streams instead, in a memory that does not grow with the tier.")
    benches = add(sub, "bench", "benchmarks: store, copy, identity, verify (the comparative ones: python -m benchmarks)")
    bench = benches.add_subparsers(dest="sub", required=True)
    bs = add(bench, "bench store", "store micro-benchmark against raw baselines")
    bs.add_argument("--quick", action="store_true", help="finish in under 30 s")
    bs.add_argument("--json", action="store_true", help="only the JSON line")
    bs.add_argument("--scale", type=int, default=None, metavar="N",
                    help="blocks on L2 for the start-up figures (default 1,000,000; 2,000 with --quick; 0: skip)")
    rp = with_config(add(sub, "replay", "replay chat traffic through the store alone (two processes), "
                             "checking every served block"))
    rp.add_argument("--conversations", type=int, default=40, help="conversations to replay (default 40)")
    add(bench, "bench copy", "block copies between the KV cache and L1 beside one contiguous copy (CUDA or CPU)")
    add(bench, "bench identity", "model identity cost at start: cold and cached")
    add(bench, "bench verify", "calibrate verified hits: honest recomputations beside other prompts, weights, layers")
    sm = add(sub, "simulate", "capacity planning: a trace through the real index and LRU")
    sm.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    sm.add_argument("--l1", required=True, help="CPU tier size, e.g. 64GiB")
    sm.add_argument("--l2", required=True, help="disk tier size, e.g. 2TiB (0: none)")
    sm.add_argument("--l3", default=None, help="shared tier size (default: none)")
    sm.add_argument("--block-bytes", default="6MiB",
                    help="KV bytes of one 512-token trace block (default 6MiB: Qwen2-0.5B in bf16)")
    sm.add_argument("--requests", type=int, default=0, help="replay only this many requests")
    sm.add_argument("--start", type=int, default=0, help="skip this many requests first")
    sm.add_argument("--json", action="store_true", help=JSON_HELP)
    add(sub, "estimate", "predicted TTFT and throughput gains from measured inputs")
    dm = add(sub, "demo", "vLLM with kvstrata: a prompt cold, then reloaded from disk after a restart")
    dm.add_argument("--model", required=True, help="model folder (examples/make_tiny_model.py builds one)")
    dm.add_argument("--config", default=None, help="kvstrata YAML (default: the embedded default)")
    dm.add_argument("--prompt-tokens", type=int, default=3000, help="prompt length (default 3000)")
    dm.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="vLLM's --dtype (default auto: the model's); make demo runs its random-weight model in "
                         "float32, where no rounding difference between compute paths flips a greedy token")
    add(sub, "torture", "stress test: several processes try to make the store serve wrong or stale KV")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    name = " ".join(x for x in (args.cmd, getattr(args, "sub", None)) if x)
    try:
        if name in TOOLS:
            return importlib.import_module(TOOLS[name]).run(args)
        return COMMANDS[name](args)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
