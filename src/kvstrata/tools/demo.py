"""``kvstrata demo``: the main job. vLLM with kvstrata, a long prompt, an engine restart, the prompt again.

1. Start the OpenAI-compatible vLLM server with ``StrataConnector`` (one launch flag) and send a
   long prompt: nothing is cached, every token is computed (cold).
2. Stop the server and start a new one: the device cache and the CPU tier (L1) are empty; only the
   disk tier (L2) remembers. Send the same prompt: kvstrata loads it from disk.
3. Reset vLLM's own prefix cache (not kvstrata's) and send it once more: now it comes from L1.

Each phase sends the prompt ``ROUNDS`` times, each under a ``cache_salt`` of its own (its own
keys, the same output), and shows the median TTFT: phase 1 is then cold three times, and after
the restart each copy is a first load from disk. Fresh salts per run make phase 1 cold even when
an earlier demo filled the disk tier. Each engine first serves an unrelated prompt of the same
length (warm-up), so that a phase times the tier it names, not a new engine's first request (its
compiled kernels, allocator and thread pool), and each request waits a second first, so that the
saves of the one before it (written on background threads) are not timed with it. Prints TTFT
per phase, where the prompt tokens came from per request (vLLM's own
``vllm:prompt_tokens_cached_by_source`` metric) and whether the greedy outputs are identical
(``--dtype float32`` for a random-weight model: in bf16 the rounding of a 1-token prefill after a
hit and of the whole prompt's differs enough, on CPUs with AMX, to flip a near-tie greedy token).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kvstrata.config import load_config

from kvstrata.tools.serving import (Completion, Server, cached_by_source, complete, free_port, strata_transfer_config,
                      vllm_command)


SETTLE_S = 1.0  # pause before each request, as bench ttft's settle_s: saves run on background threads
ROUNDS = 3  # copies of the prompt per phase (salts of their own); the table shows the median TTFT
# The demo times each tier: no request of it is a verified hit (one in a thousand by default would
# recompute its prefix instead, and show as a miss). docs/consistency.md "Verified hits".
NO_SAMPLING = {"verify.sample_rate": 0}


def _prompt(n: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 2000) for _ in range(n)]


def run(model: str, config_file: str | None, prompt_tokens: int, dtype: str = "auto") -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = load_config(config_file)  # fail here, with kvstrata's message, before starting anything
    where = f"L1 {cfg.l1.size >> 20} MiB, L2 {cfg.l2.path}" if cfg.l2.enabled else f"L1 {cfg.l1.size >> 20} MiB"
    console.print(f"kvstrata demo: vLLM + StrataConnector on {model} ({where}), {prompt_tokens}-token prompt")
    prompt = _prompt(prompt_tokens)
    warmup = _prompt(prompt_tokens, seed=8)
    salts = [uuid.uuid4().hex for _ in range(ROUNDS)]
    logs = Path(tempfile.mkdtemp(prefix="kvstrata-demo-"))
    def start(n: int) -> Server:
        port = free_port()
        server = Server(vllm_command(model, port, strata_transfer_config(config_file, NO_SAMPLING), extra=["--dtype", dtype]),
                        logs / f"vllm-{n}.log", port,
                        env={"VLLM_SERVER_DEV_MODE": "1"})  # enables POST /reset_prefix_cache
        console.print(f"  starting vLLM (log: {server.log_path}) ...")
        return server

    def warm(server: Server) -> None:
        """An unrelated prompt first, under its own salt: nothing of it is reused by the phase."""
        done = complete(server, model, warmup, max_tokens=1, cache_salt=uuid.uuid4().hex)
        console.print(f"  warmed the engine with an unrelated {prompt_tokens}-token prompt ({done.ttft_ms:.0f} ms)")

    def ask(server: Server) -> tuple[list[Completion], dict[str, int]]:
        """The prompt under each salt; the prompt tokens per source, per request."""
        before, done = cached_by_source(server.metrics()), []
        for salt in salts:
            time.sleep(SETTLE_S)  # the previous request's saves land first: a phase times its tier alone
            done.append(complete(server, model, prompt, max_tokens=16, cache_salt=salt))
        after = cached_by_source(server.metrics())
        return done, {k: round((after[k] - before.get(k, 0)) / ROUNDS) for k in after}

    with start(1) as server:
        warm(server)
        rows = [("cold (first engine)", *ask(server))]
    with start(2) as server:
        warm(server)
        rows.append(("after restart: disk", *ask(server)))
        server.post("/reset_prefix_cache")  # vLLM's own cache only: kvstrata keeps its blocks
        rows.append(("device cache reset: CPU", *ask(server)))

    table = Table(title=f"same prompt, {ROUNDS} copies per phase: median TTFT, where its tokens came from")
    for col in ("phase", "TTFT ms", "device", "CPU (L1)", "disk (L2)", "computed"):
        table.add_column(col, justify="right")
    medians = []
    for phase, done, src in rows:
        medians.append(statistics.median(d.ttft_ms for d in done))
        cached = round(statistics.mean(d.cached_tokens or 0 for d in done))
        table.add_row(phase, f"{medians[-1]:.0f}", str(src.get("device", 0)), str(src.get("host", 0)),
                      str(src.get("disk", 0)), str(prompt_tokens - cached))
    console.print(table)
    cold, disk, cpu = medians
    same = all(len({tuple(r[1][i].tokens) for r in rows}) == 1 for i in range(ROUNDS))
    console.print(f"TTFT cold / reloaded from disk: {cold / disk:.1f}x; cold / from CPU: {cold / cpu:.1f}x; "
                  f"disk / CPU: {disk / cpu:.2f} (warm engines, medians of {ROUNDS}; `python -m benchmarks ttft` measures "
                  f"each tier in engines of its own); greedy outputs identical: {same}")
    return 0 if same and all((d.cached_tokens or 0) > 0 for d in rows[1][1]) else 1
