"""One engine of ``kvstrata bench verify``: ``python -m kvstrata.tools.bench.verify_worker SPEC.json``.

An offline vLLM engine (EngineCore in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
kvstrata's connector on a fresh store computes the spec's prompts, then reads each prompt's full
blocks back from the store, in order, as the engine saved them (``lookup(pin=True)`` and
``load_into``, through the scheduler side's store and namespace). It writes one ``.pt`` file:
``{"blocks": {set name: uint8 [prompts, blocks, block_bytes]}, "layers", "kv_dtype",
"block_bytes", "timings_s"}``.

SPEC (JSON): ``model``, ``dtype``, ``block_size``, ``config`` (kvstrata YAML), ``prompts`` (token
id lists; each ``blocks * block_size`` tokens or more), ``blocks``, ``out``, and how they are
computed: ``mode`` ``alone`` (one request at a time, the whole prompt in one prefill step) or
``batched`` (``batch`` prompts per call, each after a ``fillers`` prompt of its own, prefill in
chunks of ``budget`` tokens shared by the batch); ``noise`` (``alone`` only: after the first
set, for each scale s, every weight of the model folder times ``1 + s * N(0, 1)`` is loaded in
memory (``reload_weights``), the prefix caches are reset (kvstrata's too: a new epoch) and the
prompts are computed and read back again as set ``noise:s``); ``seed``.

Imports vLLM; nothing in the package imports this module (the command runs it as a process).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import time

import numpy as np
import torch

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 60.0  # for the saves of a prompt to land in the store


def is_mla(model: str) -> bool:
    """Whether the model folder's config is an MLA model's (DeepSeek's ``kv_lora_rank``)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            return "kv_lora_rank" in json.load(f)
    except (OSError, ValueError):
        return False


def build(spec: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore here: its store is readable
    from vllm import LLM

    mla = is_mla(spec["model"])
    options: dict = {}
    if mla:  # vLLM's reference CPU MLA backend (AMX_MLA refuses fp32); it runs without chunked prefill
        options["attention_config"] = {"backend": "CPU_MLA"}
    longest = max(len(p) for p in spec["prompts"] + spec.get("fillers", []))
    max_len = -(-(longest + 64) // 256) * 256
    budget = spec.get("budget") if spec["mode"] == "batched" and not mla else max(max_len, 2048)
    ktc = {"kv_connector": "StrataConnector", "kv_role": "kv_both",
           "kv_connector_module_path": "kvstrata.adapters.vllm",
           "kv_connector_extra_config": {"config_file": spec["config"]}}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
              block_size=spec["block_size"], enforce_eager=True, seed=0,
              max_model_len=max_len, max_num_batched_tokens=budget, enable_chunked_prefill=not mla,
              enable_prefix_caching=True, kv_transfer_config=ktc, disable_log_stats=True, **options)
    return llm, budget


def _engine(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler, core.scheduler.connector._sched  # the bench reads the connector's own store


def kv_shape(llm, spec: dict) -> tuple[int, int, str]:
    """(layers, bytes of one stored block, KV dtype name) of the engine's one KV cache group; fp8 KV
    is kept as bytes (uint8) by vLLM, named here by the format vLLM wrote."""
    config = _engine(llm)[0].kv_cache_config
    if len(config.kv_cache_groups) != 1:
        raise SystemExit(f"kvstrata bench verify: {len(config.kv_cache_groups)} KV cache groups; "
                         "it compares models with one (dense attention or MLA)")
    group = config.kv_cache_groups[0]
    dtype = str(group.kv_cache_spec.dtype).removeprefix("torch.")
    cache = spec.get("kv_cache_dtype", "auto")
    if cache.startswith("fp8"):
        dtype = "float8_e5m2" if cache == "fp8_e5m2" else "float8_e4m3fn"
    return len(group.layer_names), group.kv_cache_spec.page_size_bytes * len(group.layer_names), dtype


def compute(llm, spec: dict) -> None:
    from vllm import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    if spec["mode"] == "alone":
        for p in prompts:
            llm.generate([p], one, use_tqdm=False)
        return
    fillers = [{"prompt_token_ids": f} for f in spec["fillers"]]
    k = spec["batch"]
    for i in range(0, len(prompts), k):  # each prompt after a filler: its chunks start off the block grid
        batch = [x for pair in zip(fillers[i : i + k], prompts[i : i + k]) for x in pair]
        llm.generate(batch, one, use_tqdm=False)


def read_back(llm, spec: dict, block_bytes: int) -> torch.Tensor:
    """Every prompt's first ``blocks`` blocks as stored: uint8 ``[prompts, blocks, block_bytes]``."""
    sched = _engine(llm)[1]
    store, ns, n = sched.store, sched.ns, spec["blocks"]
    out = torch.empty(len(spec["prompts"]), n, block_bytes, dtype=torch.uint8)
    for i, prompt in enumerate(spec["prompts"]):
        tokens = np.asarray(prompt[: n * spec["block_size"]], dtype=np.uint32)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while True:
            hit = store.lookup(ns, tokens, pin=True)
            if hit.num_blocks == n:
                break
            store.complete_load(hit)
            if time.monotonic() > deadline:
                raise SystemExit(f"kvstrata bench verify: prompt {i}: {hit.num_blocks} of its {n} blocks stored "
                                 f"after {READ_TIMEOUT_S:.0f} s (is L1 large enough?)")
            store.flush(1.0)
            time.sleep(0.05)
        try:
            loaded = store.load_into(hit, out[i])
        finally:
            store.complete_load(hit)
        if loaded != n:
            raise SystemExit(f"kvstrata bench verify: prompt {i}: {loaded} of {n} blocks loaded")
    return out


def perturb(llm, spec: dict, scale: float, seed: int) -> None:
    """Load the model folder's weights, each times ``1 + scale * N(0, 1)`` in the engine's dtype,
    into the running engine; then reset vLLM's prefix cache and kvstrata's epoch."""
    from safetensors.torch import load_file

    dtype = getattr(torch, spec["dtype"]) if spec["dtype"] != "auto" else None
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for path in sorted(glob.glob(os.path.join(spec["model"], "*.safetensors"))):
        for name, t in sorted(load_file(path).items()):
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            weights.append((name, (t.float() * (1 + scale * noise)).to(dtype or t.dtype)))
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if not llm.reset_prefix_cache(reset_running_requests=False, reset_connector=True):
        raise SystemExit("kvstrata bench verify: reset_prefix_cache() refused after the weights changed")


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm, budget = build(spec)
    timings = {"engine_start": time.perf_counter() - t0}
    layers, block_bytes, kv_dtype = kv_shape(llm, spec)
    sets = {}
    for name, scale in [("base", None)] + [(f"noise:{s:g}", s) for s in spec.get("noise", [])]:
        t = time.perf_counter()
        if scale is not None:
            perturb(llm, spec, scale, spec["seed"] + 1)
            timings[f"{name} reload"] = time.perf_counter() - t
            t = time.perf_counter()
        compute(llm, spec)
        timings[f"{name} compute"] = time.perf_counter() - t
        t = time.perf_counter()
        sets[name] = read_back(llm, spec, block_bytes)
        timings[f"{name} read back"] = time.perf_counter() - t
    result = {"blocks": sets, "layers": layers, "block_bytes": block_bytes, "kv_dtype": kv_dtype, "budget": budget,
              "timings_s": {k: round(v, 2) for k, v in timings.items()}}
    torch.save(result, spec["out"] + ".tmp")
    os.replace(spec["out"] + ".tmp", spec["out"])
    log.info("verify worker: %d set(s) of %d prompts x %d blocks of %d bytes (%d layers, %s) in %s",
             len(sets), len(spec["prompts"]), spec["blocks"], block_bytes, layers, kv_dtype, spec["out"])


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main(sys.argv[1])
