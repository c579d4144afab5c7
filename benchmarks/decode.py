"""``python -m benchmarks decode``: saves never stall a step, measured as decode throughput.

Two configurations of the same vLLM server, side by side in one run:

- ``off``: no connector (vLLM's own prefix caching only);
- ``strata``: kvstrata with a deliberately slow disk tier: every disk write sleeps
  ``--write-delay-ms``, so the disk cannot keep up with the saves. The delay is a test-only trial
  (tests/harness/trials.py), planted into every process of the server through its environment
  (``trials.environment``): no setting of kvstrata's can slow its disk.

Each round sends the same fresh prompts (no prefix shared with any earlier request, so nothing is
loaded and every block of every request is saved by ``strata``) at a fixed concurrency, greedy, with
``--output-tokens`` each. Rounds alternate the order of the two configurations (A B, B A, ...) so
that drift on a shared machine lands on both. Every round starts fresh servers and a fresh store.

Per request, the decode rate is ``(tokens - 1) / (end - first token)``: prefill excluded. The figure
is the median over all requests of a configuration; ``decode_ratio`` = strata / off (target: at
least 0.9). ``throughput_ratio`` compares output tokens/s over each round's wall time (prefill
included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvstrata.tools.client import acomplete, session
from kvstrata.tools.serving import Completion, Server, complete, free_port, strata_transfer_config, vllm_command
from tests.harness.trials import environment

log = logging.getLogger(__name__)
CONFIGS = ("off", "strata")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local model folder")
    parser.add_argument("--requests", type=int, default=8, help="requests per round and configuration")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--write-delay-ms", type=float, default=500,
                        help="sleep in every disk-tier write of the strata config (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each alternates the config order")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 2000) for _ in range(length)] for _ in range(n)]


def run_batch(server: Server, model: str, batch: list[list[int]], concurrency: int,
              max_tokens: int) -> tuple[list[Completion], float]:
    """The batch at ``concurrency`` requests in flight (one event loop); the completions in batch
    order and the wall time."""
    async def go() -> list[Completion]:
        gate = asyncio.Semaphore(concurrency)

        async def one(http: object, prompt: list[int]) -> Completion:
            async with gate:
                return await acomplete(http, server.url, model, prompt, max_tokens)  # type: ignore[arg-type]

        async with session(600) as http:
            return list(await asyncio.gather(*(one(http, p) for p in batch)))

    t0 = time.perf_counter()
    done = asyncio.run(go())
    return done, time.perf_counter() - t0


def decode_rate(c: Completion) -> float | None:
    span = (c.total_ms - c.ttft_ms) / 1e3
    return (len(c.tokens) - 1) / span if len(c.tokens) > 1 and span > 0 else None


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvstrata-decode-"))
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    tok_s: dict[str, list[float]] = {c: [] for c in CONFIGS}
    outputs: dict[str, list[list[int]]] = {c: [] for c in CONFIGS}
    ttfts: dict[str, list[float]] = {c: [] for c in CONFIGS}
    saved: list[int] = []
    for r in range(args.rounds):
        batch = prompts(args.requests, args.prompt_tokens, seed=1000 + r)
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for name in order:
            kv = None
            if name == "strata":
                cfg = work / f"strata-{r}.yaml"
                cfg.write_text(f"l1:\n  size: 1GiB\nl2:\n  path: {work / f'l2-{r}'}\n")
                kv = strata_transfer_config(str(cfg))
            port = free_port()
            cmd = vllm_command(args.model, port, kv, block_size=args.block_size)
            env = environment({"l2_write_delay_ms": args.write_delay_ms}) if name == "strata" else None
            with Server(cmd, work / f"{name}-{r}.log", port, env=env) as server:
                complete(server, args.model, prompts(1, args.prompt_tokens, seed=99)[0], max_tokens=4)  # warm-up
                done, wall = run_batch(server, args.model, batch, args.concurrency, args.output_tokens)
                if name == "strata":  # blocks on disk when the batch ended: the disk lagged behind
                    saved.append(sum(1 for f in (work / f"l2-{r}").rglob("*") if f.is_file()))
            rates[name] += [x for x in map(decode_rate, done) if x is not None]
            tok_s[name].append(sum(len(c.tokens) for c in done) / wall)
            outputs[name] += [c.tokens for c in done]
            ttfts[name] += [c.ttft_ms for c in done]
            log.info("round %d %s: %.1f output tok/s", r, name, tok_s[name][-1])
    med = {c: statistics.median(rates[c]) for c in CONFIGS}
    thr = {c: statistics.median(tok_s[c]) for c in CONFIGS}
    summary = {
        "decode_tok_s_per_request": {c: round(med[c], 2) for c in CONFIGS},
        "output_tok_s": {c: round(thr[c], 2) for c in CONFIGS},
        "decode_ratio": round(med["strata"] / med["off"], 3),
        "throughput_ratio": round(thr["strata"] / thr["off"], 3),
        "outputs_identical": outputs["strata"] == outputs["off"],
        "details": {"requests": args.requests, "concurrency": args.concurrency, "rounds": args.rounds,
                    "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                    "write_delay_ms": args.write_delay_ms, "block_size": args.block_size,
                    "strata_disk_files_at_batch_end": saved, "output_tok_s_per_round": tok_s,
                    "ttft_ms_median": {c: round(statistics.median(ttfts[c]), 1) for c in CONFIGS},
                    "logs": str(work)},
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"decode throughput, {args.requests} requests x {args.rounds} rounds at concurrency "
              f"{args.concurrency}, {args.prompt_tokens}+{args.output_tokens} tokens, disk writes "
              f"+{args.write_delay_ms:.0f} ms each")
        print(f"{'config':<8}{'decode tok/s/request':>22}{'output tok/s':>14}")
        for c in CONFIGS:
            print(f"{c:<8}{med[c]:>22.2f}{thr[c]:>14.2f}")
        print(f"decode_ratio {summary['decode_ratio']} (target >= 0.9), throughput_ratio "
              f"{summary['throughput_ratio']}, outputs_identical {summary['outputs_identical']}")
    return 0

