"""Test scaffolding: one offline vLLM engine (CPU) that runs lists of steps and prints JSON results.

Started by ``StepEngine`` in tests/engines/launchers.py (the one launcher of these engines), never
by a test directly: ``python vllm_steps.py SPEC.json``. The engine is built once, prints
``READY``, then reads one JSON list of steps per line on stdin and answers each list with one
``RESULT <json list>`` line (``ERROR <json traceback>`` if a step raised), until stdin closes. Several tests share one engine this way.

SPEC: {"model": DIR, "config": YAML or null (no connector), "mp": bool (separate EngineCore and
worker processes), "tp": int (tensor-parallel ranks, one worker process each), "block_size": int,
"module_path": bool (name the connector's module, else the plugin entry point finds it),
"speculative": dict|null (vLLM's speculative_config, e.g. {"method": "ngram", ...}; null: none),
"pp": int (pipeline-parallel stages, default 1), "compilation": dict|null (vLLM's
compilation_config, with enforce_eager off; null: --enforce-eager), "lora": bool (LoRA on: rank 8, two
adapters at once), "prompt_embeds": bool (vLLM's enable_prompt_embeds), "hf_overrides": dict|null,
"quantization": str|null, "max_model_len": int (default 4096), "limit_mm_per_prompt": dict|null (vLLM's,
e.g. {"image": 1}, for a vision-language model), "prefix_caching": bool (vLLM's enable_prefix_caching, default
true), "mm_processor_cache_gb": float|null (vLLM's; 0 turns its multimodal processor cache off; null: vLLM's
default), "trials": dict|null (test-only behaviour planted into kvstrata before the engine is built:
tests/harness/trials.py)}.

Steps: {"op": "generate", "prompt": [ids], "max_tokens": n, "salt": str|null, "logprobs": k|null} ->
{"tokens", "cached", "ms"} (and "top": the k highest logprobs of each generated token); {"op": "generate", "prompts": [[ids], ...]} -> {"tokens": [[...]], "cached":
[...]} (one batched call: the prompts share engine steps); a generate step may also carry "lora": [name, int id,
path] (a LoRARequest) and "embeds": {"at": [lo, hi], "seed": s} (a mixed prompt: the ids, with rows lo..hi-1
given as embeddings drawn from seed s, vLLM's ``prompt_is_token_ids`` form; "seed" null gives the token
embeddings of the ids themselves) or "images": [s, ...] (a vision-language model's prompt: the ids hold its
image token where each image goes, and image i is 64x64 RGB noise drawn from seed s), with "uuids": [str|null,
...] beside "images" (vLLM's multi_modal_uuids: the client's name of each image, null: none);
{"op": "reload_weights", "seed": s, "scale": x} -> {"ok"}: every weight
of the model folder multiplied by ``1 + x * N(0, 1)`` (drawn from seed s) and loaded into the running engine
in memory (``collective_rpc("reload_weights")``, in-process EngineCore), the model folder untouched; with
"unseen": true through the executor instead, a way around ``EngineCore.collective_rpc`` that kvstrata cannot see
(as a trainer holding the workers' models writes them); {"op": "reset", "connector": bool} ->
{"ok"}; {"op": "submit", "id": str, "prompt": [ids], "max_tokens": n} -> {}: a request added to the engine and
left in flight (``LLMEngine.add_request``); {"op": "steps", "n": k|null} -> {"finished": {id: {"tokens",
"cached"}}}: k engine steps (``LLMEngine.step``), or (null) steps until no request is in flight; {"op": "pause",
"mode": "abort"|"keep", "clear_cache": bool} -> {"ok"}: what ``pause_generation`` asks of the engine core
(``EngineCore.pause_scheduler``); {"op": "resume"} -> {"ok"} (both in-process EngineCore only); {"op": "counters"} -> the connector's counters, once the background L2 scan and the queued
comparisons of verified hits are done (in-process EngineCore only); {"op": "kv_groups"} -> {"num_blocks", "groups": [[spec class, block
size], ...]}; {"op": "group_keys", "prompt": [ids], "salt": str|null} -> {"kinds", "keys": per group, the
hex keys of the prompt's full blocks} (a hybrid model's; both in-process EngineCore only); {"op": "sleep", "s": x}; {"op": "plant", "donor": [ids], "victim": [ids]} -> {"planted": n}: the donor prompt's stored
full blocks written through the store API under the victim's keys, or with "tail": true its partial tail under the
victim's tail key (in-process EngineCore only); {"op": "lookup", "prompt": [ids]} -> {"tokens"}: the tokens a lookup of
the prompt finds stored now (in-process EngineCore only); {"op": "spec_stats"} -> {"drafts", "draft_tokens",
"accepted_tokens"}: vLLM's speculative-decoding counters so far ("speculative" engines); {"op": "arenas", "children": bool} ->
{"names"}: kvstrata's L1 arena files in /dev/shm created by this process or (by default) its
children (the EngineCore when "mp"). Greedy decoding throughout.
"""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _own_arenas(children: bool) -> list[str]:
    """Arena files (``kvstrata-PID-...``) whose PID is this process or one of its children."""
    pids = {os.getpid()}
    for entry in os.listdir("/proc") if children else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == os.getpid():
                pids.add(int(entry))
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith("kvstrata-") and n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids)


def build(spec: dict):
    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    if not spec.get("mp") or tp * pp > 1:  # TP/PP: EngineCore here, the ranks' workers in processes of their own
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          "nobind" if tp * pp == 1 else "|".join(str(r % os.cpu_count()) for r in range(tp * pp)))
    from vllm import LLM

    ktc = None
    if spec.get("config"):
        ktc = {"kv_connector": "StrataConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"config_file": spec["config"]},
               "kv_load_failure_policy": "recompute"}
        if spec.get("module_path", True):
            ktc["kv_connector_module_path"] = "kvstrata.adapters.vllm"
    return LLM(model=spec["model"], enforce_eager=not spec.get("compilation"),
               compilation_config=spec.get("compilation"), block_size=spec.get("block_size", 32),
               max_model_len=spec.get("max_model_len", 4096), kv_transfer_config=ktc,
               enable_prefix_caching=spec.get("prefix_caching", True), seed=0,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype=spec.get("dtype", "auto"),
               speculative_config=spec.get("speculative"),
               disable_log_stats=not spec.get("speculative"), **_options(spec))


def _options(spec: dict) -> dict:
    """The spec's optional engine features, as ``vllm.LLM`` keywords (none by default)."""
    out: dict = {}
    from kvstrata.tools.bench.verify_worker import is_mla

    if is_mla(spec["model"]):
        # vLLM's reference CPU MLA backend, on every CPU: where AMX is present vLLM picks AMX_MLA,
        # which refuses the fp32 mla preset ("expect weight to be bfloat16").
        out["attention_config"] = {"backend": "CPU_MLA"}
    if spec.get("lora"):
        out.update(enable_lora=True, max_lora_rank=8, max_loras=2)
    if spec.get("prompt_embeds"):
        out["enable_prompt_embeds"] = True
    if spec.get("hf_overrides"):
        out["hf_overrides"] = spec["hf_overrides"]
    if spec.get("quantization"):
        out["quantization"] = spec["quantization"]
    if spec.get("limit_mm_per_prompt"):
        out["limit_mm_per_prompt"] = spec["limit_mm_per_prompt"]
    if spec.get("mm_processor_cache_gb") is not None:
        out["mm_processor_cache_gb"] = spec["mm_processor_cache_gb"]
    return out


def _prompt(op: dict, spec: dict) -> dict:
    """The prompt of a generate step: token ids, a mixed ids + embeddings prompt (``embeds``), or
    ids with images (``images``, named by the client with ``uuids``)."""
    if "images" in op:
        prompt = {"prompt_token_ids": op["prompt"], "multi_modal_data": {"image": _images(op["images"])}}
        if op.get("uuids"):
            prompt["multi_modal_uuids"] = {"image": list(op["uuids"])}
        return prompt
    if "embeds" not in op:
        return {"prompt_token_ids": op["prompt"]}
    import torch

    lo, hi = op["embeds"]["at"]
    rows = _embedding_table(spec["model"])[torch.tensor(op["prompt"])].clone()
    if op["embeds"].get("seed") is not None:
        gen = torch.Generator().manual_seed(op["embeds"]["seed"])
        rows[lo:hi] = (torch.randn(hi - lo, rows.shape[1], generator=gen) * rows.std()).to(rows.dtype)
    mask = [not lo <= i < hi for i in range(len(op["prompt"]))]
    return {"prompt_embeds": rows, "prompt_token_ids": list(op["prompt"]), "prompt_is_token_ids": mask}


def _images(seeds: list[int]) -> list:
    """One 64x64 RGB noise image (PIL) per seed."""
    import numpy as np
    from PIL import Image

    return [Image.fromarray(np.random.default_rng(s).integers(0, 256, (64, 64, 3), dtype=np.uint8)) for s in seeds]


_TABLES: dict = {}


def _embedding_table(model: str):
    """The model's input embedding table, read from its safetensors files."""
    if model not in _TABLES:
        import glob

        from safetensors import safe_open

        for path in glob.glob(os.path.join(model, "*.safetensors")):
            with safe_open(path, "pt") as f:
                if "model.embed_tokens.weight" in f.keys():
                    _TABLES[model] = f.get_tensor("model.embed_tokens.weight")
    return _TABLES[model]


def _reload_weights(llm, spec: dict, seed: int, scale: float, unseen: bool = False) -> None:
    """Every weight of the model folder, scaled by ``1 + scale * N(0, 1)``, loaded in memory (``unseen``:
    through the executor, around the engine core's ``collective_rpc``)."""
    import glob

    import torch
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    weights = []
    for path in sorted(glob.glob(os.path.join(spec["model"], "*.safetensors"))):
        for name, t in sorted(load_file(path).items()):
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            weights.append((name, (t.float() * (1 + scale * noise)).to(t.dtype)))
    if unseen:
        llm.llm_engine.engine_core.engine_core.model_executor.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights})
    else:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})  # the spec_stats step reads vLLM's metrics


def _plant(llm, op: dict) -> dict:
    """The stored full blocks of prompt ``donor`` written through the store API (``save_now``: a
    valid checksum) under the keys of prompt ``victim``: a block whose KV is another prompt's.
    With "tail": true, the donor's stored partial tail under the victim's tail key instead (the
    two tails of one length). Returns {"planted": blocks written}."""
    import numpy as np
    import torch

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched
    store, ns, bs = sched.store, sched.ns, sched.block_size
    store.flush(30)
    if op.get("tail"):
        donor = store.lookup(ns, np.asarray(op["donor"], np.uint32), pin=True)
        try:
            assert donor.chain.lengths[-1] == len(op["victim"]) % bs, "the donor's tail is not stored, or not as long"
            rows = torch.empty(donor.num_blocks, sched.arena.slot_bytes, dtype=torch.uint8)
            assert store.load_into(donor, rows) == donor.num_blocks
        finally:
            store.complete_load(donor)
        epoch, chain = store.chain(ns, np.asarray(op["victim"], np.uint32))
        return {"planted": store.save_now(ns, epoch, chain.pick([len(chain.keys) - 1]), rows[-1:])}
    donor = store.lookup(ns, np.asarray(op["donor"], np.uint32), pin=True)
    try:
        n = min(sum(1 for k in donor.chain.lengths if k == bs), len(op["victim"]) // bs)
        rows = torch.empty(n, sched.arena.slot_bytes, dtype=torch.uint8)
        assert store.load_into(donor._replace(chain=type(donor.chain)(*(p[:n] for p in donor.chain))), rows) == n
    finally:
        store.complete_load(donor)
    epoch, chain = store.chain(ns, np.asarray(op["victim"][: n * bs], np.uint32), partial=False)
    return {"planted": store.save_now(ns, epoch, chain, rows)}


def step(llm, op: dict, spec: dict) -> dict:
    from vllm import SamplingParams

    if op["op"] == "generate":
        params = SamplingParams(temperature=0, max_tokens=op.get("max_tokens", 8))
        if "prompts" in op:
            outs = llm.generate([{"prompt_token_ids": p} for p in op["prompts"]], params, use_tqdm=False)
            return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "cached": [o.num_cached_tokens for o in outs]}
        prompt = _prompt(op, spec)
        if op.get("salt"):
            prompt["cache_salt"] = op["salt"]
        if op.get("logprobs"):
            params = SamplingParams(temperature=0, max_tokens=op.get("max_tokens", 8), logprobs=op["logprobs"])
        lora = None
        if op.get("lora"):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(*op["lora"])
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        res = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
               "ms": (time.perf_counter() - start) * 1000}
        if op.get("logprobs"):  # per generated token, the top logprobs, highest first
            res["top"] = [sorted((lp.logprob for lp in step.values()), reverse=True)[: op["logprobs"]]
                          for step in out.outputs[0].logprobs]
        return res
    if op["op"] == "reset":
        return {"ok": llm.reset_prefix_cache(reset_connector=op.get("connector", False))}
    if op["op"] == "reload_weights":
        _reload_weights(llm, spec, op["seed"], op.get("scale", 0.5), op.get("unseen", False))
        return {"ok": True}
    if op["op"] == "submit":  # left in flight: "steps" runs it
        from vllm import SamplingParams

        llm.llm_engine.add_request(op["id"], {"prompt_token_ids": op["prompt"]},
                                   SamplingParams(temperature=0, max_tokens=op.get("max_tokens", 8)))
        return {}
    if op["op"] == "steps":
        finished, n = {}, op.get("n")
        while (n is None or n > 0) and llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                if out.finished:
                    finished[out.request_id] = {"tokens": list(out.outputs[0].token_ids),
                                                "cached": out.num_cached_tokens}
            n = None if n is None else n - 1
        return {"finished": finished}
    if op["op"] == "pause":  # in-process EngineCore only
        llm.llm_engine.engine_core.engine_core.pause_scheduler(mode=op.get("mode", "abort"),
                                                               clear_cache=op.get("clear_cache", True))
        return {"ok": True}
    if op["op"] == "resume":  # in-process EngineCore only
        llm.llm_engine.engine_core.engine_core.resume_scheduler()
        return {"ok": True}
    if op["op"] == "sleep":
        time.sleep(op["s"])
        return {}
    if op["op"] == "arenas":
        return {"names": _own_arenas(op.get("children", True))}
    if op["op"] == "kv_groups":  # in-process EngineCore only
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        return {"num_blocks": config.num_blocks,
                "groups": [[type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size] for g in config.kv_cache_groups]}
    if op["op"] == "group_keys":  # a hybrid model's keys of a prompt, per group (in-process EngineCore only)
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched
        from kvstrata.keys import extra_digest

        store, ns = sched.store, sched.ns
        epoch = store.current_epoch(ns)
        extra = extra_digest([f"salt:{op['salt']}"] if op.get("salt") else [])  # as the adapter's request_extra
        return {"kinds": [g.kind for g in sched._hybrid.layouts],
                "keys": [[k.hex() for k in store.group_chain(ns, epoch, g.tag, op["prompt"], extra).keys]
                         for g in sched._hybrid.layouts]}
    if op["op"] == "spec_stats":  # vLLM's speculative-decoding counters so far (an engine with "speculative")
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
        return {names[m.name]: int(m.value) for m in llm.get_metrics() if m.name in names}
    if op["op"] == "plant":  # in-process EngineCore only: the donor's stored KV under the victim's keys
        return _plant(llm, op)
    if op["op"] == "lookup":  # in-process EngineCore only: what a lookup of the prompt finds stored now
        import numpy as np

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched
        return {"tokens": sched.store.lookup(sched.ns, np.asarray(op["prompt"], np.uint32)).num_tokens}
    if op["op"] == "counters":
        store = llm.llm_engine.engine_core.engine_core.scheduler.connector._sched.store
        store.wait_recovered(120)  # settled figures: the background L2 scan's counts included
        store.wait_verified(30)  # and the verified hits' comparisons (on the store's comparison thread)
        return store.counters.snapshot()
    raise ValueError(f"unknown step {op['op']!r}")


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from tests.harness.starts import note_start
    from tests.harness.trials import plant

    note_start("vllm offline engine")
    plant(spec.get("trials"))  # before vLLM builds the engine: a forked EngineCore has them too
    llm = build(spec)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = [step(llm, op, spec) for op in json.loads(line)]
        except Exception:  # the test fails with this; the engine stays up for the next one
            print("ERROR " + json.dumps(traceback.format_exc()), flush=True)
        else:
            print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
