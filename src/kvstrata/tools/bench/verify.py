"""``kvstrata bench verify``: the tolerance of verified hits, calibrated on a real engine.

A verified hit recomputes a stored block and compares it with the block the engine computes for the
same key, segment by segment (one layer's part of the block), by relative L2 error
(``kvstrata.verify.compare``). The tolerance per KV dtype must pass every honest recomputation and
fail everything else. This command measures both sides, per KV dtype asked, on one model:

- engine A (vLLM, kvstrata on a fresh store, L1 only) computes the prompts one at a time, each
  prefill in one step, and reads each prompt's stored blocks back; then (unless ``--other-model``)
  it loads its weights again, each times ``1 + s * N(0, 1)`` (``--noise``, and each ``--sweep``
  scale), resets its caches and computes and reads back the same prompts again;
- engine B (same model and dtype, a fresh store) computes the same prompts in batches, each after
  a filler prompt, the prefill in chunks of ``--budget`` tokens shared by the batch: another batch
  and another chunking, the honest recomputation;
- engine C (``--other-model`` only): another model folder of the same shapes, the prompts alone.

Classes, block by block at the same position: honest (A against B), other prompt (prompt i
against prompt i+1 of A), other weights (A against A's perturbed weights, or C), other layer
(within A's block, layer l against layer l+1); ``--sweep`` scales give sensitivity rows that the
margin leaves out. Per class: the worst segment's error of each block, and every segment's. The
margin is min(dishonest) / max(honest) over blocks' worst segments; the suggested tolerance their
geometric mean (the dtype's unit roundoff for the honest side where it measured 0), to one
significant digit. ``--json`` adds each class's smallest and largest error per layer.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvstrata.tools.serving import CPU_ENV, START_LISTENERS, cuda_available
from kvstrata.verify.compare import TOLERANCES, relative_errors, segments_of

log = logging.getLogger(__name__)
# --dtype word -> (the engine's dtype, its kv_cache_dtype)
DTYPES = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"), "float16": ("float16", "auto"),
          "fp8": ("bfloat16", "fp8_e4m3"), "fp8_e5m2": ("bfloat16", "fp8_e5m2")}
HONEST, DISHONEST, SENSITIVITY = "honest", "dishonest", "sensitivity"
WORKER = "kvstrata.tools.bench.verify_worker"
TAIL = 7  # tokens after each prompt's last full block (saved as a partial block, not compared)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local model folder (examples/make_tiny_model.py builds one)")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help=f"KV dtypes to calibrate, comma-separated, of {', '.join(DTYPES)} (fp8: a bfloat16 model "
                             "with vLLM's kv_cache_dtype fp8_e4m3) (default %(default)s)")
    parser.add_argument("--other-model", default=None, metavar="DIR",
                        help="a model folder of the same shapes with other weights (default: the model's own "
                             "weights perturbed in memory, see --noise)")
    parser.add_argument("--noise", type=float, default=0.01, metavar="S",
                        help="other weights: every weight times 1 + S * N(0, 1) (default %(default)s)")
    parser.add_argument("--sweep", default="", metavar="S,S",
                        help="more noise scales, reported as sensitivity rows outside the margin (e.g. 1e-3,1e-4)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts (default 8; 4 with --quick)")
    parser.add_argument("--blocks", type=int, default=10,
                        help="full blocks compared per prompt (default 10; 6 with --quick)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM block size (default 32)")
    parser.add_argument("--budget", type=int, default=None,
                        help="engine B's tokens per step, shared by its batch (default 2 blocks)")
    parser.add_argument("--batch", type=int, default=4, help="engine B's prompts per batch (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer prompts and blocks (about 30 s per dtype on "
                                                             "the tiny model)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (engine logs, stored blocks)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 3000) for _ in range(n)]


def run_worker(spec: dict, work: Path, name: str) -> dict:
    """One engine (verify_worker.py) in a session of its own, stopped if this process is
    interrupted; its result file read back, with the process's wall time."""
    spec = {**spec, "out": str(work / f"{name}.pt")}
    (work / f"{name}.json").write_text(json.dumps(spec))
    env = {**os.environ, **({} if cuda_available() else CPU_ENV), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    for listener in START_LISTENERS:
        listener("vllm offline engine")
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", WORKER, str(work / f"{name}.json")], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    if rc != 0:
        tail = (work / f"{name}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine {name} exited with {rc}; log {work / f'{name}.log'}:\n{tail}")
    result = torch.load(spec["out"])
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def pairs(x: torch.Tensor, y: torch.Tensor, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """The relative L2 error of each layer segment of blocks ``x`` against ``y`` (uint8
    ``[..., block_bytes]``, blocks ``[layer 0 | layer 1 | ...]``): float64 ``[blocks, layers]``."""
    a, b = x.reshape(-1).contiguous(), y.reshape(-1).contiguous()
    n = a.numel() // (x.shape[-1] // layers)  # segments, all blocks together: one batched pass
    return relative_errors(a, b, segments_of(a.numel(), n, dtype)).view(-1, layers)


def summary(x: torch.Tensor) -> dict:
    q = torch.quantile(x, torch.tensor([0.5, 0.99], dtype=x.dtype)).tolist() if x.numel() else [math.nan] * 2
    return {"count": x.numel(), "min": float(x.min()), "median": q[0], "p99": q[1], "max": float(x.max())}


def _sig(x: torch.Tensor) -> list[float]:
    return [float(f"{v:.3g}") for v in x.tolist()]


def one_digit(x: float) -> float:
    """``x`` rounded to one significant digit."""
    return float(f"{x:.0e}") if math.isfinite(x) and x > 0 else x


def classes(a: dict, b: dict, c: dict | None, args: argparse.Namespace) -> dict[str, tuple[str, torch.Tensor]]:
    """Class name -> (kind, per-block per-segment errors)."""
    dtype, layers = getattr(torch, a["kv_dtype"]), a["layers"]
    base = a["blocks"]["base"]
    out = {"honest": (HONEST, pairs(base, b["blocks"]["base"], layers, dtype)),
           "other prompt": (DISHONEST, pairs(base, torch.roll(base, 1, 0), layers, dtype))}
    other = c["blocks"]["base"] if c is not None else a["blocks"][f"noise:{args.noise:g}"]
    out["other weights"] = (DISHONEST, pairs(base, other, layers, dtype))
    if layers > 1:
        seg = base.shape[-1] // layers
        out["other layer"] = (DISHONEST, pairs(base[..., :-seg], base[..., seg:], layers - 1, dtype))
    for s in _sweep(args):
        out[f"weights s={s:g}"] = (SENSITIVITY, pairs(base, a["blocks"][f"noise:{s:g}"], layers, dtype))
    return out


def _sweep(args: argparse.Namespace) -> list[float]:
    return [float(s) for s in args.sweep.split(",") if s.strip()]


def figures(found: dict[str, tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict:
    rows = {name: {"kind": kind, "blocks": summary(e.max(dim=1).values), "segments": summary(e.reshape(-1)),
                   "per_layer": {"min": _sig(e.min(dim=0).values), "max": _sig(e.max(dim=0).values)}}
            for name, (kind, e) in found.items()}
    honest = [r for r in rows.values() if r["kind"] == HONEST]
    dishonest = [r for r in rows.values() if r["kind"] == DISHONEST]
    h = max(r["blocks"]["max"] for r in honest)
    d = min(r["blocks"]["min"] for r in dishonest)
    d_seg = min(r["segments"]["min"] for r in dishonest)
    tol = TOLERANCES[dtype]
    return {"classes": rows, "max_honest": h, "min_dishonest": d, "min_dishonest_segment": d_seg,
            "margin": d / h if h > 0 else None, "segment_margin": d_seg / h if h > 0 else None,  # None: no honest error
            "suggested_tolerance": suggest(h, d, dtype),
            "tolerance": tol, "separates": h <= tol < d, "separates_segments": h <= tol < d_seg}


def suggest(h: float, d: float, dtype: torch.dtype) -> float | None:
    """The geometric mean of the honest side and the smallest dishonest error, to one significant
    digit; None where they overlap. The honest side is the largest honest error, or the dtype's unit
    roundoff where every honest recomputation was bit-identical (another machine may round one
    step apart where this one never did)."""
    lo = h if h > 0 else torch.finfo(dtype).eps / 2
    return one_digit(math.sqrt(lo * d)) if d > lo else None


def calibrate(dtype: str, args: argparse.Namespace, work: Path) -> dict:
    rng = random.Random(args.seed)
    n_tok = args.blocks * args.block_size + TAIL
    prompts = [_ids(rng, n_tok) for _ in range(args.prompts)]
    fillers = [_ids(rng, rng.randrange(args.block_size + 5, 4 * args.block_size + 13)) for _ in range(args.prompts)]
    cfg = work / "kvstrata.yaml"
    cfg.write_text("l1:\n  size: 1GiB\nl2:\n  enabled: false\n")
    spec = {"model": args.model, "dtype": DTYPES[dtype][0], "kv_cache_dtype": DTYPES[dtype][1],
            "block_size": args.block_size, "config": str(cfg), "prompts": prompts, "blocks": args.blocks,
            "seed": args.seed, "mode": "alone"}
    noise = ([] if args.other_model else [args.noise]) + _sweep(args)
    a = run_worker({**spec, "noise": noise}, work, f"{dtype}-A")
    b = run_worker({**spec, "mode": "batched", "fillers": fillers, "batch": args.batch,
                    "budget": args.budget or 2 * args.block_size}, work, f"{dtype}-B")
    c = run_worker({**spec, "model": args.other_model}, work, f"{dtype}-C") if args.other_model else None
    for other in (b, c):
        if other is not None and (other["block_bytes"], other["layers"]) != (a["block_bytes"], a["layers"]):
            raise SystemExit(f"kvstrata bench verify: blocks of {other['block_bytes']} bytes in "
                             f"{other['layers']} layers beside {a['block_bytes']} in {a['layers']}: not one shape")
    out = figures(classes(a, b, c, args), getattr(torch, a["kv_dtype"]))
    out.update(kv_dtype=a["kv_dtype"], layers=a["layers"], block_bytes=a["block_bytes"],
               engines={k: {**r["timings_s"], "wall": r["wall_s"]} for k, r in zip("ABC", (a, b, c)) if r},
               budget_b=b["budget"])
    return out


def render(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"verified hits: relative L2 error per layer segment, {result['model']}, {result['prompts']} "
                  f"prompts x {result['blocks_per_prompt']} blocks of {result['block_size']} tokens. Per block its "
                  "worst segment; 'segment min': the smallest of any segment. Other weights: "
                  f"{result['other_weights']}.")
    for dtype, fig in result["dtypes"].items():
        table = Table(title=f"{dtype} ({fig['layers']} layers, {fig['block_bytes']:,} bytes a block)")
        for col in ("class", "blocks", "min", "median", "p99", "max", "segment min"):
            table.add_column(col, justify="left" if col == "class" else "right")
        for name, row in fig["classes"].items():
            blk = row["blocks"]
            label = name if row["kind"] != SENSITIVITY else f"({name.removeprefix('weights ')})"
            table.add_row(label, str(blk["count"]), *(f"{blk[k]:.1e}" for k in ("min", "median", "p99", "max")),
                          f"{row['segments']['min']:.1e}")
        console.print(table)
        engines = ", ".join(f"{k} {v['wall']:.0f} s (start {v['engine_start']:.0f} s)"
                            for k, v in fig["engines"].items())
        suggested = "none separates them" if fig["suggested_tolerance"] is None else f"{fig['suggested_tolerance']:g}"
        console.print(f"{dtype}: max honest {fig['max_honest']:.2e}, min dishonest {fig['min_dishonest']:.2e} "
                      f"(a segment: {fig['min_dishonest_segment']:.2e}), margin {_ratio(fig['margin'])} "
                      f"(segments {_ratio(fig['segment_margin'])}); suggested tolerance {suggested}; in use "
                      f"{fig['tolerance']:g}: {'separates them' if fig['separates'] else 'DOES NOT separate them'}"
                      f"{'' if fig['separates_segments'] else ' (not every dishonest segment)'}. Engines: {engines}")
    if result["work"]:
        console.print(f"logs: {result['work']}")


def _ratio(x: float | None) -> str:
    return "infinite" if x is None else f"{x:.3g}"


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.prompts, args.blocks = min(args.prompts, 4), min(args.blocks, 6)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes or args.prompts < 2 or args.blocks < 1:
        print(f"kvstrata bench verify: --dtype takes {', '.join(DTYPES)} (given: {args.dtype!r}); --prompts at "
              "least 2, --blocks at least 1", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvstrata-verify-"))
    other = (f"the model folder {args.other_model}" if args.other_model else
             f"the model's weights, each times 1 + {args.noise:g} * N(0, 1), loaded in memory")
    result = {"model": args.model, "block_size": args.block_size, "prompts": args.prompts,
              "blocks_per_prompt": args.blocks, "other_weights": other, "sweep": _sweep(args),
              "work": str(work) if args.keep else None, "dtypes": {}}
    try:
        for dtype in dtypes:
            t0 = time.perf_counter()
            result["dtypes"][dtype] = calibrate(dtype, args, work)
            log.info("bench verify: %s calibrated in %.1f s", dtype, time.perf_counter() - t0)
    except KeyboardInterrupt:
        print(f"kvstrata bench verify: interrupted; logs in {work}", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"kvstrata bench verify: {e}", file=sys.stderr)
        return 1
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        render(result)
    return 0
