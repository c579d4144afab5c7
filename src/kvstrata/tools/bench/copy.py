"""``kvstrata bench copy``: ``BlockLayout``'s block copies between an engine's KV cache and L1 arena
slots, beside the least such a copy can cost, on one device (``cuda`` when there is one).

Per layout (the engines' KV tensor shapes, ``--layers`` layers of ``--blocks`` engine blocks each), a
hit of ``--hit`` blocks scattered over the engine's cache moves to and from consecutive arena slots:

- ``save`` (engine to arena) and ``load`` (arena to engine, until the last layer's copy is done) are
  kvstrata's paths (``kvstrata.worker.copy``); ``load_return`` is how long ``load`` holds the caller
  (on CUDA the uploads are queued on a side stream, and a forward pass waits per layer);
- ``bound``: one contiguous copy of the same bytes between the same memories (one DMA between a
  page-locked host buffer and the GPU; one ``memcpy`` on CPU), the floor for any connector;
- ``per_block``: one ``copy_`` per block and layer, what a connector without batching does.

Rounds are interleaved (ours, bound, per block, ...) and the medians reported, with the ratios to
read (``*_over_bound``: our time over the floor; ``per_block_over_*``: the naive loop over ours).
The arena is page-locked on CUDA, as L1 is there (``l1.pin_memory``) and as the vLLM worker
registers its shared arena. Each layout's copies are checked for byte equality once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from kvstrata.worker.copy import BlockLayout, block_dim

# Engine KV tensor shape per layer, from the block count ``n``, for a Llama-3-8B-like attention
# (8 KV heads of 128, blocks of 16 tokens) and DeepSeek-like MLA (a 576-wide latent).
LAYOUTS: dict[str, Callable[[int], tuple[int, ...]]] = {
    "flash_attn": lambda n: (2, n, 16, 8, 128),  # vLLM CUDA FlashAttention: [2, blocks, size, heads, head]
    "flashinfer": lambda n: (n, 2, 16, 8, 128),  # FlashInfer / vLLM's default CUDA layout
    "vllm_cpu": lambda n: (n, 8, 16, 256),  # vLLM CPU: [blocks, heads, size, 2 * head]
    "mla": lambda n: (n, 16, 576),  # MLA latent: [blocks, size, latent]
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available; default)")
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS),
                        help="engine KV layouts to measure (repeatable; default: all)")
    parser.add_argument("--layers", type=int, default=32, help="KV layers (default 32)")
    parser.add_argument("--blocks", type=int, default=1024, help="engine KV blocks per layer (default 1024)")
    parser.add_argument("--hit", type=int, default=64, help="blocks per save and load (default 64: 1,024 tokens)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per path (default 20)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def measure(layout_name: str, device: torch.device, layers: int, blocks: int, hit: int, rounds: int,
            dtype: torch.dtype) -> dict[str, float | int | str]:
    shape = LAYOUTS[layout_name](blocks)
    gen = torch.Generator().manual_seed(0)
    caches = {f"model.layers.{i}.self_attn.attn": torch.empty(shape, dtype=dtype, device=device).normal_()
              for i in range(layers)}
    engine = BlockLayout(caches, blocks)
    pinned = device.type == "cuda"
    arena = torch.zeros((2 * hit, engine.nbytes), dtype=torch.uint8, pin_memory=pinned)
    block_ids = torch.randperm(blocks, generator=gen)[:hit].tolist()  # a hit's blocks, scattered
    back_ids = torch.randperm(blocks, generator=gen)[:hit].tolist()
    slots = list(range(hit, 2 * hit))
    total = hit * engine.nbytes
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)  # the bound's two ends
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    dims = {name: block_dim(tuple(kv.shape), blocks) for name, kv in caches.items()}

    def per_block_save() -> None:
        for s, b in zip(slots, block_ids):
            for layer in engine.layers:
                arena[s, layer.offset:layer.offset + layer.nbytes].copy_(
                    layer.blocks[b].reshape(-1).view(torch.uint8), non_blocking=pinned)

    def per_block_load() -> None:
        for s, b in zip(slots, back_ids):
            for layer in engine.layers:
                raw = arena[s, layer.offset:layer.offset + layer.nbytes]
                layer.blocks[b].copy_(raw.view(layer.blocks.dtype).view(layer.blocks.shape[1:]), non_blocking=pinned)

    def load() -> None:
        engine.load(slots, arena, back_ids)
        engine.wait_all()

    paths: dict[str, Callable[[], object]] = {
        "save": lambda: engine.save(block_ids, arena, slots),
        "save_bound": lambda: host.copy_(dev, non_blocking=pinned),
        "save_per_block": per_block_save,
        "load": load,
        "load_bound": lambda: dev.copy_(host, non_blocking=pinned),
        "load_per_block": per_block_load,
    }
    for fn in paths.values():  # warm-up: allocator, staging buffer, kernels
        fn()
    engine.save(block_ids, arena, slots)  # check: the saved slots hold the blocks, the loaded blocks the slots
    for name, kv in caches.items():
        moved = kv.movedim(dims[name], 0)
        want = moved[torch.tensor(block_ids, device=device)].reshape(hit, -1).view(torch.uint8).cpu()
        layer = next(x for x in engine.layers if x.name == name)
        if not torch.equal(arena[hit:, layer.offset:layer.offset + layer.nbytes], want):
            raise AssertionError(f"bench copy: {layout_name} save moved the wrong bytes for {name}")
    load()
    for layer in engine.layers:
        got = layer.blocks[torch.tensor(back_ids, device=device)].reshape(hit, -1).view(torch.uint8).cpu()
        if not torch.equal(arena[hit:, layer.offset:layer.offset + layer.nbytes], got):
            raise AssertionError(f"bench copy: {layout_name} load moved the wrong bytes for {layer.name}")

    times: dict[str, list[float]] = {name: [] for name in paths}
    returns: list[float] = []
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(_timed(fn, device))
        _sync(device)
        t = time.perf_counter()
        engine.load(slots, arena, back_ids)
        returns.append(time.perf_counter() - t)
        engine.wait_all()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    out: dict[str, float | int | str] = {"layout": layout_name, "device": str(device), "layers": layers,
                                         "hit_blocks": hit, "block_bytes": engine.nbytes, "hit_bytes": total}
    for name, t in med.items():
        out[f"{name}_ms"] = t * 1e3
        out[f"{name}_gbps"] = total / t / 1e9
    out["load_return_ms"] = statistics.median(returns) * 1e3
    for side in ("save", "load"):
        out[f"{side}_over_bound"] = med[side] / med[f"{side}_bound"]
        out[f"per_block_over_{side}"] = med[f"{side}_per_block"] / med[side]
    return out


def run(args: argparse.Namespace) -> int:
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if name == "auto":
        name = "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kvstrata bench copy: --device cuda, but torch sees no CUDA device")
    device = torch.device(name)
    dtype = getattr(torch, args.dtype)
    results = [measure(layout, device, args.layers, args.blocks, args.hit, args.rounds, dtype)
               for layout in (args.layout or list(LAYOUTS))]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "layouts": results}
    if args.json:
        print(json.dumps(report))
        return 0
    first = results[0]
    print(f"kvstrata bench copy on {report['device']}: {args.layers} layers, hits of {args.hit} blocks "
          f"({first['hit_bytes'] / 2**20:.0f} MiB for {first['layout']}), medians of {args.rounds}")
    print(f"{'layout':11} {'side':5} {'ours GB/s':>10} {'bound GB/s':>11} {'per-block GB/s':>15} "
          f"{'ours/bound':>11} {'per-block/ours':>15}")
    for r in results:
        for side in ("save", "load"):
            print(f"{r['layout']:11} {side:5} {r[f'{side}_gbps']:>10.2f} {r[f'{side}_bound_gbps']:>11.2f} "
                  f"{r[f'{side}_per_block_gbps']:>15.2f} {r[f'{side}_over_bound']:>11.2f} "
                  f"{r[f'per_block_over_{side}']:>15.2f}")
        print(f"{'':11} load returns to the caller after {r['load_return_ms']:.2f} ms "
              f"(done after {r['load_ms']:.2f} ms)")
    return 0
