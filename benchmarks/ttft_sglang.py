"""``python -m benchmarks ttft --engine sglang``: TTFT of one long prompt on SGLang, cold and from each cache.

One deterministic prompt (``ttft.make_prompt``, seed 0) and a warm-up prompt of the same length
(seed 1, no shared prefix) go to ``sglang.launch_server`` processes started from SGLang's own
environment (``tests.harness.sglang_server``: this process never imports sglang), one server at a
time, every one with the same flags (page 16, HiCache ratio 2, layer-first host layout, direct IO,
prefetch policy ``wait_complete``) and the same environment. Each server first serves the warm-up
prompt untimed (which also JIT-builds SGLang's page-hash extension). TTFT is the time to the first
streamed token of a greedy ``/generate`` request on token ids; each figure is the median of
``--rounds`` (5). ``POST /flush_cache`` empties the device and host caches (never storage).

- ``cold``: HiCache without a storage backend; flush before every request.
- ``native``: the same server, the prompt already in the device cache (no flush): the floor.
- ``l2``: kvstrata's ``StrataStorage`` (``--hicache-storage-backend dynamic``, zero-copy
  ``interface_v1``, prefix keys, its L1 and disk tier in the work folder): stored once, then flush
  + request each round, so every page comes from the storage backend.
- ``peer``: SGLang's built-in ``file`` backend (``HiCacheFile``, folder in the work folder by
  ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``), measured like ``l2``.

After the timed rounds each config serves the prompt once more (``--output-tokens``, greedy, after
a flush except for ``native``); the output token ids are compared across configs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Callable

from tests.harness.sglang_server import SGLangServer, SGLangUnavailable, cpu_env, cpu_flags, find_python, python_has_cuda
from benchmarks.ttft import CONFIGS as VLLM_CONFIGS
from benchmarks.ttft import BenchError, finish, make_prompt

log = logging.getLogger(__name__)

CONFIGS = ("cold", "native", "l2", "peer")
PAGE_SIZE = 16
DEFAULT_PROMPT_TOKENS = 3000
STORE_WAIT_S = 300  # pages reach storage asynchronously after the request that computed them


def wanted_configs(text: str | None) -> list[str]:
    """``--configs`` as a list; the shared default (vLLM's config names) means all of ours."""
    if not text or text == ",".join(VLLM_CONFIGS):
        return list(CONFIGS)
    wanted = [c.strip() for c in text.split(",") if c.strip()]
    if unknown := set(wanted) - set(CONFIGS):
        raise BenchError(f"unknown configs for --engine sglang: {sorted(unknown)} (choose from {','.join(CONFIGS)})")
    return [c for c in CONFIGS if c in wanted]


def strata_extra_config(work: Path) -> dict:
    """configs/sglang.yaml's keys with kvstrata's disk tier in the work folder."""
    return {"backend_name": "kvstrata", "module_path": "kvstrata.adapters.sglang", "class_name": "StrataStorage",
            "interface_v1": 1,
            "l1": {"size": "2GiB"}, "l2": {"path": str(work / "l2-store"), "size": "32GiB"}}


def stored_pages(kind: str, work: Path) -> Callable[[], int]:
    """Counts the pages a storage backend has on disk (one file per page for both)."""
    if kind == "l2":
        return lambda: sum(1 for _ in (work / "l2-store" / "blocks").glob("*/*.kvb"))
    return lambda: sum(1 for _ in (work / "peer-store").glob("*.bin"))


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, prompt: list[int], warmup: list[int]) -> None:
        self.args, self.work, self.prompt, self.warmup = args, work, prompt, warmup
        try:
            self.python = find_python(getattr(args, "sglang_python", None))
            self.cuda = python_has_cuda(self.python)
            self.env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            if not self.cuda:
                self.env.update(cpu_env(Path(__file__).resolve().parents[3] / ".cache" / "sglang"))
        except SGLangUnavailable as e:
            raise BenchError(str(e)) from None
        max_total = max(8192, -(-(2 * len(prompt) + 512) // PAGE_SIZE) * PAGE_SIZE)
        self.flags = ["--model-path", str(Path(args.model).resolve()), "--page-size", str(PAGE_SIZE),
                      "--enable-hierarchical-cache", "--hicache-ratio", "2",
                      "--hicache-storage-prefetch-policy", "wait_complete"]
        self.flags += cpu_flags(max_total) if not self.cuda else [
            "--max-total-tokens", str(max_total), "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first"]

    def server(self, name: str, storage: list[str], extra_env: dict[str, str] | None = None) -> SGLangServer:
        return SGLangServer(self.python, self.flags + storage, self.work / f"{name}.log",
                            {**self.env, **(extra_env or {})}, start_timeout=self.args.timeout,
                            request_timeout=self.args.timeout)

    def warm_up(self, server: SGLangServer) -> None:
        server.generate(self.warmup, 1)  # untimed: first-request costs, the page-hash JIT build

    def rounds(self, server: SGLangServer, flush: bool) -> dict:
        samples, cached = [], []
        for _ in range(self.args.rounds):
            if flush:
                server.flush()
            g = server.generate(self.prompt, 1)
            samples.append(round(g.ttft_ms, 1))
            cached.append(g.cached)
        return {"samples_ms": samples, "cached_tokens": cached}

    def output(self, server: SGLangServer, flush: bool) -> dict:
        if flush:
            server.flush()
        g = server.generate(self.prompt, self.args.output_tokens)
        return {"output": g.tokens, "output_cached_tokens": g.cached}

    def plain(self, wanted: list[str]) -> dict[str, dict]:
        """cold and native on one server without a storage backend."""
        out: dict[str, dict] = {}
        with self.server("plain", []) as server:
            start_s = server.started_s
            self.warm_up(server)
            if "cold" in wanted:
                out["cold"] = {**self.rounds(server, flush=True), **self.output(server, flush=True),
                               "server_start_s": round(start_s, 1)}
            if "native" in wanted:
                server.generate(self.prompt, 1)  # in the device cache now (again, after cold)
                out["native"] = {**self.rounds(server, flush=False), **self.output(server, flush=False),
                                 "server_start_s": round(start_s, 1)}
        return out

    def storage(self, name: str) -> dict:
        """l2 (ours) or peer (HiCacheFile): store once, then flush + request each round."""
        if name == "l2":
            (cfg := self.work / "strata.json").write_text(json.dumps(strata_extra_config(self.work)))
            storage, env = ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                            f"@{cfg}"], {}
        else:
            storage = ["--hicache-storage-backend", "file"]
            env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.work / "peer-store")}
        count, want = stored_pages(name, self.work), len(self.prompt) // PAGE_SIZE
        with self.server(name, storage, env) as server:
            start_s = server.started_s
            self.warm_up(server)
            before = _settled(count)
            first = server.generate(self.prompt, 1)
            deadline = time.monotonic() + STORE_WAIT_S
            while (have := count() - before) < want:
                if time.monotonic() > deadline:
                    raise BenchError(f"{name}: only {have} of {want} pages reached storage in {STORE_WAIT_S} s")
                time.sleep(0.2)
            return {**self.rounds(server, flush=True), **self.output(server, flush=True),
                    "server_start_s": round(start_s, 1), "store_request_cached_tokens": first.cached,
                    "pages_stored": count()}


def _settled(count: Callable[[], int], quiet_s: float = 1.0, limit_s: float = 60) -> int:
    """The page count once it stopped changing (the warm-up prompt's pages are still landing)."""
    last, since, deadline = count(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := count()) != last:
            last, since = now, time.monotonic()
    return last


def run(args: argparse.Namespace) -> dict:
    wanted = wanted_configs(args.configs)
    if args.rounds < 1 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        raise BenchError("--rounds and --prompt-tokens must be positive")
    if not (Path(args.model) / "config.json").exists():
        raise BenchError(f"--model {args.model}: no config.json there (a local model folder is needed)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    n = args.prompt_tokens or DEFAULT_PROMPT_TOKENS
    prompt, warmup = (make_prompt(args.model, n, seed) for seed in (0, 1))
    work = Path(tempfile.mkdtemp(prefix="kvstrata-ttft-sglang-"))
    try:
        bench = Bench(args, work, prompt, warmup)
    except BenchError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    load = [os.getloadavg()[0]]
    plans: list[tuple[list[str], Callable[[], dict[str, dict]]]] = [
        ([c for c in ("cold", "native") if c in wanted], lambda: bench.plain(wanted)),
        (["l2"] if "l2" in wanted else [], lambda: {"l2": bench.storage("l2")}),
        (["peer"] if "peer" in wanted else [], lambda: {"peer": bench.storage("peer")}),
    ]
    try:
        for names, plan in plans:
            if not names:
                continue
            log.info("sglang bench: %s", ", ".join(names))
            try:
                results.update(plan())
            except (BenchError, SGLangUnavailable, OSError, ValueError, KeyError, urllib.error.URLError) as e:
                for name in names:
                    errors.setdefault(name, f"{type(e).__name__}: {e}")
                log.error("%s: %s", ",".join(names), e)
    finally:
        finish(work, args.keep, load)
    if not results:
        raise BenchError("no configuration ran: " + "; ".join(f"{k}: {v}" for k, v in errors.items()))
    return summarize(results, errors, len(prompt), bench, load)


def summarize(results: dict[str, dict], errors: dict[str, str], prompt_tokens: int, bench: Bench,
              load: list[float]) -> dict:
    med = {n: round(statistics.median(r["samples_ms"]), 1) for n, r in results.items()}
    out: dict = {("cold_ms" if n == "cold" else f"{n}_hit_ms"): med.get(n) for n in CONFIGS}
    l2 = results.get("l2")
    out["hit_fraction"] = round(statistics.median(c.get("storage", 0) for c in l2["cached_tokens"]) / prompt_tokens,
                                4) if l2 else None
    outputs = {n: r["output"] for n, r in results.items()}
    out["outputs_identical"] = len({tuple(o) for o in outputs.values()}) == 1 if len(outputs) > 1 else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    out["cold_over_l2"] = ratio(med.get("cold"), med.get("l2"))
    out["l2_over_peer"] = ratio(med.get("l2"), med.get("peer"))
    # (l2 - native) / (peer - native): undefined (None) when the peer is not above the floor, i.e.
    # its load time is lost in the noise of the native figure; both differences are in details.
    diffs = ({f"{n}_minus_native_ms": round(med[n] - med["native"], 1) for n in ("l2", "peer")}
             if {"l2", "peer", "native"} <= med.keys() else {})
    out["overhead_ratio"] = (ratio(diffs["l2_minus_native_ms"], diffs["peer_minus_native_ms"])
                             if diffs and diffs["peer_minus_native_ms"] > 0 else None)
    cold = outputs.get("cold")
    keys = ("samples_ms", "cached_tokens", "output_cached_tokens", "server_start_s")
    out["details"] = {
        "prompt_tokens": prompt_tokens, "page_size": PAGE_SIZE, "rounds": bench.args.rounds, **diffs,
        "output_tokens": bench.args.output_tokens, "sglang_python": bench.python, "cuda": bench.cuda,
        "server_flags": bench.flags, "env": bench.env,
        **{k: {n: r[k] for n, r in results.items()} for k in keys},
        "min_ms": {n: min(r["samples_ms"]) for n, r in results.items()},
        "store_request_cached_tokens": {n: r["store_request_cached_tokens"] for n, r in results.items()
                                        if "store_request_cached_tokens" in r},
        "pages_stored": {n: r["pages_stored"] for n, r in results.items() if "pages_stored" in r},
        "outputs": outputs,
        "outputs_match_cold": {n: o == cold for n, o in outputs.items()} if cold is not None else None,
        "errors": errors, "loadavg_1min_start_end": load}
    return out


def print_table(summary: dict) -> None:
    d = summary["details"]
    print(f"SGLang TTFT, {d['prompt_tokens']}-token prompt, median of {d['rounds']} "
          f"(l2: kvstrata StrataStorage, peer: SGLang's file backend)")
    print(f"{'config':<8}{'median ms':>11}{'storage':>9}{'device':>8}  samples ms")
    for n in CONFIGS:
        key = "cold_ms" if n == "cold" else f"{n}_hit_ms"
        if n in d["samples_ms"]:
            cached = d["cached_tokens"][n]
            storage = statistics.median(c.get("storage", 0) for c in cached)
            device = statistics.median(c.get("device", 0) for c in cached)
            print(f"{n:<8}{summary[key]:>11.1f}{storage:>9.0f}{device:>8.0f}  {d['samples_ms'][n]}")
        else:
            print(f"{n:<8}{'-':>11}{'-':>9}{'-':>8}  {d['errors'].get(n, 'not run')}")
    print(f"hit_fraction {summary['hit_fraction']}, outputs_identical {summary['outputs_identical']}"
          + (f" (match cold: {d['outputs_match_cold']})" if d["outputs_match_cold"] else ""))
    print(f"cold/l2 {summary['cold_over_l2']}, l2/peer {summary['l2_over_peer']}, "
          f"(l2-native)/(peer-native) {summary['overhead_ratio']}")
