"""``python -m benchmarks ttft``: time to first token of one long prompt, cold and from each kind of cache.

Every configuration runs the same deterministic prompt (token ids drawn with a fixed seed from the
model's vocabulary, special tokens left out) in its own engine subprocess
(``benchmarks.ttft_worker``), one engine at a time, all with the same environment. TTFT is
the wall time of a greedy ``max_tokens=1`` request; each figure is the median of ``--rounds`` (5).
Every engine first serves one warm-up request on another prompt of the same length (no shared
prefix), so no figure includes first-request overheads.

- ``cold``: no connector, prefix caching off.
- ``native``: vLLM's own prefix-cache hit (store once, then repeat): the floor.
- ``l1``: kvstrata's connector, store once, then ``reset_prefix_cache()`` before each request.
- ``l2``: kvstrata's connector in a fresh engine process per measurement, on the disk folder that
  one earlier process filled (``l1``'s engine when it ran, else one of its own): its first request
  on the prompt is the measured one (L1 empty), and its first hit (its warm-up prompt is one of its
  own, which nothing stored).
- ``l3``: kvstrata's connector with the CPU tier and the shared Redis tier (no disk tier), in a fresh
  engine process per measurement, like ``l2``: L1 and L2 empty, the prompt loaded from Redis, which
  one earlier process filled (``--redis-url``, flushed first, else a private ``redis-server``).
  The last measured engine of each also serves the output (after a reset of vLLM's own cache, the
  prompt comes through kvstrata again in the engine that loaded it from that tier).
- ``l3mac``: ``l3`` with a secret (``remote.auth_key_file``): every value read from Redis is
  checked against its keyed-BLAKE3 MAC (``l3mac_over_l3``: the MAC's cost on a whole L3 hit).
- ``peer``: vLLM's ``ExampleConnector`` (store once, then reset + request).
- ``lmcache``: LMCache 0.5.6 in multiprocess mode (``LMCacheMPConnector`` and an ``lmcache server``),
  installed on first use into its own folder beside the venv, used only by those subprocesses.

Beside each median: the first sample and the 90th percentile, as ratios to the median
(``*_first_over_median``, ``*_p90_over_p50``): a median hides the slow first hit after a restart.

Outputs (``max_tokens`` 8, greedy) are compared across every configuration that ran. Engines run
in float32 by default (``--dtype``): on random weights, bf16 rounding flips greedy tokens between
any two compute paths, vLLM's own prefix hit against cold included, which would make that
comparison meaningless. Every engine
gets the same environment (``engine_env``): block size 128, eager mode, VLLM_CPU_OMP_THREADS_BIND=
nobind, VLLM_ENABLE_V1_MULTIPROCESSING=0 by default: one process per engine, which on 2 cores gives
medians within a few percent, where EngineCore's busy-polling beside the worker makes them vary
several-fold. LMCacheMPConnector fails in a one-process engine, so LMCache needs
``--multiprocessing 1`` (every engine then runs that way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.harness.redis_server import redis_server
from kvstrata.tools.serving import free_port, listening

log = logging.getLogger(__name__)

CONFIGS = ("cold", "native", "l1", "l2", "l3", "l3mac", "peer", "lmcache")
RATIOS = (("cold", "l1"), ("l1", "native"), ("l2", "l1"), ("l3", "l1"), ("l3mac", "l3"), ("l1", "peer"),
          ("l1", "lmcache"))
LMCACHE_PACKAGES = ("lmcache==0.5.6", "aiofile", "caio", "aiofiles", "nvtx", "sortedcontainers",
                    "redis", "setuptools_scm", "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0")
LMCACHE_MAIN = "import sys; from lmcache.cli.main import main; sys.argv[0] = 'lmcache'; sys.exit(main())"
BLOCK_SIZE = 128  # vLLM on CPU needs a multiple of 32
CONNECTOR = "StrataConnector"
MULTIPROCESSING = 0  # VLLM_ENABLE_V1_MULTIPROCESSING of every engine (see the module docstring)


class BenchError(RuntimeError):
    pass


def strata_transfer_config(config_path: str | Path) -> dict:
    """kv_transfer_config that loads kvstrata's connector with the given kvstrata YAML file."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": "kvstrata.adapters.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": str(config_path)}}


def example_transfer_config(folder: str | Path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


def lmcache_transfer_config(port: int) -> dict:
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                          "lmcache.mp.mq_timeout": 60.0}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--model", required=True, help="local model folder")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 1500 (vllm), 3000 (sglang)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per configuration")
    parser.add_argument("--output-tokens", type=int, default=8, help="greedy tokens compared")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list, subset of %(default)s")
    parser.add_argument("--dtype", default="float32",
                        help="dtype of every vLLM engine (default %(default)s: random weights have near-tied "
                        "logits, and in bf16 any change of compute path, vLLM's own prefix hit included, "
                        "can flip a greedy token; 'auto' for the model's dtype)")
    parser.add_argument("--kv-space-gib", type=int, help="VLLM_CPU_KVCACHE_SPACE (default 1, 2 over 200 MB)")
    parser.add_argument("--multiprocessing", type=int, choices=[0, 1], default=MULTIPROCESSING,
                        help="VLLM_ENABLE_V1_MULTIPROCESSING for every engine (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine process")
    parser.add_argument("--redis-url", help="l3: this Redis (its database is flushed first); default: a private "
                        "redis-server on a free loopback port")
    parser.add_argument("--lmcache-dir", help="LMCache install folder (default: .venv-lmcache by the venv)")
    parser.add_argument("--sglang-python", help="--engine sglang: interpreter with sglang (default: $KVSTRATA_SGLANG_PYTHON, "
                        "else this one if it has sglang, else ./.venv-sglang)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, disk tiers)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def make_prompt(model: str, n: int, seed: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = json.loads((Path(model) / "config.json").read_text())
    vocab = min(len(tok), cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or len(tok))
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(tok.all_special_ids, dtype=np.int64))
    return np.random.default_rng(seed).choice(allowed, size=n).tolist()


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    space = args.kv_space_gib
    if space is None:
        weights = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors"))
        space = 2 if weights > 200e6 else 1
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(space),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_ENABLE_V1_MULTIPROCESSING": str(args.multiprocessing),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class Runner:
    """Runs engine subprocesses in a work folder; each keeps its log there."""

    def __init__(self, args: argparse.Namespace, work: Path, prompt: list[int], warmup: list[int]):
        self.args, self.work, self.env = args, work, {**os.environ, **engine_env(args)}
        self.base = {"model": str(Path(args.model).resolve()), "prompt": prompt, "warmup": warmup,
                     "block_size": BLOCK_SIZE, "output_tokens": args.output_tokens, "settle_s": 1.0,
                     "dtype": getattr(args, "dtype", "float32")}

    def engine(self, name: str, kv: dict | None, prefix_caching: bool, steps: list[str],
               extra_env: dict | None = None, warmup: list[int] | None = None) -> dict:
        spec_path, log_path, result_path = (self.work / f"{name}.{ext}" for ext in ("json", "log", "result"))
        spec = {**self.base, "kv_transfer_config": kv, "prefix_caching": prefix_caching, "steps": steps}
        if warmup is not None:
            spec["warmup"] = warmup
        spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
        log.info("engine %s: %d steps", name, len(steps))
        with open(log_path, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.ttft_worker", str(spec_path)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**self.env, **(extra_env or {})}, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.args.timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                _kill_group(proc)  # also ends engine-core/worker children left behind
        if not result_path.exists():
            why = f"timed out after {self.args.timeout:.0f} s" if rc is None else f"exit code {rc}"
            log.error("engine %s failed (%s); log %s ends:\n%s", name, why, log_path, _tail(log_path))
            raise BenchError(f"engine {name}: {why}; last line: {_tail(log_path, 1)[-300:]}")
        return json.loads(result_path.read_text())


def stored_per_token(result: dict, folder: Path, prompts: tuple[list[int], ...]) -> dict:
    """``result`` with ``stored_bytes_per_token``: the bytes of the disk tier's block files (headers
    included) once the ``l1`` engine has stored its prompts (the warm-up and the measured one), over
    their tokens. What a model kind costs the tiers: every group's units, as stored."""
    files = [f for f in folder.rglob("*.kvb") if f.is_file()]
    result["stored_bytes_per_token"] = round(sum(f.stat().st_size for f in files) / sum(map(len, prompts)), 1)
    return result


def hit_steps(rounds: int) -> list[str]:
    return ["warmup", "store"] + ["reset", "time"] * rounds + ["reset", "output"]


def run_fresh(runner: Runner, name: str, kv: dict, rounds: int, stored: bool = False) -> dict:
    """Store once (unless ``stored``: an earlier engine on the same config did), then one fresh
    engine per measurement on the same store.

    Each measured engine warms up on a prompt of its own that nothing stored (a cold request), so
    its timed request is its first hit: what a user's first request after a restart pays. The
    last one then serves the output: after a reset of vLLM's own prefix cache, the prompt comes
    through kvstrata again, in that engine that loaded it from the tier measured."""
    if not stored:
        runner.engine(f"{name}-store", kv, True, ["store"])
    n, runs = len(runner.base["prompt"]), []
    for i in range(rounds):
        steps = ["warmup", "time"] + (["reset", "output"] if i == rounds - 1 else [])
        runs.append(runner.engine(f"{name}-{i}", kv, True, steps, warmup=make_prompt(runner.base["model"], n, 100 + i)))
    merged = {k: [r[k][0] for r in runs] for k in ("samples_ms", "cpu_ms", "cached_tokens")}
    return {**merged, "engine_start_s": runs[0]["engine_start_s"],
            "output": runs[-1]["output"], "output_cached_tokens": runs[-1]["output_cached_tokens"]}


def lmcache_dir(args: argparse.Namespace) -> Path:
    if args.lmcache_dir:
        return Path(args.lmcache_dir).resolve()
    if sys.prefix != sys.base_prefix:  # in a venv: a sibling folder, never its site-packages
        return Path(sys.prefix).resolve().parent / ".venv-lmcache"
    return Path.home() / ".cache" / "kvstrata" / "venv-lmcache"


def ensure_lmcache(target: Path, timeout: float = 600) -> None:
    """Install LMCache and its pure-Python extras into ``target`` once (``pip --target``, no deps)."""
    if (target / ".kvstrata-complete").exists():
        return
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("installing LMCache into %s", target)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(tmp), *LMCACHE_PACKAGES]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BenchError(f"pip install of LMCache timed out after {timeout:.0f} s") from None
    if p.returncode:
        err = " | ".join(ln for ln in p.stderr.splitlines() if "is ignored" not in ln)[-500:]
        raise BenchError(f"pip install of LMCache failed ({p.returncode}): {err}")
    (tmp / ".kvstrata-complete").write_text(" ".join(LMCACHE_PACKAGES) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def run_lmcache(runner: Runner, steps: list[str], start_timeout: float = 180) -> dict:
    target = lmcache_dir(runner.args)
    ensure_lmcache(target)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    port, log_path = free_port(), runner.work / "lmcache-server.log"
    cmd = [sys.executable, "-c", LMCACHE_MAIN, "server", "--host", "localhost", "--port", str(port),
           "--chunk-size", "256", "--l1-size-gb", "2", "--eviction-policy", "LRU",
           "--supported-transfer-mode", "auto"]
    with open(log_path, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**runner.env, **env}, start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"lmcache server not listening after {start_timeout:.0f} s (exit code "
                                 f"{server.poll()}): {_tail(log_path, 1)[-300:]}")
            time.sleep(0.5)
        try:
            return runner.engine("lmcache", lmcache_transfer_config(port), True, steps, env)
        except BenchError as e:
            if "_lib_fn_wrapper" in str(e):  # seen with vllm-cpu 0.32.0 and lmcache 0.5.6
                raise BenchError(f"{e} (in a one-process engine, vLLM's kernel-override scan trips on "
                                 "numba's llvmlite, imported by lmcache: use --multiprocessing 1)") from None
            raise
    finally:
        _kill_group(server)


def run(args: argparse.Namespace) -> dict:
    if args.engine != "vllm":
        raise BenchError(f"engine {args.engine!r} is not supported")
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := set(wanted) - set(CONFIGS):
        raise BenchError(f"unknown configs: {sorted(unknown)}")
    if args.rounds < 1 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        raise BenchError("--rounds and --prompt-tokens must be positive")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.prompt_tokens = args.prompt_tokens or 1500
    prompt, warmup = (make_prompt(args.model, args.prompt_tokens, seed) for seed in (0, 1))
    work = Path(tempfile.mkdtemp(prefix="kvstrata-ttft-"))
    runner, n = Runner(args, work, prompt, warmup), args.rounds

    def kv_config(name: str, redis_url: str | None = None, secret: bool = False) -> dict:
        text = f"l1:\n  size: 2GiB\nl2:\n  path: {work / name}-store\n"
        if redis_url:  # the shared tier only: every measured engine starts with empty L1 and L2
            text = f"l1:\n  size: 2GiB\nl2:\n  enabled: false\nremote:\n  enabled: true\n  url: {redis_url}\n"
        if secret:
            (key := work / f"{name}.key").write_text(os.urandom(32).hex())
            key.chmod(0o600)
            text += f"  auth_key_file: {key}\n"
        (path := work / f"{name}.yaml").write_text(text)
        return strata_transfer_config(path)

    def run_l3(name: str = "l3") -> dict:
        with redis_server(args.redis_url, work / "redis") as url:
            return run_fresh(runner, name, kv_config(name, url, secret=name == "l3mac"), n)

    repeat = ["time"] * n + ["output"]
    l1_fills_l2 = "l1" in wanted and "l2" in wanted[wanted.index("l1"):]
    l1_store = "l2" if l1_fills_l2 else "l1"
    plans = {
        "cold": lambda: runner.engine("cold", None, False, ["warmup"] + repeat),
        "native": lambda: runner.engine("native", None, True, ["warmup", "store"] + repeat),
        # l1 on l2's disk folder when both run: its "store" step fills it, one engine start fewer
        "l1": lambda: stored_per_token(runner.engine("l1", kv_config(l1_store), True, hit_steps(n)),
                                       work / f"{l1_store}-store", (prompt, warmup)),
        "l2": lambda: run_fresh(runner, "l2", kv_config("l2"), n, stored="l1" in results),
        "l3": run_l3,
        "l3mac": lambda: run_l3("l3mac"),
        "peer": lambda: runner.engine("peer", example_transfer_config(work / "peer"), True, hit_steps(n)),
        "lmcache": lambda: run_lmcache(runner, hit_steps(n)),
    }
    results, errors, load = {}, {}, [os.getloadavg()[0]]
    try:
        for name in wanted:
            try:
                results[name] = plans[name]()
            except (BenchError, OSError, ValueError, RuntimeError) as e:
                errors[name] = str(e)
                log.error("%s: %s", name, e)
    finally:
        finish(work, args.keep, load)
    return summarize(results, errors, len(prompt), n, engine_env(args), load)


def finish(work: Path, keep: bool, load: list[float]) -> None:
    """End of a run: note the load average beside the one at the start, drop (or keep) the work folder."""
    load.append(os.getloadavg()[0])
    if keep:
        log.warning("work folder kept: %s", work)
    else:
        shutil.rmtree(work, ignore_errors=True)


def summarize(results: dict, errors: dict, prompt_tokens: int, rounds: int, env: dict,
              load: list) -> dict:
    med = {n: round(statistics.median(r["samples_ms"]), 1) for n, r in results.items()}
    out: dict = {("cold_ms" if n == "cold" else f"{n}_hit_ms"): med.get(n) for n in CONFIGS}
    l1_cached = results.get("l1", {}).get("cached_tokens")
    out["hit_fraction"] = round(statistics.median(l1_cached) / prompt_tokens, 4) if l1_cached else None
    out["stored_bytes_per_token"] = results.get("l1", {}).get("stored_bytes_per_token")
    outputs = {n: r["output"] for n, r in results.items()}
    out["outputs_identical"] = len({tuple(o) for o in outputs.values()}) == 1 if len(outputs) > 1 else None
    out["lmcache_error"] = errors.get("lmcache")
    for a, b in RATIOS:
        out[f"{a}_over_{b}"] = round(med[a] / med[b], 3) if a in med and b in med else None
    for n, r in results.items():  # the tail a median hides: the first hit after a start, p90
        out[f"{n}_first_over_median"] = round(r["samples_ms"][0] / med[n], 3) if med[n] else None
        out[f"{n}_p90_over_p50"] = round(float(np.percentile(r["samples_ms"], 90)) / med[n], 3) if med[n] else None

    keys = ["samples_ms", "cached_tokens", "output_cached_tokens", "engine_start_s"]
    if env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        keys.append("cpu_ms")  # CPU time of the worker process, which then holds the whole engine
    native = outputs.get("native")
    out["details"] = {
        "prompt_tokens": prompt_tokens, "block_size": BLOCK_SIZE, "rounds": rounds, "env": env,
        "ours_connector": CONNECTOR,
        **{k: {n: r[k] for n, r in results.items()} for k in keys},
        "min_ms": {n: min(r["samples_ms"]) for n, r in results.items()},
        "first_ms": {n: r["samples_ms"][0] for n, r in results.items()},
        "p90_ms": {n: round(float(np.percentile(r["samples_ms"], 90)), 1) for n, r in results.items()},
        "outputs": outputs,
        "outputs_match_native": {n: o == native for n, o in outputs.items()} if native else None,
        "outputs_common_prefix": len(os.path.commonprefix(list(outputs.values()))) if outputs else None,
        "errors": errors, "loadavg_1min_start_end": load}
    return out


def print_table(summary: dict) -> None:
    d = summary["details"]
    print(f"TTFT, {d['prompt_tokens']}-token prompt, median of {d['rounds']}; l1/l2: {d['ours_connector']}")
    print(f"{'config':<9}{'median ms':>11}{'first/med':>10}{'p90/p50':>9}{'cached':>8}  samples ms")
    for n in CONFIGS:
        key = "cold_ms" if n == "cold" else f"{n}_hit_ms"
        if n in d["samples_ms"]:
            cached = statistics.median(d["cached_tokens"][n])
            print(f"{n:<9}{summary[key]:>11.1f}{summary[f'{n}_first_over_median']:>10}"
                  f"{summary[f'{n}_p90_over_p50']:>9}{cached:>8.0f}  {d['samples_ms'][n]}")
        else:
            print(f"{n:<9}{'-':>11}{'-':>8}  {d['errors'].get(n, 'not run')}")
    ratios = ", ".join(f"{a}/{b} {summary[f'{a}_over_{b}']}" for a, b in RATIOS)
    print(f"hit_fraction {summary['hit_fraction']}, outputs_identical {summary['outputs_identical']}, "
          f"stored_bytes_per_token {summary['stored_bytes_per_token']}")
    print(f"ratios: {ratios}")
