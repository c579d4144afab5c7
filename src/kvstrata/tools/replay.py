"""``kvstrata replay``: real chat traffic through the store alone, checked block by block.

Two engine-like instances replay the same conversations (sampled from the Mooncake trace shipped
in ``kvstrata/data``) one after the other, each in its own process with its own L1, sharing the
disk tier. A deterministic stand-in for prefill produces each block's KV bytes from its content
key, so every block the store serves is compared with a freshly computed one. The run fails if a
single served block differs.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from importlib import resources
from typing import NamedTuple

import numpy as np
import torch

from kvstrata.config import StrataConfig
from kvstrata.keys import BlockChain, Namespace
from kvstrata.store import BlockStore

from kvstrata.tools.trace import load_trace, prompt_tokens, sample_sessions

BLOCK_TOKENS = 64
LAYOUT = (4, 2, 2, BLOCK_TOKENS, 64)  # layers, K/V, kv heads, tokens, head dim (bf16)
BLOCK_BYTES = 2 * int(torch.tensor(LAYOUT).prod())
NS = Namespace("demo", "toy-prefill", "v1", "bfloat16", "4x[2,2,64,64]", BLOCK_TOKENS)


class Report(NamedTuple):
    requests: int
    prompt_tokens: int
    l1_tokens: int
    l2_tokens: int
    recomputed_tokens: int
    mismatches: int
    load_s: float
    prefill_s: float


def prefill(keys: list[bytes]) -> torch.Tensor:
    """Stand-in for the engine's prefill: KV bytes that depend only on the block's content key."""
    out = np.empty((len(keys), BLOCK_BYTES), dtype=np.uint8)
    for i, key in enumerate(keys):
        out[i] = np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
            0, 256, BLOCK_BYTES, dtype=np.uint8)
    return torch.from_numpy(out)


def replay(cfg: StrataConfig, conversations: int) -> Report:
    trace = load_trace(resources.files("kvstrata.tools") / "data" / "conversation_sample.jsonl")
    requests = sample_sessions(trace, conversations)
    totals = dict(prompt=0, l1=0, l2=0, recomputed=0, mismatches=0)
    load_s = prefill_s = 0.0
    with BlockStore(cfg) as store:
        for req in requests:
            tokens = prompt_tokens(req, BLOCK_TOKENS)
            t = time.perf_counter()
            hit = store.lookup(NS, tokens, pin=True)
            loaded = torch.empty((hit.num_blocks, BLOCK_BYTES), dtype=torch.uint8)
            n_ok = store.load_into(hit, loaded)
            store.complete_load(hit)
            load_s += time.perf_counter() - t
            if n_ok and not np.array_equal(loaded[:n_ok].numpy(), prefill(hit.chain.keys[:n_ok]).numpy()):
                totals["mismatches"] += 1
            served = hit.chain.lengths[:n_ok]
            for tiers, ntok in zip(hit.tiers, served):
                totals["l1" if tiers & store.l1.bit else "l2"] += ntok
            epoch, chain = store.chain(NS, tokens)
            keep = sum(1 for a, b in zip(chain.keys, hit.chain.keys[:n_ok]) if a == b)
            todo = BlockChain(*(part[keep:] for part in chain))
            t = time.perf_counter()
            kv = prefill(todo.keys)
            prefill_s += time.perf_counter() - t
            store.save(NS, epoch, todo, kv)
            totals["prompt"] += len(tokens)
            totals["recomputed"] += len(tokens) - sum(served)
        store.flush()
    return Report(len(requests), totals["prompt"], totals["l1"], totals["l2"], totals["recomputed"],
                  totals["mismatches"], load_s, prefill_s)


def _child(cfg: StrataConfig, conversations: int, queue: mp.Queue) -> None:  # type: ignore[type-arg]
    queue.put(replay(cfg, conversations))


def _in_new_process(cfg: StrataConfig, conversations: int) -> Report:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(cfg, conversations, queue))
    proc.start()
    report = queue.get()
    proc.join()
    return report


def run(cfg: StrataConfig, conversations: int = 40) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    where = f"L1 {cfg.l1.size >> 20} MiB" + (f", L2 {cfg.l2.path}" if cfg.l2.enabled else "")
    console.print(f"kvstrata replay: {conversations} conversations from the Mooncake trace ({where})")
    with BlockStore(cfg) as store:  # start from a clean namespace: earlier demo runs are hidden
        store.invalidate(NS.seed)
    rows = [("A", _in_new_process(cfg, conversations)), ("B", _in_new_process(cfg, conversations))]
    table = Table(title="prompt tokens by source")
    for col in ("", "requests", "prompt", "L1", "L2", "computed", "hit", "wrong", "load s", "prefill s"):
        table.add_column(col, justify="right")
    for name, r in rows:
        hit = 1 - r.recomputed_tokens / max(1, r.prompt_tokens)
        table.add_row(name, str(r.requests), str(r.prompt_tokens), str(r.l1_tokens), str(r.l2_tokens),
                      str(r.recomputed_tokens), f"{hit:.0%}", str(r.mismatches), f"{r.load_s:.2f}",
                      f"{r.prefill_s:.2f}")
    console.print(table)
    console.print("A and B are separate processes with their own L1 that share the disk tier; B runs "
                  "after A. 'computed' tokens ran the prefill stand-in; 'wrong' counts requests whose "
                  "served KV differed from a recomputation.")
    bad = sum(r.mismatches for _, r in rows)
    console.print("every served block matched a recomputed one" if not bad
                  else f"[red]{bad} requests were served wrong KV[/red]")
    return 1 if bad else 0
